"""Small calls straight from the Buffer's arguments: kinds and shapes checked in Python,
everything else in C (two calls for a fresh dispatch, one for a cached dispatch or a combine).

Why: host/small.py moves a small dispatch's rows (64 tokens of H=1024: a few KB per pair) in
two C phases of ~20 us together, but the call around them cost ~150 us of Python spread thin:
the argument checks, the layout check, the backend's bookkeeping, the handle, the results
(docs/PERF.md, session 15). That made a tiny dispatch no faster than MPI's exchange.

Which calls, on a Buffer whose small calls may run (small.usable: one host, not elastic,
every rank active), without num_worst_tokens, active_ranks or bias, all tensors contiguous
on the CPU:

- a fresh dispatch of a bf16, fp16 or float32 x [T, H] with topk_idx int64 [T, K],
  topk_weights float32 [T, K] or None, and get_dispatch_layout's three tensors;
- a cached dispatch of such an x on a handle of this Buffer;
- a combine of bf16 or float32 rows, with or without float32 weights.

The Python here checks kinds and shapes only. The first C call checks the values before it
writes anything - a fresh dispatch's ids within [-1, E) and its layout the one topk_idx gives
(a cached dispatch or a combine: every pair's rows within an eager slot); this rank not
fenced - and declines otherwise. A call
this path does not take, or that C declines, runs the Buffer's whole path, which says what is
wrong: the two accept the same calls and return the same results (tests/test_small_calls.py).

The words, slots and epochs are the small path's (the C phases are small.py's), so a rank
here pairs with a rank on either other path. A fresh dispatch of any size begins here: the
rows of the pairs that fit a slot go there, the count matrix comes back, and where it shows
rows beyond a slot (this rank's or another's) the call goes on in normal.dispatch
(``started``), which grants regions for those; a late or differing peer
is waited for, or raised on, by small._drive, as on the small path.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
import torch

from .. import signature
from ..event import EventOverlap
from ..handle import DispatchHandle, TokenIds
from ..layout import DispatchLayout, aligned_expert_counts
from ..wire import MAX_EPOCH, SlabLayout
from . import granted, native, small
from .pool import POOLED_BYTES

# x dtypes a dispatch here moves (as rows of bytes: the dtype only sizes them); a combine
# sums small.SUM_DTYPES
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# what the first C call returns where it does not take the call (host_ops.c SMALL_DECLINED)
DECLINED = 5

# A fresh dispatch begun here up to its count matrix, handed to normal.dispatch to go on:
# its eager parity, epoch, and (count matrix, token ids by rank, their offsets [R + 1])
Started = namedtuple("Started", "parity epoch counts")


class DirectCalls:
    """One Buffer's direct path (built once, with its buffer key for the handles)."""

    def __init__(self, comm, buffer_key):
        self.comm, self.key = comm, buffer_key
        self.on = small.usable(comm)          # what cannot change over the Buffer's life
        if not self.on:
            return
        self.a = small.addresses(comm)
        self.lib, self.cx = self.a.lib, self.a.p_context
        R = comm.num_ranks
        # scratch the C calls write, read back before the call returns: a fresh dispatch's
        # rows in, whether all pairs go eagerly, the rows from each source; a cached
        # dispatch's or combine's counts per peer (2R)
        self.info = np.zeros(2 + R, dtype=np.int64)
        self.p_info = self.info.ctypes.data
        self.counts = np.zeros(2 * R, dtype=np.int64)
        self.p_counts = self.counts.ctypes.data
        self.local = self.index = self.sums = None         # grown as needed (_scratch)
        self._scratch(1, 1, 1)
        self.shapes = {}                # (H, dtype, K, E) -> what a dispatch of it uses

    def _scratch(self, num_local, index, hidden):
        """Room for ``num_local`` received-id counts (a dispatch), a combine's index of
        ``index`` int64 and its float32 scratch of 2 * ``hidden``."""
        if self.local is None or num_local > len(self.local):
            self.local = np.zeros(num_local, dtype=np.int64)
            self.p_local = self.local.ctypes.data
        if self.index is None or index > self.index.numel():
            self.index = torch.empty(max(index, 1024), dtype=torch.int64)
        if self.sums is None or 2 * hidden > self.sums.numel():
            self.sums = torch.empty(2 * hidden, dtype=torch.float32)

    def _numbers(self):
        """A call's eager parity, epoch and call parity, and its deadline (ns), as the
        Python protocol takes them (HostComm), but only read: :meth:`_take` takes them once
        C took the call."""
        comm = self.comm
        deadline = comm.refresh_deadline()
        return ((comm.normal_seq + 1) % 2, comm.epoch % MAX_EPOCH + 1, comm.call_seq % 2,
                int(deadline * 1e9))

    def _take(self, epoch):
        comm = self.comm
        comm.epoch, comm.normal_seq, comm.call_seq = epoch, comm.normal_seq + 1, comm.call_seq + 1

    def _empty(self, key, nbytes, shapes) -> list:
        """New output tensors of ``shapes`` ((rows, cols, dtype) or None); ``nbytes``
        together: from reused bases where large or poisoned (small._outputs)."""
        if self.comm.poison is None and nbytes < POOLED_BYTES:
            return [None if s is None else torch.empty((s[0], s[1]), dtype=s[2])
                    for s in shapes]
        return small._outputs(self.comm, key, shapes)

    def _sources(self, counts):
        """The rows each source sends this rank, as small._drive waits for their slots: none
        from this rank, whose rows a dispatch here takes from x."""
        counts = counts.copy()
        counts[self.comm.rank] = 0
        return counts

    def _of_handle(self, handle) -> bool:
        return (handle.__class__ is DispatchHandle and handle.buffer_key is self.key and
                handle.rounds is None and handle.relay is None and not handle.num_worst_tokens)

    @staticmethod
    def _matrix(handle):
        """The handle's count matrix as the C calls read it (int64, row-major)."""
        m = handle.count_matrix
        return m if m.dtype == np.int64 and m.flags.c_contiguous else \
            np.ascontiguousarray(m, dtype=np.int64)

    def _shape(self, hidden, dtype, topk, num_experts):
        """A fresh dispatch's signature, its address, row bytes and slot / heap rows."""
        key = (hidden, dtype, topk, num_experts)
        found = self.shapes.get(key)
        if found is None:
            row = signature.normal("dispatch", hidden=hidden, dtype=dtype, scale_cols=0,
                                   topk=topk, num_experts=num_experts, num_worst_tokens=0,
                                   handle_id=0)
            row_bytes = hidden * dtype.itemsize
            found = self.shapes[key] = (row, row.ctypes.data, row_bytes,
                                        *small._max_rows(self.comm, row_bytes, 0, topk,
                                                         "dispatch"))
            self._scratch(num_experts // self.comm.num_ranks, 1, 1)
        return found

    def usable(self, active_ranks, num_worst_tokens=0) -> bool:
        """What every call here needs of the Buffer and of the arguments not its tensors."""
        return (self.on and self.comm.all_active and active_ranks is None and
                num_worst_tokens.__class__ is int and num_worst_tokens == 0)

    def dispatch(self, backend, x, per_rank, in_rank, per_expert, idx, w, alignment,
                 num_worst_tokens, active_ranks):
        """Buffer.dispatch's result for a fresh call this path takes, else None (nothing
        moved)."""
        comm, Tensor = self.comm, torch.Tensor
        if not (self.usable(active_ranks, num_worst_tokens) and
                alignment.__class__ is int and alignment >= 1 and
                x.__class__ is Tensor and idx.__class__ is Tensor and
                (w is None or w.__class__ is Tensor) and per_rank.__class__ is Tensor and
                in_rank.__class__ is Tensor and per_expert.__class__ is Tensor):
            return None
        dtype, R = x.dtype, comm.num_ranks
        if not (dtype in ROW_DTYPES and idx.dtype is torch.int64 and
                (w is None or w.dtype is torch.float32) and per_rank.dtype is torch.int32 and
                per_expert.dtype is torch.int32 and in_rank.dtype is torch.bool and
                x.dim() == 2 and idx.dim() == 2 and per_expert.dim() == 1):
            return None
        (T, H), K, E = x.shape, idx.shape[1], per_expert.shape[0]
        if not (H > 0 and K > 0 and idx.shape[0] == T and (w is None or w.shape == idx.shape) and
                in_rank.shape == (T, R) and per_rank.shape == (R,) and 0 < E and
                E % R == 0 and E <= native.LAYOUT_CHECK_MAX and
                x.is_contiguous() and idx.is_contiguous() and in_rank.is_contiguous() and
                per_rank.is_contiguous() and per_expert.is_contiguous() and x.is_cpu and
                idx.is_cpu and in_rank.is_cpu and per_rank.is_cpu and per_expert.is_cpu and
                (w is None or (w.is_contiguous() and w.is_cpu))):
            return None
        p_w = 0 if w is None else w.data_ptr()     # none: the weights received are 0
        call_row, p_call_row, row_bytes, slot_rows, heap_rows = self._shape(H, dtype, K, E)
        parity, epoch, cp, deadline_ns = self._numbers()
        # what the handle keeps, in one allocation (a numpy array's address costs more than
        # a tensor's): the token ids by rank [T * R], their offsets [R + 1], the count matrix
        ids = torch.empty(T * R + R + 1 + R * R, dtype=torch.int64)
        p_first = ids.data_ptr() + 8 * T * R
        p_matrix, p_recv_count = p_first + 8 * (R + 1), self.p_info + 16
        block = ids.numpy()
        first, matrix = block[T * R:T * R + R + 1], block[T * R + R + 1:].reshape(R, R)
        lib, cx = self.lib, self.cx
        rc = lib.moe_small_dispatch_direct(
            cx, parity, cp, epoch, deadline_ns, idx.data_ptr(), T, K, E, per_rank.data_ptr(),
            per_expert.data_ptr(), in_rank.data_ptr(), x.data_ptr(), row_bytes, p_w,
            slot_rows, heap_rows, p_call_row, ids.data_ptr(), p_first, p_matrix, self.p_info,
            p_recv_count)
        if rc == DECLINED:
            return None
        self._take(epoch)
        if rc or self.a.differ[0]:    # late or differing signatures, late counts: the waits
            small._drive(comm, lambda resume: lib.moe_small_dispatch_start(   # go on there
                cx, parity, cp, cp, resume, epoch, deadline_ns, 0, T, R, 1, 0, p_first, 0, 0,
                0, 0, 0, 0, 0, 0, K, 0, p_call_row, p_matrix), "dispatch", epoch, parity, cp,
                cp, rc=rc)
            lib.moe_small_matrix_info(p_matrix, R, comm.rank, slot_rows, heap_rows,
                                      self.p_info, p_recv_count)
        num_recv, eager_everywhere = int(self.info[0]), self.info[1]
        if not eager_everywhere:      # a pair beyond a slot, or rows beyond a heap: granted
            lib.moe_small_send_own(cx, parity, epoch, ids.data_ptr(), p_first, x.data_ptr(), T,
                                   row_bytes, idx.data_ptr(), p_w, K, E // R, slot_rows)
            started = Started(parity, epoch, (matrix, ids, first))
            if self._one_round(matrix, slot_rows, heap_rows):
                return self._granted(started, x, idx, w, E, alignment, in_rank, slot_rows)
            return self._go_on(backend, started, x, idx, w, E, alignment, in_rank, per_rank,
                               per_expert)
        recv_x, recv_i, recv_w = self._empty("dispatch", num_recv * (row_bytes + 12 * K), [
            (num_recv, H, dtype), (num_recv, K, torch.int64), (num_recv, K, torch.float32)])
        args = (cx, parity, 0, epoch, deadline_ns, p_recv_count, row_bytes, K,
                recv_x.data_ptr(), recv_i.data_ptr(), recv_w.data_ptr(), E // R, self.p_local,
                0, x.data_ptr(), T, ids.data_ptr(), p_first, idx.data_ptr(), p_w)
        rc = lib.moe_small_direct_finish(*args)
        if rc:                        # (a fresh dispatch's finish checks no signatures)
            small._drive(comm, lambda resume: lib.moe_small_direct_finish(*args), "dispatch",
                         epoch, parity, cp, counts=self._sources(self.info[2:]), rc=rc)
        counts = self._counted(E // R, alignment)
        handle = DispatchHandle(self.key, T, H, matrix, in_rank, TokenIds(ids, first), num_recv,
                                0, call_id=epoch)
        return recv_x, recv_i, recv_w, counts, handle, EventOverlap()

    def _one_round(self, matrix, slot_rows, heap_rows) -> bool:
        """Whether a fresh dispatch of count ``matrix`` moves in one round (every rank's
        region fits its heap) with no source's rows in an eager slot of this rank: then
        :meth:`_granted` runs it."""
        col = matrix[:, self.comm.rank]
        return int(matrix.sum(0).max()) <= heap_rows and not (
            (col > 0) & (col <= slot_rows)).any()

    def _granted(self, started, x, idx, w, num_experts, alignment, in_rank, slot_rows):
        """The rest of a fresh dispatch :meth:`_one_round` accepts: granted.fresh_dispatch
        (its grant and payload phase in one C call), then the region as the outputs and the
        received ids counted per expert. normal.dispatch runs the same steps for any call, in
        several times the Python (docs/PERF.md, session 26)."""
        comm, (matrix, ids, first) = self.comm, started.counts
        me, R = comm.rank, comm.num_ranks
        (T, H), K, num_local = x.shape, idx.shape[1], num_experts // R
        num_recv = int(matrix[:, me].sum())
        lay = SlabLayout(num_recv, H * x.element_size(), 0, K)
        handle = DispatchHandle(self.key, T, H, matrix, in_rank, TokenIds(ids, first),
                                num_recv, 0, call_id=started.epoch)
        page = granted.fresh_dispatch(comm, started.epoch, started.parity, handle, lay,
                                      x.view(torch.uint8), idx, w, num_local, slot_rows)
        offs = lay.offsets
        recv_x, recv_i, recv_w = comm.heap.tensors_owning(page, lay.nbytes, [
            (0, x.dtype, num_recv, H), (offs[2], torch.int64, num_recv, K),
            (offs[3], torch.float32, num_recv, K)])
        if self.lib.moe_count_experts(recv_i.data_ptr(), num_recv * K, num_local,
                                      self.p_local):        # (an id beyond them: torch says)
            return recv_x, recv_i, recv_w, aligned_expert_counts(recv_i, num_local,
                                                                 alignment), handle, EventOverlap()
        return recv_x, recv_i, recv_w, self._counted(num_local, alignment), handle, \
            EventOverlap()

    def _counted(self, num_local, alignment) -> list:
        """The received ids per local expert C counted into ``self.local``, rounded up to
        ``alignment``."""
        counts = self.local[:num_local].tolist()
        if alignment != 1:
            counts = [(c + alignment - 1) // alignment * alignment for c in counts]
        return counts

    def _go_on(self, backend, started, x, idx, w, num_experts, alignment, in_rank, per_rank,
               per_expert):
        """The rest of a call begun here whose rows do not all fit slots (normal.dispatch)."""
        recv_x, _, recv_i, recv_w, handle = backend.normal.dispatch(
            self.comm, x_bytes=x.view(torch.uint8), dtype=x.dtype, hidden=x.shape[1],
            scales=None, topk_idx=idx, topk_weights=w,
            layout=DispatchLayout(per_rank, per_expert, in_rank), handle=None,
            num_experts=num_experts, num_worst_tokens=0, buffer_key=self.key, started=started)
        counts = backend.expert_counts(recv_i, handle, num_experts // self.comm.num_ranks,
                                       alignment)
        return recv_x, recv_i, recv_w, counts, handle, EventOverlap()

    def cached(self, x, handle, idx, w, alignment, num_worst_tokens, active_ranks):
        """Buffer.dispatch's result for a cached call (``handle``) this path takes, else
        None (nothing moved)."""
        if not (self.usable(active_ranks, num_worst_tokens) and idx is None and w is None and
                alignment.__class__ is int and alignment >= 1 and
                self._of_handle(handle) and x.__class__ is torch.Tensor):
            return None
        dtype, T, H = x.dtype, handle.num_tokens, handle.hidden
        if not (dtype in ROW_DTYPES and x.dim() == 2 and x.shape == (T, H) and
                x.is_contiguous() and x.is_cpu):
            return None
        row_bytes, num_recv = H * dtype.itemsize, handle.num_recv_tokens
        slot_rows, heap_rows = small._max_rows(self.comm, row_bytes, 0, 0, "dispatch")
        call_row = signature.normal("cached dispatch", hidden=H, dtype=dtype, scale_cols=0,
                                    topk=0, num_experts=0, num_worst_tokens=0,
                                    handle_id=handle.call_id)
        ids, first = small.handle_ids(handle)
        recv_x, = self._empty("dispatch", num_recv * row_bytes, [(num_recv, H, dtype)])
        parity, epoch, cp, deadline_ns = self._numbers()
        lib, cx, p_call_row = self.lib, self.cx, call_row.ctypes.data
        matrix = self._matrix(handle)                 # (held while C reads it)
        rc = lib.moe_small_cached_direct(
            cx, parity, cp, epoch, deadline_ns, matrix.ctypes.data, slot_rows,
            heap_rows, ids.data_ptr(), first.ctypes.data, x.data_ptr(), T, row_bytes,
            recv_x.data_ptr(), p_call_row, self.p_counts)
        if rc == DECLINED:
            return None
        self._take(epoch)
        if rc or self.a.differ[0]:    # late or differing peers: the waits go on there
            small._drive(self.comm, lambda resume: lib.moe_small_direct_finish(
                cx, parity, cp, epoch, deadline_ns, self.p_counts, row_bytes, 0,
                recv_x.data_ptr(), 0, 0, 0, 0, p_call_row, x.data_ptr(), T, ids.data_ptr(),
                first.ctypes.data, 0, 0), "dispatch", epoch, parity, cp,
                counts=self._sources(self.counts[:self.comm.num_ranks]), rc=rc)
        return recv_x, None, None, None, None, EventOverlap()

    def combine(self, x, handle, w, bias, active_ranks):
        """Buffer.combine's result for a call this path takes, else None (nothing moved)."""
        comm = self.comm
        if not (self.usable(active_ranks) and bias is None and self._of_handle(handle) and
                x.__class__ is torch.Tensor):
            return None
        dtype, n, H, T = x.dtype, handle.num_recv_tokens, handle.hidden, handle.num_tokens
        if not (dtype in small.SUM_DTYPES and x.dim() == 2 and x.shape == (n, H) and
                x.is_contiguous() and x.is_cpu):
            return None
        K = 0
        if w is not None:
            if not (w.__class__ is torch.Tensor and w.dtype is torch.float32 and
                    w.dim() == 2 and w.shape[0] == n and w.shape[1] > 0 and
                    w.is_contiguous() and w.is_cpu):
                return None
            K = w.shape[1]
        row_bytes = H * dtype.itemsize
        slot_rows, heap_rows = small._max_rows(comm, row_bytes, 0, K, "combine")
        if int(handle.count_matrix.max(initial=0)) > slot_rows:
            return None               # (C declines it: a pair beyond a slot) before outputs
        call_row = signature.normal("combine", hidden=H, dtype=dtype, scale_cols=0, topk=K,
                                    num_experts=0, num_worst_tokens=0, handle_id=handle.call_id)
        ids, first = small.handle_ids(handle)
        R = comm.num_ranks
        self._scratch(1, T + 1 + int(first[R]), H)
        # (two keys: the two results are separate tensors, as small.receive_combine's)
        out, = self._empty("combine", T * row_bytes, [(T, H, dtype)])
        out_w, = self._empty("combine_w", T * 4 * K, [(T, K, torch.float32) if K else None])
        parity, epoch, cp, deadline_ns = self._numbers()
        lib, cx, p_call_row, dt = self.lib, self.cx, call_row.ctypes.data, small.SUM_DTYPES[dtype]
        p_ids, p_first, p_out = ids.data_ptr(), first.ctypes.data, out.data_ptr()
        p_out_w = 0 if w is None else out_w.data_ptr()
        p_index, p_sums = self.index.data_ptr(), self.sums.data_ptr()
        matrix = self._matrix(handle)
        rc = lib.moe_small_combine_direct(
            cx, parity, cp, epoch, deadline_ns, matrix.ctypes.data, slot_rows, heap_rows,
            p_ids, p_first, x.data_ptr(), dt, H, 0 if w is None else w.data_ptr(), K, T, p_out,
            p_out_w, p_index, p_sums, p_call_row, self.p_counts)
        if rc == DECLINED:
            return None
        self._take(epoch)
        if rc or self.a.differ[0]:    # late or differing peers: the waits go on there
            own = int(matrix[:comm.rank, comm.rank].sum())   # my rows for myself, in x
            own_x, own_w = x[own:].data_ptr(), 0 if w is None else w[own:].data_ptr()
            small._drive(comm, lambda resume: lib.moe_small_combine_finish(
                cx, parity, cp, epoch, deadline_ns, self.p_counts + 8 * R, p_ids, p_first, dt,
                H, K, T, 0, 0, p_out, dt, p_out_w, p_index, p_sums, p_call_row, own_x, own_w),
                "combine", epoch, parity, cp, counts=self.counts[R:].copy(), rc=rc)
        return out, out_w, EventOverlap()
