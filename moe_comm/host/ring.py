"""A normal combine too large for the eager slots, streamed through them in parts, in one C
call (csrc/host/ring.c).

A granted combine moves each returned row through memory twice: the expert rank writes it
into the owner's granted region, the owner reads it back for its sum, and a region of
megabytes has left the cache by then (its share of the copy bandwidth sat near 0.6 of the
dispatch's). Here each expert rank writes an owner's rows a part at a time into its eager
slot at the owner (``PARTS`` parts a slot), and the owner sums every token whose rows have all
come, while those parts are still in the cache, then hands the parts back for the next ones.
Pairs whose rows fit a slot whole go eagerly as before (small.start_combine); this rank's rows
for itself stay in x.

Every rank takes this path for a call alike or none does: the count matrix (the handle's,
which the call's signature names) and the rows' shape (in the signature) decide it, with
``HostComm.ring_combine``, which the ranks agree on when the Buffer is made (every rank has
the C library and neither ``MOE_COMM_SMALL`` nor ``MOE_COMM_RING`` is "0"). (A call all of
whose pairs fit the slots may still be summed here on one rank and by small.receive_combine
on another, where their biases differ in layout: the words and bytes are the same.) A wait
that passes its deadline raises CommTimeoutError naming the ranks whose parts (or
hand-backs) this rank waited for; signatures that differ raise CallMismatchError on every
rank at its deadline (a peer may have taken another path and wait there for words this rank
never sends, as the small calls' and the Python protocol's waits do: the ranks then meet at
the next call).
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch

from ..errors import CommTimeoutError
from . import eager, native, small

ENV = "MOE_COMM_RING"        # "0" on any rank: large combines go through granted regions
PARTS = 4                    # parts a slot holds: an expert writes ahead of the owner's sum
ALIGN = 64                   # a part's weights start on a cache line (ring.c RING_ALIGN)
# ring.c's codes (the deadline passed with parts or hand-backs missing; a handle whose token
# ids are not ascending in [0, T)) and its state words before the per-rank ones
RING_LATE, RING_BAD_IDS, STATE_WORDS = 9, 10, 4


def able() -> bool:
    """Whether this rank can take this path (HostComm agrees on it for all ranks)."""
    return native.library() is not None and os.environ.get(small.ENV, "1") != "0" and \
        os.environ.get(ENV, "1") != "0"


@functools.lru_cache(maxsize=256)
def parts_of(room: int, row_bytes: int, topk: int) -> tuple:
    """``(rows, bytes)`` of one part of a slot of ``room`` bytes (rows: 0 where one row does
    not fit)."""
    part = room // PARTS // ALIGN * ALIGN

    def size(n):
        return -(-n * row_bytes // ALIGN) * ALIGN + n * topk * 4
    rows = max(0, part // max(1, row_bytes + topk * 4))
    while rows and size(rows) > part:
        rows -= 1
    return rows, part


def usable(comm, dtype, row_bytes: int, topk: int) -> bool:
    """Whether a combine of these rows (its start sent in C: small.start_combine) streams
    here. The same on every rank whose call has the same signature."""
    return comm.ring_combine and dtype in small.SUM_DTYPES and \
        parts_of(eager.room(comm, "combine"), row_bytes, topk)[0] > 0


def combine(comm, epoch: int, parity: int, handle, x, topk_weights, *, dtype, hidden: int,
            topk: int, biases, call_parity: int, call_row: np.ndarray):
    """The rest of a combine begun by small.start_combine: this rank's streamed rows to their
    owners and its per-token sums (normal._reduce's, bit for bit: rows added in rank order).
    Returns ``(combined_x, combined_weights or None)``."""
    a, me, R = small.addresses(comm), comm.rank, comm.num_ranks
    matrix = handle.count_matrix
    count_in = np.ascontiguousarray(matrix[me], dtype=np.int64)        # rows d returns me
    count_out = np.ascontiguousarray(matrix[:, me], dtype=np.int64)    # rows I return to o
    row_bytes = hidden * x.element_size()
    slot_rows = small._max_rows(comm, row_bytes, 0, topk, "combine")[0]
    part_rows, part_bytes = parts_of(eager.room(comm, "combine"), row_bytes, topk)
    T = handle.num_tokens
    ids, first = small.handle_ids(handle)
    out, = small._outputs(comm, "combine", [(T, hidden, dtype)])
    out_w, = small._outputs(comm, "combine_w", [(T, topk, torch.float32) if topk else None])
    biases = [b.to(torch.float32).contiguous() for b in biases]
    bias_addr = np.array([b.data_ptr() for b in biases] or [0], dtype=np.int64)
    index = torch.empty(T + 1 + int(count_in.sum()), dtype=torch.int64)
    state = np.zeros(STATE_WORDS + 4 * R, dtype=np.int64)
    eager_in = np.where(count_in <= slot_rows, count_in, 0)   # the sources in eager slots
    args = (a.p_context, parity, call_parity, epoch, small._deadline_ns(comm))
    rest = (state.ctypes.data, count_in.ctypes.data, count_out.ctypes.data, ids.data_ptr(),
            first.ctypes.data, small.SUM_DTYPES[dtype], hidden, topk, T, bias_addr.ctypes.data,
            len(biases), out.data_ptr(), small.SUM_DTYPES[dtype], small._ptr(out_w),
            index.data_ptr(), call_row.ctypes.data, x.data_ptr(), small._ptr(topk_weights),
            slot_rows, part_rows, part_bytes, PARTS)

    def phase(resume):        # (run again after a slice: the state says where it was)
        rc = a.lib.moe_ring_combine(*args, *rest)
        if rc == RING_LATE:
            comm.check_fence()                 # a rank the survivors masked: RankMaskedError
            if a.differ[0]:                    # a peer on another path: CallMismatchError
                comm.verify_call(small.call_views(comm, call_parity), epoch, "combine")
            silent = np.flatnonzero(state[STATE_WORDS + 3 * R:]).tolist()
            raise CommTimeoutError("combine/payload", silent, comm.timeout_s)
        if rc == RING_BAD_IDS:
            raise ValueError("combine: the handle's token ids are not ascending within its "
                             "num_tokens (a handle this Buffer's dispatch did not make?)")
        return rc
    small._drive(comm, phase, "combine", epoch, parity, call_parity, counts=eager_in)
    return out, out_w
