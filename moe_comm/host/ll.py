"""Low-latency mode on the host backend: no count exchange up front, fixed per-expert
receive blocks, counts travel with the data, send and receive as separate phases.

dispatch call s (buffer b = s % 2):
  send    - cast to fp8 once per token (optional); wait until each destination has read its
            buffer b from call s-2 (LL_DISPATCH_FREE, normally already true); for every local
            expert of the destination, write this rank's tokens routed to it as one message per
            (token, expert) into block [expert][me] (index_select into the peer's memory), the
            (token, slot) meta beside them, then release-store the row of counts [me][*].
  receive - wait for every source's count row; pack each expert's rows (source order) into
            recv_x [E_local, R*max_tokens, H]; publish LL_DISPATCH_FREE[b].
combine call c (buffer b = c % 2):
  send    - wait until the owner has read its buffer b from call c-2; copy each row back into
            the owner's slot (token, top-k slot); signal LL_COMBINE_DONE[b][me].
  receive - wait for every rank's DONE; weighted sum over the top-k slots in float32.
"""
from __future__ import annotations

import numpy as np
import torch

from ..handle import LowLatencyHandle
from ..quant import pack_ue8m0, quantize_fp8
from ..wire import LL_MAX_TOPK, LL_NUM_BUFFERS, LLLayout, round_up, tag_value


COMBINE_CHUNK_TOKENS = 8          # float32 copy of 8 tokens' top-k rows stays in cache


def msg_stride(hidden: int, fp8: bool) -> int:
    """Bytes of one message on the wire: the token, and its scales with fp8; a multiple of 16
    so rows move as int64 words (torch's CPU row scatter is ~7x faster on int64 than bytes)."""
    return round_up(hidden + hidden // 128 * 4, 16) if fp8 else 2 * hidden


def _words(t: torch.Tensor) -> torch.Tensor:
    """A [rows, bytes] uint8 tensor (any view of one) as int64 words."""
    return t.view(torch.uint8).view(torch.int64)


def _wait_free(comm, slot_of, seq, op, deadline, on_ready):
    """Run ``on_ready(rank)`` for every rank once its buffer is free for call ``seq``."""
    if seq <= LL_NUM_BUFFERS:
        for r in range(comm.num_ranks):
            on_ready(r, None)
        return
    waits = {r: comm.slot(r, slot_of) for r in range(comm.num_ranks)}
    comm.wait(waits, seq - LL_NUM_BUFFERS, op, deadline, on_ready)


def dispatch_send(comm, *, x, topk_idx, lay: LLLayout, use_fp8, round_scale, buffer_key):
    """Post this rank's messages. Returns the handle (completed by :func:`dispatch_recv`)."""
    comm.ll_seq["dispatch"] += 1
    seq = comm.ll_seq["dispatch"]
    buf = seq % LL_NUM_BUFFERS
    me, R, num_local = comm.rank, comm.num_ranks, lay.num_local
    num_tokens, hidden = x.shape
    stride = msg_stride(hidden, use_fp8)
    if use_fp8:
        data, scales = quantize_fp8(x, round_scale)
        msgs = torch.empty(num_tokens, stride, dtype=torch.uint8)
        msgs[:, :hidden] = data.view(torch.uint8)
        msgs[:, hidden:hidden + hidden // 32] = scales.view(torch.uint8)
    else:
        msgs = x.view(torch.uint8)
    valid = topk_idx >= 0
    tok, slot = valid.nonzero(as_tuple=True)               # sorted by token, then slot
    expert = topk_idx[tok, slot]
    order = torch.sort(expert, stable=True).indices         # by expert, then token
    tok, slot, expert = tok[order], slot[order], expert[order]
    meta = (tok << 8) | slot
    counts = torch.bincount(expert, minlength=lay.num_experts)
    starts = (torch.cumsum(counts, 0) - counts).tolist() + [tok.numel()]
    counts_l = counts.tolist()
    payload, meta_off = lay.offset(buf, "payload"), lay.offset(buf, "meta")
    count_off = lay.offset(buf, "counts") + me * lay.count_row_words * 8
    slots = num_local * R * lay.max_tokens
    # message j (expert e, i-th token of this rank for e) lands in row (le*R + me)*M + i
    rank_in_expert = torch.arange(tok.numel()) - torch.tensor(starts)[expert]
    dst_row = ((expert % num_local) * R + me) * lay.max_tokens + rank_in_expert
    bounds = [starts[d * num_local] if d < R else tok.numel() for d in range(R + 1)]

    def send(dst, _grant):
        lo, hi = bounds[dst], bounds[dst + 1]
        if hi > lo:
            region = comm.peer_ll(dst)
            rows = region[payload:payload + slots * stride].view(slots, stride)
            _words(rows).index_copy_(0, dst_row[lo:hi], _words(msgs).index_select(0, tok[lo:hi]))
            region[meta_off:meta_off + slots * 8].view(torch.int64).index_copy_(
                0, dst_row[lo:hi], meta[lo:hi])
        comm.ll_signal(dst, count_off, seq, counts_l[dst * num_local:(dst + 1) * num_local])

    _wait_free(comm, comm.layout.ll_dispatch_free(buf), seq, "low_latency_dispatch/free",
               comm.deadline(), send)
    return LowLatencyHandle(buffer_key, seq, buf, lay.max_tokens, hidden, lay.num_experts,
                            num_tokens, topk_idx.shape[1])


def dispatch_recv(comm, handle: LowLatencyHandle, lay: LLLayout, *, recv_x, recv_scales,
                  recv_count, use_fp8, use_ue8m0, stats):
    """Wait for every source's counts, pack rows per local expert into ``recv_x`` (and
    ``recv_scales``), fill ``recv_count`` and the handle; then free the buffer for reuse."""
    me, R, num_local, buf = comm.rank, comm.num_ranks, lay.num_local, handle.buf
    hidden, M = handle.hidden, lay.max_tokens
    stride = msg_stride(hidden, use_fp8)
    count_off = lay.offset(buf, "counts")
    waits = {s: comm.ll_slot(me, count_off + s * lay.count_row_words * 8, num_local)
             for s in range(R)}
    comm.wait(waits, handle.seq, "low_latency_dispatch/recv", comm.deadline())
    counts = torch.from_numpy(np.stack([tag_value(waits[s]) for s in range(R)]).astype(
        np.int64))                                          # [src, local expert]
    region = comm.peer_ll(me)
    payload, meta_off = lay.offset(buf, "payload"), lay.offset(buf, "meta")
    slots = num_local * R * M
    by_expert = counts.t().contiguous()                     # [local expert, src]
    flat = by_expert.flatten()
    block = torch.repeat_interleave(torch.arange(num_local * R), flat)   # (le, src) of a row
    i = torch.arange(block.numel()) - (torch.cumsum(flat, 0) - flat)[block]
    src_row = block * M + i                                 # where src wrote it
    packed = (torch.cumsum(by_expert, 1) - by_expert).flatten()[block] + i
    dst_row = (block // R) * (R * M) + packed               # where recv_x wants it
    msgs = _words(region[payload:payload + slots * stride].view(slots, stride)).index_select(
        0, src_row).view(torch.uint8)
    if use_fp8:
        _words(recv_x.view(slots, hidden)).index_copy_(0, dst_row, _words(msgs[:, :hidden]))
        s = msgs[:, hidden:hidden + hidden // 32].contiguous().view(torch.float32)
        s = pack_ue8m0(s) if use_ue8m0 else s
        recv_scales.view(slots, -1).index_copy_(0, dst_row, s)
    else:
        _words(recv_x.view(slots, hidden)).index_copy_(0, dst_row, _words(msgs))
    recv_meta = torch.full((num_local, R * M), -1, dtype=torch.int64)
    recv_meta.view(-1).index_copy_(0, dst_row, region[meta_off:meta_off + slots * 8].view(
        torch.int64).index_select(0, src_row))
    ranges = torch.stack([torch.cumsum(by_expert, 1) - by_expert, by_expert], -1)
    per_expert = by_expert.sum(1)
    recv_count.copy_(per_expert.to(torch.int32))
    if stats is not None:
        stats += per_expert.to(stats.dtype)
    handle.recv_meta, handle.recv_ranges, handle.received = recv_meta, ranges, True
    comm.signal(me, comm.layout.ll_dispatch_free(buf), handle.seq, 0)


def combine_send(comm, *, x, handle: LowLatencyHandle, lay: LLLayout):
    """Send every packed row back to its (token, slot) in the owner's combine region."""
    comm.ll_seq["combine"] += 1
    seq = comm.ll_seq["combine"]
    buf = seq % LL_NUM_BUFFERS
    me, R, num_local, M = comm.rank, comm.num_ranks, lay.num_local, lay.max_tokens
    hidden = x.shape[-1]
    flat = x.reshape(num_local * R * M, hidden)
    ranges = handle.recv_ranges
    comb_off = lay.offset(buf, "combine")

    # every received row, grouped by the rank that owns its token
    counts = ranges[:, :, 1]                                # [le, src]
    owner_of = torch.arange(R).expand(num_local, R)
    order = torch.argsort(owner_of.flatten(), stable=True)  # (le, src) blocks by owner
    flat_c = counts.flatten()[order]
    block = order.repeat_interleave(flat_c)
    i = torch.arange(block.numel()) - (torch.cumsum(flat_c, 0) - flat_c).repeat_interleave(flat_c)
    le = block // R
    packed = ranges[:, :, 0].flatten()[block] + i
    pos = le * R * M + packed                               # row in x
    meta = handle.recv_meta[le, packed]
    slot = (meta >> 8) * LL_MAX_TOPK + (meta & 0xFF)        # row in the owner's slots
    per_owner = counts.sum(0).tolist()
    bounds = [0] + torch.cumsum(torch.tensor(per_owner), 0).tolist()

    def send(owner, _grant):
        lo, hi = bounds[owner], bounds[owner + 1]
        n = hi - lo
        if n:
            region = comm.peer_ll(owner)
            dst = region[comb_off:comb_off + M * LL_MAX_TOPK * hidden * 2].view(
                torch.bfloat16).view(M * LL_MAX_TOPK, hidden)
            _words(dst).index_copy_(0, slot[lo:hi], _words(flat).index_select(0, pos[lo:hi]))
        comm.signal(owner, comm.layout.ll_combine_done(buf, me), seq, n)

    _wait_free(comm, comm.layout.ll_combine_free(buf), seq, "low_latency_combine/free",
               comm.deadline(), send)
    return seq, buf


def combine_recv(comm, seq, buf, lay: LLLayout, *, topk_idx, topk_weights, out):
    """Wait for every rank's rows; ``out`` [T, H] = sum_k w[t, k] * row(t, k) (float32)."""
    me, R = comm.rank, comm.num_ranks
    waits = {s: comm.slot(me, comm.layout.ll_combine_done(buf, s)) for s in range(R)}
    comm.wait(waits, seq, "low_latency_combine/recv", comm.deadline())
    num_tokens, topk = topk_idx.shape
    hidden = out.shape[1]
    comb_off = lay.offset(buf, "combine")
    slots = comm.peer_ll(me)[comb_off:comb_off + lay.max_tokens * LL_MAX_TOPK * hidden * 2].view(
        torch.bfloat16).view(lay.max_tokens, LL_MAX_TOPK, hidden)[:num_tokens, :topk]
    # slots of -1 entries were never written: zero them (0 * garbage could be NaN)
    unused = (topk_idx < 0).nonzero(as_tuple=True)
    slots[unused] = 0
    w = torch.where(topk_idx >= 0, topk_weights, 0.0).unsqueeze(1)       # [T, 1, K]
    for t0 in range(0, num_tokens, COMBINE_CHUNK_TOKENS):
        t1 = min(t0 + COMBINE_CHUNK_TOKENS, num_tokens)
        out[t0:t1] = torch.bmm(w[t0:t1], slots[t0:t1].float()).squeeze(1)
    comm.signal(me, comm.layout.ll_combine_free(buf), seq, 0)
    return out
