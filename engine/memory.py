"""Allocating the page tensor on CPU in transparent huge pages.

Pages of a sequence are scattered across a tensor of gigabytes; with 4 KiB
OS pages every KV page read risks a TLB miss. Where the kernel's THP mode is
`madvise` (a common default), memory must ask for huge pages explicitly, so
the CPU page tensor is mapped anonymously, 2 MiB aligned, with
MADV_HUGEPAGE. Anywhere that fails, a plain torch allocation is used.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor backed by huge pages where the OS allows it."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize
    for n in shape:
        nbytes *= n
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        offset = (-base) % HUGE_PAGE
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(base + offset), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
        flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    except (OSError, ValueError, AttributeError):
        return torch.empty(shape, dtype=dtype)
    # The tensor keeps `region` alive through its storage.
    return flat.view(dtype).view(shape)


# Device memory kept free beside the KV cache for what the sizes below miss:
# the CUDA context's growth, the allocator's slack, CUDA graphs.
_FIXED_HEADROOM = 768 << 20
# Prompt rows whose log-probabilities a step computes at once (step_run.py): a
# whole prompt chunk's logits over a 150k vocabulary would be gigabytes (the
# 16-bit logits, float32, the log-softmax); a slice's are in the estimate below.
PROMPT_LOGPROB_ROWS = 256
# Bytes per [batch, vocabulary] element of a sampling step at its fullest
# (logits, raw log-probabilities, penalty counts and seen tokens, scaled
# logits, the sort's values and int64 order, softmax, cumulative sum, a
# decode graph's static logits): measured on CPU at 64 x 152k, 371 MB above
# the logits, about 40 a element; CUDA's sort takes scratch on top.
_SAMPLING_BYTES = 48


def kv_budget_gib(device: torch.device, utilization: float, max_tokens: int, max_seqs: int, hidden: int,
                  intermediate: int, vocab: int) -> float:
    """The KV cache's share of a CUDA device, in GiB, once the model is loaded:
    `utilization` of its memory, less what is in use now (the weights, other
    processes) and an estimate of a step's peak activations (the largest
    prompt chunk through one layer, sampling over the largest batch, a slice
    of prompt log-probabilities). vLLM measures the peak with a dummy forward
    pass; the estimate errs large, and `kv_cache_gib` sizes the cache exactly
    instead."""
    # What the allocator caches but no tensor holds (the GEMV timing's weight
    # copies, graph pools of start-up probes) is free for the KV cache.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    activations = max_tokens * (6 * hidden + 3 * intermediate) * 4 + max_seqs * vocab * _SAMPLING_BYTES \
        + PROMPT_LOGPROB_ROWS * vocab * 10
    budget = utilization * total - (total - free) - activations - _FIXED_HEADROOM
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization:g} leaves no memory for the KV cache "
                         f"({(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB in use)")
    return budget / 2**30
