"""Hierarchical normal mode of the host backend: a token crosses to each other host once.

For a sender ``s`` and a host ``H`` other than its own, the *relay* of ``s`` on ``H`` is the
rank of ``H`` with ``s``'s local index (modulo ``H``'s rank count): DeepEP's choice of the
GPU with the same index, so each (host pair, local index) is one rail. One epoch, one round:

dispatch
  1. notify   - (exchange.exchange_counts) each rank's row carries, after its R per-rank
                counts, its token count per host: every rank knows every region size and
                decides alike whether the call runs here (it fits the heap) or flat.
  2. grants   - each rank grants its output region (the flat protocol's: by source, then
                token) to the ranks of its own host, which write all of it, and a staging
                region to the remote senders it relays for.
  3. stage    - each rank writes each of its tokens that goes to another host once, into its
                relay's staging region there: payload, scales, global top-k ids and
                weights, and a mask of the relay host's ranks that get the token. DONE.
  4. forward  - once every remote sender it relays for is DONE, each rank writes to each rank
                of its host its own rows and the staged rows for it, at the rows the flat
                protocol would have used. DONE.
combine mirrors it
  1. grants   - each rank grants one region to the ranks of its host (each writes its rows of
                this rank's tokens, then its rows of the tokens this rank relays) and one to
                its relays on other hosts (one partial-sum row per token that went there).
  2. local    - each rank writes its received rows back to its host: to the owner when it is
                on this host, else to the owner's relay here. DONE.
  3. relay    - a relay sums, per relayed token, the rows of its host (float32, cast to the
                payload dtype: DeepEP's scheme), and writes one row per token across. DONE.
  4. reduce   - the owner sums its host's rows and one partial row per other host.
Results, ordering and handles equal the flat protocol's (normal.py). One call serves groups
spread over hosts whose regions fit the heap each rank has free; a call too big for that runs
as token rounds of such calls (relay_rounds.py), and only a call not even one token of which
fits goes flat.

Masked ranks (elastic, or a controller's set_active_ranks): the relays of a call are picked
among the ranks the notify agreement kept (``Relays.among``; a host with no active rank gets
nothing), so every rank derives the same choice. Counts sent before that agreement may
count tokens only for a rank it masked: a sender pads such rows with an empty destination
mask (forwarded nowhere, summed as nothing). A rank masked mid-call (or, for a call on a
handle, since its dispatch) may have been a relay of healthy ranks' rows, partly forwarded
or summed: once the survivors agree on the mask (the end of the payload phase), every
survivor sees that a rank the relays were picked among is gone and raises
:class:`RelayLost` - before any rank raises its own outcome of the call - after
quarantining what a late writer may still write; normal.py then redoes the call flat over
the survivors in fresh epochs (its inputs are the caller's, untouched). Not a repair of the
lost rows: a partial sum that took in the rows of a rank masked after it was summed cannot
be taken apart, and the deadline spent on the dead rank dwarfs one more flat call. A relay
may wait deadlines out for dead peers of its own before it writes: ranks waiting for a relay
give it PATIENT_TIMEOUTS more timeouts (HostComm.wait ``patient``) and the call's agreement
allows for that (``late``).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..relay_map import Relays
from ..wire import PAGE, SlabLayout, tag_value
from .exchange import (DONE_LOST, DONE_WRITTEN, done_words, grant, put_rows,
                       release_on_error, send_when_granted, settle, signature_check)
from .reduce import sum_rows_per_token

log = logging.getLogger("moe_comm")

# A relay writes after at most two waits of its own that may each end at a fresh deadline
# (dispatch: its grants, then the senders it relays for; combine: the grants of its host,
# then the rows of its host's writers): it may be that many timeouts late and healthy, so
# ranks waiting for it give it that much more (HostComm.wait ``patient``, agree ``late``).
PATIENT_TIMEOUTS = 2


class RelayLost(Exception):
    """A rank the call's relays were picked among was masked since (mid-call, or between a
    dispatch and a call on its handle): the relayed result may miss rows of healthy ranks,
    so the survivors redo the call flat (normal.py)."""


class Routes:
    """One dispatch's hierarchical geometry, kept on its handle for combine and cached
    dispatches: the count matrix, tokens per (rank, host) and, filled by the dispatch, the
    destination masks of the rows this rank relayed (``masks[s]`` bool [n, ranks here])."""

    def __init__(self, relays: Relays, matrix: np.ndarray, host_counts: np.ndarray):
        # counts were sent before the notify agreement: nothing of a masked rank, nothing to
        # a host with no active rank. A count may still exceed the tokens that go (a rank of
        # that host masked since): the sender pads its rows with empty destination masks.
        host_counts = host_counts.copy()
        host_counts[~relays.active] = 0
        host_counts[:, [h for h, ranks in enumerate(relays.active_on) if not ranks]] = 0
        self.relays, self.matrix, self.host_counts = relays, matrix, host_counts
        self.masks = {}
        self.combine_fits = False        # set by fits(), for its combine_row_bytes
        self._combine_budget = None      # per rank: heap its combine regions may take
        self._rows_to_host = relays.rows_per_host(matrix)

    # -- dispatch ------------------------------------------------------------------------
    def stage_rows(self, f: int) -> int:
        return int(sum(self.host_counts[s, self.relays.host_of[f]]
                       for s in self.relays.relayed[f]))

    def stage_row0(self, s: int, f: int) -> int:
        h = self.relays.host_of[f]
        return int(sum(self.host_counts[p, h] for p in self.relays.relayed[f] if p < s))

    def forwards(self, w: int, d: int) -> bool:
        """Whether rank w (on d's host) writes rows into d's output region."""
        m = self.matrix
        return bool(m[w, d] or any(m[s, d] for s in self.relays.relayed[w]))

    # -- combine -------------------------------------------------------------------------
    def back_part(self, d: int, f: int) -> list:
        """Row counts of expert rank d's part of f's combine region (both on one host): f's
        own tokens, then those of each rank f relays for."""
        return [int(self.matrix[f, d])] + [int(self.matrix[s, d])
                                           for s in self.relays.relayed[f]]

    def back_rows(self, f: int) -> int:
        h = self.relays.host_of[f]
        return int(self._rows_to_host[f, h] + sum(self._rows_to_host[s, h]
                                                  for s in self.relays.relayed[f]))

    def back_row0(self, d: int, f: int) -> int:
        return sum(sum(self.back_part(p, f)) for p in self.relays.ranks_on[
            self.relays.host_of[f]] if p < d)

    def partial_rows(self, o: int) -> int:
        """Rows of o's region for partial sums: one per token of o that went to another
        host, by host."""
        mine = self.relays.host_of[o]
        return int(sum(self.host_counts[o, h] for h in range(self.relays.num_hosts)
                       if h != mine))

    def combine_fits_for(self, row_bytes: int, topk: int) -> bool:
        """Whether a combine of rows of ``row_bytes`` (its x's width, which may differ from
        the dispatch's: fp8 in, bf16 back) with ``topk`` weight columns goes by relays: both
        its regions fit the heap fits() left it on every active rank. Every rank holds the
        same routes, so all answer the same."""
        if self._combine_budget is None:
            return False
        return all(max(PAGE, SlabLayout(self.back_rows(f), row_bytes, 0, topk).nbytes) +
                   SlabLayout(self.partial_rows(f), row_bytes, 0, topk).nbytes <= budget
                   for f, budget in self._combine_budget.items())

    def partial_row0(self, o: int, host: int) -> int:
        mine = self.relays.host_of[o]
        return int(sum(self.host_counts[o, h] for h in range(host) if h != mine))


def fits(routes: Routes, R: int, final_rows: list, row_bytes, scale_cols, topk,
         free_bytes, combine_row_bytes, output_held=True) -> bool:
    """Whether a dispatch goes by relays: every active rank's output and staging regions fit
    the heap it had free at the call's start (``free_bytes[f]``, told in the count rows, so
    every rank answers the same). Also records on ``routes`` how much heap its combine may
    take (:meth:`Routes.combine_fits_for`): what stays free once the dispatch's output is
    held (the caller holds it at combine; whatever else it holds by then makes that combine
    fail as a flat one could) - or, ``output_held`` False, the whole free heap (token rounds
    move each round's output out of the heap, relay_rounds.py) - and whether a combine of
    rows of ``combine_row_bytes`` fits it (``routes.combine_fits``)."""
    mc = routes.relays.mask_cols
    # (a rank's own region is granted even when empty: a page at least, exchange.grant)
    final = [max(PAGE, SlabLayout(final_rows[f], row_bytes, scale_cols, topk).nbytes)
             for f in range(R)]
    stage = [SlabLayout(routes.stage_rows(f), row_bytes, scale_cols, topk, mc).nbytes
             for f in range(R)]
    live = np.flatnonzero(routes.relays.active).tolist()
    routes._combine_budget = {f: int(free_bytes[f]) - final[f] * output_held for f in live}
    routes.combine_fits = routes.combine_fits_for(combine_row_bytes, topk)
    return all(final[f] + stage[f] <= free_bytes[f] for f in live)


def _grant_two(comm, epoch, own, extra, refuse=None):
    """A relay call's two grants, each ``(nbytes, what, senders)``: the region this rank's
    own host writes, and the one ranks of other hosts write (none when no sender). Returns
    (page, extra page, the first error)."""
    page, error = grant(comm, epoch, *own, refuse)
    extra_page, extra_error = grant(comm, epoch, *extra) if extra[2] else (None, None)
    return page, extra_page, error or extra_error


def _view(heap, base, lay: SlabLayout, sub: int, row: int, count: int, width: int,
          elem: int, dtype, spans: list):
    """Rows ``[row, row + count)`` of sub-array ``sub`` of the region ``lay`` at byte
    ``base`` of ``heap``, as a [count, width] tensor; the span goes to ``spans`` (commits)."""
    start = base + lay.offsets[sub] + row * width * elem
    spans.append((start, count * width * elem))
    return heap[start:start + count * width * elem].view(dtype).view(count, width)


def _commit(comm, dst, spans):
    for start, nbytes in spans:
        comm.commit(dst, "heap", start, nbytes)


def dispatch(comm, epoch, handle, *, x_bytes, scales, topk_idx, topk_weights, num_local,
             final, refuse, calls, call_row):
    """The payload phase of a hierarchical dispatch (steps 2-4); returns this rank's output
    region's first page. ``final(d)``: rank d's output SlabLayout (as the flat protocol's)."""
    routes, me = handle.relay, comm.rank
    relays, m = routes.relays, handle.count_matrix
    row0 = np.cumsum(m, 0) - m
    row_bytes, topk = x_bytes.shape[1], 0 if topk_idx is None else topk_idx.shape[1]
    scale_cols = 0 if scales is None else scales.shape[1]
    here = relays.host_of[me]

    def staging(f):
        return SlabLayout(routes.stage_rows(f), row_bytes, scale_cols, topk, relays.mask_cols)

    writers = [w for w in relays.local if routes.forwards(w, me)]
    senders = [s for s in relays.relayed[me] if routes.host_counts[s, here]]
    page, stage_page, own_error = _grant_two(
        comm, epoch, (final(me).nbytes, "dispatch", writers),
        (staging(me).nbytes, "dispatch (relay staging)", senders), refuse)
    agrees = signature_check(comm, epoch, "dispatch", calls, call_row)
    stage_dones, dones = done_words(comm, senders), done_words(comm, writers)
    try:
        # 3. stage: each token once per other host, to this rank's relay there
        hosts = [h for h in range(relays.num_hosts) if h != here and routes.host_counts[me, h]]
        relay_of = {relays.relay(me, h): h for h in hosts}

        def stage(f, f_page):
            h = relay_of[f]
            in_host = handle.is_token_in_rank[:, relays.ranks_on[h]]
            ids = in_host.any(1).nonzero().flatten()
            lay, at, c, spans = staging(f), routes.stage_row0(me, f), len(ids), []
            counted = int(routes.host_counts[me, h])    # >= c: see Routes
            heap, base = comm.peer_heap(f), f_page * PAGE
            torch.index_select(x_bytes, 0, ids, out=_view(heap, base, lay, 0, at, c, row_bytes,
                                                          1, torch.uint8, spans))
            if scales is not None:
                torch.index_select(scales, 0, ids, out=_view(heap, base, lay, 1, at, c,
                                                             scale_cols, 4, scales.dtype, spans))
            if topk:
                _view(heap, base, lay, 2, at, c, topk, 8, torch.int64, spans).copy_(topk_idx[ids])
                w = _view(heap, base, lay, 3, at, c, topk, 4, torch.float32, spans)
                w.copy_(topk_weights[ids]) if topk_weights is not None else w.zero_()
            mask = _view(heap, base, lay, 4, at, counted, relays.mask_cols, 1, torch.uint8,
                         spans)
            mask.zero_()                # padding rows: forwarded nowhere, summed as nothing
            mask[:c, :in_host.shape[1]] = in_host[ids]
            _commit(comm, f, spans)

        failed, short = send_when_granted(comm, epoch, list(relay_of), stage,
                                          lambda f: staging(f).nbytes, "dispatch/grant", agrees)
        comm.wait(stage_dones, epoch, "dispatch/relay")
        # a sender masked meanwhile is no loss (its rows are dropped; RelayLost below)
        live = [s for s in senders if comm.active[s]]
        lost = (senders and stage_page is None) or any(
            int(tag_value(stage_dones[s][0])) != DONE_WRITTEN for s in live)
        staged = _staged(comm, routes, stage_page, staging(me), live, here, relays,
                         scales, topk) if not lost else {}

        # 4. forward: own rows and relayed rows to each rank of this host
        def forward(d, d_page):
            base, lay, li = d_page * PAGE, final(d), relays.local_index[d]
            put_rows(comm, d, base, lay, int(row0[me, d]), handle.send_token_ids[d], x_bytes,
                     scales, topk_idx, topk_weights, num_local)
            for s, rows in staged.items():
                if m[s, d]:             # (never more rows than granted for s, whatever came)
                    put_rows(comm, d, base, lay, int(row0[s, d]),
                             routes.masks[s][:, li].nonzero().flatten()[:int(m[s, d])],
                             *rows, num_local)

        dests = [d for d in relays.local if routes.forwards(me, d)]
        f2, s2 = send_when_granted(comm, epoch, dests, forward, lambda d: final(d).nbytes,
                                   "dispatch/grant", agrees,
                                   written=DONE_LOST if lost else DONE_WRITTEN)
        # a forwarder may first wait deadlines out for dead peers of its own (comm.py)
        comm.wait(dones, epoch, "dispatch/payload", patient=writers)
        settle(comm, epoch, "dispatch", pages=[page, stage_page], own_error=own_error,
               dones={**stage_dones, **dones}, failed=failed + f2, short=short + s2,
               calls=calls, late=PATIENT_TIMEOUTS * comm.timeout_s,
               agreed=lambda: _check_relays(comm, routes, "dispatch"))
    except BaseException:
        release_on_error(comm, epoch, [page, stage_page], {**stage_dones, **dones})
        raise
    if stage_page is not None:
        comm.heap.free(stage_page)
    return page


def _check_relays(comm, routes, op) -> None:
    """RelayLost when the survivors' agreed mask drops a rank the call's relays were chosen
    among: every survivor decides alike (same routes, same mask; before any rank raises its
    own outcome of the call), after the settle has quarantined what a late writer may still
    write; the caller's except clause frees the rest and normal.py redoes the call flat over
    the survivors, where a capacity error of this call comes again on every rank alike."""
    if not routes.relays.serve(comm.active):
        gone = np.flatnonzero(routes.relays.active & ~comm.active).tolist()
        log.warning("moe_comm rank %d: %s: rank(s) %s, among whom the call's relays were "
                    "picked, masked since; the call is redone flat", comm.rank, op, gone)
        raise RelayLost(f"{op}: rank(s) {gone} masked since the call's relays were picked")


def _staged(comm, routes, page, lay, senders, here, relays, scales, topk) -> dict:
    """The staged rows of each relayed sender as tensors over this rank's staging region
    (payload, scales, global top-k ids, weights); keeps each one's destination mask on the
    route (a copy: combine needs it after the region is freed)."""
    if page is None:
        return {}
    region = torch.from_numpy(comm.heap.view(page, lay.nbytes))
    out, nloc = {}, len(relays.local)
    for s in senders:
        at, c, spans = routes.stage_row0(s, comm.rank), int(routes.host_counts[s, here]), []
        rows = [_view(region, 0, lay, 0, at, c, lay.row_bytes, 1, torch.uint8, spans),
                _view(region, 0, lay, 1, at, c, lay.scale_cols, 4, scales.dtype, spans)
                if scales is not None else None,
                _view(region, 0, lay, 2, at, c, topk, 8, torch.int64, spans) if topk else None,
                _view(region, 0, lay, 3, at, c, topk, 4, torch.float32, spans) if topk
                else None]
        mask = _view(region, 0, lay, 4, at, c, lay.mask_cols, 1, torch.uint8, spans)
        routes.masks[s] = mask[:, :nloc].bool()
        out[s] = rows
    return out


def combine(comm, epoch, handle, *, x, topk_weights, bias, calls, call_row):
    """A hierarchical combine (see the module docstring). Returns ``(combined_x [T, H],
    combined_topk_weights or None)``."""
    routes, me = handle.relay, comm.rank
    relays, m = routes.relays, handle.count_matrix
    here = relays.host_of[me]
    dtype, hidden = x.dtype, x.shape[1]
    x_bytes = x.view(torch.uint8)
    row_bytes, topk = x_bytes.shape[1], 0 if topk_weights is None else topk_weights.shape[1]
    received0 = np.cumsum(m[:, me]) - m[:, me]      # where each source's rows start in x

    def back(f):
        return SlabLayout(routes.back_rows(f), row_bytes, 0, topk)

    def partials(o):
        return SlabLayout(routes.partial_rows(o), row_bytes, 0, topk)

    writers = [d for d in relays.local if sum(routes.back_part(d, me))]
    remote_hosts = [h for h in range(relays.num_hosts) if h != here and routes.host_counts[me, h]]
    across = [relays.relay(me, h) for h in remote_hosts]
    page, part_page, own_error = _grant_two(
        comm, epoch, (back(me).nbytes, "combine", writers),
        (partials(me).nbytes, "combine (relay partials)", across))
    agrees = signature_check(comm, epoch, "combine", calls, call_row)
    dones, part_dones = done_words(comm, writers), done_words(comm, across)
    try:
        # 2. local: this rank's rows of each owner's tokens to the owner or its relay here
        def write_back(f, f_page):
            lay, heap, base, spans = back(f), comm.peer_heap(f), f_page * PAGE, []
            at = routes.back_row0(me, f)
            for s, c in zip([f] + relays.relayed[f], routes.back_part(me, f)):
                if c:
                    src = int(received0[s])
                    _view(heap, base, lay, 0, at, c, row_bytes, 1, torch.uint8,
                          spans).copy_(x_bytes[src:src + c])
                    if topk:
                        _view(heap, base, lay, 3, at, c, topk, 4, torch.float32,
                              spans).copy_(topk_weights[src:src + c])
                at += c
            _commit(comm, f, spans)

        dests = [f for f in relays.local if sum(routes.back_part(me, f))]
        failed, short = send_when_granted(comm, epoch, dests, write_back,
                                          lambda f: back(f).nbytes, "combine/grant", agrees)
        comm.wait(dones, epoch, "combine/payload")
        mine = _region(comm, page, back(me), topk) if page is not None else None
        lost = own_error is not None or any(int(tag_value(w[0])) != DONE_WRITTEN
                                            for d, w in dones.items() if comm.active[d])

        # 3. relay: one partial row per relayed token, across to its owner
        def write_partials(o, o_page):
            if lost:
                return                      # DONE_LOST tells the owner
            rows, wts = _relay_sums(routes, o, mine, me, dtype, hidden, topk)
            lay, heap, base, spans = partials(o), comm.peer_heap(o), o_page * PAGE, []
            at, c = routes.partial_row0(o, here), rows.shape[0]
            _view(heap, base, lay, 0, at, c, row_bytes, 1, torch.uint8, spans).copy_(
                rows.view(torch.uint8).view(c, row_bytes))
            if topk:
                _view(heap, base, lay, 3, at, c, topk, 4, torch.float32, spans).copy_(wts)
            _commit(comm, o, spans)

        owners = [s for s in relays.relayed[me] if routes.host_counts[s, here]]
        f2, s2 = send_when_granted(comm, epoch, owners, write_partials,
                                   lambda o: partials(o).nbytes, "combine/grant", agrees,
                                   written=DONE_LOST if lost else DONE_WRITTEN)
        # a relay may first wait deadlines out for dead peers of its own (comm.py)
        comm.wait(part_dones, epoch, "combine/relay", patient=across)
        settle(comm, epoch, "combine", pages=[page, part_page], own_error=own_error,
               dones={**dones, **part_dones}, failed=failed + f2, short=short + s2, calls=calls,
               late=PATIENT_TIMEOUTS * comm.timeout_s,
               agreed=lambda: _check_relays(comm, routes, "combine"))
        # 4. reduce: this host's rows of my tokens, one partial row per other host
        segments, ids, weights = [], [], []
        rows, wts = mine
        at = 0
        in_rank = handle.is_token_in_rank
        for d in relays.local:
            c = routes.back_part(d, me)
            if c[0]:
                segments.append(rows[at:at + c[0]])
                weights.append(None if wts is None else wts[at:at + c[0]])
                ids.append(handle.send_token_ids[d])
            at += sum(c)
        prow, pw = _region(comm, part_page, partials(me), topk) if across else (None, None)
        for h in remote_hosts:          # the tokens that went there, then padding (Routes)
            lo = routes.partial_row0(me, h)
            ids.append(in_rank[:, relays.ranks_on[h]].any(1).nonzero().flatten())
            n = len(ids[-1])
            segments.append(prow[lo:lo + n])
            weights.append(None if pw is None else pw[lo:lo + n])
        segments = [s.view(dtype).view(-1, hidden) for s in segments]
        out = _sum(segments, ids, handle.num_tokens, dtype, hidden, bias)
        combined_w = None
        if topk:
            combined_w = torch.zeros(handle.num_tokens, topk, dtype=torch.float32)
            for w, i in zip(weights, ids):
                combined_w.index_add_(0, i, w)
    except BaseException:
        release_on_error(comm, epoch, [page, part_page], {**dones, **part_dones})
        raise
    for p in (page, part_page):
        if p is not None:
            comm.heap.free(p)
    return out, combined_w


def _region(comm, page, lay: SlabLayout, topk):
    """(payload rows [n, row_bytes] uint8, weights [n, topk] float32 or None) of a received
    combine region of this rank."""
    region = torch.from_numpy(comm.heap.view(page, lay.nbytes))
    spans = []
    rows = _view(region, 0, lay, 0, 0, lay.rows, lay.row_bytes, 1, torch.uint8, spans)
    wts = _view(region, 0, lay, 3, 0, lay.rows, topk, 4, torch.float32, spans) if topk \
        else None
    return rows, wts


def _relay_sums(routes, o, mine, me, dtype, hidden, topk):
    """This relay's partial sums for owner o's relayed tokens: per token, the float32 sum of
    the rows this host's ranks wrote back for it, in the payload dtype; weights summed."""
    relays = routes.relays
    rows, wts = mine
    mask = routes.masks[o]
    k = 1 + relays.relayed[me].index(o)          # o's part in each writer's part
    segments, ids, weights = [], [], []
    for d in relays.local:
        part = routes.back_part(d, me)
        if part[k]:
            lo = routes.back_row0(d, me) + sum(part[:k])
            segments.append(rows[lo:lo + part[k]].view(dtype).view(-1, hidden))
            weights.append(None if wts is None else wts[lo:lo + part[k]])
            ids.append(mask[:, relays.local_index[d]].nonzero().flatten())
    n = mask.shape[0]
    out = _sum(segments, ids, n, dtype, hidden)
    sums = None
    if topk:
        sums = torch.zeros(n, topk, dtype=torch.float32)
        for w, i in zip(weights, ids):
            sums.index_add_(0, i, w)
    return out, sums


def _sum(segments, ids, num_tokens, dtype, hidden, biases=()):
    """reduce.sum_rows_per_token, also when no rows came (the width is then ``hidden``)."""
    if not segments:
        segments, ids = [torch.empty(0, hidden, dtype=dtype)], [torch.empty(0, dtype=torch.long)]
    return sum_rows_per_token(segments, ids, num_tokens, dtype, biases)
