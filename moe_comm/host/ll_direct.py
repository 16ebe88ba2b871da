"""Low-latency calls straight from the Buffer's arguments: each half of a dispatch or a
combine one C call (csrc/host/ll_direct.c), waits included; kinds and shapes checked here.

Why: a 64-token low-latency dispatch spent ~500 us in Python around ~50 us of C loops (the
checks, the route's and messages' tensors, a signal and a wait per peer), and with 4 ranks
on 2 cores half of each rank's CPU in a 128 x 7168 dispatch was Python and polling, CPU the
other ranks needed (docs/PERF.md, session 16).

Which calls, on a Buffer whose peers are all on this host, while every rank is active:

- a dispatch of a contiguous bf16 x [T, H] with topk_idx int64 [T, K], without
  round_scale, use_ue8m0, dispatch_wait_recv_cost_stats or active_ranks (the stats of
  received rows, int32 or int64, are added in C);
- a combine of bf16 rows on a handle of such a dispatch or of the Python path's, without
  LogFMT, combine_wait_recv_cost_stats or active_ranks.

The C send half checks the values before it writes anything (ids in [-1, E), no expert
over M messages, this rank not fenced) and declines otherwise: the Buffer's whole path then
runs and raises what is wrong. A C wait returns after a slice of 50 ms, so that Python's
signal handlers run: a send or a receive then resumes in C; past its deadline (or with this
rank fenced) a send waits in Python for the ranks it has not reached (HostComm.wait: the
timeout's error), then resumes. A receive past its deadline, one that finds signatures that
differ, or runs after a rank was masked since its send, is handed to host/ll.py's receive,
which has read nothing less: it waits, raises, or packs. In an elastic Buffer a receive's C
waits and its reads are two calls with the survivors' agreement between them, as in ll.py
(reads in ll.py where the agreement masked a rank), and a send's Python wait masks the ranks
that stay silent instead of raising; once a rank is masked, the Buffer's calls take ll.py's
path. The words and
places are ll.py's, so a rank here pairs with a rank on the Python path.

A dispatch's receive gives the call two on one of this rank's receive areas (comm.ll_areas)
in its FREE push, and the senders here write their rows straight into it, at the places the
pack would give them, once the sources before them announced their counts; recv_x and its
scales are then tensors on that area (docs/ARCHITECTURE.md, "Receive areas").
"""
from __future__ import annotations

import os

import numpy as np
import torch

from .. import signature
from ..handle import LowLatencyHandle
from ..wire import (CALL_WORDS, LL_AREA_BITS, LL_MAX_TOPK, LL_NUM_BUFFERS, LL_RECV_AREAS,
                    PAGE, LLLayout, ll_msg_stride)
from . import ll, native, small
from .pool import storage_users

# what the C halves return (ll_direct.c LL_*), and FINISHED: the reads ran in ll.py
OK, AGAIN, LATE, DIFFER, DECLINED, FINISHED = 0, 1, 2, 3, 5, 6
WAITS, READS = 1, 2               # a receive half's steps (ll_direct.c LL_WAITS, LL_READS)
SKIPPED = 2                       # a send's sent[r]: rank r masked before it was sent to
# a dispatch whose messages come to fewer bytes gives no receive area for the call two on:
# for a small call the area's bookkeeping cost more than the pack it saves (64 x 1024 on 2
# ranks: 140 against 112 us a dispatch; 128 x 7168 on 4 ranks: 1250 against 1610)
AREA_MIN_BYTES = native.STREAM_MIN_BYTES
ENV = "MOE_COMM_LL_DIRECT"        # "0": every low-latency call on ll.py's path


class Context:
    """The addresses of one low-latency layout (the ``lx`` words of ll_direct.c: every rank's
    blocks, count rows, signal words and doorbells, per buffer), built once per layout."""

    def __init__(self, comm, lay: LLLayout):
        me, R, L, hl = comm.rank, comm.num_ranks, lay.num_local, comm.layout
        regions = np.array([comm.peer_ll(r).data_ptr() for r in range(R)], dtype=np.int64)
        words = np.array([comm.words[r].ctypes.data for r in range(R)], dtype=np.int64)
        mine = words[me]
        keep = []                                   # the arrays the words point into

        def arr(values) -> int:
            a = np.ascontiguousarray(values, dtype=np.int64)
            keep.append(a)
            return a.ctypes.data

        def in_mine(word_of, b):                    # every source's word in this header
            return arr([mine + 8 * word_of(b, s) for s in range(R)])

        per_buffer = {name: [] for name in ("payload", "meta", "count_out", "count_in",
                                            "call_out", "call_in", "dfree_in", "dfree_out",
                                            "cfree_in", "cfree_out", "done_in", "done_out",
                                            "combine", "announce")}
        crw = lay.count_row_words * 8
        for b in range(LL_NUM_BUFFERS):
            off = {part: lay.offset(b, part, comm.ll_stride)
                   for part in ("payload", "meta", "counts", "combine", "announce")}
            for name, value in (
                    ("payload", arr(regions + off["payload"])),
                    ("meta", arr(regions + off["meta"])),
                    ("count_out", arr(regions + off["counts"] + me * crw)),
                    ("count_in", arr(regions[me] + off["counts"] + crw * np.arange(R))),
                    ("call_out", arr(words + 8 * hl.ll_call(b, me))),
                    ("call_in", in_mine(hl.ll_call, b)),
                    ("dfree_in", in_mine(hl.ll_dispatch_free, b)),
                    ("dfree_out", arr(words + 8 * hl.ll_dispatch_free(b, me))),
                    ("cfree_in", in_mine(hl.ll_combine_free, b)),
                    ("cfree_out", arr(words + 8 * hl.ll_combine_free(b, me))),
                    ("done_in", in_mine(hl.ll_combine_done, b)),
                    ("done_out", arr(words + 8 * hl.ll_combine_done(b, me))),
                    ("combine", arr(regions + off["combine"])),
                    ("announce", arr(regions + off["announce"]))):
                per_buffer[name].append(value)
        a = small.addresses(comm)          # the doorbells, fence and rotation small.py uses
        # every rank's receive areas (comm.ll_areas), or none
        areas = 0 if comm.ll_areas is None else \
            arr([comm.ll_areas[r].ctypes.data for r in range(R)])
        self.words = np.array(
            [R, me, L, lay.max_tokens, int(comm.crowded), a.fence, a.bell, a.p_bells,
             a.p_rotation, a.p_ready, arr(np.full(R, CALL_WORDS)), arr(np.full(R, L + 1)),
             arr(np.ones(R)), CALL_WORDS, lay.max_tokens * LL_MAX_TOPK, areas, comm.ll_stride,
             LL_RECV_AREAS * comm.ll_stride, crw] +
            [p for name in per_buffer for p in per_buffer[name]], dtype=np.int64)
        self.keep = keep
        self.p = self.words.ctypes.data
        if native.library().moe_ll_context_words() != len(self.words):
            raise RuntimeError("host/ll_direct.py and ll_direct.c disagree on the context words")


class LLDirectCalls:
    """One Buffer's direct low-latency path (built once, with its buffer key for the
    handles and the backend's output pool)."""

    def __init__(self, comm, buffer_key, empty):
        self.comm, self.key, self.empty = comm, buffer_key, empty
        self.lib = native.library() if os.environ.get(ENV, "1") != "0" else None
        # what cannot change over the Buffer's life: one host, the C library
        self.on = self.lib is not None and comm.transport is None and comm.relays is None
        self.layouts = {}                 # (M, H, E) -> (LLLayout, Context), or None: too big
        self.rows = {}                    # the signature of each dispatch shape
        # tensors grown as calls need (_grown): float32 scratch, and the fp8 message rows of
        # each buffer b, which only this path and a handle's receive read - buffer b's rows
        # serve call s + 2 only once call s has received (the Buffer's reserve refuses a
        # third call in flight)
        self.grown = {}
        self.everyone = np.ones(comm.num_ranks, dtype=bool)    # the handles' sent_to
        self.sent = np.zeros(comm.num_ranks, dtype=np.uint8)
        self.p_sent = self.sent.ctypes.data
        self.announced = np.zeros(comm.num_ranks, dtype=np.int64)   # ll_direct.c's scratch
        # this rank's receive areas (comm.ll_areas): a dispatch's recv_x and scales lie in
        # the area it gave its senders, which wrote the rows there; lent[k]: the storages
        # of area k's last tensors (the area is free again once only these refer to them)
        self.areas = None if comm.ll_areas is None or not self.on else [
            comm.ll_areas[comm.rank][k * comm.ll_stride:(k + 1) * comm.ll_stride]
            for k in range(LL_RECV_AREAS)]
        self.lent = [()] * LL_RECV_AREAS

    def _layout(self, M, H, E):
        """(LLLayout, Context) of these shapes, or None where they do not fit the region (the
        whole path raises BufferTooSmallError)."""
        key = (M, H, E)
        if key not in self.layouts:
            lay = LLLayout(M, H, self.comm.num_ranks, E)
            self.layouts[key] = (lay, Context(self.comm, lay)) \
                if lay.nbytes <= self.comm.ll_bytes else None
        return self.layouts[key]

    def _call_row(self, H, use_fp8, K, E, M) -> np.ndarray:
        key = (H, use_fp8, K, E, M)
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = signature.low_latency(
                hidden=H, use_fp8=use_fp8, round_scale=False, topk=K, num_experts=E,
                max_tokens=M)
        return row

    def _grown(self, name, n, dtype) -> torch.Tensor:
        """The first ``n`` elements of this path's tensor ``name``, grown where too small (a
        tensor a caller's handle still holds stays alive as it was)."""
        t = self.grown.get(name)
        if t is None or t.numel() < n:
            t = self.grown[name] = torch.empty(n, dtype=dtype)
        return t[:n]

    def _usable(self, active_ranks, wait_stats) -> bool:
        comm = self.comm
        return (self.on and comm.all_active and active_ranks is None and wait_stats is None
                and not comm.late_rows.held)

    def dispatch(self, x, idx, M, E, stats, wait_stats, use_fp8, round_scale, use_ue8m0,
                 active_ranks, reserve):
        """Send a low-latency dispatch this path takes: returns (recv_x, or (recv_x,
        scales), recv_count, handle, receive), or None (nothing moved). ``reserve()``: the
        Buffer's check that a buffer is free of pending hooks, run once the call is taken."""
        comm, Tensor = self.comm, torch.Tensor
        if not (self._usable(active_ranks, wait_stats) and round_scale is False and
                use_ue8m0 is False and (use_fp8 is True or use_fp8 is False) and
                M.__class__ is int and E.__class__ is int and x.__class__ is Tensor and
                idx.__class__ is Tensor and x.dtype is torch.bfloat16 and
                idx.dtype is torch.int64 and x.dim() == 2 and idx.dim() == 2):
            return None
        (T, H), K, R = x.shape, idx.shape[1], comm.num_ranks
        if not (0 < M and T <= M and H > 0 and H % 128 == 0 and 0 < K <= LL_MAX_TOPK and
                idx.shape[0] == T and 0 < E and E % R == 0 and x.is_contiguous() and
                idx.is_contiguous() and x.is_cpu and idx.is_cpu):
            return None
        L = E // R
        p_stats, stats64 = 0, 0
        if stats is not None:
            if not (stats.__class__ is Tensor and stats.dtype in (torch.int32, torch.int64) and
                    stats.shape == (L,) and stats.is_contiguous() and stats.is_cpu):
                return None
            p_stats, stats64 = stats.data_ptr(), int(stats.dtype is torch.int64)
        laid = self._layout(M, H, E)
        if laid is None:
            return None
        lay, cx = laid
        reserve()
        seq = comm.ll_seq["dispatch"] + 1
        b = seq % LL_NUM_BUFFERS
        stride = ll_msg_stride(H, use_fp8)
        msgs = self._grown(("msgs", b), T * stride, torch.uint8).view(T, stride) if use_fp8 \
            else x
        scratch = self._grown("scratch", T * (H // 128) + H, torch.float32)
        # the route (tok, slot [T * K], first [E + 1], per-expert counts [E]) and the receive's
        # results (recv_meta [L, R*M], ranges [L, R, 2], per_expert [L], return_base [R])
        # with its scratch (count rows [R, L + 1], canon [R*M]), in one allocation
        n_route, n_recv = 2 * T * K + 2 * E + 1, L * R * M + 2 * L * R + L + R
        block = torch.empty(n_route + n_recv + R * (L + 1) + R * M + T, dtype=torch.int64)
        p = block.data_ptr()
        p_tok, p_slot, p_first = p, p + 8 * T * K, p + 16 * T * K
        p_seen = p + 8 * (n_route + n_recv + R * (L + 1) + R * M)
        call_row = self._call_row(H, use_fp8, K, E, M)
        wait_free = seq > comm.ll_base["dispatch"] + LL_NUM_BUFFERS
        rows, x_bytes = R * M, H if use_fp8 else 2 * H
        area_bytes = L * rows * (x_bytes + (H // 32 if use_fp8 else 0))
        area = self._given(b, seq, wait_free, area_bytes)
        args = [cx.p, b, 0, seq, wait_free, int(comm.refresh_deadline() * 1e9), x.data_ptr(),
                T, H, idx.data_ptr(), K, E, int(use_fp8), msgs.data_ptr(), stride,
                scratch.data_ptr(), scratch.data_ptr() + 4 * T * (H // 128), p_tok, p_slot,
                p_first, p_first + 8 * (E + 1), call_row.ctypes.data, self.p_sent, p_seen,
                self.announced.ctypes.data]
        rc = self.lib.moe_ll_direct_send(*args)
        if rc == DECLINED:
            return None
        comm.ll_seq["dispatch"] = seq
        comm.ll_layout = (M, H, E)        # signature.low_latency_refusal's, every rank active
        if rc:                            # resumed: only the waits and sends are left
            self._drive_send(self.lib.moe_ll_direct_send, args, rc,
                             comm.layout.ll_dispatch_free, b, seq, "low_latency_dispatch/free")
        n = int(block.numpy()[2 * T * K + E])
        tok, slot = block[:n], block[T * K:T * K + n]
        first = block[2 * T * K:2 * T * K + E + 1]
        sent_to = self.everyone if comm.all_active else self.sent == 1
        handle = LowLatencyHandle(self.key, seq, b, M, H, E, T, K, send_tok=tok, send_slot=slot,
                                  call_row=call_row, sent_to=sent_to,
                                  own_rows=(comm.rank, msgs, tok, slot, first) if use_fp8
                                  else None)
        if area is not None:              # (the senders wrote their rows there, or will)
            recv_x, recv_scales = self._lend(area, (L, rows, H), use_fp8)
        else:
            recv_x = self.empty(("ll_x", b), (L, rows, H),
                                torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
            recv_scales = self.empty(("ll_s", b), (L, rows, H // 128), torch.float32) \
                if use_fp8 else None
        recv_count = torch.zeros(L, dtype=torch.int32)     # (zeros until received)
        at = n_route
        recv_meta = block[at:at + L * rows].view(L, rows)
        ranges = block[at + L * rows:at + L * rows + 2 * L * R].view(L, R, 2)
        per_expert = block[at + L * rows + 2 * L * R:at + L * rows + 2 * L * R + L]
        return_base = block[at + n_recv - R:at + n_recv]
        p_rows_in = p + 8 * (n_route + n_recv)

        def receive():
            own = handle.own_rows
            # the area this rank gives the call two on (its FREE push says which), where
            # calls like this one are large
            nxt, free_value = self._next_area(area, area_bytes) \
                if T * K * stride >= AREA_MIN_BYTES else (None, 0)
            args = [cx.p, b, 0, seq, int(comm.refresh_deadline() * 1e9), call_row.ctypes.data,
                    stride, H if use_fp8 else 2 * H, H, recv_x.data_ptr(),
                    recv_scales.data_ptr() if use_fp8 else 0, recv_meta.data_ptr(),
                    ranges.data_ptr(), per_expert.data_ptr(), recv_count.data_ptr(), p_stats,
                    stats64, return_base.data_ptr(), p_rows_in, p_rows_in + 8 * R * (L + 1),
                    *((msgs.data_ptr(), stride, tok.data_ptr(), slot.data_ptr(),
                       first.data_ptr() + 8 * comm.rank * L) if own else (0, 0, 0, 0, 0)),
                    int(area is not None), free_value]
            outs = dict(recv_x=recv_x, recv_scales=recv_scales, recv_count=recv_count,
                        use_fp8=use_fp8, use_ue8m0=False, stats=stats)
            rc = self._receive(self.lib.moe_ll_direct_recv, args, "low_latency_dispatch",
                               lambda: ll.dispatch_pack(comm, handle, lay, **outs))
            if rc == OK:
                handle.recv_meta, handle.recv_ranges, handle.return_base = \
                    recv_meta, ranges, return_base
                handle.received, handle.own_rows = True, None
                comm.ll_area_next[b] = None if nxt is None else (nxt, seq)
            elif rc < 0:
                raise ValueError(
                    f"low-latency dispatch: a source announced more than {M} rows for one "
                    "expert (a peer with another layout?)" if rc == -1 else
                    "low-latency dispatch: this rank's own count row disagrees with its "
                    "messages" if rc == -2 else
                    "low-latency dispatch: a source wrote its rows into a receive area this "
                    "rank did not give for the call")
            elif rc != FINISHED:
                ll.dispatch_recv(comm, handle, lay, **outs)

        return (recv_x, recv_scales) if use_fp8 else recv_x, recv_count, handle, receive

    def _lend(self, area, shape, use_fp8):
        """recv_x of ``shape`` and its scales in receive area ``area`` (ll.area_tensors), their
        storages kept in ``lent`` to see when the caller is done with them."""
        recv_x, scales = ll.area_tensors(self.areas[area], shape, use_fp8)
        self.lent[area] = tuple(t.untyped_storage() for t in (recv_x, scales) if t is not None)
        return recv_x, scales

    def _free(self, area) -> bool:
        """Whether no tensor of the caller (or of a pending call) uses area ``area``."""
        return all(storage_users(st) <= 1 for st in self.lent[area])

    def _given(self, b, seq, wait_free, nbytes):
        """The receive area this rank gave for dispatch ``seq`` (its FREE push of call seq - 2
        on buffer ``b``, which the senders read where they awaited it), or None: none given,
        or less of it reserved than this call's recv_x and scales take."""
        given = self.comm.ll_area_next[b]
        if self.areas is None or not wait_free or given is None or \
                given[1] != seq - LL_NUM_BUFFERS or \
                self.comm.area_reserved(given[0]) < nbytes:
            return None
        return given[0]

    def _next_area(self, current, nbytes):
        """(area, FREE push value) for dispatch seq + 2: an area of this rank that neither
        this call (``current``), nor a call it gave an area that is still to come (whatever
        its number: receive hooks may run newest first), nor a tensor of the caller uses,
        with ``nbytes`` of it reserved (this layout's recv_x and scales); (None, 0) where
        there is none (the senders then write into the region's blocks)."""
        if self.areas is None:
            return None, 0
        comm = self.comm
        busy = {current} | {given[0] for given in comm.ll_area_next if given is not None}
        for k in range(LL_RECV_AREAS):
            if k not in busy and self._free(k) and comm.reserve_area(k, nbytes):
                return k, (comm.area_reserved(k) // PAGE) << LL_AREA_BITS | (k + 1)
        return None, 0

    def _receive(self, half, args, op, reads_in_python) -> int:
        """A receive half ``half(*args)`` (``args[2]``: its steps): both steps in one call,
        called again after each slice that ran out (AGAIN; Python's signal handlers run
        between: a receive that waits long stays on this path, and the dispatch's receive
        still gives an area for the call two on); in an elastic Buffer the waits, the
        survivors' agreement (HostComm.agree, as ll.py's receive), then the reads, or
        ``reads_in_python()`` (ll.py's) where the agreement masked a rank. Returns the C
        half's code, FINISHED where ll.py read, or AGAIN without a C call where a rank was
        masked since the send (ll.py's receive leaves it out)."""
        if not self._usable(None, None):
            return AGAIN
        if not self.comm.elastic:
            args[2] = WAITS | READS
            rc = half(*args)
            while rc == AGAIN:
                rc = half(*args)
            return rc
        args[2] = WAITS
        rc = half(*args)
        if rc != OK:
            return rc
        self.comm.agree(op)
        if not self._usable(None, None):
            reads_in_python()
            return FINISHED
        args[2] = READS
        return half(*args)

    def _drive_send(self, half, args, rc, word_of, b, seq, op):
        """A send half the C call ``half(*args)`` left (AGAIN: its slice ran out, Python's
        signal handlers have run; LATE: past the deadline, or this rank fenced) goes on: the
        Python wait for the ranks not yet sent to raises what the Python path raises, or
        returns once their buffers are free, and the C call resumes."""
        comm = self.comm
        views = ll._header_views(comm, word_of, b)
        args[2] = 1                        # resume
        while rc:
            if rc < 0:                    # (only a combine's: a base from rank -rc - 1)
                raise IndexError(
                    f"low-latency combine: rank {-rc - 1} announced where this rank's rows go "
                    "back outside its combine rows (a peer with another layout?)")
            if rc == LATE:
                comm.check_fence()
                comm.wait({r: views[r] for r in np.flatnonzero(self.sent == 0).tolist()},
                          seq - LL_NUM_BUFFERS, op)
                # elastic: the ranks that stayed silent are masked now, and sent nothing
                self.sent[(self.sent == 0) & ~comm.active] = SKIPPED
                args[5] = int(comm.deadline * 1e9)
            rc = half(*args)

    def combine(self, x, idx, w, handle, use_logfmt, out, wait_stats, active_ranks, reserve):
        """Send a low-latency combine this path takes: returns (out, its buffer, receive),
        or None (nothing moved). ``x``: the rows to send (the combine buffer with
        zero_copy)."""
        comm, Tensor = self.comm, torch.Tensor
        if not (self._usable(active_ranks, wait_stats) and use_logfmt is False and
                handle.__class__ is LowLatencyHandle and handle.buffer_key is self.key and
                handle.received and handle.return_shift == 0 and x.__class__ is Tensor and
                idx.__class__ is Tensor and w.__class__ is Tensor and
                x.dtype is torch.bfloat16 and idx.dtype is torch.int64 and
                w.dtype is torch.float32 and (out is None or (out.__class__ is Tensor and
                                                            out.dtype is torch.bfloat16))):
            return None
        R, M, H, E = comm.num_ranks, handle.max_tokens, handle.hidden, handle.num_experts
        T, K = handle.num_tokens, handle.topk
        laid = self._layout(M, H, E)
        if laid is None or not (
                x.shape == (E // R, R * M, H) and idx.shape == (T, K) and w.shape == (T, K) and
                (out is None or (out.shape == (T, H) and out.is_contiguous() and out.is_cpu))
                and x.is_contiguous() and w.is_contiguous() and x.is_cpu and w.is_cpu and
                idx.is_cpu):
            return None
        lay, cx = laid
        if out is None:
            out = self.empty(("ll_out", comm.ll_seq["combine"] % LL_NUM_BUFFERS), (T, H),
                             torch.bfloat16)
        reserve()
        seq = comm.ll_seq["combine"] + 1
        b = seq % LL_NUM_BUFFERS
        ranges, bases = handle.recv_ranges, handle.return_base
        tok, slot = handle.send_tok, handle.send_slot
        if not (ranges.is_contiguous() and tok.is_contiguous() and slot.is_contiguous()):
            return None                   # (never, as both receives make them)
        if not bases.is_contiguous():     # (the Python receive's is a column of its counts)
            bases = handle.return_base = bases.contiguous()
        wait_free = seq > comm.ll_base["combine"] + LL_NUM_BUFFERS
        args = [cx.p, b, 0, seq, wait_free, int(comm.refresh_deadline() * 1e9), x.data_ptr(),
                H, ranges.data_ptr(), bases.data_ptr(), self.p_sent]
        rc = self.lib.moe_ll_direct_combine_send(*args)
        if rc == DECLINED:
            return None
        comm.ll_seq["combine"] = seq
        if rc:
            self._drive_send(self.lib.moe_ll_direct_combine_send, args, rc,
                             comm.layout.ll_combine_free, b, seq, "low_latency_combine/free")

        def receive():
            n = tok.numel()
            index = torch.empty(n + T + 1, dtype=torch.int64)
            scratch = self._grown("scratch", n + 2 * H, torch.float32)
            args = [cx.p, b, 0, seq, int(comm.refresh_deadline() * 1e9), 0, tok.data_ptr(),
                    slot.data_ptr(), n, w.data_ptr(), T, K, H, out.data_ptr(),
                    index.data_ptr(), scratch.data_ptr(), scratch.data_ptr() + 4 * n]
            outs = dict(handle=handle, topk_idx=idx, topk_weights=w, out=out)
            rc = self._receive(self.lib.moe_ll_direct_combine_recv, args, "low_latency_combine",
                               lambda: ll.combine_sum(comm, seq, b, lay, **outs))
            if rc < 0:
                raise IndexError("low-latency combine: a (token, slot) outside topk_weights")
            if rc not in (OK, FINISHED):
                ll.combine_recv(comm, seq, b, lay, **outs)

        return out, b, receive
