"""The payload phase of a granted normal dispatch or combine in one C call
(csrc/host/granted.c).

normal.py's ``_exchange`` waits for each destination's grant, writes its rows there, tells
it DONE, then waits for every source's DONE word: a few hundred Python operations a call,
which in a 4-rank 1024 x 7168 dispatch on 2 cores took a fifth of each rank's CPU (the ranks
share the cores, so one rank's Python slows the others' copies). Here the C call does those
steps over all peers, with the same words at the same places (exchange.py), so a rank here
pairs with a rank on the Python path.

Which calls: those that move in one round (no rank's region streams) and that no rank
refused (a region too small for one row, ``num_worst_tokens`` exceeded) on a Buffer whose small
calls may run (small.usable: every rank on this host, not elastic, every rank active, no
relays, the C library loaded): a dispatch without scales whose handle keeps its token ids as
one tensor (handle.TokenIds: begun in direct.py or small.py), and a combine whose start ran in
C (small.start_combine). A wait that does not end (the deadline, this rank fenced) hands
over to the Python steps on the same words, which raise as in any call.

A fresh dispatch begun in direct.py that moves in one round with no source's rows in this
rank's slots goes further (fresh_dispatch): its grant too, and its destinations' table, in
the same C call, so that Python does no more than allocate the region before it and make
the outputs after (normal.dispatch's Python around this phase took ~250 us of each rank's
CPU a call in the 4-rank 1024 x 7168 dispatch above).
"""
from __future__ import annotations

import numpy as np

from ..wire import GRANT_FAILED, PAGE, SlabLayout
from . import small
from .eager import flags as eager_flags
from .exchange import (DONE_NOTHING, DONE_REFUSED, GATHER_S, done_words, grant,
                       mismatch_behind, put_rows, release_on_error, send_when_granted, settle,
                       signature_check)

# granted.c's return codes beyond small.py's (SMALL_OK 0, SMALL_AGAIN)
LATE_GRANTS, LATE_DONE, BAD_ID, UNWRITTEN = 6, 7, 8, 9
# a destination's row of the table the C call reads (granted.c GD_*), and its states (GS_*)
GD_WORDS, GD_STATE = 6, 5
WRITTEN, FAILED, SHORT, DIFFER = 1, 2, 3, 4


class Addresses:
    """The addresses one rank's granted dispatches use, built once per Buffer
    (HostComm.ll_cache["granted"]): every destination's grant in this rank's header, this
    rank's DONE word in every peer's header, every source's DONE word in this rank's, every
    rank's heap; ``context`` lists them in the order granted.c's GX_* words name them."""

    def __init__(self, comm):
        me, R, lay = comm.rank, comm.num_ranks, comm.layout
        words = [comm.words[r].ctypes.data for r in range(R)]
        self.arrays = [np.array(a, dtype=np.int64) for a in (
            [words[me] + 8 * lay.grant(d) for d in range(R)],
            [words[d] + 8 * lay.done(me) for d in range(R)],
            [words[me] + 8 * lay.done(s) for s in range(R)],
            [comm.peer_heap(d).data_ptr() for d in range(R)],
            [words[s] + 8 * lay.grant(me) for s in range(R)])]
        self.context = np.array([GRANT_FAILED, DONE_NOTHING, DONE_REFUSED] +
                                [a.ctypes.data for a in self.arrays], dtype=np.int64)
        self.p_context = self.context.ctypes.data
        self.src = np.zeros(R, dtype=np.int64)        # what each source's wait reads
        self.p_src = self.src.ctypes.data
        # a fresh dispatch's destinations and their number, as moe_granted_fresh fills them
        self.table = np.zeros((R, GD_WORDS), dtype=np.int64)
        self.nd = np.zeros(1, dtype=np.int64)
        self.p_table, self.p_nd = self.table.ctypes.data, self.nd.ctypes.data


def addresses(comm) -> Addresses:
    found = comm.ll_cache.get("granted")
    if found is None:
        found = comm.ll_cache["granted"] = Addresses(comm)
    return found


def dispatch(comm, epoch, parity, *, page, own_error, plan, dests, sources, in_slots, sizes,
             send_ids, x_bytes, topk_idx, topk_weights, num_local, calls, call_row, write,
             need):
    """normal.dispatch's ``_exchange`` of round 0 of a call that moves in one round: this
    rank's rows to every destination of ``dests`` once it grants (``plan``: the call's
    RoundPlan; ``send_ids``: the handle's TokenIds), then the DONE words of ``sources`` and
    the eager flags of ``in_slots`` (at eager ``parity``; ``sizes`` the bytes this rank
    expects in each), then settle. ``calls`` (a cached dispatch: the signatures, posted at
    the last call parity), else None. ``write`` / ``need``: the Python path's, for the
    destinations left when a wait hands over."""
    me = comm.rank
    table = _table(plan, me, dests, send_ids.ids.data_ptr() + 8 * send_ids.first[dests])
    K = 0 if topk_idx is None else topk_idx.shape[1]

    def phase(a, g, deadline_ns, cp, resume):
        return a.lib.moe_granted_dispatch(
            a.p_context, g.p_context, parity, cp, epoch, deadline_ns, resume,
            table.ctypes.data, len(dests), g.p_src, x_bytes.data_ptr(), x_bytes.stride(0),
            x_bytes.shape[0], x_bytes.shape[1], small._ptr(topk_idx), small._ptr(topk_weights), K,
            num_local, 0 if calls is None else call_row.ctypes.data, int(GATHER_S * 1e9))
    _run(comm, "dispatch", epoch, parity, phase, table, page=page, own_error=own_error,
         dests=dests, sources=sources, in_slots=in_slots, sizes=sizes, calls=calls,
         call_row=call_row, write=write, need=need)


class OneRound:
    """The RoundPlan (normal.py) of a call that moves in one round, as _table reads it:
    every region's rows (``chunk``), where each source's rows start in it (``row0``), the
    count matrix (``counts``)."""

    def __init__(self, matrix: np.ndarray, rows_at: np.ndarray):
        self.counts, self.chunk = matrix, rows_at
        self.row0 = np.cumsum(matrix, 0) - matrix


def fresh_dispatch(comm, epoch, parity, handle, region: SlabLayout, x_bytes, topk_idx,
                   topk_weights, num_local, slot_rows) -> int:
    """The rest of a fresh dispatch begun in direct.py, once its count matrix came, where it
    moves in one round and no source's rows wait in an eager slot of this rank: its grant of
    ``region`` (the slab of every row this rank receives), then :func:`dispatch`'s payload
    phase to the destinations beyond an eager slot of ``slot_rows`` rows (those within one
    got theirs with the counts), in one C call (granted.c moe_granted_fresh) where the
    region could be allocated. normal.dispatch's steps for such a call, without the
    branches it does not take. Returns the granted page; raises as normal.dispatch does."""
    pages = max(1, -(-region.nbytes // PAGE))
    page = comm.heap.alloc(pages)
    if page is None:                  # (grant says so to every source, and raises after)
        return _fresh_in_python(comm, epoch, parity, handle, region, x_bytes, topk_idx,
                                topk_weights, num_local, slot_rows)
    me, send_ids = comm.rank, handle.send_token_ids
    # (C reads it as int64, row-major: direct.py's is already, so this copies nothing)
    matrix = np.ascontiguousarray(handle.count_matrix, dtype=np.int64)
    sources = None
    try:
        a, g = small.addresses(comm), addresses(comm)
        deadline_ns, K = int(comm.deadline * 1e9), topk_idx.shape[1]

        def phase(resume):
            return a.lib.moe_granted_fresh(
                a.p_context, g.p_context, parity, epoch, deadline_ns, resume,
                matrix.ctypes.data, slot_rows, page, pages, g.p_table, g.p_nd, g.p_src,
                send_ids.ids.data_ptr(), send_ids.first.ctypes.data, x_bytes.data_ptr(),
                x_bytes.stride(0), x_bytes.shape[0], x_bytes.shape[1], topk_idx.data_ptr(),
                small._ptr(topk_weights), K, num_local, int(GATHER_S * 1e9))
        rc = phase(0)
        while rc == small.AGAIN:
            rc = phase(1)
        if rc == 0:
            return page
        # what stopped it, on the same words, as the Python steps conclude (they raise)
        sources = np.flatnonzero(matrix[:, me]).tolist()
        table = g.table[:int(g.nd[0])].copy()
        plan = OneRound(matrix, matrix.sum(0))
        write, need = _fresh_writes(comm, plan, send_ids, x_bytes, topk_idx, topk_weights,
                                    num_local, K)
        _conclude(comm, "dispatch", epoch, rc, table, page=page, own_error=None,
                  dests=table[:, 0].tolist(), dones=done_words(comm, sources), sizes={},
                  calls=None, call_row=None, write=write, need=need)
    except BaseException:
        if sources is None:
            sources = np.flatnonzero(matrix[:, me]).tolist()
        release_on_error(comm, epoch, [page], done_words(comm, sources))
        raise
    return page


def _fresh_writes(comm, plan, send_ids, x_bytes, topk_idx, topk_weights, num_local, K):
    """A one-round dispatch's ``write`` and ``need`` for the Python steps (a grant that came
    late), as normal.dispatch gives them."""
    me, row_bytes = comm.rank, x_bytes.shape[1]

    def slab(d):
        return SlabLayout(int(plan.chunk[d]), row_bytes, 0, K)

    def write(d, d_page):
        put_rows(comm, d, d_page * PAGE, slab(d), int(plan.row0[me, d]), send_ids[d],
                 x_bytes, None, topk_idx, topk_weights, num_local)
    return write, lambda d: slab(d).nbytes


def _fresh_in_python(comm, epoch, parity, handle, region, x_bytes, topk_idx, topk_weights,
                     num_local, slot_rows) -> int:
    """fresh_dispatch where this rank's region could not be allocated: the grant tells every
    source so (GRANT_FAILED), this rank still writes to its destinations, then raises
    BufferTooSmallError as every rank on normal.dispatch's path does."""
    me, matrix, send_ids = comm.rank, handle.count_matrix, handle.send_token_ids
    K = topk_idx.shape[1]
    plan = OneRound(matrix, matrix.sum(0))
    sources = np.flatnonzero(matrix[:, me]).tolist()
    page, own_error = grant(comm, epoch, region.nbytes, "dispatch", sources)
    row = matrix[me]
    dests = [int(d) for d in small.addresses(comm).rotation if row[d] > slot_rows]
    write, need = _fresh_writes(comm, plan, send_ids, x_bytes, topk_idx, topk_weights,
                                num_local, K)
    dispatch(comm, epoch, parity, page=page, own_error=own_error, plan=plan, dests=dests,
             sources=sources, in_slots=[], sizes={}, send_ids=send_ids, x_bytes=x_bytes,
             topk_idx=topk_idx, topk_weights=topk_weights, num_local=num_local, calls=None,
             call_row=None, write=write, need=need)
    return page


def combine(comm, epoch, parity, *, page, own_error, plan, dests, sources, in_slots, sizes,
            x, topk_weights, calls, call_row, write, need):
    """normal.combine's ``_exchange`` of round 0 of a call that moves in one round (its
    signature posted in C: ``calls`` at the last call parity): this rank's received rows of
    ``x`` (contiguous) and their weights back to each owner of ``dests`` once it grants, then
    as :func:`dispatch`."""
    me, matrix = comm.rank, plan.counts.T          # (plan: rows go back, matrix.T's)
    before = np.cumsum(matrix[:, me]) - matrix[:, me]    # x's rows from each owner start
    table = _table(plan, me, dests, before[dests])
    K = 0 if topk_weights is None else topk_weights.shape[1]

    def phase(a, g, deadline_ns, cp, resume):
        return a.lib.moe_granted_combine(
            a.p_context, g.p_context, parity, cp, epoch, deadline_ns, resume,
            table.ctypes.data, len(dests), g.p_src, x.data_ptr(), x.shape[1] * x.element_size(),
            small._ptr(topk_weights), K, call_row.ctypes.data)
    _run(comm, "combine", epoch, parity, phase, table, page=page, own_error=own_error,
         dests=dests, sources=sources, in_slots=in_slots, sizes=sizes, calls=calls,
         call_row=call_row, write=write, need=need)


def _run(comm, op, epoch, parity, phase, table, *, page, own_error, dests, sources, in_slots,
         sizes, calls, call_row, write, need):
    """The C phase to its end (resumed after each slice of its waits, so Python's signal
    handlers run), the Python steps where a wait handed over, then settle."""
    dones = {**done_words(comm, sources), **eager_flags(comm, parity, in_slots)}
    try:
        a, g = small.addresses(comm), addresses(comm)
        g.src[:] = 0
        g.src[sources] = 1
        g.src[in_slots] = 2
        deadline_ns, cp = int(comm.deadline * 1e9), (comm.call_seq - 1) % 2
        rc = phase(a, g, deadline_ns, cp, 0)
        while rc == small.AGAIN:
            rc = phase(a, g, deadline_ns, cp, 1)
        _conclude(comm, op, epoch, rc, table, page=page, own_error=own_error, dests=dests,
                  dones=dones, sizes=sizes, calls=calls, call_row=call_row, write=write,
                  need=need)
    except BaseException as e:
        release_on_error(comm, epoch, [page], dones)
        mismatch_behind(comm, epoch, op, calls, e)
        raise


def _conclude(comm, op, epoch, rc, table, *, page, own_error, dests, dones, sizes, calls,
              call_row, write, need):
    """After a C payload phase returned ``rc`` with ``table``'s states: the Python steps
    where a wait handed over (a late grant, a late DONE), then settle, which raises what went
    wrong the same way on every rank."""
    state = table[:, GD_STATE]
    if rc == BAD_ID:
        raise IndexError(f"{op}: a token id outside the rows of x")
    failed = [d for d, s in zip(dests, state) if s == FAILED]
    short = [d for d, s in zip(dests, state) if s == SHORT]
    if rc == LATE_GRANTS:          # the Python steps on the same words (they raise)
        more = send_when_granted(comm, epoch, [d for d, s in zip(dests, state) if not s],
                                 write, need, op + "/grant",
                                 signature_check(comm, epoch, op, calls, call_row))
        failed, short = failed + more[0], short + more[1]
    if rc:
        comm.wait(dones, epoch, op + "/payload")
    settle(comm, epoch, op, pages=[page], own_error=own_error, dones=dones, failed=failed,
           short=short, calls=calls, sizes=sizes)


def _table(plan, me: int, dests: list, rows) -> np.ndarray:
    """granted.c's destination rows: rank, rows of its region, where this rank's rows start
    there, ``rows`` (a dispatch: the address of its token ids; a combine: its first row of
    x), how many, state."""
    d = np.asarray(dests, dtype=np.int64)
    table = np.zeros((len(d), GD_WORDS), dtype=np.int64)
    table[:, 0] = d
    table[:, 1] = np.asarray(plan.chunk, dtype=np.int64)[d]
    table[:, 2] = plan.row0[me, d]
    table[:, 3] = rows
    table[:, 4] = plan.counts[me, d]
    return table
