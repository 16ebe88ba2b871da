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
from ..wire import LL_MAX_TOPK, LL_NUM_BUFFERS, LLLayout, tag_value


def msg_stride(hidden: int, fp8: bool) -> int:
    """Bytes of one message on the wire: the token, and its scales with fp8."""
    return hidden + hidden // 128 * 4 if fp8 else 2 * hidden


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
        msgs = torch.cat([data.view(torch.uint8), scales.view(torch.uint8)], 1)
    else:
        msgs = x.view(torch.uint8)
    valid = topk_idx >= 0
    tok, slot = valid.nonzero(as_tuple=True)               # sorted by token, then slot
    expert = topk_idx[tok, slot]
    order = torch.sort(expert, stable=True).indices         # by expert, then token
    tok, slot, expert = tok[order], slot[order], expert[order]
    meta = (tok << 8) | slot
    counts = torch.bincount(expert, minlength=lay.num_experts)
    starts = (torch.cumsum(counts, 0) - counts).tolist()
    counts_l = counts.tolist()
    payload, meta_off = lay.offset(buf, "payload"), lay.offset(buf, "meta")
    count_off = lay.offset(buf, "counts") + me * lay.count_row_words * 8
    block = lay.max_tokens * stride        # one (expert, source) block, rows packed at stride

    def send(dst, _words):
        region = comm.peer_ll(dst)
        for le in range(num_local):
            e = dst * num_local + le
            c = counts_l[e]
            if c == 0:
                continue
            at = payload + (le * R + me) * block
            rows = region[at:at + c * stride].view(c, stride)
            ids = tok[starts[e]:starts[e] + c]
            torch.index_select(msgs, 0, ids, out=rows)
            m_at = meta_off + ((le * R + me) * lay.max_tokens) * 8
            region[m_at:m_at + c * 8].view(torch.int64).copy_(meta[starts[e]:starts[e] + c])
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
    block = M * stride
    recv_meta = torch.full((num_local, R * M), -1, dtype=torch.int64)
    ranges = torch.zeros(num_local, R, 2, dtype=torch.int64)
    per_expert = counts.sum(0)
    for le in range(num_local):
        n = int(per_expert[le])
        col = counts[:, le]
        ranges[le, :, 0] = torch.cumsum(col, 0) - col
        ranges[le, :, 1] = col
        if n == 0:
            continue
        # row r of source s sits at message (s * M + r) of this expert's blocks
        src = torch.repeat_interleave(torch.arange(R), col)
        rows = src * M + (torch.arange(n) - ranges[le, src, 0])
        at = payload + le * R * block
        msgs = region[at:at + R * block].view(R * M, stride)
        picked = msgs.index_select(0, rows)
        if use_fp8:
            recv_x[le, :n].view(torch.uint8).copy_(picked[:, :hidden])
            s = picked[:, hidden:stride].contiguous().view(torch.float32)
            if use_ue8m0:
                recv_scales[le, :n] = pack_ue8m0(s)
            else:
                recv_scales[le, :n] = s
        else:
            recv_x[le, :n].view(torch.uint8).copy_(picked)
        m_at = meta_off + le * R * M * 8
        recv_meta[le, :n] = region[m_at:m_at + R * M * 8].view(torch.int64).index_select(0, rows)
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

    def send(owner, _words):
        pos, slots = [], []
        for le in range(num_local):
            start, c = ranges[le, owner].tolist()
            if c:
                pos.append(torch.arange(le * R * M + start, le * R * M + start + c))
                meta = handle.recv_meta[le, start:start + c]
                slots.append((meta >> 8) * LL_MAX_TOPK + (meta & 0xFF))
        n = 0
        if pos:
            pos, slots = torch.cat(pos), torch.cat(slots)
            n = pos.numel()
            region = comm.peer_ll(owner)
            dst = region[comb_off:comb_off + M * LL_MAX_TOPK * hidden * 2].view(
                torch.bfloat16).view(M * LL_MAX_TOPK, hidden)
            dst.index_copy_(0, slots, flat.index_select(0, pos))
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
    w = torch.where(topk_idx >= 0, topk_weights, 0.0)
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    for k in range(topk):
        valid = (topk_idx[:, k] >= 0).nonzero().flatten()
        if valid.numel():
            acc.index_add_(0, valid, slots[valid, k].float() * w[valid, k, None])
    out.copy_(acc)
    comm.signal(me, comm.layout.ll_combine_free(buf), seq, 0)
    return out
