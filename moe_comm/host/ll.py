"""Low-latency mode on the host backend: no count exchange up front, fixed per-expert
receive blocks, counts travel with the data, send and receive as separate phases.

dispatch call s (buffer b = s % 2):
  send    - cast to fp8 once per token (optional, in C where host/native.py can); wait until
            each destination has read its buffer b from call s-2 (its LL_DISPATCH_FREE push,
            normally already there); for every local expert of the destination, write this
            rank's tokens routed to it as one message per (token, expert) into block
            [expert][me] (straight into the peer's memory; on one host a token's bytes only
            into its first message to that rank, the others carry only their meta), the
            (token, slot) meta beside them, then release-store the row of counts [me][*].
            Destinations in turn from the next rank on, itself last; with fp8 its messages
            to itself stay in its message rows (the receive reads them there).
  receive - wait for every source's count row; pack each expert's rows (source order) into
            recv_x [E_local, R*max_tokens, H], each message's bytes read from its token's
            first message from that source (a source on host/ll_direct.py's path may have
            written its rows straight into the receive area this rank gave: they are copied
            from there); push LL_DISPATCH_FREE[b][me] to every peer.
            Each phase is one C call where host/native.py can build one (the sort of the
            messages, each destination's copies, the pack; the combine's returns and sum),
            and the header views and offsets it reads are made once per layout.
combine call c (buffer b = c % 2):
  send    - wait until the owner has read its buffer b from call c-2; copy this rank's rows
            for the owner, expert by expert, as one contiguous run at the owner's base offset
            (the owner's messages to this rank, in the owner's order); signal
            LL_COMBINE_DONE[b][me].
  receive - wait for every rank's DONE; sum weight(token, slot) * row per token in float32.

Inactive ranks get no messages and are not awaited; a source masked by a receive's deadline
counts as having sent nothing, and rows from expert ranks masked before a combine receive
are left out of the sums. In elastic mode each receive half ends with the survivors agreeing
on the mask (one round of signal words without failures).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .. import signature
from ..errors import CallMismatchError
from .. import logfmt
from ..handle import LowLatencyHandle
from ..quant import pack_ue8m0, quantize_fp8
from . import native
from .native import copy_rows
from .pool import OutputPool
from .reduce import weighted_sum_rows
from ..wire import (CALL_WORDS, LL_AREA_BITS, LL_CALL_FIELDS, LL_DONE_LOGFMT, LL_MAX_TOPK,
                    LL_NUM_BUFFERS, LL_ROWS_DIRECT, LLLayout, ll_msg_stride, tag_epoch,
                    tag_value)

REFUSED = LL_CALL_FIELDS.index("layout_refused")   # the signature word of a refusal


def _cached(comm, key, build):
    """``build()``, made once per communicator: the header views and region offsets a call
    reads are the same for every call of a layout and buffer (building them anew cost more
    Python than a small call's copies)."""
    got = comm.ll_cache.get(key)
    if got is None:
        got = comm.ll_cache[key] = build()
    return got


def _offsets(comm, lay: LLLayout, buf: int) -> dict:
    """Byte offsets of buffer ``buf``'s parts (``LLLayout.offset``) in this rank's region."""
    return _cached(comm, ("offsets", lay, buf), lambda: {
        part: lay.offset(buf, part, comm.ll_stride)
        for part in ("payload", "meta", "counts", "combine", "announce")})


def _blocks(comm, lay: LLLayout, buf: int, rank: int, stride: int):
    """Buffer ``buf``'s dispatch blocks in ``rank``'s region: (payload uint8 [slots,
    stride], meta uint8 [slots * 8]), made once."""
    def build():
        off, slots = _offsets(comm, lay, buf), lay.num_local * lay.num_ranks * lay.max_tokens
        region = comm.peer_ll(rank)
        return (region[off["payload"]:off["payload"] + slots * stride].view(slots, stride),
                region[off["meta"]:off["meta"] + slots * 8])
    return _cached(comm, ("blocks", lay, buf, rank, stride), build)


def _header_views(comm, word_of, buf: int, n: int = 1) -> dict:
    """``{rank: n words of this rank's header at word_of(buf, rank)}``, made once."""
    return _cached(comm, (word_of.__name__, buf, n), lambda: {
        r: comm.slot(comm.rank, word_of(buf, r), n) for r in range(comm.num_ranks)})


def _send_order(comm) -> list:
    """The ranks in the order this rank sends to them: the next ranks first, itself last.
    Every rank then starts with a different peer, and the data a rank's own receive waits for
    from its peers is written while it writes its own share (with itself first, a rank's
    receive would wait for the share a peer writes last)."""
    me, R = comm.rank, comm.num_ranks
    return [(me + 1 + i) % R for i in range(R)]


def _wait_free(comm, kind, word_of, buf, seq, op, on_ready):
    """Run ``on_ready(rank)`` for every active rank once its buffer is free for call ``seq``
    (it pushed ``word_of(buf, rank)`` = seq - 2 into this rank's header), in
    :func:`_send_order` where they are free alike; the first two calls after a start or a
    reset have nothing to wait for."""
    if seq <= comm.ll_base[kind] + LL_NUM_BUFFERS:
        for r in _send_order(comm):
            if comm.active[r]:
                on_ready(r, None)
        return
    views = _header_views(comm, word_of, buf)
    waits = _cached(comm, ("send order", word_of.__name__, buf),
                    lambda: {r: views[r] for r in _send_order(comm)})
    comm.wait(waits, seq - LL_NUM_BUFFERS, op, on_ready)


def _timed_wait(comm, waits, epoch, op, wait_stats, start_ns) -> None:
    """``comm.wait``; with ``wait_stats`` (int64 [R]) also add, per source, the nanoseconds
    from ``start_ns`` until its words arrived (a source still silent at the end: until
    then). Sources masked before the wait are not awaited and add nothing."""
    if wait_stats is None:
        comm.wait(waits, epoch, op)
        return
    awaited = [r for r in waits if comm.active[r]]
    arrived = {}
    comm.wait(waits, epoch, op,
              lambda src, _words: arrived.setdefault(src, time.monotonic_ns()))
    end = time.monotonic_ns()
    cost = torch.zeros(comm.num_ranks, dtype=torch.int64)
    for r in awaited:
        cost[r] = arrived.get(r, end) - start_ns
    wait_stats += cost


def _publish_free(comm, slot, seq):
    """Tell every active peer this rank finished reading a buffer for call ``seq``."""
    comm.signal_each(np.flatnonzero(comm.active), slot, seq, 0)


def _route(topk_idx: torch.Tensor, num_experts: int):
    """This rank's messages, one per (token, slot) with an expert, sorted by expert, then
    token, then slot: (tok, slot int64 [n], first int64 [E + 1]: where each expert's messages
    start; first[E] = n). One C pass where it can run, else torch's stable sort."""
    routed = native.ll_route(topk_idx, num_experts)
    if routed is not None:
        return routed
    tok, slot = (topk_idx >= 0).nonzero(as_tuple=True)     # sorted by token, then slot
    expert = topk_idx[tok, slot]
    order = torch.sort(expert, stable=True).indices         # by expert, then token
    first = torch.zeros(num_experts + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(expert, minlength=num_experts), 0, out=first[1:])
    return tok[order], slot[order], first


def _messages(comm, x, use_fp8, round_scale, stride, buf):
    """The message row of every token: fp8 bytes then float32 scales (cast once per token,
    in C where it can run), or the bf16 token itself. The fp8 rows reuse the memory of
    call s-2's (buffer ``buf``) once its receive has dropped them: fresh memory costs a page
    fault per 4 KiB on first touch."""
    if not use_fp8:
        return x.view(torch.uint8)
    hidden = x.shape[1]
    pool = _cached(comm, "message rows", OutputPool)
    msgs = pool.empty(("msgs", buf), (x.shape[0], stride), torch.uint8)
    if native.quantize_fp8(x, round_scale, msgs, scales_at=hidden) is None:
        data, scales = quantize_fp8(x, round_scale)
        msgs[:, :hidden] = data.view(torch.uint8)
        msgs[:, hidden:hidden + hidden // 32] = scales.view(torch.uint8)
    return msgs


def _write_messages(msgs, tok, slot, first, dst, lay: LLLayout, me, rows, meta,
                    once=False) -> None:
    """This rank's messages to ``dst``'s experts into its blocks [le][me]: ``rows`` uint8
    [slots, stride] and ``meta`` uint8 [slots * 8] of its region; one C call, or a row copy
    per message (torch's indexing where the C loops cannot run). ``once``: each token's row
    only into its first message to ``dst`` (C only; every receive reads a token's messages
    from that row, see :func:`_pack_torch`)."""
    L, R, M = lay.num_local, lay.num_ranks, lay.max_tokens
    if native.library() is not None:
        native.ll_send(msgs, tok, slot, first, dst * L, L, R, me, M, rows, meta, once=once)
        return
    lo, hi = int(first[dst * L]), int(first[(dst + 1) * L])
    counts = first[dst * L + 1:(dst + 1) * L + 1] - first[dst * L:(dst + 1) * L]
    le = torch.repeat_interleave(torch.arange(L), counts, output_size=hi - lo)
    # the row of each message: block [le][me], then its place among le's messages
    at_row = (le * R + me) * M + torch.arange(lo, hi) - first[dst * L:(dst + 1) * L][le]
    copy_rows(msgs, tok[lo:hi], rows, at_row)
    meta_bytes = ((tok[lo:hi] << 8) | slot[lo:hi]).view(torch.uint8).view(-1, 8)
    copy_rows(meta_bytes, None, meta.view(-1, 8), at_row)


def dispatch_send(comm, *, x, topk_idx, lay: LLLayout, use_fp8, round_scale, buffer_key):
    """Post this rank's messages. Returns the handle (completed by :func:`dispatch_recv`)."""
    comm.start_call()
    me, R, num_local = comm.rank, comm.num_ranks, lay.num_local
    num_tokens, hidden = x.shape
    stride = ll_msg_stride(hidden, use_fp8)
    msgs = _messages(comm, x, use_fp8, round_scale, stride,
                     (comm.ll_seq["dispatch"] + 1) % LL_NUM_BUFFERS)
    tok, slot, first = _route(topk_idx, lay.num_experts)
    shift = _place_return_rows(comm, lay, tok.numel(), hidden)    # before anything moves
    comm.ll_seq["dispatch"] += 1
    seq = comm.ll_seq["dispatch"]
    buf = seq % LL_NUM_BUFFERS
    first_l = first.tolist()
    off = _offsets(comm, lay, buf)
    payload, meta_off = off["payload"], off["meta"]
    count_off = off["counts"] + me * lay.count_row_words * 8
    announce_off = off["announce"] + me * lay.count_row_words * 8
    # the FREE pushes this call waits for: where one gives a receive area, the senders after
    # this rank on host/ll_direct.py's path place their rows after this rank's (below)
    frees = _header_views(comm, comm.layout.ll_dispatch_free, buf) \
        if comm.ll_areas is not None and seq > comm.ll_base["dispatch"] + LL_NUM_BUFFERS \
        else None
    call_word = comm.layout.ll_call(buf, me)
    M = lay.max_tokens
    call_row = signature.low_latency(hidden=hidden, use_fp8=use_fp8, round_scale=round_scale,
                                     topk=topk_idx.shape[1], num_experts=lay.num_experts,
                                     max_tokens=M,
                                     refused_by=signature.low_latency_refusal(
                                         comm, (lay.max_tokens, hidden, lay.num_experts)))

    sent_to = np.zeros(R, dtype=bool)
    # the messages to itself stay in msgs, for its receive to copy once, straight into
    # recv_x (one copy of 1/R of the payload saved); fp8 only: bf16 messages are the caller's
    # x, which may change before a hooked receive runs
    own_rows = (me, msgs, tok, slot, first) if use_fp8 and native.library() is not None \
        else None

    def send(dst, _grant):
        comm.check_fence()             # a rank the survivors masked writes nothing
        sent_to[dst] = True
        # the signature first: a receiver with another layout still finds it (moe_comm/
        # signature.py), and checks it before it trusts the count row
        comm.signal(dst, call_word, seq, call_row)
        e_lo = dst * num_local
        counts = [first_l[e + 1] - first_l[e] for e in range(e_lo, e_lo + num_local)]
        if frees is not None and tag_value(int(frees[dst][0])) & ((1 << LL_AREA_BITS) - 1):
            # its counts, announced: the senders after it need them before they write
            comm.ll_signal(dst, announce_off, seq, counts)
        if first_l[e_lo + num_local] > first_l[e_lo] and \
                not (dst == me and own_rows is not None):       # each message one row copy
            # a token's row once per rank (not once per expert: a top-8 token has ~8/R
            # messages per rank); a network peer gets whole blocks, so it gets every row
            _write_messages(msgs, tok, slot, first, dst, lay, me,
                            *_blocks(comm, lay, buf, dst, stride), once=not comm.is_remote(dst))
            if comm.is_remote(dst):                       # the byte runs a network peer gets
                for le, c in enumerate(counts):
                    if c:
                        at = (le * R + me) * M
                        comm.commit(dst, "ll", payload + at * stride, c * stride)
                        comm.commit(dst, "ll", meta_off + at * 8, c * 8)
        comm.ll_signal(dst, count_off, seq, counts + [first_l[e_lo] + shift])

    _wait_free(comm, "dispatch", comm.layout.ll_dispatch_free, buf, seq,
               "low_latency_dispatch/free", send)
    return LowLatencyHandle(buffer_key, seq, buf, lay.max_tokens, hidden, lay.num_experts,
                            num_tokens, topk_idx.shape[1], send_tok=tok, send_slot=slot,
                            call_row=call_row, return_shift=shift, sent_to=sent_to,
                            own_rows=own_rows)


def _combine_offsets(comm, lay: LLLayout) -> list:
    """Where each buffer's combine rows start in this rank's low-latency region."""
    return [_offsets(comm, lay, b)["combine"] for b in range(LL_NUM_BUFFERS)]


def _place_return_rows(comm, lay: LLLayout, rows: int, hidden: int) -> int:
    """The row of this rank's combine region where the results of its ``rows`` messages
    will come back: past the rows a masked rank may still write into (host/late_rows.py)."""
    shift = comm.late_rows.place(rows, hidden * 2, _combine_offsets(comm, lay),
                                 lay.max_tokens * LL_MAX_TOPK)
    if shift is None:
        held = comm.late_rows.held
        raise RuntimeError(
            f"low-latency dispatch: no room for {rows} combine rows: "
            f"{sum(end - start for start, end, _ in held)} bytes of the combine region are held "
            f"back from masked rank(s) {sorted({r for *_, r in held})}, which may still write "
            "there (until their late rows come or their processes are gone); a new Buffer "
            "starts clean")
    return shift


def _check_signatures(comm, handle) -> None:
    """Every source's signature of this call (written before its messages) must equal this
    rank's; else every rank raises CallMismatchError here, before reading what a source with
    another layout wrote, and frees the buffer so the next agreeing calls go on."""
    me, buf = comm.rank, handle.buf
    waits = _header_views(comm, comm.layout.ll_call, buf, CALL_WORDS)
    comm.wait(waits, handle.seq, "low_latency_dispatch/signature")
    if comm.all_active and not handle.call_row[REFUSED]:   # the common case first: every
        mine = (handle.seq << 32) | handle.call_row          # signature is this rank's
        if all((words == mine).all() for words in waits.values()):
            return
    try:
        signature.check("low_latency_dispatch", {s: tag_value(waits[s]) for s in
                                                 np.flatnonzero(comm.active)}, LL_CALL_FIELDS)
    except CallMismatchError:
        _publish_free(comm, comm.layout.ll_dispatch_free(buf, me), handle.seq)
        raise


def dispatch_recv(comm, handle: LowLatencyHandle, lay: LLLayout, *, recv_x, recv_scales,
                  recv_count, use_fp8, use_ue8m0, stats, wait_stats=None):
    """Wait for every source's counts, pack rows per local expert into ``recv_x`` (and
    ``recv_scales``), fill ``recv_count`` and the handle; then free the buffer for reuse.
    ``wait_stats``: int64 [R] or None, adds the ns waited for each source's counts."""
    comm.start_call()
    start_ns = time.monotonic_ns()
    _check_signatures(comm, handle)
    rows = _count_rows(comm, lay, handle.buf)
    _timed_wait(comm, {s: rows[s] for s in range(comm.num_ranks)}, handle.seq,
                "low_latency_dispatch/recv", wait_stats, start_ns)
    if comm.elastic:
        comm.agree("low_latency_dispatch")
    dispatch_pack(comm, handle, lay, recv_x=recv_x, recv_scales=recv_scales,
                  recv_count=recv_count, use_fp8=use_fp8, use_ue8m0=use_ue8m0, stats=stats)


def _count_rows(comm, lay: LLLayout, buf: int) -> np.ndarray:
    """Every source's count row in this rank's region: a view [R, counts and base]."""
    rows_words = comm.ll_slot(comm.rank, _offsets(comm, lay, buf)["counts"],
                              comm.num_ranks * lay.count_row_words).reshape(comm.num_ranks, -1)
    return rows_words[:, :lay.num_local + 1]


def dispatch_pack(comm, handle: LowLatencyHandle, lay: LLLayout, *, recv_x, recv_scales,
                  recv_count, use_fp8, use_ue8m0, stats):
    """:func:`dispatch_recv` from the point where every source's count row is there (or its
    source masked) and, in elastic mode, the survivors agreed: the pack, then the FREE
    pushes."""
    me, num_local, buf = comm.rank, lay.num_local, handle.buf
    hidden, M = handle.hidden, lay.max_tokens
    stride = ll_msg_stride(hidden, use_fp8)
    rows_in = tag_value(_count_rows(comm, lay, buf))      # a copy, read once
    rows_in[~comm.active] = 0                              # inactive sources sent nothing
    # sources on host/ll_direct.py's path may have written their rows straight into the
    # receive area this rank gave for the call (its FREE push two calls ago)
    direct = (rows_in[:, num_local] & LL_ROWS_DIRECT) != 0
    rows_in[:, num_local] &= ~LL_ROWS_DIRECT
    area = _given_area(comm, lay, handle, use_fp8) if direct.any() else None
    region_rows, meta = _blocks(comm, lay, buf, me, stride)
    row_bytes = hidden if use_fp8 else hidden * 2
    own, handle.own_rows = handle.own_rows, None
    packed = None if use_ue8m0 or (area is None and direct.any()) else native.ll_recv(
        region_rows, meta, rows_in, M, recv_x, row_bytes, recv_scales if use_fp8 else None,
        hidden, own=own, direct=direct.astype(np.uint8) if area is not None else None,
        area=area)
    if packed is None and direct.any():
        raise RuntimeError("low-latency dispatch: a source wrote its rows into a receive area "
                           "this rank cannot read them from here")
    if packed is None:
        if own is not None:     # torch's packing reads every row from the region
            _write_messages(*own[1:], me, lay, me, region_rows, meta)
        packed = _pack_torch(region_rows, meta, torch.from_numpy(rows_in[:, :num_local]), M,
                             recv_x, row_bytes, recv_scales if use_fp8 else None, hidden,
                             use_ue8m0)
    recv_meta, ranges, per_expert = packed
    recv_count.copy_(per_expert)
    if stats is not None:
        stats += per_expert.to(stats.dtype)
    handle.recv_meta, handle.recv_ranges, handle.received = recv_meta, ranges, True
    handle.return_base = torch.from_numpy(rows_in[:, num_local])
    _publish_free(comm, comm.layout.ll_dispatch_free(buf, me), handle.seq)
    comm.ll_area_next[buf] = None               # (this FREE push gives no area)


def _given_area(comm, lay: LLLayout, handle, use_fp8):
    """(x, scales) of the receive area this rank gave for the call of ``handle``, shaped as
    recv_x and recv_scales (:func:`area_tensors`), or None where it gave none."""
    given = comm.ll_area_next[handle.buf] if comm.ll_areas is not None else None
    if given is None or given[1] != handle.seq - LL_NUM_BUFFERS:
        return None
    at = given[0] * comm.ll_stride
    return area_tensors(comm.ll_areas[comm.rank][at:at + comm.ll_stride],
                        (lay.num_local, lay.num_ranks * lay.max_tokens, handle.hidden),
                        use_fp8)


def area_tensors(mem, shape, use_fp8):
    """recv_x [L, R*M, H] (fp8, or bf16) and its float32 scales (fp8; else None) laid out in
    a receive area ``mem`` (numpy uint8): the rows, then the scales, each tensor on a storage
    of its own (torch.save refuses two tensors that view one storage as different types)."""
    L, rows, H = shape
    x_dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    x_bytes = L * rows * H * x_dtype.itemsize
    x = torch.empty(0, dtype=x_dtype).set_(torch.from_numpy(mem[:x_bytes]).untyped_storage(),
                                           0, shape)
    if not use_fp8:
        return x, None
    scales = torch.from_numpy(mem[x_bytes:x_bytes + L * rows * H // 32]).untyped_storage()
    return x, torch.empty(0, dtype=torch.float32).set_(scales, 0, (L, rows, H // 128))


def _pack_torch(region_rows, meta, counts, M, recv_x, row_bytes, recv_scales, hidden,
                use_ue8m0):
    """dispatch_recv's packing with torch's indexing (no C loops, or UE8M0 scales):
    ``counts`` int64 [src, local expert]; returns (recv_meta, ranges, per_expert) as
    native.ll_recv does."""
    R, num_local = counts.shape
    slots = num_local * R * M
    by_expert = counts.t().contiguous()                     # [local expert, src]
    flat = by_expert.flatten()
    block = torch.repeat_interleave(torch.arange(num_local * R), flat)   # (le, src) of a row
    i = torch.arange(block.numel()) - (torch.cumsum(flat, 0) - flat)[block]
    src_row = block * M + i                                 # where src wrote it
    packed = (torch.cumsum(by_expert, 1) - by_expert).flatten()[block] + i
    dst_row = (block // R) * (R * M) + packed               # where recv_x wants it
    read_row = _first_rows(meta.view(torch.int64), src_row, block % R, R, M)
    copy_rows(region_rows[:, :row_bytes], read_row,
              recv_x.view(torch.uint8).view(slots, row_bytes), dst_row)
    if recv_scales is not None:
        s = region_rows[:, hidden:hidden + hidden // 32].index_select(0, read_row)
        s = s.view(torch.float32)
        s = pack_ue8m0(s) if use_ue8m0 else s
        recv_scales.view(slots, -1).index_copy_(0, dst_row, s)
    recv_meta = torch.full((num_local, R * M), -1, dtype=torch.int64)
    recv_meta.view(-1).index_copy_(0, dst_row, meta.view(torch.int64).index_select(0, src_row))
    ranges = torch.stack([torch.cumsum(by_expert, 1) - by_expert, by_expert], -1)
    return recv_meta, ranges, by_expert.sum(1)


def _first_rows(meta, rows, src, num_ranks, M):
    """The row each message's bytes are read from (native.ll_recv's rule): the first of
    ``rows`` (region rows, in block order) from the same source ``src`` whose meta names the
    same token; a row whose token lies outside [0, M) is read itself."""
    token = meta.index_select(0, rows) >> 8
    named = (token >= 0) & (token < M)
    keys = num_ranks * M                                    # one per (source, token)
    key = torch.where(named, src * M + token, keys + torch.arange(rows.numel()))
    first = torch.full((keys + rows.numel(),), -1, dtype=torch.int64)
    first.scatter_reduce_(0, key, rows, "amin", include_self=False)
    return first[key]


def combine_send(comm, *, x, handle: LowLatencyHandle, lay: LLLayout, use_logfmt=False):
    """Send every packed row back to its (token, slot) in the owner's combine region: bf16,
    or LogFMT-encoded (``use_logfmt``: the same slots, each run's rows packed from its first
    slot on)."""
    comm.start_call()
    comm.ll_seq["combine"] += 1
    seq = comm.ll_seq["combine"]
    buf = seq % LL_NUM_BUFFERS
    me = comm.rank
    hidden = x.shape[-1]
    comb_off = _offsets(comm, lay, buf)["combine"]

    bases = handle.return_base.tolist()
    ranges = handle.recv_ranges
    sizes = ranges[:, :, 1].sum(0).tolist()                 # rows back to each owner
    x_rows = x.view(-1, hidden)                              # [le * R*M + row, H]
    x_bytes = x_rows.view(torch.uint8)

    def send(owner, _grant):
        # this rank's rows for `owner`, expert by expert, are one run of the owner's messages
        n = sizes[owner]
        comm.check_fence()             # a rank the survivors masked writes nothing
        if n:
            at = comb_off + bases[owner] * hidden * 2
            if use_logfmt:
                rows = logfmt.encode(x_rows.index_select(
                    0, _return_rows(ranges, owner, x.shape[1], n)))
                comm.peer_ll(owner)[at:at + rows.numel()].view(rows.shape).copy_(rows)
                comm.commit(owner, "ll", at, rows.numel())
            else:
                dst = comm.peer_ll(owner)[at:at + n * hidden * 2].view(n, hidden * 2)
                if not native.ll_return(x_bytes, ranges, owner, dst):
                    copy_rows(x_bytes, _return_rows(ranges, owner, x.shape[1], n), dst, None)
                comm.commit(owner, "ll", at, n * hidden * 2)
        comm.signal(owner, comm.layout.ll_combine_done(buf, me), seq,
                    n | (LL_DONE_LOGFMT if use_logfmt else 0))

    _wait_free(comm, "combine", comm.layout.ll_combine_free, buf, seq,
               "low_latency_combine/free", send)
    return seq, buf


def _return_rows(ranges: torch.Tensor, owner: int, rows_per_expert: int, n: int):
    """The ``n`` rows of the combine input (viewed as [E_local * R*M, H]) that go back to
    ``owner``, expert by expert: ``ranges`` [E_local, R, (start, count)] of the handle."""
    first = ranges[:, owner, 0] + torch.arange(ranges.shape[0]) * rows_per_expert
    counts = ranges[:, owner, 1]
    # row i: first row of its expert's run + its place in that run
    base = torch.repeat_interleave(first - (torch.cumsum(counts, 0) - counts), counts,
                                   output_size=n)
    return base + torch.arange(n)


def combine_recv(comm, seq, buf, lay: LLLayout, *, handle, topk_idx, topk_weights, out,
                 use_logfmt=False, wait_stats=None):
    """Wait for every rank's rows; ``out`` [T, H] = sum_k w[t, k] * row(t, k) (float32).
    ``wait_stats``: int64 [R] or None, adds the ns waited for each rank's rows."""
    comm.start_call()
    waits = _header_views(comm, comm.layout.ll_combine_done, buf)
    _timed_wait(comm, waits, seq, "low_latency_combine/recv", wait_stats,
                time.monotonic_ns())
    if comm.elastic:
        comm.agree("low_latency_combine")
    return combine_sum(comm, seq, buf, lay, handle=handle, topk_idx=topk_idx,
                       topk_weights=topk_weights, out=out, use_logfmt=use_logfmt)


def combine_sum(comm, seq, buf, lay: LLLayout, *, handle, topk_idx, topk_weights, out,
                use_logfmt=False):
    """:func:`combine_recv` from the point where every rank's DONE is there (or the rank
    masked) and, in elastic mode, the survivors agreed: the sums, then the FREE pushes."""
    me, R = comm.rank, comm.num_ranks
    waits = _header_views(comm, comm.layout.ll_combine_done, buf)
    hidden = out.shape[1]
    comb_off = _offsets(comm, lay, buf)["combine"]
    tok, slot = handle.send_tok, handle.send_slot          # my messages, in return order
    n = tok.numel()
    at = comb_off + handle.return_shift * hidden * 2
    region = comm.peer_ll(me)[at:at + n * hidden * 2]
    encoded = {s: bool(tag_value(waits[s][0]) & LL_DONE_LOGFMT) for s in range(R)
               if comm.active[s]}
    if any(e != bool(use_logfmt) for e in encoded.values()):
        _publish_free(comm, comm.layout.ll_combine_free(buf, me), seq)
        raise CallMismatchError("low_latency_combine", {"use_logfmt": {
            **encoded, me: bool(use_logfmt)}})
    everyone = comm.active.all()
    owner = None if everyone and not use_logfmt else topk_idx[tok, slot] // lay.num_local
    rows = _decoded(region, owner, hidden, R) if use_logfmt else \
        region.view(torch.bfloat16).view(n, hidden)
    if not everyone:                # rows of inactive expert ranks never came (or are void)
        _hold_late_rows(comm, handle, seq, owner, at, hidden, waits)
        keep = torch.from_numpy(comm.active)[owner]
        tok, slot, rows = tok[keep], slot[keep], rows[keep]
    if not native.ll_combine(rows, tok, slot, topk_weights, out):
        weighted_sum_rows(rows, tok, topk_weights[tok, slot].float(), out)
    _publish_free(comm, comm.layout.ll_combine_free(buf, me), seq)
    return out


def _decoded(region, owner, hidden: int, num_ranks: int) -> torch.Tensor:
    """float32 [n, hidden]: the LogFMT-encoded rows in ``region`` (the call's return slots,
    a run per expert rank in rank order, ``owner`` the rank of each; each run's rows packed
    from its first slot on) decoded."""
    counts = torch.bincount(owner, minlength=num_ranks).tolist()
    out = torch.empty(owner.numel(), hidden)
    encoded_row, first = logfmt.row_bytes(hidden), 0
    for c in counts:
        if c:
            at = first * hidden * 2
            out[first:first + c] = logfmt.decode(
                region[at:at + c * encoded_row].view(c, encoded_row), hidden)
        first += c
    return out


def _hold_late_rows(comm, handle, seq, owner, at, hidden, waits) -> None:
    """Hold back the rows of combine call ``seq`` (``at``: its first row's byte, ``owner``:
    the expert rank of each row, a run per rank) that a masked rank was sent messages for
    and whose DONE never came: it may be stopped right before its copy (host/late_rows.py)."""
    per_rank = torch.bincount(owner, minlength=comm.num_ranks).tolist()
    first = np.cumsum([0] + per_rank[:-1]).tolist()
    row_bytes = hidden * 2
    for r in np.flatnonzero(~comm.active & handle.sent_to).tolist():
        if per_rank[r] and tag_epoch(int(waits[r][0])) != seq:
            start = at + first[r] * row_bytes
            comm.late_rows.hold(start, start + per_rank[r] * row_bytes, r, waits[r], seq)
