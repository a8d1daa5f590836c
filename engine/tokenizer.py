"""The model's tokenizer: encode, chat template, decode and incremental decode."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InvalidRequest
from .models.config import CheckpointError
from .requests import ID_SLICE, id_slices

# Text with each space transformers' clean-up removes; _UNKNOWN: a tokenizer
# whose decode of it keeps none of them.
_CLEANUP_PROBE = "a . b , c ! d ? e ' f n't g 'm h 's i 've j 're k"
_UNKNOWN = object()


class Tokenizer:
    """A Hugging Face fast tokenizer loaded from the checkpoint directory."""

    def __init__(self, model_dir: str | Path):
        root = Path(model_dir)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (root / name).exists():
                raise CheckpointError(f"checkpoint is missing {name} (looked in {root})")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import PreTrainedTokenizerFast

        # tokenizer.json as written, not the class tokenizer_config.json names:
        # transformers 5 rebuilds a named class's normalizer and pre-tokenizer
        # (a Llama-2 checkpoint's "<s>[INST]" then loses the space marker before "["), while
        # routers tokenize with the file itself. Special tokens and the chat
        # template still come from the config; whether BOS/EOS are added is the
        # file's post-processor, as with transformers 5's AutoTokenizer (both
        # read past add_bos_token/add_eos_token).
        self.hf: Any = PreTrainedTokenizerFast.from_pretrained(str(root), local_files_only=True)
        if not getattr(self.hf, "is_fast", False):
            raise CheckpointError("a fast tokenizer (tokenizer.json) is required")
        self.backend = self.hf.backend_tokenizer
        self._encode_fast = getattr(self.backend, "encode_batch_fast", None)

    def __len__(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encoding(self, text: str, add_special_tokens: bool = True) -> Any:
        """The backend's Encoding of `text` (ids, offsets, ...), by the batch call
        transformers' encode makes, which releases the GIL while it works;
        transformers also turns type ids and masks into lists, each a GIL hold
        of ~0.1 s (every stream, every health check) for millions of tokens."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode(self, text: str, add_special_tokens: bool = True, context: int | None = None) -> list[int]:
        """The token ids of `text`. By the backend's fast batch call where it
        has one (tokenizers >= 0.21): it keeps no token strings or offsets, so
        the encoding is freed at once, where a full one's free held the GIL
        ~0.25 s for 3M tokens (and it encodes in about half the time).

        A prompt for a `context` of that many tokens that a part of it shows
        is far longer is refused (InvalidRequest on "prompt") before the
        whole is tokenized (`telling_part`)."""
        if context is not None:
            part = telling_part(text, context, lambda part: len(self._ids(part, False)))
            if part is not None:
                raise InvalidRequest("prompt", f"the prompt has more than {2 * context} tokens (its first "
                                               f"{len(part)} characters alone); the context holds {context}")
        return self._ids(text, add_special_tokens)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._encode_fast is None:
            return self.encoding(text, add_special_tokens).ids
        return self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def apply_chat_template(self, messages: Sequence[dict[str, str]],
                            add_generation_prompt: bool = True, tools: Sequence[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None, context: int | None = None) -> list[int]:
        """Render chat messages with the model's template and tokenize them.

        `tools` (OpenAI's layout: {"type": "function", "function": {...}}) and
        `template_kwargs` (more variables, such as enable_thinking) go to the
        template as they are; `context` as in `encode`.
        """
        if not self.has_chat_template:
            raise ValueError("this model has no chat template")
        text = self.hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                           tokenize=False, tools=list(tools) if tools else None,
                                           **(template_kwargs or {}))
        # The template already writes BOS where the model wants it.
        return self.encode(text, add_special_tokens=False, context=context)

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """transformers' decode of `ids`, by the backend's batch call, which
        releases the GIL while it works (transformers' own decode holds it:
        ~1 s for 4M ids, every other stream's event loop stopped), then the
        space clean-up transformers would apply, if any."""
        ids = _as_list(ids)
        if self._cleanup is _UNKNOWN:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        text = self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.hf.clean_up_tokenization(text) if self._cleanup else text

    @functools.cached_property
    def _cleanup(self) -> object:
        """Whether transformers' decode cleans up spaces after the backend's
        (" ." to "."): its flag, and where set, a probe, since versions differ
        (transformers 5 skips it for BPE models). _UNKNOWN where the probe's
        text has none of the spaces the clean-up removes."""
        if not getattr(self.hf, "clean_up_tokenization_spaces", False):
            return False
        ids = self.backend.encode(_CLEANUP_PROBE, add_special_tokens=False).ids
        raw = self.backend.decode(ids, skip_special_tokens=True)
        theirs = self.hf.decode(ids, skip_special_tokens=True)
        if raw != theirs:
            return True if self.hf.clean_up_tokenization(raw) == theirs else _UNKNOWN
        return False if self.hf.clean_up_tokenization(raw) != raw else _UNKNOWN

    @functools.cached_property
    def skipped_ids(self) -> frozenset[int]:
        """The ids `decode(..., skip_special_tokens=True)` leaves out."""
        return skipped_ids(self.backend)

    def stream(self, prefix: Sequence[int] = (), skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, prefix, skip_special_tokens)


def telling_part(text: str, limit: int, count: Callable[[str], int], from_end: bool = False) -> str | None:
    """A prefix of `text` (suffix: `from_end`) already past twice `limit`
    tokens by `count`, or None when no shorter part is: what tells that a
    long text is over `limit` at a cost bounded by the limit, not the text.

    A text of megabytes tokenized whole took seconds of a core (and
    gigabytes) only to be refused. The parts grow x4 a try, up to the whole
    text. Tokenization is local: a cut changes the tokens next to it, never
    those a window earlier, so a part's first (last) tokens are the text's."""
    size = max(PREFIX_CHARS, PREFIX_CHARS_PER_TOKEN * limit)
    while len(text) > size:
        part = _cut_at_space(text, size, from_end)
        if count(part) > 2 * limit:
            return part
        size *= 4
    return None


# Where a long text's measuring starts: enough characters for the limit in
# almost any text (a token is a few characters), cheap to tokenize.
PREFIX_CHARS = 4096
PREFIX_CHARS_PER_TOKEN = 16


def _cut_at_space(text: str, size: int, from_end: bool) -> str:
    """About `size` characters of `text`'s start (end: `from_end`), cut at a
    space when one is near, so no word is split where one can be avoided."""
    if from_end:
        part = text[-size:]
        space = next((i for i, ch in enumerate(part[: size // 2]) if ch.isspace()), None)
        return part if space is None else part[space:]
    part = text[:size]
    for i in range(size - 1, size // 2, -1):
        if part[i].isspace():
            return part[:i]
    return part


def token_spans(encoding: Any) -> np.ndarray:
    """A backend Encoding's character span of each token, as an (n, 2) int64
    array ((0, 0) for a token the post-processor added, as its `offsets`
    has). Read a token at a time: `offsets` builds every tuple in one call,
    and with numpy's conversion of them held the GIL ~1 s for 3M tokens."""
    span = encoding.token_to_chars
    count = len(encoding)
    flat = np.fromiter((edge for i in range(count) for edge in (span(i) or (0, 0))), dtype=np.int64,
                       count=2 * count)
    return flat.reshape(count, 2)


def _as_list(ids: Iterable[int] | np.ndarray) -> list[int]:
    """`ids` as a list of ints, built a slice at a time (an array's or a
    protobuf field's conversion in one call held the GIL ~0.1 s for 4M ids)."""
    if isinstance(ids, list):
        return ids
    out: list[int] = []
    if isinstance(ids, np.ndarray):
        flat = ids.reshape(-1)
        for first in range(0, flat.size, ID_SLICE):
            out.extend(flat[first:first + ID_SLICE].tolist())
        return out
    for part in id_slices(ids):
        out.extend(part)
    return out

# What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Token-by-token decoding of a response: the text its tokens add to the prompt's.

    The rule, for prompt ids P and generated ids G: the response's text is
    `decode(P + G)` without the prompt's characters. A character split between
    the prompt and the response belongs to the response only if a generated
    byte completes it: the prompt's text is that of its tokens up to the last
    whole character (`clean`), plus, when no generated byte completes the
    bytes left dangling after it, their U+FFFD as `decode(P)` shows them.

    A trailing run of U+FFFD is held until a later token completes it (so a
    character is never sent in halves; a byte-fallback decoder writes one per
    byte of a run of byte tokens that is not yet valid UTF-8, so the whole run
    waits); `flush` gives what is still held when the response ends, so the
    joined pieces are exactly the rule's text. After `MAX_HELD` tokens the
    text is sent as it stands (only a long stream of stray bytes gets there).
    The one departure: a byte-fallback decoder that meets an invalid byte
    turns its whole run into U+FFFD, characters already whole and sent
    included; those stay sent (docs/api.md).

    Only a window of the last tokens is decoded: some prompt tokens as context
    (leading-space rules depend on the token before), then the response's. A
    window never starts inside a character or a byte-fallback run (its decode
    would begin with U+FFFD), and slides back to a few tokens once it grows.
    """

    CONTEXT_TOKENS = 4
    MAX_CONTEXT = 64
    MAX_WINDOW = 32
    MAX_HELD = 256
    # How many prompt tokens may dangle after its last whole character (a
    # character has at most 4 bytes; zero-width special tokens may follow).
    MAX_DANGLING = 8

    def __init__(self, tokenizer: Tokenizer, prefix: Sequence[int], skip_special_tokens: bool):
        backend = tokenizer.backend
        self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        keep = self.MAX_CONTEXT + self.MAX_DANGLING
        if skip_special_tokens:
            # Skipped tokens are dropped before the decoder runs, so the
            # context is the last visible tokens, however many skipped ones
            # follow them (a window of those alone decodes to nothing, and the
            # next word's leading space was stripped as the first visible).
            prompt = _last_visible(prefix, tokenizer.skipped_ids, keep)
        else:
            prompt = [int(t) for t in prefix[-keep:]]
        start, cut, clean = self._prompt_window(prompt)
        self._ids = prompt[start:]
        self._clean = clean  # the window's text up to the prompt's last whole character
        self._seen = clean if cut == len(prompt) else self._decode(self._ids)  # and with what dangles
        self._held = 0  # tokens since text was last taken whole

    def _prompt_window(self, prompt: list[int]) -> tuple[int, int, str]:
        """(window start, the prompt's cut after its last whole character, the
        window's text up to the cut)."""
        n = len(prompt)
        fallback: tuple[int, int, str] | None = None
        for cut in range(n, max(n - self.MAX_DANGLING, 0) - 1, -1):
            start, text = self._window_start(prompt, cut)
            fallback = fallback or (start, cut, text)
            if not text.endswith(REPLACEMENT):
                return start, cut, text
        assert fallback is not None
        return fallback  # no whole character near the end: the prompt's text as decoded

    def _window_start(self, ids: list[int], end: int) -> tuple[int, str]:
        """A start for a window ending at `end` whose decode does not begin
        inside a character and is not empty (the shortest with CONTEXT_TOKENS
        or more), and its text. An empty one holds only skipped special
        tokens: a SentencePiece decoder would then strip the leading space of
        the next word, as the first visible one."""
        k = self.CONTEXT_TOKENS
        while True:
            start = max(0, end - k)
            text = self._decode(ids[start:end])
            if start == 0 or (text and not text.startswith(REPLACEMENT)) or k >= self.MAX_CONTEXT:
                return start, text
            k *= 2

    def step(self, token_id: int) -> str:
        """The text `token_id` completes ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT) and self._held < self.MAX_HELD:
            # What precedes the trailing run of U+FFFD is final; the run
            # may still become characters (it is all a decoder rewrites).
            self._held += 1
            stable = text.rstrip(REPLACEMENT)
            if self._seen.startswith(stable):
                # Nothing past what is accounted for (the prompt's text when
                # its last token holds whole characters before the bytes left
                # dangling: those characters are the prompt's).
                return ""
            new = self._beyond(stable)
            if not new:
                return ""
            self._seen = self._clean = stable
            return new
        return self._take(text)

    def flush(self) -> str:
        """What is still held at the end (bytes no later token completed)."""
        return self._take(self._decode(self._ids))

    def _beyond(self, text: str) -> str:
        """`text` (a decode of the window) past what the window's text accounts for."""
        if text.startswith(self._seen):
            return text[len(self._seen):]
        if text.startswith(self._clean):
            # The prompt's dangling bytes became (part of) a generated character.
            return text[len(self._clean):]
        n = 0  # a decoder rewrote more than the end: past the common prefix
        for a, b in zip(self._seen, text, strict=False):
            if a != b:
                break
            n += 1
        return text[n:]

    def _take(self, text: str) -> str:
        new = self._beyond(text)
        self._seen = self._clean = text
        self._held = 0
        if len(self._ids) > self.MAX_WINDOW:
            self._slide(text)
        return new

    def _slide(self, text: str) -> None:
        """Keep the last few tokens, where their own decode is the end of `text`."""
        start, tail = self._window_start(self._ids, len(self._ids))
        if start > 0 and tail and text.endswith(tail) and not tail.startswith(REPLACEMENT):
            self._ids = self._ids[start:]
            self._seen = self._clean = tail


def _last_visible(ids: Sequence[int], skipped: frozenset[int], count: int) -> list[int]:
    """The last `count` of `ids` that are not in `skipped`, in order."""
    out: list[int] = []
    for token in reversed(ids):
        if int(token) not in skipped:
            out.append(int(token))
            if len(out) == count:
                break
    return out[::-1]


def skipped_ids(backend: Any) -> frozenset[int]:
    """The ids a `tokenizers` backend's decode with skip_special_tokens leaves
    out before its decoder runs: the added tokens marked special."""
    return frozenset(i for i, added in backend.get_added_tokens_decoder().items() if added.special)
