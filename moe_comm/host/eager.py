"""Eager sends of the host backend's normal mode: small rows need no grant.

Each segment holds, after its heap, one slot per (parity, source rank)
(``wire.eager_slot_bytes``): a page whose first word is the slot's flag, then the rows. Where
a sender's rows for a receiver fit a slot (every rank decides the same from the count
matrix), the sender writes them into its slot at the receiver at the very start of the call,
then the flag (tagged with the call's epoch, after the rows: the DONE of this pair); the
receiver grants nothing to it and, once the call's signatures agree, copies those rows into
its output. A small call so costs one exchange of words instead of three (notify, grant,
done).

Why the slot is free without asking: the parity flips with each normal call, so call ``j``
writes where call ``j - 2`` wrote. Its sender has finished call ``j - 1``, which waited for
the receiver's signature of ``j - 1`` (every normal call checks every rank's), so the
receiver had finished call ``j - 2`` - including copying that call's rows out. The flag has
the parity too: the receiver may still be waiting for call ``j - 1``'s flag when call ``j``'s
is written, so one word per pair would be overwritten before it was read. A rank masked in
elastic mode is never read from again, so its late writes land in a slot nobody reads.
"""
from __future__ import annotations

import functools

import numpy as np

from ..wire import PAGE, SlabLayout
from .exchange import DONE_WRITTEN


@functools.lru_cache(maxsize=256)
def max_rows(slot_bytes: int, row_bytes: int, scale_cols: int, topk: int) -> int:
    """The most rows whose SlabLayout fits a slot of ``slot_bytes`` (0 when off)."""
    def fits(n):
        return SlabLayout(n, row_bytes, scale_cols, topk).nbytes <= slot_bytes
    if slot_bytes <= 0 or not fits(1):
        return 0
    lo, hi = 1, slot_bytes // max(1, row_bytes + scale_cols * 4 + topk * 12) + 1
    while hi - lo > 1:                      # fits(lo), and nothing from hi on fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# Where more ranks than cores share one host, a dispatch's rows for one rank go through a
# slot only up to this many bytes over the square of the ranks (at least DISPATCH_MIN_BYTES,
# at most the slot: 4 MiB on 2 ranks, 1 MiB on 4): the R x R pairs' slots and the copies out
# of them then stay within a server's last-level cache (32 MB here). A slot costs a dispatch a
# second copy (into the slot, then out into recv_x), a granted region a round trip. With 4
# ranks on 2 cores the copy cost more from about 1 MB a pair: a 128 x 7168 dispatch took
# 1.75-1.95 ms through slots against 0.86-1.25 through granted regions, a 1024 x 1024 one
# 2.5-2.8 against 1.6-2.0, while a 64 x 7168 one (0.84 MB a pair) took 464-666 us against
# 553-815 (docs/PERF.md, session 23). Only that was measured: with a core per rank, or across
# hosts (where a slot saves a round trip over the network), a pair fills the whole slot. A
# combine's rows go through slots up to their size everywhere: the owner sums them from
# there, still in the cache.
HOST_DISPATCH_BYTES = 16 << 20
DISPATCH_MIN_BYTES = 128 << 10


def room(comm, op: str) -> int:
    """The bytes of a slot one pair's rows of ``op`` ("dispatch" or "combine") may fill (the
    slot's first page holds its flag); 0 when slots are off. The same on every rank."""
    if comm.eager_slot <= 0:
        return 0
    whole = comm.eager_slot - PAGE
    if op == "dispatch" and comm.transport is None and comm.shared_cores:
        return min(whole, max(DISPATCH_MIN_BYTES, HOST_DISPATCH_BYTES // comm.num_ranks ** 2))
    return whole


def pairs(comm, counts: np.ndarray, row_bytes: int, scale_cols: int, topk: int,
          on: bool, op: str) -> np.ndarray:
    """bool [R, R]: ``[s, d]`` when s's ``counts[s, d]`` rows (of that shape) of ``op`` go to
    d eagerly."""
    if not on:
        return np.zeros(counts.shape, dtype=bool)
    n = max_rows(room(comm, op), row_bytes, scale_cols, topk)
    return (counts > 0) & (counts <= n)


def flag_at(comm, parity: int, src: int) -> int:
    """Byte offset, in a ``peer_heap`` view, of slot ``(parity, src)``'s flag word."""
    return comm.eager_page(parity, src) * PAGE


def rows_at(comm, parity: int, src: int) -> int:
    """Byte offset, in a ``peer_heap`` view, of slot ``(parity, src)``'s rows."""
    return flag_at(comm, parity, src) + PAGE


def flags(comm, parity: int, sources) -> dict:
    """The flags of ``sources``' slots at this rank (views for ``HostComm.wait``): DONE, and
    the bytes the sender wrote (the receiver checks them against its own sizes, so a sender
    that sized the call otherwise is caught even where no grant bounds it)."""
    return {s: comm.heap_slot(comm.rank, flag_at(comm, parity, s), 2) for s in sources}


def copy_out(comm, parity: int, src: int, lay: SlabLayout, outs, row: int, widths) -> None:
    """Copy the ``lay.rows`` rows in this rank's slot ``(parity, src)`` into ``outs`` (one
    [n, width] tensor or None per sub-array, ``widths`` ``(width, elem, dtype)`` each) from
    row ``row`` on."""
    region = comm.peer_heap(comm.rank)
    base, n = rows_at(comm, parity, src), lay.rows
    for sub, (out, (w, elem, dt)) in enumerate(zip(outs, widths)):
        if out is not None and n:
            at = base + lay.offsets[sub]
            out[row:row + n] = region[at:at + n * w * elem].view(dt).view(n, w)


def send(comm, epoch: int, parity: int, dests, write) -> None:
    """``write(dst, base)`` for each destination (its rows at byte ``base`` of its
    ``peer_heap``: this rank's slot there; returns the bytes its layout spans), then the
    slot's flag."""
    me = comm.rank
    for dst in dests:
        comm.check_fence()            # a rank the survivors masked writes nothing
        nbytes = write(dst, rows_at(comm, parity, me))
        comm.heap_signal(dst, flag_at(comm, parity, me), epoch, [DONE_WRITTEN, nbytes])
