"""The steps every normal-mode exchange of the host backend is built from (normal.py's flat
protocol and relay.py's hierarchical one): the count exchange, grants of receive regions,
writes once a region is granted, DONE words, and what a call raises when something went wrong.

A pair of ranks (writer, receiver) uses one GRANT slot and one DONE slot per call: the
receiver pushes its region's first page and page count into the writer's GRANT slot, the
writer answers with one DONE word saying what it did with the region.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from .. import signature
from ..errors import BufferTooSmallError, CommTimeoutError
from ..layout import local_topk
from ..wire import GRANT_FAILED, PAGE, tag_epoch, tag_value
from . import native

log = logging.getLogger("moe_comm")


class ReceiverFailed(RuntimeError):
    pass


# DONE values: what a writer did with the receiver's grant. DONE_LOST: it wrote, but rows it
# relays for ranks of other hosts never reached it (relay.py), so the receiver's rows of those
# ranks are missing.
DONE_NOTHING, DONE_WRITTEN, DONE_REFUSED, DONE_LOST = 0, 1, 2, 3


def exchange_counts(comm, epoch: int, row: np.ndarray, call_row: np.ndarray) -> np.ndarray:
    """Notify phase: the call's signature and this rank's ``row`` of counts (R per-rank counts,
    then in a hierarchical call one count per host) to every rank, the signatures checked
    (CallMismatchError), then every rank's row: ``m[s, :R][d]`` = tokens s sends to d (zero
    rows for inactive ranks). The NOTIFY rows take the parity of the call's signature: every
    normal call signs, on every rank, whatever it is, so ranks that disagreed about a call
    (a fresh dispatch against a cached one, which counts nothing) stay in step for the next.
    The slots are free again for the same reason as the CALL slots (HostComm.post_call)."""
    lay, me, R = comm.layout, comm.rank, comm.num_ranks
    n = len(row)
    calls = comm.post_call(epoch, call_row)
    parity = (comm.call_seq - 1) % 2
    comm.signal_each(np.flatnonzero(comm.active), lay.notify(parity, me), epoch, row)
    comm.verify_call(calls, epoch, "dispatch")
    waits = {s: comm.slot(me, lay.notify(parity, s), n) for s in range(R)}
    comm.wait(waits, epoch, "dispatch/notify")
    return np.stack([tag_value(waits[s]) if comm.active[s] else np.zeros(n, np.int64)
                     for s in range(R)]).astype(np.int64)


def grant(comm, epoch: int, nbytes: int, what: str, senders, refuse=None):
    """Allocate a receive region of ``nbytes`` and push its first page and its page count to
    every sender. Returns (page, error); ``refuse`` (an error) grants nothing and answers
    GRANT_FAILED."""
    page, error = None, refuse
    pages = max(1, -(-nbytes // PAGE))
    if refuse is None:
        page = comm.heap.alloc(pages)
        if page is None:
            error = BufferTooSmallError(
                what + f" (while {comm.heap.bytes_in_use} bytes are held by received tensors "
                "still alive)", nbytes + comm.heap.bytes_in_use, comm.heap.capacity)
    # (masked senders send nothing: a relay call on a handle may still name one)
    comm.signal_each([s for s in senders if comm.active[s]], comm.layout.grant(comm.rank),
                     epoch, [GRANT_FAILED, 0] if page is None else [page, pages])
    return page, error


# How long a sender with write_many waits for all its grants before it writes to those it
# has: a pass over x for all of them reads x once (the grants come within tens of us of each
# other when every rank is in the call), a late rank costs the others at most this much.
GATHER_S = 200e-6


def send_when_granted(comm, epoch, dests, write, need, op, agrees=None, written=DONE_WRITTEN,
                      write_many=None):
    """Wait for each destination's grant and call ``write(dst, page)``, then DONE
    (``written``); returns the ranks whose grant said they could not allocate, and those whose
    granted pages were fewer than ``need(dst)`` bytes (nothing is written there: no write
    leaves the region granted for the call, whatever the sender computed). ``agrees(dst)``:
    whether dst signed this call as this rank did (its signature came before its grant);
    nothing is written to a rank that did not (the caller then raises CallMismatchError).
    ``write_many([(dst, page)])``: writes to several destinations at once, called for those
    whose grants came together (after a wait of up to GATHER_S for all of them)."""
    failed, short = [], []
    me = comm.rank

    def verdict(dst, words):
        """(page to write, DONE word): page None where nothing is written."""
        page, pages = int(tag_value(words[0])), int(tag_value(words[1]))
        if page == GRANT_FAILED:
            failed.append(dst)         # DONE (nothing sent) all the same: the receiver
            return None, DONE_NOTHING  # waits for it before granting again
        if agrees is not None and not agrees(dst):
            return None, DONE_REFUSED
        if need(dst) > pages * PAGE:
            short.append(dst)
            return None, DONE_REFUSED
        return page, written

    def on_batch(arrived):
        ready = []
        for dst, words in arrived:
            page, done = verdict(dst, words)
            if page is None:           # told at once (nothing to wait for, even if a write
                comm.signal(dst, comm.layout.done(me), epoch, done)     # below raises)
            else:
                ready.append((dst, page))
        if not ready:
            return
        comm.check_fence()             # a rank the survivors masked writes nothing
        if write_many is not None and len(ready) > 1:
            write_many(ready)
            for dst, _ in ready:
                comm.signal(dst, comm.layout.done(me), epoch, written)
            return
        for dst, page in ready:
            write(dst, page)
            comm.signal(dst, comm.layout.done(me), epoch, written)

    grants = {d: comm.slot(me, comm.layout.grant(d), 2) for d in dests}
    if write_many is not None and len(grants) > 1:
        comm.gather(grants, epoch, op, GATHER_S)
    comm.wait(grants, epoch, op, on_batch=on_batch)
    return failed, short


def put_rows(comm, dst, base, lay, row, ids, x_bytes, scales, topk_idx, topk_weights,
              num_local):
    """This rank's tokens ``ids`` as rows ``row..`` of the slab ``lay`` at byte ``base`` of
    ``dst``'s heap view (a granted region or an eager slot), top-k ids made local to dst;
    committed (ranks on other hosts)."""
    put_rows_multi(comm, [(dst, base, lay, row, ids)], x_bytes, scales, topk_idx,
                   topk_weights, num_local)


def put_rows_multi(comm, parts, x_bytes, scales, topk_idx, topk_weights, num_local):
    """put_rows for each ``(dst, base, lay, row, ids)`` of ``parts``, in one C pass over x
    where it runs (a token for several destinations read once)."""
    topk = 0 if topk_idx is None else topk_idx.shape[1]
    spans, dests = [], []
    for dst, base, lay, row, ids in parts:
        c, heap, offs = len(ids), comm.peer_heap(dst), lay.offsets

        def rows(sub, width, elem, dt):
            start = base + offs[sub] + row * width * elem
            spans.append((dst, start, c * width * elem))
            return heap[start:start + c * width * elem].view(dt).view(c, width)

        outs = (rows(0, x_bytes.shape[1], 1, torch.uint8),
                None if scales is None else rows(1, scales.shape[1], 4, scales.dtype),
                None if topk_idx is None else rows(2, topk, 8, torch.int64),
                None if topk_idx is None else rows(3, topk, 4, torch.float32))
        dests.append((ids, dst * num_local, outs))
    # one C pass where it runs: the torch code below is ~a dozen operations per destination
    if not native.put_rows_multi(x_bytes, scales, topk_idx, topk_weights, num_local, dests):
        for (dst, *_), (ids, _, outs) in zip(parts, dests):
            _put_rows_torch(x_bytes, scales, topk_idx, topk_weights, ids, dst, num_local, outs)
    for dst, start, nbytes in spans:
        comm.commit(dst, "heap", start, nbytes)


def _put_rows_torch(x_bytes, scales, topk_idx, topk_weights, ids, dst, num_local, outs):
    """put_rows's copies where the C loops cannot run them (native.put_rows's definition)."""
    out_x, out_scales, out_idx, out_w = outs
    torch.index_select(x_bytes, 0, ids, out=out_x)
    if scales is not None:
        torch.index_select(scales, 0, ids, out=out_scales)
    if topk_idx is not None:
        li, lw = local_topk(topk_idx[ids], None if topk_weights is None
                            else topk_weights[ids], dst, num_local)
        out_idx.copy_(li)
        out_w.copy_(lw) if lw is not None else out_w.zero_()


def signature_check(comm, epoch, op, calls, call_row):
    """``agrees(dst)`` for :func:`send_when_granted` when the call's signatures were posted
    (``calls`` from post_call) but not yet checked: None when they were checked already."""
    if calls is None:
        return None

    def agrees(dst):
        comm.wait({dst: calls[dst]}, epoch, op + "/notify")   # sent before its grant
        return np.array_equal(tag_value(calls[dst]), call_row)
    return agrees


def done_words(comm, sources) -> dict:
    """The DONE slots of the active ``sources`` in this rank's header, taken right after the
    grant: a rank masked before it was granted nothing (grant) and writes nothing, so its
    silence quarantines nothing (quarantine_if_late)."""
    return {s: comm.slot(comm.rank, comm.layout.done(s)) for s in sources if comm.active[s]}


def settle(comm, epoch, op, *, pages, own_error, dones, failed, short, calls=None,
           sizes=None, late=0.0, agreed=None):
    """The end of a payload phase, once every DONE came or timed out: agree on the mask
    (elastic), quarantine what a late writer may still write, check the signatures (when
    ``calls``), then raise what went wrong, the same way on every rank that saw it.
    ``sizes``: {source: bytes this rank expects} of the sources whose DONE carries the bytes
    they wrote (eager slots); a source that wrote another size counts as refused. ``late``:
    see HostComm.agree. ``agreed()``: runs once the mask is agreed and the signatures are
    checked, before this rank's own outcome is raised: a decision every rank must take
    alike, whatever went wrong here (relay.py: RelayLost, then every survivor redoes the
    call, this one too)."""
    if comm.elastic:
        comm.agree(op, late)
    for page in pages:
        quarantine_if_late(comm, epoch, page, dones)
    if calls is not None:
        comm.verify_call(calls, epoch, op)
    if agreed is not None:
        agreed()
    if own_error is not None:
        raise own_error
    said = {s: int(tag_value(w[0])) for s, w in dones.items() if comm.active[s]}
    refused = sorted(s for s, v in said.items() if v == DONE_REFUSED or (
        sizes and s in sizes and int(tag_value(dones[s][1])) != sizes[s]))
    if short or refused:
        raise RuntimeError(f"{op}: rows larger than the granted region (sender and "
                           f"receiver computed other sizes): nothing written to rank(s) "
                           f"{short}, nothing received from rank(s) {refused}")
    if failed:
        raise ReceiverFailed(f"{op}: rank(s) {sorted(failed)} could not allocate their "
                             "receive region (buffer too small there); nothing was sent "
                             "to them")
    lost = sorted(s for s, v in said.items() if v == DONE_LOST)
    if lost:
        raise ReceiverFailed(f"{op}: rank(s) {lost} could not relay the rows of ranks on "
                             "other hosts to this rank (their staging region was refused)")


def mismatch_behind(comm, epoch: int, op: str, calls, error: BaseException) -> None:
    """A payload phase's wait that ran out (``error``, CommTimeoutError): where every active
    rank's signature of this call (``calls``, post_call's views) came, and two differ, raise
    CallMismatchError instead. Ranks that disagree about a call can disagree about which
    pairs go through eager slots (rows of other widths near a slot's size), and then each
    waits for words the other never sends; the signatures say why, on every rank alike."""
    if calls is None or not isinstance(error, CommTimeoutError):
        return
    rows = {s: calls[s] for s in np.flatnonzero(comm.active)}
    if all((tag_epoch(w) == epoch).all() for w in rows.values()):
        signature.check(op, {s: tag_value(w) for s, w in rows.items()})


def keeps_in_step(error: BaseException) -> bool:
    """Whether a rank whose round raised ``error`` still goes through the call's remaining
    rounds (granting nothing) and raises at the end: a capacity or consistency outcome of
    that round. Peers not involved with it in that round meet it in the next one and would
    otherwise wait for it until their deadline. Deadlines and masks end the call at once."""
    return isinstance(error, (ValueError, ReceiverFailed)) or type(error) is RuntimeError


def release_on_error(comm, epoch, pages, dones) -> None:
    """A call that raises: quarantine what a late writer may still write, free the rest."""
    for page in pages:
        quarantine_if_late(comm, epoch, page, dones)
        if page is not None:
            comm.heap.free(page)


def quarantine_if_late(comm, epoch, page, dones) -> None:
    """A source whose DONE never came (masked, or the call failed waiting for it) may still be
    writing into the region granted to it - frozen, not dead: the region is never handed out
    again (PageHeap.quarantine)."""
    late = [s for s, w in dones.items() if tag_epoch(w[0]) != epoch]
    if late and page is not None and page not in comm.heap.quarantined:
        comm.heap.quarantine(page)
        log.warning("moe_comm rank %d: %d bytes of the heap quarantined: granted to rank(s) "
                    "%s, whose DONE never came", comm.rank,
                    comm.heap.quarantined[page] * PAGE, late)
