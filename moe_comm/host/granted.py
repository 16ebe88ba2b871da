"""The payload phase of a granted normal dispatch in one C call (csrc/host/granted.c).

normal.dispatch's ``_exchange`` waits for each destination's grant, writes its rows there,
tells it DONE, then waits for every source's DONE word: a few hundred Python operations a
call, which in a 4-rank 1024 x 7168 dispatch on 2 cores took a fifth of each rank's CPU (the
ranks share the cores, so one rank's Python slows the others' copies). Here the C call does
those steps over all peers, with the same words at the same places (exchange.py), so a rank
here pairs with a rank on the Python path.

Which calls: a fresh dispatch begun in direct.py (``started``: every rank on this host, not
elastic, every rank active, no relays, the C library loaded, x without scales) that moves in
one round (no rank's region streams). A wait that does not end (the deadline, this rank
fenced) hands over to the Python steps on the same words, which raise as in any call.
"""
from __future__ import annotations

import numpy as np

from ..wire import GRANT_FAILED, PAGE, SlabLayout
from . import small
from .eager import flags as eager_flags
from .exchange import (DONE_NOTHING, DONE_REFUSED, GATHER_S, done_words, put_rows,
                       release_on_error, send_when_granted, settle)

# granted.c's return codes beyond small.py's (SMALL_OK 0, SMALL_AGAIN)
LATE_GRANTS, LATE_DONE, BAD_ID = 6, 7, 8
# a destination's row of the table the C call reads (granted.c GD_*), and its states (GS_*)
GD_WORDS, GD_STATE = 6, 5
WRITTEN, FAILED, SHORT = 1, 2, 3


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
            [comm.peer_heap(d).data_ptr() for d in range(R)])]
        self.context = np.array([GRANT_FAILED, DONE_NOTHING, DONE_REFUSED] +
                                [a.ctypes.data for a in self.arrays], dtype=np.int64)
        self.p_context = self.context.ctypes.data
        self.src = np.zeros(R, dtype=np.int64)        # what each source's wait reads
        self.p_src = self.src.ctypes.data


def addresses(comm) -> Addresses:
    found = comm.ll_cache.get("granted")
    if found is None:
        found = comm.ll_cache["granted"] = Addresses(comm)
    return found


def exchange(comm, epoch, parity, *, page, own_error, plan, dests, sources, in_slots, sizes,
             send_ids, x_bytes, topk_idx, topk_weights, num_local):
    """normal.py's ``_exchange`` of round 0 of a call that moves in one round: this rank's
    rows to every destination of ``dests`` once it grants (``plan``: the call's RoundPlan;
    ``send_ids``: the handle's TokenIds), then the DONE words of ``sources`` and the eager
    flags of ``in_slots`` (at eager ``parity``; ``sizes`` the bytes this rank expects in
    each), then settle. The granted ``page`` goes back to the heap if anything raises."""
    me = comm.rank
    dones = {**done_words(comm, sources), **eager_flags(comm, parity, in_slots)}
    try:
        table = _table(plan, me, dests, send_ids)
        a, g = small.addresses(comm), addresses(comm)
        g.src[:] = 0
        g.src[sources] = 1
        g.src[in_slots] = 2
        K = topk_idx.shape[1]
        deadline_ns = int(comm.deadline * 1e9)

        def phase(resume):
            return a.lib.moe_granted_dispatch(
                a.p_context, g.p_context, parity, epoch, deadline_ns, resume,
                table.ctypes.data, len(dests), g.p_src, x_bytes.data_ptr(),
                x_bytes.stride(0), x_bytes.shape[0], x_bytes.shape[1], topk_idx.data_ptr(),
                0 if topk_weights is None else topk_weights.data_ptr(), K, num_local,
                int(GATHER_S * 1e9))

        rc = phase(0)
        while rc == small.AGAIN:       # a slice of the wait: Python's signal handlers ran
            rc = phase(1)
        state = table[:, GD_STATE]
        if rc == BAD_ID:
            raise IndexError(f"put_rows: a token id outside [0, {x_bytes.shape[0]})")
        failed = [d for d, s in zip(dests, state) if s == FAILED]
        short = [d for d, s in zip(dests, state) if s == SHORT]
        if rc == LATE_GRANTS:          # the Python steps on the same words (they raise)
            def slab(d):
                return SlabLayout(plan.chunk[d], x_bytes.shape[1], 0, K)

            def write(d, dst_page):
                put_rows(comm, d, dst_page * PAGE, slab(d), int(plan.row0[me, d]),
                         send_ids[d], x_bytes, None, topk_idx, topk_weights, num_local)
            more = send_when_granted(comm, epoch, [d for d, s in zip(dests, state) if not s],
                                     write, lambda d: slab(d).nbytes, "dispatch/grant")
            failed, short = failed + more[0], short + more[1]
        if rc:
            comm.wait(dones, epoch, "dispatch/payload")
        settle(comm, epoch, "dispatch", pages=[page], own_error=own_error, dones=dones,
               failed=failed, short=short, sizes=sizes)
    except BaseException:
        release_on_error(comm, epoch, [page], dones)
        raise


def _table(plan, me: int, dests: list, send_ids) -> np.ndarray:
    """granted.c's destination rows: rank, rows of its region, where this rank's rows start
    there, this rank's token ids for it (address, count), state."""
    d = np.asarray(dests, dtype=np.int64)
    table = np.zeros((len(d), GD_WORDS), dtype=np.int64)
    table[:, 0] = d
    table[:, 1] = np.asarray(plan.chunk, dtype=np.int64)[d]
    table[:, 2] = plan.row0[me, d]
    table[:, 3] = send_ids.ids.data_ptr() + 8 * send_ids.first[d]
    table[:, 4] = plan.counts[me, d]
    return table
