"""Our Triton paged-attention kernels (engine/attention/triton_kernels.py)
against a float64 reference that gathers each sequence's keys through its
block table.

Without CUDA the kernels run in Triton's interpreter, which is chosen when they
are decorated, so TRITON_INTERPRET must be set before the module is imported.
With CUDA the same tests run on the GPU, plus CUDA-graph capture and replay.
Either way one test compiles the kernels for sm_80 and sm_90 with Triton's
bundled ptxas (no GPU needed), which checks what the interpreter does not, and
that no kernel spills registers. The CUDA builds of torch 2.10 to 2.13 pin
Triton 3.6 or 3.7, CPU set-ups get the newest: to check another release, put
it first on the path (`pip install --target DIR --no-deps triton==3.6.0`, then
`PYTHONPATH=DIR pytest -k compile_for_gpus`). The interpreter of Triton 3.6
(not 3.9) fails on these kernels with numpy 2.4 (a loop bound loaded from
memory is a one-element array it cannot turn into an int); with numpy 2.3
every test here passes there too.

Every cache slot that holds no key of a sequence is NaN and unused block-table
entries hold garbage page ids (out of range, or the NaN page), so a kernel
that reads past a sequence's keys shows it.

Tolerances (absolute, relative) against the float64 reference: float32 1e-5
(IEEE dot products); float16 2e-3 (output rounding, probabilities cast to
float16 for P @ V); bfloat16 1e-2 / 1.6e-2 (output rounding; on a GPU also the
bfloat16 probabilities).
"""

from __future__ import annotations

import ast
import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.attention import triton_kernels as tk  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}
LAYERS, LAYER = 2, 1
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D], possibly a strided view
    kv_blocks: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_q: torch.Tensor
    max_q: int
    scale: float
    window: int = 0  # sliding window (0: none)
    softcap: float = 0.0  # scores capped as softcap * tanh(s / softcap) (0: none)

    def run(self, **kwargs: Any) -> torch.Tensor:
        return tk.paged_attention(self.q, self.kv_blocks, LAYER, self.block_table, self.seq_lens, self.cu_q,
                                  self.max_q, self.scale, window=self.window, softcap=self.softcap, **kwargs)


def build(seqs: list[tuple[int, int]], *, dtype: torch.dtype, page_size: int, head_dim: int, group: int,
          kv_heads: int = 2, pad_rows: int = 0, strided_q: bool = False, max_q: int | None = None,
          seed: int = 0) -> Case:
    """A batch of (seq_len, q_len) sequences, pages scattered over the cache."""
    g = torch.Generator().manual_seed(seed)
    batch = len(seqs)
    pages = [-(-n // page_size) for n, _ in seqs]
    width = max(pages) + 2  # spare entries: garbage
    num_pages = sum(pages) + 2
    poison = num_pages - 1  # a page no sequence owns
    perm = torch.randperm(num_pages - 1, generator=g)
    table = torch.randint(-(1 << 20), 1 << 20, (batch, width), generator=g)
    table[:, -1] = poison
    kv = torch.randn(num_pages, 2, LAYERS, page_size, kv_heads, head_dim, generator=g)
    used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    start = 0
    for b, (n, _) in enumerate(seqs):
        table[b, :pages[b]] = perm[start:start + pages[b]]
        start += pages[b]
        pos = torch.arange(n)
        used[table[b, pos // page_size], pos % page_size] = True
    kv.masked_fill_(~used[:, None, None, :, None, None], float("nan"))
    q_lens = [ql for _, ql in seqs]
    num_tokens = sum(q_lens) + pad_rows
    heads = kv_heads * group
    q = torch.randn(num_tokens, heads + 2, head_dim, generator=g)
    q = q[:, 1:-1] if strided_q else q[:, 1:-1].contiguous()
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return Case(q.to(dtype).to(DEVICE), kv.to(dtype).to(DEVICE), table.int().to(DEVICE),
                torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=DEVICE), cu_q.to(DEVICE),
                max(q_lens) if max_q is None else max_q, head_dim ** -0.5)


def reference(case: Case) -> torch.Tensor:
    """float64 attention of each sequence over its gathered keys, causal mask bottom-right aligned
    (and a query at position p sees keys from p - window + 1 with a window)."""
    q = case.q.double().cpu()
    kv = case.kv_blocks.double().cpu()
    table = case.block_table.cpu().long()
    page_size, kv_heads = kv.shape[3], kv.shape[4]
    group = q.shape[1] // kv_heads
    cu = case.cu_q.cpu().tolist()
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    for b, n in enumerate(case.seq_lens.cpu().tolist()):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        pos = torch.arange(n)
        page, slot = table[b, pos // page_size], pos % page_size
        k = kv[page, 0, LAYER, slot].repeat_interleave(group, 1)  # [n, H, D]
        v = kv[page, 1, LAYER, slot].repeat_interleave(group, 1)
        q_pos = n - (hi - lo) + torch.arange(hi - lo)
        if case.window:  # keys before every query's window may be poisoned: none of them counts
            unseen = pos <= int(q_pos[0]) - case.window
            k[unseen], v[unseen] = 0.0, 0.0
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi], k) * case.scale
        if case.softcap:
            scores = case.softcap * torch.tanh(scores / case.softcap)
        scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        if case.window:
            scores = scores.masked_fill(pos[None, :] <= q_pos[:, None] - case.window, float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def check(case: Case, out: torch.Tensor, rows: int | None = None) -> None:
    atol, rtol = TOL[case.q.dtype]
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    expected = reference(case)
    rows = int(case.cu_q[-1]) if rows is None else rows
    torch.testing.assert_close(out[:rows].double().cpu(), expected[:rows], atol=atol, rtol=rtol)


# -- decode (max_q == 1): uneven lengths, lengths on page boundaries, splits ---------------------

DTYPES = [F32, F16, BF16]
PAGE_SIZES = [1, 3, 16, 64]
HEAD_DIMS = [16, 32, 80, 128]
GROUPS = [1, 2, 4]
SPLITS = [1, 3, None, 2, 5]
# Every dtype x page size x head_dim; groups and split counts cycle through the cases.
DECODE_CASES = [(dtype, p, d, GROUPS[i % 3], SPLITS[i % 5])
                for i, (dtype, p, d) in enumerate((t, p, d) for t in DTYPES for p in PAGE_SIZES for d in HEAD_DIMS)]


def _ids(values: list[tuple[Any, ...]], names: str) -> list[str]:
    short = {F32: "f32", F16: "f16", BF16: "bf16"}
    return ["-".join(f"{n}{short.get(v, v)}" for n, v in zip(names.split(","), case, strict=True))
            for case in values]


@pytest.mark.parametrize("dtype,page_size,head_dim,group,num_splits", DECODE_CASES,
                         ids=_ids(DECODE_CASES, ",p,d,g,s"))
def test_decode_matches_reference(dtype, page_size, head_dim, group, num_splits):
    p = page_size
    # Length 1, exactly one and four pages, one past two pages, longer than several key
    # blocks (so the splits really split), and a sequence without a query this step.
    seqs = [(1, 1), (p, 1), (4 * p, 1), (2 * p + 1, 1), (20, 0), (150, 1)]
    case = build(seqs, dtype=dtype, page_size=page_size, head_dim=head_dim, group=group,
                 seed=page_size * 1000 + head_dim + group)
    assert case.max_q == 1
    check(case, case.run(num_splits=num_splits))


def test_decode_splits_agree():
    """The same long-context decode batch with 1, 2 and 7 splits (some of them empty)."""
    case = build([(300, 1), (7, 1), (97, 1)], dtype=F32, page_size=5, head_dim=32, group=2)
    outs = [case.run(num_splits=s) for s in (1, 2, 7)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)
    check(case, outs[0])


# -- prefill / extend (max_q > 1): mixed batches -------------------------------------------------

# Every dtype x page size; head_dim and group cycle (groups 3 and 8 too: a query block
# of BLOCK_M rows then holds BLOCK_M // group queries, not a power of two for 3).
MIXED_CASES = [(dtype, p, HEAD_DIMS[i % 4], [2, 4, 1, 3, 8][i % 5])
               for i, (dtype, p) in enumerate((t, p) for t in DTYPES for p in PAGE_SIZES)]


@pytest.mark.parametrize("dtype,page_size,head_dim,group", MIXED_CASES, ids=_ids(MIXED_CASES, ",p,d,g"))
def test_mixed_batch_matches_reference(dtype, page_size, head_dim, group):
    p = page_size
    seqs = [
        (11 + 37, 37),  # a prompt chunk over a cached prefix, several query blocks
        (5, 1),  # decode
        (9, 0),  # no query this step
        (20, 20),  # a fresh prompt
        (3 * p, 3),  # forced tokens ending on a page boundary
        (70, 1),  # decode over more than one key block
        (64, 2),  # first query at 62: the key block boundary right after it must be masked
    ]
    # q a strided view, max_q larger than any q_len, two padding rows after the batch.
    case = build(seqs, dtype=dtype, page_size=page_size, head_dim=head_dim, group=group, pad_rows=2,
                 strided_q=True, max_q=40, seed=page_size * 1000 + head_dim + group)
    out = torch.full(case.q.shape, 7.0, dtype=dtype, device=DEVICE)
    assert case.run(out=out) is out
    check(case, out)
    assert bool((out[-2:] == 7.0).all()), "rows outside the batch were written"


# -- sliding windows: a query at position p sees keys p - window + 1 .. p ---------------------------

WINDOW_CASES = [(F32, 1, 5), (F32, 16, 16), (F32, 3, 40), (F16, 4, 7), (BF16, 64, 20), (F32, 5, 1)]


@pytest.mark.parametrize("dtype,page_size,window", WINDOW_CASES, ids=_ids(WINDOW_CASES, ",p,w"))
def test_sliding_window_decode_matches_reference(dtype, page_size, window):
    p = page_size
    # Shorter than the window, exactly it, one past it, a window starting mid-page and
    # many pages past it (so whole pages and key blocks lie before the window).
    seqs = [(1, 1), (window, 1), (window + 1, 1), (window + p + p // 2 + 1, 1), (9, 0), (150, 1)]
    case = build(seqs, dtype=dtype, page_size=page_size, head_dim=32, group=2, seed=window)
    case.window = window
    # Keys no query's window reaches on pages the decode kernel reads are poisoned:
    # it must skip them, not mask them (a NaN value times a zero weight is NaN).
    table = case.block_table.long()
    for b, n in enumerate(case.seq_lens.tolist()):
        first = max(0, n - window)
        for pos in range(first - first % p, first):
            case.kv_blocks[table[b, pos // p], :, LAYER, pos % p] = float("nan")
    for splits in (1, 3, None):
        check(case, case.run(num_splits=splits))


@pytest.mark.parametrize("dtype,page_size,window", WINDOW_CASES, ids=_ids(WINDOW_CASES, ",p,w"))
def test_sliding_window_mixed_batch_matches_reference(dtype, page_size, window):
    seqs = [(11 + 37, 37), (5, 1), (9, 0), (20, 20), (70, 1), (64, 2), (window + 3, 3)]
    case = build(seqs, dtype=dtype, page_size=page_size, head_dim=32, group=4, max_q=40, seed=window)
    case.window = window
    check(case, case.run())


# -- capped scores (Gemma 2): s -> softcap * tanh(s / softcap) before the softmax --------------------

CAP_CASES = [(F32, 16, 0), (F32, 3, 7), (F16, 4, 0), (BF16, 5, 20)]


@pytest.mark.parametrize("dtype,page_size,window", CAP_CASES, ids=_ids(CAP_CASES, ",p,w"))
def test_capped_scores_match_reference(dtype, page_size, window):
    """Decode (whole and split) and a mixed batch, queries scaled up so that
    most scores pass the cap of 1.5: uncapped, the result is another."""
    decode = build([(1, 1), (40, 1), (150, 1), (9, 0)], dtype=dtype, page_size=page_size, head_dim=32, group=2,
                   seed=page_size)
    mixed = build([(11 + 37, 37), (5, 1), (9, 0), (70, 1), (64, 2)], dtype=dtype, page_size=page_size,
                  head_dim=32, group=4, max_q=40, seed=page_size)
    for case in (decode, mixed):
        case.q.mul_(3.0)
    for case, splits in ((decode, 1), (decode, 3), (mixed, None)):
        case.window, case.softcap = window, 1.5
        out = case.run(num_splits=splits)
        check(case, out)
        case.softcap = 0.0
        assert not torch.allclose(out.double().cpu()[:int(case.cu_q[-1])],
                                  reference(case)[:int(case.cu_q[-1])], atol=0.05, rtol=0.05)


def test_a_window_as_long_as_the_context_changes_nothing():
    case = build([(48, 37), (5, 1), (64, 2)], dtype=F32, page_size=4, head_dim=16, group=2)
    full = case.run()
    case.window = 64
    torch.testing.assert_close(case.run(), full)


def test_decode_rows_same_through_either_path():
    """A decode batch run as max_q == 1 (decode kernel) and max_q == 4 (prefill kernel)."""
    case = build([(33, 1), (1, 1), (64, 1)], dtype=F32, page_size=16, head_dim=32, group=4)
    decode = case.run(num_splits=2)
    case.max_q = 4
    torch.testing.assert_close(case.run(), decode, atol=1e-5, rtol=1e-5)


def test_int64_metadata_and_empty_batch():
    case = build([(40, 6), (9, 1)], dtype=F32, page_size=8, head_dim=16, group=2)
    expected = case.run()
    case.block_table, case.seq_lens, case.cu_q = (t.long() for t in (case.block_table, case.seq_lens, case.cu_q))
    torch.testing.assert_close(case.run(), expected)
    empty = tk.paged_attention(case.q[:0], case.kv_blocks, 0, case.block_table[:0], case.seq_lens[:0],
                               case.cu_q[:1], 0, 1.0)
    assert empty.shape == (0, *case.q.shape[1:])


def test_rejects_mismatched_inputs():
    case = build([(4, 1)], dtype=F32, page_size=4, head_dim=16, group=1)
    with pytest.raises(ValueError):
        tk.paged_attention(case.q.half(), case.kv_blocks, 0, case.block_table, case.seq_lens, case.cu_q, 1, 1.0)
    with pytest.raises(ValueError):
        tk.paged_attention(case.q, case.kv_blocks, LAYERS, case.block_table, case.seq_lens, case.cu_q, 1, 1.0)
    with pytest.raises(ValueError):
        tk.paged_attention(case.q, case.kv_blocks, 0, case.block_table, case.seq_lens, case.cu_q[:1], 1, 1.0)
    with pytest.raises(ValueError):
        tk.paged_attention(case.q[:, :, :8], case.kv_blocks, 0, case.block_table, case.seq_lens, case.cu_q, 1, 1.0)


def test_default_num_splits_from_host_ints():
    assert tk.default_num_splits(256, 8, 4096, 132) == 1  # the device is full already
    assert tk.default_num_splits(1, 8, 32768, 132) == 16  # capped
    assert tk.default_num_splits(4, 2, 32768, 132) == 16
    assert tk.default_num_splits(1, 1, 100, 132, block_n=64) == 2  # no more than key blocks
    assert tk.default_num_splits(1, 1, 0, 132) == 1
    splits = [tk.default_num_splits(b, 4, 8192, 132) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert splits == sorted(splits, reverse=True)


def test_triton_available():
    assert tk.triton_available()


# -- no host synchronisation: usable inside a CUDA graph ----------------------------------------

FORBIDDEN = {"item", "tolist", "cpu", "numpy", "synchronize", "nonzero", "to_dense"}


def test_module_source_has_no_host_round_trip():
    tree = ast.parse(inspect.getsource(tk))
    found = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} & FORBIDDEN)
    assert not found, f"host round trips in triton_kernels: {found}"


class _Recorder:
    """Stands in for a kernel: records each launch's grid and Python arguments."""

    def __init__(self, log: list[Any], name: str):
        self.log, self.name = log, name

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            plain = tuple(("tensor", tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
            self.log.append((self.name, grid, plain, kwargs))
        return launch


@contextmanager
def _no_tensor_reads() -> Iterator[None]:
    """Any conversion of a tensor value to the host raises."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a tensor value was read on the host")

    names = ["item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"]
    saved = {name: getattr(torch.Tensor, name) for name in names}
    try:
        for name in names:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@pytest.mark.parametrize("max_q", [1, 16])
def test_launches_depend_on_host_ints_only(monkeypatch, max_q):
    """Two batches of the same shapes but different lengths and offsets launch the
    same grids with the same arguments, and the wrapper reads no tensor value."""
    log: list[Any] = []
    for name in ("_decode_kernel", "_merge_kernel", "_prefill_kernel"):
        monkeypatch.setattr(tk, name, _Recorder(log, name))
    long = build([(40, 1), (17, 1), (33, 1)], dtype=F32, page_size=4, head_dim=32, group=2, max_q=max_q)
    q_lens = [0, 1, 1] if max_q == 1 else [2, 0, 1]
    short = replace(long, seq_lens=torch.tensor([3, 9, 2], dtype=torch.int32, device=DEVICE),
                    cu_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                                      device=DEVICE))
    launches = []
    for case in (long, short):
        with _no_tensor_reads():
            case.run(num_splits=None)
        launches.append(log[:])
        log.clear()
    assert launches[0] and launches[0] == launches[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_q", [1, 8])
def test_cuda_graph_replay_follows_new_metadata(max_q):
    """Captured once; replayed after the lengths, query offsets and block table
    changed in place, it attends with the new ones. No call synchronises."""
    case = build([(90, 1), (40, 1), (17, 1)], dtype=F16, page_size=16, head_dim=64, group=4, max_q=max_q,
                 pad_rows=8)
    out = torch.zeros_like(case.q)
    case.run(out=out, num_splits=2)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        case.run(out=out, num_splits=2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a sync or host read here fails the capture
        case.run(out=out, num_splits=2)
    # Rows reversed: row 0 now owns the 17-key pages, row 2 the 90-key ones.
    q_lens = [1, 0, 1] if max_q == 1 else [8, 2, 1]
    case.block_table.copy_(case.block_table.flip(0).clone())
    case.seq_lens.copy_(torch.tensor([17, 33, 90], dtype=torch.int32))
    case.cu_q.copy_(torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32))
    out.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    check(case, out)
    assert bool((out[sum(q_lens):] == 7.0).all())


# -- GPU code generation, checked without a GPU ---------------------------------------------------

_COMPILE_SCRIPT = r"""
import itertools, os, re, subprocess, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.attention import triton_kernels as tk

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
         torch.int64: "i64"}
archs = [int(a) for a in sys.argv[1:]]
compiled = []


class Compile:
    # Stands in for a kernel launch: compiles it for each arch, specialised as the runtime
    # would (ints equal to 1 become constants; 16-aligned pointers and ints get divisibility 16).
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            bound = dict(zip(self.fn.arg_names, args), **kwargs)
            signature, constants, attrs = {}, {}, {}
            for i, name in enumerate(self.fn.arg_names):
                value = bound[name]
                if name in kwargs or (type(value) is int and value == 1):
                    signature[name], constants[(i,)] = "constexpr", value
                    continue
                if isinstance(value, torch.Tensor):
                    signature[name], aligned = "*" + TYPES[value.dtype], value.data_ptr() % 16 == 0
                elif isinstance(value, float):
                    signature[name], aligned = "fp32", False
                else:
                    signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                    aligned = value % 16 == 0
                if aligned:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            for arch in archs:
                kernel = triton.compile(ASTSource(self.fn, signature, constants, attrs),
                                        target=GPUTarget("cuda", arch, 32), options=options)
                compiled.append((self.fn.__name__, arch))
                check_no_spills(kernel, f"{self.fn.__name__} sm_{arch} {constants}")
        return launch


BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def check_no_spills(kernel, what):
    # Registers spilled to local memory make a slow kernel that still computes the
    # right thing, which no other test would notice. ptxas -v counts the spills;
    # Triton bundles a ptxas per GPU generation, so take one that reads this PTX.
    path = os.path.join(os.environ["TRITON_CACHE_DIR"], "spill-check.ptx")
    with open(path, "w") as f:
        f.write(kernel.asm["ptx"])
    arch = re.search(r"^\.target\s+(\w+)", kernel.asm["ptx"], re.M).group(1)
    for ptxas in sorted(p for p in os.listdir(BIN) if p.startswith("ptxas")):
        report = subprocess.run([os.path.join(BIN, ptxas), "-v", f"--gpu-name={arch}", path, "-o", os.devnull],
                                capture_output=True, text=True)
        if report.returncode == 0:
            break
    else:
        sys.exit(f"{what}: no bundled ptxas assembles it: {report.stderr[-500:]}")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report.stderr)]
    if not spills or any(spills):
        sys.exit(f"{what}: registers spill: {report.stderr.strip()}")


for name in ("_decode_kernel", "_merge_kernel", "_prefill_kernel"):
    setattr(tk, name, Compile(getattr(tk, name)))
for dtype, head_dim, page_size, group in ((torch.float32, 80, 3, 4), (torch.float16, 128, 16, 8),
                                          (torch.bfloat16, 256, 64, 1), (torch.float16, 16, 1, 2)):
    kv = torch.zeros(8, 2, 2, page_size, 2, head_dim, dtype=dtype)
    # Plain, and with both a sliding window and capped scores (the most registers).
    for (max_q, splits), (window, softcap) in itertools.product(((1, 1), (1, 4), (64, None)),
                                                                ((0, 0.0), (5, 50.0))):
        q = torch.zeros(3 * max_q, 2 * group, head_dim, dtype=dtype)
        cu_q = torch.arange(4, dtype=torch.int32) * max_q
        tk.paged_attention(q, kv, 1, torch.zeros(3, 8, dtype=torch.int32), torch.ones(3, dtype=torch.int32),
                           cu_q, max_q, 0.125, num_splits=splits, window=window, softcap=softcap)
# The KV writes (plain, and with the rotary embedding in) and the pointwise kernels, at Llama-3-8B's widths.
from engine.kernels import triton_ops as to
for name in ("_add_rms_norm_kernel", "_silu_mul_kernel", "_rotary_kernel"):
    setattr(to, name, Compile(getattr(to, name)))
tk._write_kv_kernel = Compile(tk._write_kv_kernel)
tk._rotate_write_kv_kernel = Compile(tk._rotate_write_kv_kernel)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    x = torch.zeros(2, 4096, dtype=dtype)
    to.add_rms_norm(x, x.clone(), torch.zeros(4096, dtype=dtype), 1e-5)
    to.silu_mul(torch.zeros(2, 2 * 14336, dtype=dtype))
    to.rotary_embedding(torch.zeros(2, 40, 128, dtype=dtype), torch.zeros(10, 128), torch.zeros(2, dtype=torch.int64))
    kv = torch.zeros(2, 8, 128, dtype=dtype)
    tk.write_kv(torch.zeros(64, 8, 128, dtype=dtype), torch.zeros(2, dtype=torch.int64), 16, 48, kv, kv)
    tk.rotate_write_kv(torch.zeros(2, 32, 128, dtype=dtype), kv, kv, torch.zeros(10, 128),
                       torch.zeros(2, dtype=torch.int64), torch.zeros(64, 8, 128, dtype=dtype),
                       torch.zeros(2, dtype=torch.int64), 16, 48)
# The batch-1 matrix-vector kernel in every config and the block_n its grid may
# halve to, 16-bit only (float32 keeps cuBLAS).
from engine.kernels import triton_gemv as tg
tg._gemv_kernel = Compile(tg._gemv_kernel)
for dtype, bias in ((torch.float16, True), (torch.bfloat16, False)):
    weight = torch.zeros(64, 4096, dtype=dtype)
    for block_n, block_k, warps in tg.CONFIGS:
        for n in sorted({block_n, min(block_n, 8)}):
            tg.gemv(torch.zeros(1, 4096, dtype=dtype), weight, torch.zeros(64, dtype=dtype) if bias else None,
                    tg.GemvConfig(n, block_k, warps))
            if dtype == torch.bfloat16:  # the down projection's, with SiLU x up on its input
                tg.gemv(torch.zeros(1, 8192, dtype=dtype), weight, None, tg.GemvConfig(n, block_k, warps), gated=True)
# The experts' two kernels at Mixtral's widths, with decode's 16-row blocks and a prompt's 64
# (float32 keeps 16: its 64-row blocks spilled).
from engine.kernels import triton_moe as te
te._gate_up_kernel = Compile(te._gate_up_kernel)
te._down_kernel = Compile(te._down_kernel)
te._route_kernel = Compile(te._route_kernel)
# Mixtral's decode (float32); Qwen3-MoE's prompt; the widest tile, without rescaling.
for tokens, experts, top_k, renormalize, dtype in ((1, 8, 2, True, torch.float32), (512, 128, 8, True, torch.bfloat16),
                                                   (1, 256, 8, False, torch.bfloat16)):
    te.route_and_align(torch.zeros(tokens, experts, dtype=dtype), top_k, renormalize, 16)
te.route_and_align = lambda logits, top_k, renormalize, block_m: (
    torch.zeros(logits.shape[0] * top_k),
    torch.zeros(te.max_blocks(logits.shape[0] * top_k, logits.shape[1], block_m) * block_m, dtype=torch.int32),
    torch.zeros(te.max_blocks(logits.shape[0] * top_k, logits.shape[1], block_m), dtype=torch.int32))
for dtype, tokens in itertools.product((torch.float32, torch.float16, torch.bfloat16), (1, 4096)):
    # (Weights left uninitialised: a few GB never touched.)
    te.fused_experts(torch.zeros(tokens, 4096, dtype=dtype), torch.empty(8, 2 * 14336, 4096, dtype=dtype),
                     torch.empty(8, 4096, 14336, dtype=dtype), torch.zeros(tokens, 8, dtype=dtype), 2, True)
from engine.kernels import triton_mask as tm

tm._mask_kernel = Compile(tm._mask_kernel)
tm.apply_token_bitmask(torch.zeros(4, 1000), torch.zeros(4, 32, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
print("compiled", len(compiled))
"""


def test_kernels_compile_for_gpus(tmp_path):
    """The interpreter checks neither tl.dot's minimum shapes nor types the way the GPU
    compiler does: compile every kernel for sm_80 and sm_90 (Triton's bundled ptxas, no
    GPU needed), in processes without TRITON_INTERPRET, one per architecture, side by
    side (compiling is all CPU, and the two share nothing but the sources)."""
    import subprocess
    import sys

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    compilers = []
    for arch in ("80", "90"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(tmp_path / arch)  # also where its spill check writes PTX
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
        compilers.append(subprocess.Popen([sys.executable, "-c", _COMPILE_SCRIPT, arch], cwd=root, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    counts = []
    try:
        for compiler in compilers:
            out, err = compiler.communicate(timeout=300)
            assert compiler.returncode == 0, err[-3000:]
            counts.append(int(out.split()[-1]))
    finally:
        for compiler in compilers:
            compiler.kill()
            compiler.wait()
    # Per architecture: 4 configurations x (decode, decode + merge, prefill) x (plain,
    # and with a sliding window and capped scores), then
    # 3 dtypes x 5 pointwise kernels (both KV writes among them), then 2 dtypes x 9 GEMV
    # launches (3 configs x (block_n as given, and 8), 3 with block_n <= 8) and
    # the 9 gated ones in bfloat16, the experts' routing at 3 widths
    # and 2 GEMM kernels x 3 dtypes x (decode, prompt), and the grammar mask's.
    assert counts == [4 * 4 * 2 + 3 * 5 + 3 * 9 + 3 + 2 * 3 * 2 + 1] * 2
