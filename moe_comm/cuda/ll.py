"""Low-latency mode on the CUDA backend.

Same calls, inputs and outputs as moe_comm/host/ll.py (``dispatch_send``/``dispatch_recv``/
``combine_send``/``combine_recv``), for CUDA tensors. Each half is a one-block wait kernel
(flow control or arrival; the only kernels that spin) followed by one data kernel on the
current stream, with no host synchronisation, so send and receive can be split
(return_recv_hook).

Wire layout: moe_comm/wire.py ``LLLayout`` (two buffers, alternating by call number), message
rows packed at ``msg_stride`` inside each [local expert][source] block, count rows ending in
the return-base word, combine rows in the owner's message order - exactly like the host
backend. Device code and memory ordering: csrc/kernels/low_latency.cuh.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import logfmt as logfmt_codec
from .. import signature
from ..errors import BufferTooSmallError
from ..handle import LowLatencyHandle
from ..jit import variants
from ..jit.kernel_args import call_args, pack
from ..jit.launch import launch
from ..jit.variants import THREADS
from ..wire import LL_MAX_TOPK, LL_NUM_BUFFERS, LLLayout, ll_msg_stride, ll_stride
from .comm import SIGNAL_STRIDE, CudaComm
from .elastic import agree
from .kernel_inputs import errors, ll_group

MAX_SPLIT = 8           # blocks per local expert in recv / combine send


@dataclass(eq=False)
class CudaLowLatencyHandle(LowLatencyHandle):
    """LowLatencyHandle with device tables: ``send_index`` int32 [T, K] (message index of
    each routed (token, slot) in this rank's message order: where combine finds its returned
    row), ``return_base`` int64 [R], ``recv_meta`` int64 [E/R, R*M], ``recv_ranges`` int64
    [E/R, R, 2]. ``send_tok``/``send_slot`` (the host backend's form) stay None. Elastic:
    ``return_runs`` int32 [R, 2], the combine rows this rank's messages to each rank come back
    to (low_latency.cuh ReturnRows)."""

    send_index: torch.Tensor = None
    return_runs: torch.Tensor = None


def _offsets(comm: CudaComm, lay: LLLayout, buf: int):
    return {part: comm.ll_offset + lay.offset(buf, part, ll_stride(comm.ll_bytes))
            for part in ("payload", "meta", "counts", "combine")}


def _contiguous(**tensors) -> None:
    """Kernels write outputs in place: they must be dense."""
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def _split(num_local: int) -> int:
    return max(1, min(MAX_SPLIT, 128 // max(1, num_local)))


def _check(comm: CudaComm, lay: LLLayout, hidden: int, num_tokens: int, topk: int,
           use_fp8: bool) -> None:
    if lay.nbytes > comm.ll_bytes:
        raise BufferTooSmallError("low-latency mode", lay.nbytes, comm.ll_bytes,
                                  argument="num_rdma_bytes")
    if lay.num_experts % comm.num_ranks:
        raise ValueError(f"num_experts={lay.num_experts} must be divisible by the group size "
                         f"{comm.num_ranks}")
    if num_tokens > lay.max_tokens:
        raise ValueError(f"{num_tokens} tokens exceed num_max_dispatch_tokens_per_rank="
                         f"{lay.max_tokens}")
    if topk > LL_MAX_TOPK:
        raise ValueError(f"low-latency mode supports top-k <= {LL_MAX_TOPK}, got {topk}")
    if use_fp8 and hidden % 128:
        raise ValueError(f"fp8 low-latency dispatch needs hidden % 128 == 0, got {hidden}")


def _wait(comm: CudaComm, kernels, op: str, offset: int, src_stride: int, words: int,
          epoch: int, wait_cost=None) -> None:
    """One-block wait on this rank's own slots, one row per source (ll.cu ``moe_ll_wait``);
    ``wait_cost``: int64 [R] on the device or None, adds the ns waited for each source."""
    launch(kernels["moe_ll_wait"], 1, THREADS["moe_ll_wait"],
           pack("moe_ll_wait", **ll_group(comm), **errors(comm, op), offset=offset,
                src_stride=src_stride, words=words, epoch=epoch, active=comm.active,
                wait_cost=wait_cost),
           device=comm.device)


def dispatch_send(comm: CudaComm, *, x, topk_idx, lay: LLLayout, use_fp8: bool,
                  round_scale: bool, buffer_key) -> CudaLowLatencyHandle:
    """Post this rank's messages: ``x`` bf16 [T, H], ``topk_idx`` int64 [T, K] (-1 = unused).
    Returns the handle (completed by :func:`dispatch_recv`)."""
    comm.begin_call()
    num_tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    _check(comm, lay, hidden, num_tokens, topk, use_fp8)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"low-latency dispatch takes bf16 x, got {x.dtype}")
    comm.ll_seq["dispatch"] += 1
    seq = comm.ll_seq["dispatch"]
    buf = seq % LL_NUM_BUFFERS
    off = _offsets(comm, lay, buf)
    send_index = torch.empty(num_tokens, topk, dtype=torch.int32, device=comm.device)
    shift, runs = _return_rows(comm)
    call_row = signature.low_latency(hidden=hidden, use_fp8=use_fp8, round_scale=round_scale,
                                     topk=topk, num_experts=lay.num_experts,
                                     max_tokens=lay.max_tokens,
                                     refused_by=signature.low_latency_refusal(
                                         comm, (lay.max_tokens, hidden, lay.num_experts)))
    k = comm.kernels(variants.ll_dispatch_send(hidden, use_fp8, round_scale))
    x = x.contiguous()
    stride = ll_msg_stride(hidden, use_fp8)
    staged, staged_stride = None, 0
    if use_fp8:        # each token cast once, then copied into each of its messages
        staged_stride = stride                           # the message layout, 16-aligned
        staged = torch.empty(num_tokens, staged_stride, dtype=torch.uint8, device=comm.device)
        launch(k["moe_ll_quantize"], max(1, num_tokens), THREADS["moe_ll_quantize"],
               pack("moe_ll_quantize", x=x, num_tokens=num_tokens, hidden=hidden,
                    staged=staged, staged_stride=staged_stride), device=comm.device)
    if seq > LL_NUM_BUFFERS:     # every rank has read its buffer `buf` of call seq - 2
        _wait(comm, k, "low_latency_dispatch/send", comm.layout.ll_dispatch_free(buf, 0) * 8,
              SIGNAL_STRIDE, 1, seq - LL_NUM_BUFFERS)
    launch(k["moe_ll_dispatch_send"], max(1, lay.num_experts), THREADS["moe_ll_dispatch_send"],
           pack("moe_ll_dispatch_send", **ll_group(comm),
                **errors(comm, "low_latency_dispatch/send"), payload_off=off["payload"],
                meta_off=off["meta"], counts_off=off["counts"],
                count_row_words=lay.count_row_words, stride=stride,
                max_tokens=lay.max_tokens, x=x, staged=staged, staged_stride=staged_stride,
                num_tokens=num_tokens,
                hidden=hidden, topk_idx=topk_idx.contiguous(), topk=topk,
                num_experts=lay.num_experts, send_index=send_index, seq=seq,
                active=comm.active, call_off=comm.layout.ll_call(buf, 0) * 8,
                **call_args(call_row), holds=comm.ll_holds, shift_used=shift, runs=runs,
                rows_cap=lay.max_tokens * LL_MAX_TOPK), device=comm.device)
    return CudaLowLatencyHandle(buffer_key, seq, buf, lay.max_tokens, hidden, lay.num_experts,
                                num_tokens, topk, send_index=send_index, call_row=call_row,
                                return_runs=runs)


def _return_rows(comm: CudaComm):
    """Elastic: (int32 [1] = -1, the shift the dispatch's blocks agree on; int32 [R, 2], its
    rows per expert rank) for low_latency.cuh ReturnRows; else (None, None)."""
    if comm.ll_holds is None:
        return None, None
    return (torch.full((1,), -1, dtype=torch.int32, device=comm.device),
            torch.zeros(comm.num_ranks, 2, dtype=torch.int32, device=comm.device))


def dispatch_recv(comm: CudaComm, handle: LowLatencyHandle, lay: LLLayout, *, recv_x,
                  recv_scales, recv_count, use_fp8: bool, use_ue8m0: bool, stats,
                  wait_stats=None) -> None:
    """Receive call ``handle.seq``: fills ``recv_x`` [E/R, R*M, H] (float8_e4m3fn or bf16),
    ``recv_scales`` (float32 [E/R, R*M, H/128], or int32 [E/R, R*M, H/512] with UE8M0),
    ``recv_count`` int32 [E/R], adds to ``stats`` (int32/int64 [E/R] or None), and the
    handle's ``recv_meta`` int64 [E/R, R*M], ``recv_ranges`` int64 [E/R, R, 2] and
    ``return_base`` int64 [R] (device tensors). ``wait_stats``: int64 [R] on the device or
    None; adds per source the ns this receive waited for its signature and counts
    (%globaltimer in the signature check and the wait kernel, ll.cu ``add_wait_cost``)."""
    comm.begin_call()
    if use_ue8m0 and handle.hidden % 512:
        raise ValueError(f"UE8M0 scales pack four per int32: hidden % 512 == 0 needed, got "
                         f"{handle.hidden}")
    _contiguous(recv_x=recv_x, recv_scales=recv_scales, recv_count=recv_count, stats=stats,
                dispatch_wait_recv_cost_stats=wait_stats)
    R, M, num_local, dev = comm.num_ranks, lay.max_tokens, lay.num_local, comm.device
    wide_stats = stats is not None and stats.dtype != torch.int32
    stats32 = torch.zeros(num_local, dtype=torch.int32, device=dev) if wide_stats else stats
    handle.recv_meta = torch.empty(num_local, R * M, dtype=torch.int64, device=dev)
    handle.recv_ranges = torch.empty(num_local, R, 2, dtype=torch.int64, device=dev)
    handle.return_base = torch.empty(R, dtype=torch.int64, device=dev)
    off = _offsets(comm, lay, handle.buf)
    k = comm.kernels(variants.ll_dispatch_recv(handle.hidden, use_fp8, use_ue8m0))
    # every source's count row: num_local counts + the base word
    # every source's signature first: one with another layout writes its counts elsewhere
    comm.last_call = ("ll", handle.buf)
    launch(k["moe_ll_check_call"], 1, THREADS["moe_ll_check_call"],
           pack("moe_ll_check_call", **ll_group(comm),
                **errors(comm, "low_latency_dispatch/recv"),
                call_off=comm.layout.ll_call(handle.buf, 0) * 8, seq=handle.seq,
                active=comm.active, **call_args(handle.call_row), wait_cost=wait_stats),
           device=dev)
    _wait(comm, k, "low_latency_dispatch/recv", off["counts"], lay.count_row_words * 8,
          num_local + 1, handle.seq, wait_stats)
    agree(comm, "low_latency_dispatch/recv")   # elastic: the same sources count on every rank
    launch(k["moe_ll_dispatch_recv"], (num_local, _split(num_local)),
           THREADS["moe_ll_dispatch_recv"],
           pack("moe_ll_dispatch_recv", **ll_group(comm),
                **errors(comm, "low_latency_dispatch/recv"), payload_off=off["payload"],
                meta_off=off["meta"], counts_off=off["counts"],
                count_row_words=lay.count_row_words,
                stride=ll_msg_stride(handle.hidden, use_fp8), max_tokens=M, hidden=handle.hidden,
                num_local=num_local, free_off=comm.layout.ll_dispatch_free(handle.buf, 0) * 8,
                seq=handle.seq, recv_x=recv_x, recv_scales=recv_scales if use_fp8 else None,
                recv_count=recv_count, stats=stats32, recv_meta=handle.recv_meta,
                recv_ranges=handle.recv_ranges, return_base=handle.return_base,
                counter=comm.counter("ll_dispatch_recv"), active=comm.active), device=dev)
    if wide_stats:                              # the kernel adds int32; int64 stats allowed
        stats += stats32
    handle.received = True


def combine_send(comm: CudaComm, *, x, handle: CudaLowLatencyHandle, lay: LLLayout,
                 use_logfmt: bool = False):
    """Send every received row of ``x`` bf16 [E/R, R*M, H] back to its owner's combine rows,
    in the owner's message order (one contiguous run per owner); ``use_logfmt``: each row
    LogFMT-encoded (moe_comm/logfmt.py) at the start of its row slot, and the DONE word says
    so (wire.LL_DONE_LOGFMT). Returns ``(seq, buf)`` for :func:`combine_recv`."""
    comm.begin_call()
    if x.dtype != torch.bfloat16:
        raise TypeError(f"low-latency combine takes bf16 x, got {x.dtype}")
    if use_logfmt:              # before anything moves: ValueError naming use_logfmt
        logfmt_codec.row_bytes(x.shape[-1])
    comm.ll_seq["combine"] += 1
    seq = comm.ll_seq["combine"]
    buf = seq % LL_NUM_BUFFERS
    hidden, num_local = x.shape[-1], lay.num_local
    k = comm.kernels(variants.ll_combine(hidden))
    if seq > LL_NUM_BUFFERS:     # every owner has summed its combine rows of call seq - 2
        _wait(comm, k, "low_latency_combine/send", comm.layout.ll_combine_free(buf, 0) * 8,
              SIGNAL_STRIDE, 1, seq - LL_NUM_BUFFERS)
    launch(k["moe_ll_combine_send"], (num_local, _split(num_local)),
           THREADS["moe_ll_combine_send"],
           pack("moe_ll_combine_send", **ll_group(comm),
                **errors(comm, "low_latency_combine/send"),
                combine_off=_offsets(comm, lay, buf)["combine"], max_tokens=lay.max_tokens,
                x=x.contiguous(), hidden=hidden, num_local=num_local,
                rows_cap=lay.max_tokens * LL_MAX_TOPK, recv_ranges=handle.recv_ranges,
                return_base=handle.return_base,
                done_off=comm.layout.ll_combine_done(buf, 0) * 8, done_stride=SIGNAL_STRIDE,
                seq=seq, counter=comm.counter("ll_combine_send"), active=comm.active,
                logfmt=int(bool(use_logfmt))),
           device=comm.device)
    return seq, buf


def combine_recv(comm: CudaComm, seq: int, buf: int, lay: LLLayout, *, handle, topk_idx,
                 topk_weights, out, use_logfmt: bool = False, wait_stats=None):
    """Wait for every rank's rows; ``out`` bf16 [T, H] = sum_k w[t, k] * row(t, k) in float32
    (slots with id -1 skipped; LogFMT rows decoded with ``use_logfmt``). ``handle``: this
    call's dispatch handle (its send_index); ``topk_idx`` int64 / ``topk_weights`` float32
    [T, K], as dispatched. ``wait_stats``: int64 [R] on the device or None; adds per rank the
    ns waited for its DONE. A rank whose DONE says otherwise about use_logfmt fails the call
    on every rank: CallMismatchError when the rank next checks its errors (comm.py ``check``:
    at its next call; kernels are asynchronous), and the buffer serves the call after."""
    comm.begin_call()
    _contiguous(out=out, combine_wait_recv_cost_stats=wait_stats)
    num_tokens, topk = topk_idx.shape
    hidden = out.shape[1]
    k = comm.kernels(variants.ll_combine(hidden))
    _wait(comm, k, "low_latency_combine/recv", comm.layout.ll_combine_done(buf, 0) * 8,
          SIGNAL_STRIDE, 1, seq, wait_stats)
    agree(comm, "low_latency_combine/recv")
    # a mismatch error reads each rank's use_logfmt from here (comm.py check)
    comm.last_call = ("ll_combine", comm.ll_logfmt_seen)
    launch(k["moe_ll_combine_recv"], max(1, min(num_tokens, 64)),
           THREADS["moe_ll_combine_recv"],
           pack("moe_ll_combine_recv", **ll_group(comm),
                **errors(comm, "low_latency_combine/recv"),
                combine_off=_offsets(comm, lay, buf)["combine"], hidden=hidden,
                num_tokens=num_tokens, topk=topk, rows_cap=lay.max_tokens * LL_MAX_TOPK,
                topk_idx=topk_idx.contiguous(), topk_w=topk_weights.contiguous(),
                send_index=handle.send_index, free_off=comm.layout.ll_combine_free(buf, 0) * 8,
                seq=seq, out=out, counter=comm.counter("ll_combine_recv"),
                num_local=lay.num_local, active=comm.active, holds=comm.ll_holds,
                runs=handle.return_runs, done_off=comm.layout.ll_combine_done(buf, 0) * 8,
                logfmt=int(bool(use_logfmt)), logfmt_seen=comm.ll_logfmt_seen),
           device=comm.device)
    return out
