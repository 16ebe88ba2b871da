"""The host backend's per-element loops in C (csrc/host/host_ops.c), where a C compiler is.

Why: the CPU work of a call is a few loops over every payload byte (the fp8 cast of a
low-latency dispatch, the float32 sums of a combine). As torch operations each is several
passes with float32 temporaries, 5-8x slower than one C loop that reads each row once; these
loops are most of a large call's time on the host backend (docs/PERF.md, session 11).

Same results: each function here returns the bits of the torch code it stands in for
(moe_comm/quant.py's cast, moe_comm/host/reduce.py's sums): the C file keeps torch's order
of float32 operations and its roundings (tests/test_host_native.py checks it bit for bit).
NaN is the exception: a NaN stays a NaN, but its sign and payload bits may differ.
Where it cannot run (no ``cc``/``gcc``, a dtype it does not handle, ``MOE_COMM_HOST_NATIVE=0``)
the callers use torch, so the backend runs on any machine.

The library is built once per source and compiler (a few tenths of a second) into the kernel
cache (moe_comm/jit/cache.py, folder ``host``, keyed by the compiler, its target and the
source), for the baseline target plus an AVX2 clone picked at load time on x86-64 CPUs that
have it, so a cache shared between machines never holds code a CPU cannot run.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

from ..jit.cache import cache_dir, key, write_atomic

log = logging.getLogger(__name__)

ENV = "MOE_COMM_HOST_NATIVE"
SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "host" / "host_ops.c"
# the files SOURCE includes (built as part of it: the cache key covers them too)
INCLUDED = tuple(SOURCE.parent / name for name in ("ll_direct.c", "granted.c", "ring.c"))
FLAGS = ("-O3", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared", "-Wall", "-Werror")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}       # host_ops.c's DT_F32, DT_BF16

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES = {
    "moe_sum_rows": (_P, _P, _P, ctypes.c_int, _I, _I, _P, ctypes.c_int, _P, ctypes.c_int, _P),
    "moe_sum_segments": (_P, _I, _P, ctypes.c_int, _I, _I, _P, ctypes.c_int, _P, ctypes.c_int,
                         _P, _P),
    "moe_fp8_scales": (_P, ctypes.c_int, _I, _I, _I, _P, _P),
    "moe_fp8_cast": (_P, ctypes.c_int, _I, _I, _I, _P, _P, _I, _P, _I),
    "moe_fp8_quantize": (_P, ctypes.c_int, _I, _I, _I, _P, _P, _I, _P, _I),
    "moe_copy_rows": (_P, _I, _P, _I, _P, _I, _P, _I, _I, _I),
    "moe_count_experts": (_P, _I, _I, _P),
    "moe_put_rows_multi": (_P, _I, _I, _I, _P, _I, _I, _P, _P, _I, _I, _P, _I),
    "moe_ll_route": (_P, _I, _I, _I, _P, _P, _P, _P),
    "moe_ll_send": (_P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, _P, _I, _P, _I, _P,
                    ctypes.c_int),
    "moe_ll_recv": (_P, _I, _P, _P, _I, _I, _I, _I, _P, _I, _P, _I, _I, _P, _P, _P,
                    _I, _P, _I, _P, _P, _P, _P, _P, _P, _P),
    "moe_ll_return": (_P, _I, _I, _P, _I, _I, _I, _I, _P, _I, _I, _I),
    "moe_ll_combine": (_P, _I, _P, _P, _I, _P, _I, _I, _I, _P, ctypes.c_int, _P, _P, _P),
    # small normal calls (host/small.py): addresses travel as int64, every one checked there
    "moe_small_context_words": (),
    "moe_arm_bell": (_I,), "moe_bell_sleep": (_I, _I), "moe_ring_bell": (_I,),
    "moe_small_dispatch_start": (_P, _I, _I, _I, _I, _I, _I, _P, _I, _I, _I, _P, _P, _P, _I, _I,
                                 _P, _I, _I, _P, _P, _I, _I, _P, _P),
    "moe_small_dispatch_finish": (_P, _I, _I, _I, _I, _P, _I, _I, _I, _P, _P, _P, _P, _I, _P,
                                  _P),
    "moe_small_combine_start": (_P, _I, _I, _I, _P, _P, _I, _P, _I, _P, _I),
    "moe_small_combine_finish": (_P, _I, _I, _I, _I, _P, _P, _P, ctypes.c_int, _I, _I, _I, _P,
                                 ctypes.c_int, _P, ctypes.c_int, _P, _P, _P, _P, _P, _P),
    "moe_small_matrix_info": (_P, _I, _I, _I, _I, _P, _P),
    "moe_small_dispatch_direct": (_P, _I, _I, _I, _I, _P, _I, _I, _I, _P, _P, _P, _P, _I, _P,
                                  _I, _I, _P, _P, _P, _P, _P, _P),
    "moe_small_direct_finish": (_P, _I, _I, _I, _I, _P, _I, _I, _P, _P, _P, _I, _P, _P, _P, _I,
                                _P, _P, _P, _P),
    "moe_small_send_own": (_P, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I, _I),
    "moe_granted_dispatch": (_P, _P, _I, _I, _I, _I, _I, _P, _I, _P, _P, _I, _I, _I, _P, _P, _I,
                             _I, _P, _I),
    "moe_granted_combine": (_P, _P, _I, _I, _I, _I, _I, _P, _I, _P, _P, _I, _P, _I, _P),
    "moe_granted_fresh": (_P, _P, _I, _I, _I, _I, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I,
                          _I, _I, _P, _P, _I, _I, _I),
    # a combine streamed through the eager slots (host/ring.py)
    "moe_ring_combine": (_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, ctypes.c_int, _I, _I, _I, _P,
                         ctypes.c_int, _P, ctypes.c_int, _P, _P, _P, _P, _P, _I, _I, _I, _I),
    "moe_small_cached_direct": (_P, _I, _I, _I, _I, _P, _I, _I, _P, _P, _P, _I, _I, _P, _P,
                                _P),
    "moe_small_combine_direct": (_P, _I, _I, _I, _I, _P, _I, _I, _P, _P, _P, ctypes.c_int, _I,
                                 _P, _I, _I, _P, _P, _P, _P, _P, _P),
    # low-latency halves (host/ll_direct.py)
    "moe_ll_context_words": (), "moe_ll_stop_before_peer_write": (_I,),
    "moe_ll_direct_send": (_P, _I, _I, _I, _I, _I, _P, _I, _I, _P, _I, _I, _I, _P, _I, _P, _P,
                           _P, _P, _P, _P, _P, _P, _P, _P),
    "moe_ll_direct_recv": (_P, _I, _I, _I, _I, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I,
                           _P, _P, _P, _P, _I, _P, _P, _P, _I, _I),
    "moe_ll_direct_combine_send": (_P, _I, _I, _I, _I, _I, _P, _I, _P, _P, _P),
    "moe_ll_direct_combine_recv": (_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _I, _I, _P, _P,
                                   _P, _P),
    "moe_dispatch_layout": (_P, _I, _I, _I, _I, _P, _P, _P),
    "moe_copy_stream": (_P, _P, _I),
    "moe_stream_min_bytes": (),
    "moe_layout_matches": (_P, _I, _I, _I, _I, _P, _P, _P),
}
_RETURNS = {"moe_copy_rows": ctypes.c_int, "moe_count_experts": ctypes.c_int,
            "moe_ll_route": _I, "moe_ll_send": ctypes.c_int,
            "moe_sum_segments": ctypes.c_int, "moe_put_rows_multi": ctypes.c_int,
            "moe_stream_min_bytes": _I,
            "moe_ll_recv": ctypes.c_int, "moe_ll_return": ctypes.c_int,
            "moe_ll_combine": ctypes.c_int, "moe_small_context_words": _I,
            "moe_small_dispatch_start": _I, "moe_small_dispatch_finish": _I,
            "moe_small_combine_finish": _I, "moe_small_dispatch_direct": _I,
            "moe_small_cached_direct": _I, "moe_small_direct_finish": _I,
            "moe_small_combine_direct": _I, "moe_ll_context_words": _I,
            "moe_ll_stop_before_peer_write": _I,
            "moe_ll_direct_send": _I, "moe_ll_direct_recv": _I,
            "moe_ll_direct_combine_send": _I, "moe_ll_direct_combine_recv": _I,
            "moe_dispatch_layout": ctypes.c_int,
            "moe_layout_matches": ctypes.c_int, "moe_granted_dispatch": _I,
            "moe_granted_combine": _I, "moe_granted_fresh": _I, "moe_ring_combine": _I}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    """The built library: from the cache, or compiled in a private temporary folder (ranks
    that build at once never share a file) and published atomically; where the cache cannot
    be written, the temporary copy is loaded."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    target = subprocess.run([cc, "-dumpmachine"], capture_output=True, text=True).stdout
    digest = key(*(f.read_bytes().hex() for f in (SOURCE, *INCLUDED)), version, target,
                 platform.machine(), " ".join(FLAGS))
    path = cache_dir("host") / f"host_ops-{digest[:40]}.so"
    if path.is_file():
        return path
    built = Path(tempfile.mkdtemp(prefix="moe_comm_host_")) / path.name
    done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-2000:]}")
    return path if write_atomic(path, built.read_bytes()) else built


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None or not SOURCE.is_file():
        log.info("host backend: no C compiler (cc/gcc) or %s: torch does its loops", SOURCE)
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError) as e:
        log.warning("host backend: the C loops are not available (%s); torch does them", e)
        return None
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = _RETURNS.get(name)
    if lib.moe_stream_min_bytes() != STREAM_MIN_BYTES:
        raise RuntimeError("host_ops.c and native.py disagree on STREAM_MIN_BYTES")
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded C library, or None where it cannot run (or ``MOE_COMM_HOST_NATIVE=0``)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    return _library()


def _rows_ok(t: torch.Tensor) -> bool:
    """A CPU matrix whose rows are contiguous in a dtype the C loops read."""
    return t.device.type == "cpu" and t.dtype in DTYPES and t.dim() == 2 and \
        (t.shape[1] <= 1 or t.stride(1) == 1)


MADV_HUGEPAGE = 14                   # Linux's <sys/mman.h>
HUGE_PAGE = 2 << 20
FRESH_MAPPING_BYTES = 32 << 20       # glibc's largest mmap threshold (64-bit)


@functools.lru_cache(maxsize=None)
def _madvise():
    """libc's madvise where there is one (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


def empty_output(rows: int, cols: int, dtype) -> torch.Tensor:
    """torch.empty for an output a C loop writes whole. One of 32 MiB or more is a fresh
    mapping from the kernel on every call (glibc maps allocations that large on their own):
    its first write faults in every 4 KiB page, about half the time of a combine of 4096
    tokens x 7168 (14,000 faults). Such an output asks for transparent huge pages first
    (where the kernel lets a process ask: ``enabled`` = madvise or always), 2 MiB a fault.
    Smaller outputs come from memory glibc reuses and are left alone (advising part of its
    heap would split the heap's mapping)."""
    return advise_huge_pages(torch.empty(rows, cols, dtype=dtype))


def advise_huge_pages(out: torch.Tensor) -> torch.Tensor:
    """``out`` (contiguous, fresh), advised to transparent huge pages where it is a mapping of
    its own (FRESH_MAPPING_BYTES or more: see empty_output)."""
    nbytes = out.numel() * out.element_size()
    madvise = _madvise() if nbytes >= FRESH_MAPPING_BYTES else None
    if madvise is not None:
        lo = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        hi = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if hi > lo:
            madvise(lo, hi - lo, MADV_HUGEPAGE)     # advice only: a refusal changes nothing
    return out


def sum_rows(segments, ids_per_segment, num_tokens: int, out_dtype, biases=(),
             weights=None, out=None) -> torch.Tensor | None:
    """``reduce.sum_rows_per_token`` (and with ``weights``, float32 [n_i] per segment, the
    weighted sum of the low-latency combine) in C, into ``out`` (contiguous [num_tokens, H]
    of ``out_dtype``) or a new tensor; None (nothing written) where the C loops cannot run
    it. A token's rows are added in segment order, and within a segment in row order."""
    lib = library()
    if out is not None and (not out.is_contiguous() or out.dtype != out_dtype):
        return None
    if lib is None or out_dtype not in DTYPES or not segments or \
            any(not _rows_ok(s) or s.dtype != segments[0].dtype for s in segments) or \
            any(b.dtype != torch.float32 or not b.is_contiguous() for b in biases):
        return None
    hidden = segments[0].shape[1]
    ids = [i.to(torch.int64).contiguous() for i in ids_per_segment]
    n = sum(s.shape[0] for s in segments)
    # the torch path raises for inconsistent shapes (and, from the C code, ids past the
    # tokens): leave those to it
    if len(ids) != len(segments) or \
            any(s.shape[1] != hidden or i.numel() != s.shape[0] for s, i in zip(segments, ids)) or \
            any(tuple(b.shape) != (num_tokens, hidden) for b in biases) or \
            (out is not None and tuple(out.shape) != (num_tokens, hidden)) or \
            (weights is not None and sum(w.numel() for w in weights) != n):
        return None
    # the rows' order by token is found in C (moe_sum_segments): no sort, gather or address
    # table in torch
    table = torch.tensor([[s.data_ptr(), s.stride(0) * s.element_size(), s.shape[0],
                           i.data_ptr()] for s, i in zip(segments, ids)], dtype=torch.int64)
    w = None if weights is None else torch.cat(list(weights)).to(torch.float32).contiguous()
    bias_addr = torch.tensor([b.data_ptr() for b in biases] or [0], dtype=torch.int64)
    index = torch.empty(n + num_tokens + 1, dtype=torch.int64)
    w_sorted = None if w is None else torch.empty(n, dtype=torch.float32)
    # a new output last, after the temporaries: allocated before them, glibc handed a
    # combine's output fresh pages from the kernel on about one call in seven (measured: ~500
    # page faults a call at 1024 tokens x 7168, most of a millisecond); the normal combine
    # passes one from the Buffer's pool (pool.outputs)
    if out is None:
        out = empty_output(num_tokens, hidden, out_dtype)
    err = lib.moe_sum_segments(table.data_ptr(), len(segments),
                               None if w is None else w.data_ptr(),
                               DTYPES[segments[0].dtype], hidden, num_tokens,
                               bias_addr.data_ptr(), len(biases), out.data_ptr(),
                               DTYPES[out_dtype], index.data_ptr(),
                               None if w is None else w_sorted.data_ptr())
    return None if err else out


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """layout.dispatch_layout in one C pass (the same three tensors), or None where the C
    loops cannot run it (or an id is out of range: the torch code then says which)."""
    lib = library()
    if lib is None or topk_idx.device.type != "cpu" or topk_idx.dtype != torch.int64 or \
            topk_idx.dim() != 2 or num_experts % num_ranks:
        return None
    topk_idx = topk_idx.contiguous()
    T, K = topk_idx.shape
    per_rank = torch.empty(num_ranks, dtype=torch.int32)
    per_expert = torch.empty(num_experts, dtype=torch.int32)
    in_rank = torch.empty(T, num_ranks, dtype=torch.bool)
    if lib.moe_dispatch_layout(topk_idx.data_ptr(), T, K, num_experts, num_ranks,
                               per_rank.data_ptr(), per_expert.data_ptr(),
                               in_rank.data_ptr()) < 0:
        return None
    return per_rank, per_expert, in_rank


LAYOUT_CHECK_MAX = 1 << 16     # ranks and experts moe_layout_matches counts on its stack


def layout_matches(lib, topk_idx, num_experts, per_rank, per_expert, in_rank) -> bool:
    """Whether the caller's layout is exactly what ``topk_idx`` gives (layout.py's
    dispatch_layout), checked in one C pass with ``lib`` (the library); False also where it
    cannot be checked so (then the torch code decides, and says what differs)."""
    if lib is None or any(t is None or t.device.type != "cpu" or not t.is_contiguous()
                          for t in (topk_idx, per_rank, per_expert, in_rank)):
        return False
    T, R = in_rank.shape
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != T or \
            per_rank.dtype != torch.int32 or tuple(per_rank.shape) != (R,) or \
            per_expert.dtype != torch.int32 or tuple(per_expert.shape) != (num_experts,) or \
            in_rank.dtype != torch.bool or not R or num_experts % R or \
            max(R, num_experts) > LAYOUT_CHECK_MAX:
        return False
    return bool(lib.moe_layout_matches(topk_idx.data_ptr(), T, topk_idx.shape[1], num_experts,
                                       R, per_rank.data_ptr(), per_expert.data_ptr(),
                                       in_rank.data_ptr()))


def quantize_fp8(x: torch.Tensor, round_scale: bool, out: torch.Tensor,
                 scales_at: int | None = None):
    """quant.quantize_fp8 in C, the e4m3 bytes written straight into ``out`` (uint8 rows of
    at least H bytes: the messages of a low-latency dispatch), and with ``scales_at`` each
    row's float32 scales after them at that byte. Returns the float32 scales [T, H/128], or
    None (nothing written) where the C loops cannot run it."""
    lib = library()
    if lib is None or not _rows_ok(x) or out.stride(1) != 1 or out.dtype != torch.uint8:
        return None
    tokens, hidden = x.shape
    if scales_at is not None and out.shape[1] < scales_at + hidden // 32:
        raise IndexError(f"quantize_fp8: rows of {out.shape[1]} bytes cannot hold the scales "
                         f"at byte {scales_at}")
    scales = torch.empty(tokens, hidden // 128, dtype=torch.float32)
    scratch = torch.empty(max(hidden, 1), dtype=torch.float32)
    dt = DTYPES[x.dtype]
    if not round_scale:             # both passes token by token, the row still in the cache
        lib.moe_fp8_quantize(x.data_ptr(), dt, tokens, hidden, x.stride(0), scales.data_ptr(),
                             out.data_ptr(), out.stride(0), scratch.data_ptr(),
                             -1 if scales_at is None else scales_at)
        return scales
    lib.moe_fp8_scales(x.data_ptr(), dt, tokens, hidden, x.stride(0), scales.data_ptr(),
                       scratch.data_ptr())
    # torch's own rounding of the (few) scales: quant.py's exactly
    scales = torch.exp2(torch.ceil(torch.log2(scales)))
    lib.moe_fp8_cast(x.data_ptr(), dt, tokens, hidden, x.stride(0), scales.data_ptr(),
                     out.data_ptr(), out.stride(0), scratch.data_ptr(),
                     -1 if scales_at is None else scales_at)
    return scales


def _avx512_switch(symbol: str, on: bool | None) -> bool:
    """A C loop's AVX-512 switch (a test hook: typed here, not in _SIGNATURES): ``on=False``
    turns the version off, ``True`` back on where the CPU has it, None only asks."""
    switch = getattr(library(), symbol)
    switch.argtypes, switch.restype = (ctypes.c_int,), ctypes.c_int
    return bool(switch(-1 if on is None else int(on)))


def fp8_avx512(on: bool | None = None) -> bool:
    """Whether the fp8 cast runs its AVX-512 version (tests check the bits of both)."""
    return _avx512_switch("moe_fp8_avx512", on)


def stream_avx512(on: bool | None = None) -> bool:
    """Whether the non-temporal copies (copy_stream and the large receives' rows) store whole
    64-byte lines with AVX-512 (tests check the bytes of both versions)."""
    return _avx512_switch("moe_stream_avx512", on)


def sum_avx512(on: bool | None = None) -> bool:
    """Whether the per-token sums (sum_rows, the combines' sums) run their AVX-512 version
    (tests check the bits of both)."""
    return _avx512_switch("moe_sum_avx512", on)


def copy_rows(src: torch.Tensor, src_rows, dst: torch.Tensor, dst_rows) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for uint8 matrices (rows contiguous, any row
    stride; the row width is ``src``'s, at most ``dst``'s), ``None`` rows meaning 0, 1, ...:
    one pass in C, where torch would gather into a temporary and scatter from it. A plain
    copy, so torch's indexing stands in for it wherever the C loops cannot run."""
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8:
        raise TypeError(f"copy_rows: uint8 matrices, not {src.dtype} -> {dst.dtype}")
    src_rows = None if src_rows is None else src_rows.to(torch.int64)
    dst_rows = None if dst_rows is None else dst_rows.to(torch.int64)
    n = src_rows.numel() if src_rows is not None else \
        dst_rows.numel() if dst_rows is not None else src.shape[0]
    nbytes = src.shape[1]
    if nbytes > dst.shape[1] or (src_rows is not None and dst_rows is not None and
                                 dst_rows.numel() != n):
        raise IndexError(f"copy_rows: {n} rows of {nbytes} bytes do not match the "
                         f"destination {tuple(dst.shape)} and its row indices")
    lib = library()
    if lib is None or src.stride(1) != 1 or dst.stride(1) != 1:
        rows = src[:n] if src_rows is None else src.index_select(0, src_rows)
        if dst_rows is None:
            dst[:n, :nbytes] = rows
        else:
            dst[:, :nbytes].index_copy_(0, dst_rows, rows)
        return
    src_rows = None if src_rows is None else src_rows.contiguous()
    dst_rows = None if dst_rows is None else dst_rows.contiguous()
    err = lib.moe_copy_rows(src.data_ptr(), src.stride(0),
                            None if src_rows is None else src_rows.data_ptr(), src.shape[0],
                            dst.data_ptr(), dst.stride(0),
                            None if dst_rows is None else dst_rows.data_ptr(), dst.shape[0],
                            n, nbytes)
    if err:
        side, rows = ("source", src) if err == -1 else ("destination", dst)
        raise IndexError(f"copy_rows: a {side} row outside [0, {rows.shape[0]})")


# host_ops.c's STREAM_MIN_BYTES (checked when the library loads): the runs worth
# non-temporal stores (copy_stream)
STREAM_MIN_BYTES = 2 << 20


def copy_stream(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst`` = ``src`` (contiguous CPU tensors of as many bytes) with non-temporal stores,
    as the large dispatch payloads are written (moe_put_rows_multi): a large combine return,
    the benchmark's copy bar. False (nothing copied) where the C loops cannot run it."""
    lib = library()
    nbytes = src.numel() * src.element_size()
    if lib is None or src.device.type != "cpu" or dst.device.type != "cpu" or \
            not src.is_contiguous() or not dst.is_contiguous() or \
            dst.numel() * dst.element_size() != nbytes:
        return False
    lib.moe_copy_stream(dst.data_ptr(), src.data_ptr(), nbytes)
    return True


def expert_counts(recv_idx: torch.Tensor, num_local: int) -> list | None:
    """How many received top-k ids name each local expert (layout.aligned_expert_counts's
    bincount, before rounding), or None where the C loop cannot run it."""
    lib = library()
    if lib is None or recv_idx.dtype != torch.int64 or not recv_idx.is_contiguous() or \
            recv_idx.device.type != "cpu":
        return None
    counts = np.zeros(num_local, dtype=np.int64)
    if lib.moe_count_experts(recv_idx.data_ptr(), recv_idx.numel(), num_local,
                             counts.ctypes.data):
        return None
    return counts.tolist()


def put_rows(x_bytes: torch.Tensor, scales, topk_idx, topk_weights, ids: torch.Tensor,
             lo: int, num_local: int, outs) -> bool:
    """exchange.put_rows's copies for one destination (put_rows_multi)."""
    return put_rows_multi(x_bytes, scales, topk_idx, topk_weights, num_local, [(ids, lo, outs)])


# words per destination of moe_put_rows_multi (host_ops.c PUT_WORDS)
PUT_WORDS = 7


def put_rows_multi(x_bytes: torch.Tensor, scales, topk_idx, topk_weights, num_local: int,
                   dests) -> bool:
    """exchange.put_rows's copies for several destinations in one C pass over x:
    ``dests`` = [(ids, lo, outs)]: tokens ``ids`` of ``x_bytes`` (uint8 rows), ``scales``
    (4-byte columns) and ``topk_idx``/``topk_weights`` (made local to the experts ``[lo, lo +
    num_local)``, layout.local_topk) into ``outs`` = (payload, scales, top-k ids, weights) rows
    of that destination's region (None where the call has none). False (nothing written)
    where the C loops cannot run it; IndexError for a token id out of range."""
    lib = library()
    if lib is None or x_bytes.dtype != torch.uint8 or x_bytes.stride(1) != 1 or \
            (scales is not None and (scales.element_size() != 4 or scales.stride(1) != 1)) or \
            (topk_idx is not None and (topk_idx.dtype != torch.int64 or
                                       not topk_idx.is_contiguous())) or \
            (topk_weights is not None and (topk_weights.dtype != torch.float32 or
                                           not topk_weights.is_contiguous())) or \
            any(ids.dtype != torch.int64 or not ids.is_contiguous() or
                any(o is not None and not o.is_contiguous() for o in outs)
                for ids, _, outs in dests):
        return False
    table = torch.tensor([[ids.data_ptr(), ids.numel(), lo] +
                          [0 if o is None else o.data_ptr() for o in outs]
                          for ids, lo, outs in dests], dtype=torch.int64)
    K = 0 if topk_idx is None else topk_idx.shape[1]
    err = lib.moe_put_rows_multi(
        x_bytes.data_ptr(), x_bytes.stride(0), x_bytes.shape[0], x_bytes.shape[1],
        None if scales is None else scales.data_ptr(),
        0 if scales is None else scales.stride(0) * 4,
        0 if scales is None else scales.shape[1] * 4,
        None if topk_idx is None else topk_idx.data_ptr(),
        None if topk_weights is None else topk_weights.data_ptr(), K, num_local,
        table.data_ptr(), len(dests))
    if err:
        raise IndexError(f"put_rows: a token id outside [0, {x_bytes.shape[0]})")
    return True


# -- low-latency mode: one C call per phase (moe_comm/host/ll.py) ------------------------------
# Each returns None where the C loops cannot run (ll.py then runs its torch code); arguments
# are the ll.py's own, already checked by moe_comm/validate.py, and the C code checks the
# indices it is given again before any byte moves (a peer's counts above all).

def ll_route(topk_idx: torch.Tensor, num_experts: int):
    """This rank's (token, slot) messages sorted by expert, then token, then slot: (tok, slot
    int64 [n], first int64 [E + 1]: where each expert's messages start), or None."""
    lib = library()
    if lib is None:
        return None
    idx = topk_idx.contiguous()
    tokens, topk = idx.shape
    first = torch.empty(num_experts + 1, dtype=torch.int64)
    counts = torch.empty(num_experts, dtype=torch.int64)
    tok = torch.empty(tokens * topk, dtype=torch.int64)
    slot = torch.empty(tokens * topk, dtype=torch.int64)
    n = lib.moe_ll_route(idx.data_ptr(), tokens, topk, num_experts, counts.data_ptr(),
                         first.data_ptr(), tok.data_ptr(), slot.data_ptr())
    if n < 0:
        raise ValueError(f"topk_idx holds an expert id outside [-1, {num_experts})")
    return tok[:n], slot[:n], first


def ll_send(msgs: torch.Tensor, tok, slot, first, expert_lo: int, num_local: int,
            num_ranks: int, me: int, max_tokens: int, payload: torch.Tensor,
            meta: torch.Tensor, once: bool = False, stream: bool = False) -> None:
    """Write this rank's messages to experts [expert_lo, expert_lo + num_local) into one
    receiver's blocks: ``payload`` uint8 [slots, msg bytes] and ``meta`` uint8 [slots * 8] of
    its region (ll_route's ``tok``, ``slot``, ``first``). ``once``: a token's row only into its
    first message to that rank (every receive reads it there; meta goes into every one).
    ``stream``: with non-temporal stores (as ll_direct.c sends a large call's messages)."""
    tokens = msgs.shape[0]
    seen = torch.empty(tokens if once else 0, dtype=torch.uint8)
    err = library().moe_ll_send(msgs.data_ptr(), msgs.stride(0), msgs.shape[1], tok.data_ptr(),
                                slot.data_ptr(), first.data_ptr(), expert_lo, num_local,
                                num_ranks, me, max_tokens, payload.data_ptr(),
                                payload.stride(0), meta.data_ptr(), tokens,
                                seen.data_ptr() if once else None, int(stream))
    if err == -2:
        raise IndexError(f"low-latency dispatch: a message of a token outside [0, {tokens})")
    if err:
        raise IndexError(f"low-latency dispatch: more than {max_tokens} messages for one "
                         "expert")


def ll_recv(payload: torch.Tensor, meta: torch.Tensor, counts, max_tokens: int,
            recv_x: torch.Tensor, row_bytes: int, recv_scales, scales_at: int, own=None,
            direct=None, area=None):
    """Pack the received rows per local expert: ``payload`` uint8 [slots, msg bytes] and
    ``meta`` (uint8, 8 per slot) of this rank's region, ``counts`` numpy int64 [R, >= L] (each
    source's count row); into ``recv_x`` (contiguous, ``row_bytes`` per row) and
    ``recv_scales`` (contiguous float32, or None). ``own``: (rank, msgs, tok, slot, first)
    where this rank's messages to itself stayed in ``msgs`` (ll_route's ``tok``, ``slot``,
    ``first``) rather than in its region. A message's bytes are read from the first row of its
    token from the same source (a sender writes only that one: ll_send's ``once``).
    ``direct``: numpy uint8 [R] or None, the sources that wrote their rows straight into this
    rank's receive ``area`` (x, scales: tensors shaped as recv_x and recv_scales) at their
    packed places (host/ll_direct.py); copied from there unless recv_x is that area. Returns
    (recv_meta int64 [L, R*M], ranges int64 [L, R, 2], per_expert int64 [L]), or None where
    the C loops cannot run."""
    lib = library()
    if lib is None or not recv_x.is_contiguous() or \
            (recv_scales is not None and not recv_scales.is_contiguous()):
        return None
    num_local = recv_x.shape[0]
    R = counts.shape[0]
    recv_meta = torch.empty(num_local, R * max_tokens, dtype=torch.int64)
    ranges = torch.empty(num_local, R, 2, dtype=torch.int64)
    per_expert = torch.empty(num_local, dtype=torch.int64)
    canon = torch.empty(R * max_tokens, dtype=torch.int64)
    scale_bytes = 0 if recv_scales is None else recv_scales[0, 0].numel() * 4
    me, msgs, tok, slot, first = own if own is not None else (-1, None, None, None, None)
    err = lib.moe_ll_recv(payload.data_ptr(), payload.stride(0), meta.data_ptr(),
                          counts.ctypes.data, counts.strides[0] // 8, num_local, R, max_tokens,
                          recv_x.data_ptr(), row_bytes,
                          None if recv_scales is None else recv_scales.data_ptr(),
                          scale_bytes, scales_at, recv_meta.data_ptr(), ranges.data_ptr(),
                          per_expert.data_ptr(), me,
                          *((None, 0, None, None, None) if own is None else
                            (msgs.data_ptr(), msgs.stride(0), tok.data_ptr(), slot.data_ptr(),
                             first.data_ptr() + me * num_local * 8)), canon.data_ptr(),
                          None if direct is None else direct.ctypes.data,
                          None if direct is None else area[0].data_ptr(),
                          None if direct is None or area[1] is None else area[1].data_ptr())
    if err == -1:
        raise ValueError(f"low-latency dispatch: a source announced more than {max_tokens} "
                         "rows for one expert (a peer with another layout?)")
    if err:
        raise ValueError("low-latency dispatch: this rank's own count row disagrees with "
                         "its messages")
    return recv_meta, ranges, per_expert


def ll_return(src: torch.Tensor, ranges: torch.Tensor, owner: int, dst: torch.Tensor) -> bool:
    """The combine's return to ``owner``: for each local expert in turn, its rows from that
    owner (``ranges`` int64 [L, R, (first, count)] of the handle) of ``src`` (uint8 [L * R*M,
    bytes], rows contiguous), into the first rows of ``dst``; False (nothing copied) where the
    C loops cannot run."""
    lib = library()
    if lib is None or src.stride(1) != 1 or dst.stride(1) != 1 or not ranges.is_contiguous():
        return False
    num_local, R = ranges.shape[0], ranges.shape[1]
    err = lib.moe_ll_return(src.data_ptr(), src.stride(0), src.shape[0], ranges.data_ptr(),
                            num_local, R, owner, src.shape[0] // num_local, dst.data_ptr(),
                            dst.stride(0), dst.shape[0], src.shape[1])
    if err:
        raise IndexError("low-latency combine: a run of rows outside the expert's block or "
                         "past the destination's rows")
    return True


def ll_combine(rows: torch.Tensor, tok, slot, weights: torch.Tensor, out: torch.Tensor) -> bool:
    """``out`` [T, H] = per token, the float32 sum of ``weights[tok[i], slot[i]] * rows[i]``
    over its rows in row order (reduce.weighted_sum_rows's bits); False (nothing written)
    where the C loops cannot run it."""
    lib = library()
    if lib is None or rows.dtype != torch.bfloat16 or not _rows_ok(rows) or \
            weights.dtype != torch.float32 or not weights.is_contiguous() or \
            not out.is_contiguous() or out.dtype not in DTYPES or \
            tuple(out.shape) != (weights.shape[0], rows.shape[1]):
        return False
    n, hidden = rows.shape
    tokens, topk = weights.shape
    index = torch.empty(n + tokens + 1, dtype=torch.int64)
    w = torch.empty(n, dtype=torch.float32)
    scratch = torch.empty(2 * max(hidden, 1), dtype=torch.float32)
    err = lib.moe_ll_combine(rows.data_ptr(), rows.stride(0) * 2, tok.data_ptr(),
                             slot.data_ptr(), n, weights.data_ptr(), tokens, topk, hidden,
                             out.data_ptr(), DTYPES[out.dtype], index.data_ptr(), w.data_ptr(),
                             scratch.data_ptr())
    if err:
        raise IndexError("low-latency combine: a (token, slot) outside topk_weights")
    return True
