"""Token-level stop rules: stop token ids, EOS, length limits.

Pure: `token_verdict` says how a newly known token ends its request and the
step's postprocess applies it. Stop strings are matched on text by the
request's output stream (output.py); a constrained request's EOS is the
grammar's to accept (step_masks.py).
"""

from __future__ import annotations

from .context import GenerationStatus, TextContext


def token_verdict(ctx: TextContext, token: int, index: int, max_seq_len: int) -> GenerationStatus | None:
    """How the token now known at `index` ends `ctx`, if it does."""
    params = ctx.sampling_params
    generated = index + 1 - ctx.prompt_len
    constrained = ctx.constrained  # inside a thought, a grammar's request follows the free rules
    if generated >= params.min_new_tokens or constrained:
        # EOS first, as vLLM: an EOS the client also lists in stop_token_ids
        # ends with EOS, no stop token matched (unless EOS is ignored). A
        # constrained output ends with EOS only when its matcher accepts the
        # stop token: never on the sampler's word.
        if not params.ignore_eos and token in ctx.eos_token_ids and not constrained:
            return GenerationStatus.END_OF_SEQUENCE
        if token in params.stop_token_ids and not (constrained and token in ctx.eos_token_ids):
            return GenerationStatus.STOP_TOKEN
    # Length limits apply once everything before the limit is known.
    if ctx.pending_futures == 0 and ctx.end_idx >= min(ctx.max_length, max_seq_len):
        limited_by_request = params.max_new_tokens is not None and ctx.num_generated >= params.max_new_tokens
        return GenerationStatus.MAXIMUM_LENGTH if limited_by_request else GenerationStatus.CONTEXT_LENGTH
    return None
