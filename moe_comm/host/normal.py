"""Normal (high-throughput) mode on the host backend.

dispatch, one epoch:
  1. notify  - each rank writes its row of token counts (per destination) into every peer's
               NOTIFY slot; after waiting for all rows every rank knows the R x R matrix.
               (Skipped when a cached handle already holds the matrix.)
  2. grant   - each receiver allocates one region of its heap for exactly the rows it will
               receive and pushes its page into each sender's GRANT slot. Every rank also
               checks, from the
               matrix, that no receiver needs more than a heap can hold, so an impossible
               call fails on every rank alike before a payload byte moves.
  3. payload - each sender, as soon as a receiver's grant is visible, writes its tokens
               straight into that region (index_select into the peer's memory: one copy per
               token and destination), then signals DONE.
  4. receive - the receiver waits for DONE from every rank that sends it rows; the region is
               handed to the caller as recv_x (no second copy) and returns to the heap when
               the caller drops the tensors.
combine reverses the flow: the token owner grants a staging region, expert ranks write their
rows back into it, the owner sums them per token in float32.

Inactive ranks (``comm.active``) take no part: they get no rows, none are awaited from them,
and their rows and columns of the count matrix are zero. In elastic mode a rank that misses a
deadline becomes inactive mid-call; the survivors agree on the mask (after notify, so their
count matrices match before any offset is computed, and at the end of the call) and drop
whatever the newly masked ranks sent, so the result equals the reference over the survivors.

Across hosts a call goes by relays (relay.py): in one copy, or, too big for the heap, as token
rounds of relayed calls (relay_rounds.py); only calls not even one token of which fits stream
flat (RoundPlan).
"""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from .. import signature
from ..errors import BufferTooSmallError
from ..handle import DispatchHandle, TokenIds
from ..layout import tokens_per_host
from ..wire import PAGE, SlabLayout, stream_chunk_rows
from . import eager, granted, native, relay, relay_rounds, ring, small
from .exchange import (ReceiverFailed, done_words, exchange_counts, grant, keeps_in_step,
                       mismatch_behind, put_rows, put_rows_multi, release_on_error,
                       send_when_granted, settle, signature_check)
from .pool import outputs
from .reduce import sum_rows_per_token

log = logging.getLogger("moe_comm")
__all__ = ["ReceiverFailed", "combine", "dispatch"]


class RoundPlan:
    """How one call's receive regions pass through the heaps: rank d's region holds
    ``chunk[d]`` of its ``rows_at[d]`` rows per round - all of them when they fit (one round,
    the region is the output), else it streams in rounds. ``counts[s, d]``: rows s sends d,
    which land at rows ``[row0[s, d], row0[s, d] + counts[s, d])`` of d's region (by source,
    then token). Computed from the count matrix and the equal heap size: the same everywhere."""

    def __init__(self, counts: np.ndarray, rows_at: list, chunk: list):
        self.counts, self.rows_at, self.chunk = counts, rows_at, chunk
        self.row0 = np.cumsum(counts, 0) - counts
        self.rounds = max([1] + [-(-n // c) for n, c in zip(rows_at, chunk) if n and c])
        self._parts = {}

    def streams(self, d: int) -> bool:
        return self.chunk[d] < self.rows_at[d]

    def span(self, d: int, r: int):
        """Rows ``[lo, hi)`` of d's region that round r moves (empty when none)."""
        lo = r * self.chunk[d]
        return lo, max(lo, min(lo + self.chunk[d], self.rows_at[d]))

    def _round(self, r: int):
        """``(first, last)`` [s, d] of round r for every pair at once, numpy: every rank asks
        about all its peers each round, and a Python loop per pair is O(R^2) per rank."""
        if r not in self._parts:
            chunk = np.asarray(self.chunk, dtype=np.int64)
            lo = r * chunk
            hi = np.maximum(lo, np.minimum(lo + chunk, np.asarray(self.rows_at, np.int64)))
            first = np.maximum(lo[None, :], self.row0)
            last = np.maximum(first, np.minimum(hi[None, :], self.row0 + self.counts))
            self._parts[r] = first, last
        return self._parts[r]

    def part(self, s: int, d: int, r: int):
        """``(first, last, local)``: s's rows at d that round r moves, as rows of d's region,
        and where ``first`` lands in that round's chunk."""
        first, last = self._round(r)
        lo = r * self.chunk[d]
        return int(first[s, d]), int(last[s, d]), int(first[s, d]) - lo

    def sources(self, d: int, r: int) -> list:
        first, last = self._round(r)
        return np.flatnonzero(last[:, d] > first[:, d]).tolist()

    def dests(self, s: int, r: int) -> list:
        """Ranks s writes to in round r, in s's rotation order."""
        first, last = self._round(r)
        order = np.asarray(_rotation(s, len(self.rows_at)), dtype=np.int64)
        return order[last[s, order] > first[s, order]].tolist()

    def epochs(self, comm, epoch: int, refused: bool) -> list:
        """One epoch per round, all taken now: every rank advances alike whatever fails."""
        return [epoch] + ([] if refused else [comm.next_epoch() for _ in range(self.rounds - 1)])


def _row_error(comm, what: str, plan: RoundPlan, layout_of):
    """BufferTooSmallError when a rank's region cannot take even one row per round (the same
    on every rank), else None. ``layout_of(n)``: the SlabLayout of n rows."""
    for d, (rows, chunk) in enumerate(zip(plan.rows_at, plan.chunk)):
        if rows and not chunk:
            return BufferTooSmallError(f"{what} (one row, streamed through half the heap)",
                                       2 * layout_of(1).nbytes, comm.heap.capacity)
    return None


def _exchange(comm, epoch, op, *, page, own_error, dests, sources, write, need, calls=None,
              call_row=None, flags=None, sizes=None, write_many=None):
    """The payload phase after this rank's grant: write to each destination once it grants,
    wait for every source's DONE (even without a region of our own: their DONE ends their use
    of this op's GRANT slot), agree on the mask (elastic), then raise what went wrong. The
    granted ``page`` goes back to the heap if anything raises. ``calls`` (from post_call,
    when no count exchange checked the signatures already): each destination's signature is
    checked before writing to it, and all of them at the end (CallMismatchError on every
    rank), so the call costs no extra round. ``flags``: the eager slots' flags of the sources
    that wrote without a grant (eager.py), waited for like DONE words, and ``sizes`` the bytes
    this rank expects in each. ``write_many``: send_when_granted's."""
    dones = {**done_words(comm, sources), **(flags or {})}
    try:
        failed, short = send_when_granted(comm, epoch, dests, write, need, op + "/grant",
                                          signature_check(comm, epoch, op, calls, call_row),
                                          write_many=write_many)
        comm.wait(dones, epoch, op + "/payload")
        settle(comm, epoch, op, pages=[page], own_error=own_error, dones=dones, failed=failed,
               short=short, calls=calls, sizes=sizes)
    except BaseException as e:
        release_on_error(comm, epoch, [page], dones)
        mismatch_behind(comm, epoch, op, calls, e)
        raise


def dispatch(comm, *, x_bytes, dtype, hidden, scales, topk_idx, topk_weights, layout,
             handle, num_experts, num_worst_tokens, buffer_key, round_index=None,
             aborted=False, started=None):
    """Run one normal dispatch. ``x_bytes`` is x as uint8 ``[T, row_bytes]``; ``layout``
    (moe_comm/layout.py DispatchLayout) where fresh routing sends it, None with a ``handle``.
    ``round_index``: this call is that round of a bigger one (relay_rounds.py), not split
    again; ``aborted``: this rank's previous round failed (relay_rounds.in_step).
    ``started``: host/direct.py began this fresh dispatch, up to its count matrix
    (direct.Started: the pairs that fit a slot sent there), and the matrix shows that not
    every pair went eagerly or a rank's rows exceed its heap: it goes on here.

    Returns ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, handle)``."""
    me, R = comm.rank, comm.num_ranks
    given = handle                    # the caller's handle (a cached dispatch), or None
    in_round = round_index is not None
    args = dict(x_bytes=x_bytes, dtype=dtype, hidden=hidden, scales=scales, topk_idx=topk_idx,
                topk_weights=topk_weights, num_experts=num_experts,
                num_worst_tokens=num_worst_tokens, buffer_key=buffer_key)
    if handle is not None and handle.rounds is not None:
        return _cached_rounds(comm, handle, args)
    if started is None:
        comm.start_call()
        parity, epoch = comm.next_normal_parity(), comm.next_epoch()
    else:
        parity, epoch = started.parity, started.epoch
    call_row = signature.of_dispatch(
        hidden=hidden, dtype=dtype, scales=scales, topk_idx=topk_idx, num_experts=num_experts,
        num_worst_tokens=num_worst_tokens, handle=handle, round_index=round_index,
        aborted=aborted)
    num_tokens, row_bytes = x_bytes.shape
    scale_cols = 0 if scales is None else scales.shape[1]
    topk = 0 if topk_idx is None else topk_idx.shape[1]
    num_local = num_experts // R if topk else 0
    eager_on = comm.eager_slot > 0 and _relays(comm) is None

    def put(dst, base, lay, row, ids):
        put_rows(comm, dst, base, lay, row, ids, x_bytes, scales, topk_idx, topk_weights,
                  num_local)

    def send_eagerly(counts, ids_to):     # rows that fit a slot, before anything else
        fit = eager.pairs(comm, counts[None, :], row_bytes, scale_cols, topk, eager_on,
                          "dispatch")[0]
        dests = [d for d in _rotation(me, R) if fit[d] and comm.active[d]]
        def write(d, base):
            lay = SlabLayout(int(counts[d]), row_bytes, scale_cols, topk)
            put(d, base, lay, 0, ids_to(d))
            return lay.nbytes
        eager.send(comm, epoch, parity, dests, write)

    rows = dict(x_bytes=x_bytes, scales=scales, topk_idx=topk_idx, topk_weights=topk_weights,
                num_local=num_local)
    small_ok = round_index is None and not aborted and small.usable(comm)   # small.py
    calls = None
    if handle is not None:           # no count exchange: checked along the payload phase
        cached = handle.without_inactive(comm.active, me)
        own = cached.count_matrix[me]
        if small_ok and small.fits(comm, own, row_bytes, scale_cols, topk):
            call_parity = small.start_dispatch(comm, epoch, parity, call_row, None,
                                               *small.handle_ids(cached), **rows)
            if not num_worst_tokens and small.dispatch_in_slots(
                    comm, cached.count_matrix, row_bytes, scale_cols, topk):
                return _small_finish(comm, epoch, parity, cached, dtype, rows, call_row,
                                     call_parity)
            calls = small.call_views(comm, call_parity)
        else:
            send_eagerly(own, lambda d: cached.send_token_ids[d])
            calls = comm.post_call(epoch, call_row)
    elif started is not None or (small_ok and small.fits(comm, layout.per_rank.numpy(),
                                                         row_bytes, scale_cols, topk)):
        matrix, ids, first = (started.counts if started is not None else small.start_dispatch(
            comm, epoch, parity, call_row, layout.in_rank, None, None, **rows))
        handle = DispatchHandle(buffer_key, num_tokens, hidden, matrix, layout.in_rank,
                                TokenIds(ids, first), int(matrix[:, me].sum()),
                                num_worst_tokens, call_id=epoch)
        if not num_worst_tokens and small.dispatch_in_slots(comm, matrix, row_bytes,
                                                            scale_cols, topk):
            return _small_finish(comm, epoch, parity, handle, dtype, rows, call_row, None)
    else:
        row = layout.per_rank.numpy().astype(np.int64)
        is_token_in_rank = layout.in_rank
        row[~comm.active] = 0
        send_ids = [is_token_in_rank[:, d].nonzero().flatten() for d in range(R)]
        send_eagerly(row, lambda d: send_ids[d])
        if _relays(comm) is not None:     # hierarchical: tokens per host, free heap, tokens
            row = np.concatenate([row, tokens_per_host(is_token_in_rank, comm.host_of).numpy(),
                                  [comm.heap.free_bytes // PAGE, num_tokens]])
        counts = exchange_counts(comm, epoch, row, call_row)
        matrix = counts[:, :R]
        if _relays(comm) is not None:
            host_counts, free_pages, tokens = counts[:, R:-2], counts[:, -2], counts[:, -1]
        if comm.elastic:
            comm.agree("dispatch/notify")
        if not comm.active.all():                  # nothing goes to masked ranks
            is_token_in_rank = is_token_in_rank.clone()
            is_token_in_rank[:, torch.from_numpy(~comm.active)] = False
            send_ids = [t if comm.active[d] else t[:0] for d, t in enumerate(send_ids)]
        handle = DispatchHandle(buffer_key, num_tokens, hidden, matrix, is_token_in_rank,
                                send_ids, int(matrix[:, me].sum()), num_worst_tokens,
                                call_id=epoch)
    handle = handle.without_inactive(comm.active, me)
    matrix, send_ids = handle.count_matrix, handle.send_token_ids
    eagerly = eager.pairs(comm, matrix, row_bytes, scale_cols, topk, eager_on,
                          "dispatch")   # [s, d]
    recv_rows = matrix.sum(0)
    rows_at = [max(int(recv_rows[d]), num_worst_tokens) for d in range(R)]
    plan = RoundPlan(matrix, rows_at, [stream_chunk_rows(
        rows_at[d], row_bytes, scale_cols, topk, comm.heap_bytes) for d in range(R)])

    def slab(d):            # the region rank d receives into, each round
        return SlabLayout(plan.chunk[d], row_bytes, scale_cols, topk)

    refuse = _row_error(comm, "dispatch", plan, lambda n: SlabLayout(n, row_bytes, scale_cols,
                                                                      topk))
    if refuse is not None and calls is None:
        raise refuse       # after the count exchange: every rank raises here, nothing moved
    # (a cached dispatch goes through the payload phase granting nothing, so a rank that
    # signed the call differently - and sized it differently - still raises with the rest)
    epochs = plan.epochs(comm, epoch, refuse is not None)
    num_recv = int(recv_rows[me])
    if refuse is None and num_worst_tokens and num_recv > num_worst_tokens:
        refuse = ValueError(f"num_worst_tokens={num_worst_tokens} is smaller than the "
                            f"{num_recv} tokens rank {me} receives")
    rounds = None
    if layout is not None and _relays(comm) is not None:
        relays = _relays(comm).among(comm.active)
        routes = relay.Routes(relays, matrix, host_counts)
        back_bytes = _combine_row_bytes(row_bytes, hidden)
        # (a round's output leaves the heap before its combine: relay_rounds.py)
        fits = relay.fits(routes, R, rows_at, row_bytes, scale_cols, topk, free_pages * PAGE,
                          back_bytes, output_held=not in_round)
        if not (fits and routes.combine_fits) and not in_round and not (
                num_worst_tokens and recv_rows.max() > num_worst_tokens):
            # too big for one copy (its combine included): token rounds of relayed calls
            rounds = relay_rounds.plan(relays, matrix, host_counts, tokens, row_bytes,
                                       scale_cols, topk, free_pages * PAGE, back_bytes)
        if fits and rounds is None:
            handle.relay = routes     # (else flat: it streams what does not fit)

    def write_round(r):
        """(write, write_many) of round r for send_when_granted."""
        def part(dst, dst_page):
            first, last, local = plan.part(me, dst, r)
            at = first - int(plan.row0[me, dst])
            return dst, dst_page * PAGE, slab(dst), local, send_ids[dst][at:at + last - first]

        def write_many(ready):
            put_rows_multi(comm, [part(dst, page) for dst, page in ready], x_bytes, scales,
                           topk_idx, topk_weights, num_local)
        return lambda dst, dst_page: put(*part(dst, dst_page)), write_many

    widths, wanted = _widths(row_bytes, scales, topk)
    if rounds is not None:
        return _rounds(comm, handle, args, layout, widths, wanted, rows_at[me], *rounds)
    mine, streamed = slab(me), plan.streams(me)
    if streamed:                      # the rows pass through the heap: outputs of their own
        recv = [torch.empty(rows_at[me], w, dtype=dt) if want else None
                for (w, _, dt), want in zip(widths, wanted)]
    if handle.relay is not None and _relays(comm) is not None:     # one round, by relays
        try:
            first_page = relay.dispatch(
                comm, epoch, handle, x_bytes=x_bytes, scales=scales, topk_idx=topk_idx,
                topk_weights=topk_weights, num_local=num_local, final=slab, refuse=refuse,
                calls=calls, call_row=call_row)
        except relay.RelayLost:       # every survivor: again, flat, over the survivors
            if given is not None:     # (all alike) later calls on it go flat at once
                given.relay = None
            return dispatch(comm, x_bytes=x_bytes, dtype=dtype, hidden=hidden, scales=scales,
                            topk_idx=topk_idx, topk_weights=topk_weights, layout=None,
                            handle=replace(handle, relay=None), num_experts=num_experts,
                            num_worst_tokens=num_worst_tokens, buffer_key=buffer_key)
        epochs = []
    in_slots = [s for s in range(R) if eagerly[s, me]]   # their rows wait in eager slots
    # the payload phase in one C call (granted.py): one round, token ids as one tensor
    in_c = (small_ok and refuse is None and plan.rounds == 1 and scales is None and
            handle.relay is None and
            isinstance(send_ids, TokenIds) and _c_rows(topk_idx, torch.int64) and
            _c_rows(topk_weights, torch.float32))
    failure = None                    # a round's error: the rest of the rounds still run
    for r, ep in enumerate(epochs):
        if r:
            comm.refresh_deadline()
        sources = [s for s in plan.sources(me, r) if not eagerly[s, me]]
        has_region = r == 0 or plan.span(me, r)[1] > plan.span(me, r)[0]
        page, own_error = (grant(comm, ep, mine.nbytes, "dispatch", sources,
                                 refuse if r == 0 else failure)
                           if has_region else (None, None))
        if r == 0:
            first_page = page
        dests = [d for d in plan.dests(me, r) if not eagerly[me, d]]
        sizes = {s: SlabLayout(int(matrix[s, me]), row_bytes, scale_cols, topk).nbytes
                 for s in in_slots}
        try:
            write, write_many = write_round(r)
            if in_c:
                granted.dispatch(comm, ep, parity, page=page, own_error=own_error, plan=plan,
                                 dests=dests, sources=sources, in_slots=in_slots, sizes=sizes,
                                 send_ids=send_ids, x_bytes=x_bytes, topk_idx=topk_idx,
                                 topk_weights=topk_weights, num_local=num_local, calls=calls,
                                 call_row=call_row, write=write,
                                 need=lambda d: slab(d).nbytes)
            else:
                _exchange(comm, ep, "dispatch", page=page, own_error=own_error,
                          write=write, write_many=write_many, need=lambda d: slab(d).nbytes,
                          calls=calls if r == 0 else None, call_row=call_row, dests=dests,
                          sources=sources,
                          flags=eager.flags(comm, parity, in_slots) if r == 0 else None,
                          sizes=sizes)
        except Exception as e:
            if not keeps_in_step(e):
                raise
            failure = failure or e
            continue
        if failure is not None:
            if page is not None:
                comm.heap.free(page)
            continue
        if streamed and page is not None:
            lo, hi = plan.span(me, r)
            region = torch.from_numpy(comm.heap.view(page, mine.nbytes))
            for sub, ((w, elem, dt), out) in enumerate(zip(widths, recv)):
                if out is not None:
                    at = mine.offsets[sub]
                    out[lo:hi] = region[at:at + (hi - lo) * w * elem].view(dt).view(hi - lo, w)
            comm.heap.free(page)
    if failure is not None:
        raise failure

    if not streamed:                  # single copy: the region itself is the output
        region = comm.heap.tensor_owning(first_page, mine.nbytes)
        offs, rows_out = mine.offsets, mine.rows

        def out(sub, width, elem, dt):
            return region[offs[sub]:offs[sub] + rows_out * width * elem].view(dt).view(
                rows_out, width)

        recv = [out(sub, w, elem, dt) if want else None
                for sub, ((w, elem, dt), want) in enumerate(zip(widths, wanted))]
    for s in in_slots:                # the eager rows, into their place by source
        if comm.active[s]:
            eager.copy_out(comm, parity, s, SlabLayout(int(matrix[s, me]), row_bytes,
                                                       scale_cols, topk),
                           recv, int(plan.row0[s, me]), widths)
    return _finish(comm, handle, recv, num_worst_tokens, dtype)


def _c_rows(t, dtype) -> bool:
    """Whether C may read ``t`` as it is: None, or contiguous of ``dtype``."""
    return t is None or (t.dtype == dtype and t.is_contiguous())


def _small_finish(comm, epoch, parity, handle, dtype, rows, call_row, call_parity):
    """A small dispatch every pair of which went eagerly (small.py): its receive; a cached
    one (``call_parity``) checks the signatures there."""
    scales, topk_idx = rows["scales"], rows["topk_idx"]
    recv_x, recv_s, recv_i, recv_w, local = small.receive_dispatch(
        comm, epoch, parity, handle.count_matrix, row_bytes=rows["x_bytes"].shape[1],
        scales=scales, topk=0 if topk_idx is None else topk_idx.shape[1],
        num_local=rows["num_local"], call_row=call_row, call_parity=call_parity)
    if call_parity is None:                  # a fresh dispatch's (HostBackend.expert_counts)
        handle.recv_expert_counts = local
    return recv_x.view(dtype), recv_s, recv_i, recv_w, handle


def _rounds(comm, handle, args, layout, widths, wanted, rows_out, chunk, count):
    """A fresh relayed dispatch too big for the heap, as ``count`` token rounds of ``chunk``
    tokens (relay_rounds.py); ``handle`` is the whole call's."""
    def one_round(lo, hi, r, aborted):
        return dispatch(comm, **_sliced(args, lo, hi), layout=relay_rounds.round_layout(
            layout.in_rank[lo:hi]), handle=None, round_index=r, aborted=aborted)

    recv, rounds = relay_rounds.dispatch(
        comm, one_round, handle.count_matrix[:, comm.rank], rows_out, widths, wanted,
        handle.num_tokens, relay_rounds.spans_of(chunk, count, handle.num_tokens))
    return _finish(comm, relay_rounds.with_rounds(handle, rounds), recv,
                   args["num_worst_tokens"], args["dtype"])


def _cached_rounds(comm, handle, args):
    """A cached dispatch on a handle of token rounds: one cached dispatch per round."""
    me, topk_idx = comm.rank, args["topk_idx"]
    rows_out = max(int(handle.count_matrix[:, me].sum()), args["num_worst_tokens"])
    widths, wanted = _widths(args["x_bytes"].shape[1], args["scales"],
                             0 if topk_idx is None else topk_idx.shape[1])

    def one_round(lo, hi, r, aborted):
        return dispatch(comm, **_sliced(args, lo, hi), layout=None,
                        handle=handle.rounds[r].handle, round_index=r, aborted=aborted)

    recv, rounds = relay_rounds.dispatch(
        comm, one_round, handle.count_matrix[:, me], rows_out, widths, wanted,
        handle.num_tokens, [(rd.lo, rd.hi) for rd in handle.rounds])
    return _finish(comm, relay_rounds.with_rounds(handle, rounds), recv,
                   args["num_worst_tokens"], args["dtype"])


def _widths(row_bytes: int, scales, topk: int):
    """A dispatch's received sub-arrays (payload, scales, top-k ids, weights): their
    ``(columns, element bytes, dtype)``, and which of them the call returns. Scales are
    4-byte columns of the caller's dtype (float32, or int32 UE8M0 packed)."""
    scale_cols = 0 if scales is None else scales.shape[1]
    scale_dtype = torch.float32 if scales is None else scales.dtype
    return ([(row_bytes, 1, torch.uint8), (scale_cols, 4, scale_dtype),
             (topk, 8, torch.int64), (topk, 4, torch.float32)],
            [True, scales is not None, topk > 0, topk > 0])


def _sliced(args: dict, lo: int, hi: int) -> dict:
    """A dispatch's arguments for its tokens ``[lo, hi)`` (one round of token rounds)."""
    out = dict(args, num_worst_tokens=0)
    for key in ("x_bytes", "scales", "topk_idx", "topk_weights"):
        if out[key] is not None:
            out[key] = out[key][lo:hi]
    return out


def _finish(comm, handle, recv, num_worst_tokens, dtype):
    """A dispatch's results from its received rows ``recv`` (by source, then token): rows of
    sources masked during the call dropped, num_worst_tokens padding rows cleared."""
    me = comm.rank
    matrix, num_recv = handle.count_matrix, handle.num_recv_tokens
    survivors = handle.without_inactive(comm.active, me)
    if survivors is not handle:       # ranks masked during the payload: drop what they sent
        keep = _rows_of(matrix[:, me], comm.active)
        recv = [None if t is None else t[keep] for t in recv]
        if num_worst_tokens:
            recv = [None if t is None else torch.cat([t, t.new_empty(
                num_worst_tokens - t.shape[0], t.shape[1])]) for t in recv]
        if handle.rounds is not None:
            survivors.rounds = relay_rounds.survivors(handle.rounds, keep,
                                                      int(matrix[:, me].sum()), comm.active,
                                                      me)
        handle, num_recv = survivors, survivors.num_recv_tokens
    recv_x, recv_scales, recv_idx, recv_w = recv
    recv_x = recv_x.view(dtype)
    if recv_x.shape[0] > num_recv:                  # num_worst_tokens padding rows
        recv_x[num_recv:].view(torch.uint8).zero_()
        if recv_idx is not None:
            recv_idx[num_recv:] = -1
            recv_w[num_recv:] = 0
    return recv_x, recv_scales, recv_idx, recv_w, handle


def _combine_row_bytes(row_bytes: int, hidden: int) -> int:
    """The width a dispatch expects its combine's rows to have: at least bf16 (an fp8
    dispatch comes back in bf16), else as wide as its own (float32 stays float32). A combine
    of other rows decides again (relay.Routes.combine_fits_for)."""
    return max(row_bytes, 2 * hidden)


def _rows_of(counts: np.ndarray, active: np.ndarray) -> torch.Tensor:
    """Indices of the rows (grouped by source, ``counts[s]`` each) of active sources."""
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return torch.cat([torch.arange(int(bounds[s]), int(bounds[s + 1]))
                      for s in range(len(counts)) if active[s]] +
                     [torch.zeros(0, dtype=torch.long)])


def combine(comm, *, x, handle, topk_weights, bias, aborted=False):
    """Run one normal combine. ``x`` [rows, H] holds this rank's expert outputs in received
    order. Returns ``(combined_x [T, H], combined_topk_weights or None)``; rows of ranks that
    are (or become) inactive are left out of the sums. ``aborted``: this call is a round of
    a combine in token rounds whose previous round failed here (relay_rounds.in_step)."""
    me, R = comm.rank, comm.num_ranks
    if handle.rounds is not None:     # a relayed call in token rounds: a combine per round
        return relay_rounds.combine(
            lambda x_r, h, w, b, aborted: combine(comm, x=x_r, handle=h, topk_weights=w,
                                                  bias=b, aborted=aborted),
            x=x, handle=handle, topk_weights=topk_weights, bias=bias)
    comm.start_call()
    parity, epoch = comm.next_normal_parity(), comm.next_epoch()
    call_row = signature.of_combine(x=x, topk_weights=topk_weights, handle=handle,
                                    aborted=aborted)
    matrix, send_ids = handle.count_matrix, handle.send_token_ids
    hidden, dtype = x.shape[1], x.dtype
    x_bytes = x.view(torch.uint8)
    row_bytes = x_bytes.shape[1]
    topk = 0 if topk_weights is None else topk_weights.shape[1]
    # a small combine (small.py): every pair in an eager slot, in C; else what it sent stands
    call_parity = small.start_combine(comm, epoch, parity, call_row, matrix, x, topk_weights) \
        if not aborted and small.usable(comm) else None
    if call_parity is not None:
        if small.combine_in_slots(comm, matrix, dtype, row_bytes, topk, bias):
            return small.receive_combine(comm, epoch, parity, handle, x, topk_weights,
                                         dtype=dtype, hidden=hidden, topk=topk, biases=bias,
                                         call_parity=call_parity, call_row=call_row)
        # the rest streamed through the slots, the owners summing from the cache (ring.py)
        if ring.usable(comm, dtype, row_bytes, topk):
            return ring.combine(comm, epoch, parity, handle, x, topk_weights, dtype=dtype,
                                hidden=hidden, topk=topk, biases=bias, call_parity=call_parity,
                                call_row=call_row)
    sent_rows = matrix.sum(1)
    # the rows come back to their owners: expert rank d sends owner o matrix[o, d] rows
    plan = RoundPlan(matrix.T, [int(n) for n in sent_rows], [stream_chunk_rows(
        int(sent_rows[o]), row_bytes, 0, topk, comm.heap_bytes) for o in range(R)])

    def slab(o):            # the staging region owner o receives into, each round
        return SlabLayout(plan.chunk[o], row_bytes, 0, topk)

    # too small: granted nothing but gone through with the others (see dispatch)
    refuse = _row_error(comm, "combine", plan, lambda n: SlabLayout(n, row_bytes, 0, topk))
    epochs = plan.epochs(comm, epoch, refuse is not None)
    mine = slab(me)

    def put_back(owner, base, lay, local, src0, c):
        """My rows ``[src0, src0 + c)`` (received order) as rows ``local..`` of ``lay``; none
        to myself: _reduce reads those from x (a copy less, about 1/R of the bytes)."""
        if owner == me:
            return
        heap, o = comm.peer_heap(owner), lay.offsets
        at = base + o[0] + local * row_bytes
        dst, src = heap[at:at + c * row_bytes].view(c, row_bytes), x_bytes[src0:src0 + c]
        # a large return with non-temporal stores (5-8% faster combines on 2 and 4 ranks,
        # 1024 x 7168, calls alternating with plain copies); small ones stay in the cache
        if c * row_bytes < native.STREAM_MIN_BYTES or not native.copy_stream(dst, src):
            dst.copy_(src)
        comm.commit(owner, "heap", at, c * row_bytes)
        if topk:
            at = base + o[3] + local * topk * 4
            heap[at:at + c * topk * 4].view(torch.float32).view(c, topk).copy_(
                topk_weights[src0:src0 + c])
            comm.commit(owner, "heap", at, c * topk * 4)

    def write_round(r):
        def write(owner, owner_page):
            first, last, local = plan.part(me, owner, r)
            # my received rows from `owner` start at src0; these are `first - row0` further
            src0 = int(matrix[:owner, me].sum()) + first - int(plan.row0[me, owner])
            put_back(owner, owner_page * PAGE, slab(owner), local, src0, last - first)
        return write

    # rows that fit an eager slot go first, without a grant (eager.py); then the signature
    eagerly = eager.pairs(comm, matrix.T, row_bytes, 0, topk,
                          comm.eager_slot > 0 and _relays(comm) is None,
                          "combine")    # [expert, owner]
    def write_eagerly(o, base):
        lay = SlabLayout(int(matrix[o, me]), row_bytes, 0, topk)
        put_back(o, base, lay, 0, int(matrix[:o, me].sum()), int(matrix[o, me]))
        return lay.nbytes

    if call_parity is not None:             # (small.py sent it)
        calls = small.call_views(comm, call_parity)
    else:
        eager.send(comm, epoch, parity, [o for o in _rotation(me, R)
                                         if eagerly[me, o] and comm.active[o]], write_eagerly)
        calls = comm.post_call(epoch, call_row)     # checked along the payload phase
    # (by the handle's relays even when this rank knows one of them masked since: whether a
    # call goes by relays must not depend on masks, which may differ between ranks until
    # the call's agreement; relay.RelayLost then sends every survivor flat alike)
    if handle.relay is not None and _relays(comm) is not None and \
            handle.relay.combine_fits_for(row_bytes, topk):
        try:
            return relay.combine(comm, epoch, handle, x=x, topk_weights=topk_weights,
                                 bias=bias, calls=calls, call_row=call_row)
        except relay.RelayLost:       # every survivor: again, flat (x keeps the handle's rows)
            handle.relay = None       # (all alike) later calls on it go flat at once
            return combine(comm, x=x, handle=handle,
                           topk_weights=topk_weights, bias=bias)
    streamed, n_rows = plan.streams(me), plan.rows_at[me]
    if streamed:                      # the rows pass through the heap into tensors of their own
        rows_all = torch.empty(n_rows, row_bytes, dtype=torch.uint8)
        weights_all = torch.empty(n_rows, topk, dtype=torch.float32) if topk else None
    result = None
    own = _own_rows(x, topk_weights, matrix[:, me], me)
    in_slots = [d for d in range(R) if eagerly[d, me] and comm.active[d]]
    widths = [(row_bytes, 1, torch.uint8), (0, 4, torch.float32), (topk, 8, torch.int64),
              (topk, 4, torch.float32)]

    def take_eager(rows, weights):    # the eager rows, into their place by expert rank
        for d in in_slots:
            if comm.active[d] and d != me:    # (my own slot holds nothing: put_back)
                eager.copy_out(comm, parity, d, SlabLayout(int(matrix[me, d]), row_bytes, 0,
                                                           topk),
                               [rows, None, None, weights], int(plan.row0[d, me]), widths)

    # the payload phase in one C call (granted.py): one round, begun in C (small.py)
    in_c = (call_parity is not None and refuse is None and plan.rounds == 1 and
            _c_rows(topk_weights, torch.float32))
    failure = None                    # a round's error: the rest of the rounds still run
    for r, ep in enumerate(epochs):   # every round, also those that bring this rank nothing
        if r:
            comm.refresh_deadline()
        experts = [d for d in plan.sources(me, r) if comm.active[d] and not eagerly[d, me]]
        lo, hi = plan.span(me, r)
        page, own_error = (grant(comm, ep, mine.nbytes, "combine", experts,
                                 refuse if r == 0 else failure)
                           if r == 0 or hi > lo else (None, None))
        owners = [o for o in plan.dests(me, r) if comm.active[o] and not eagerly[me, o]]
        sizes = {d: SlabLayout(int(matrix[me, d]), row_bytes, 0, topk).nbytes
                 for d in in_slots}
        try:
            if in_c:                  # the payload phase in one C call (granted.py)
                granted.combine(comm, ep, parity, page=page, own_error=own_error, plan=plan,
                                dests=owners, sources=experts, in_slots=in_slots, sizes=sizes,
                                x=x, topk_weights=topk_weights, calls=calls,
                                call_row=call_row, write=write_round(r),
                                need=lambda owner: slab(owner).nbytes)
            else:
                _exchange(comm, ep, "combine", page=page, own_error=own_error,
                          write=write_round(r), need=lambda owner: slab(owner).nbytes,
                          calls=calls if r == 0 else None, call_row=call_row,
                          sources=experts, dests=owners,
                          flags=eager.flags(comm, parity, in_slots) if r == 0 else None,
                          sizes=sizes)
        except Exception as e:
            if not keeps_in_step(e):
                raise
            failure = failure or e
            continue
        if page is None:
            continue
        if failure is not None:
            comm.heap.free(page)
            continue
        staging = torch.from_numpy(comm.heap.view(page, mine.nbytes))
        o = mine.offsets
        rows = staging[o[0]:o[0] + (hi - lo) * row_bytes].view(hi - lo, row_bytes)
        weights = staging[o[3]:o[3] + (hi - lo) * topk * 4].view(torch.float32).view(
            hi - lo, topk) if topk else None
        try:
            if not streamed:          # one round: reduce straight from the staging region
                take_eager(rows, weights)
                result = _reduce(comm, rows.view(dtype).view(hi - lo, hidden), weights,
                                 matrix[me], send_ids, handle.num_tokens, bias, own)
            else:
                rows_all[lo:hi] = rows
                if topk:
                    weights_all[lo:hi] = weights
        finally:
            comm.heap.free(page)
    if failure is not None:
        raise failure
    if streamed:
        take_eager(rows_all, weights_all)
        result = _reduce(comm, rows_all.view(dtype).view(n_rows, hidden), weights_all,
                         matrix[me], send_ids, handle.num_tokens, bias, own)
    return result


def _own_rows(x, topk_weights, received, me):
    """The rows (and weights) this rank returns to itself, where x holds them: the rows it
    received from itself in the dispatch (``received[s]`` from each source s, by source)."""
    at = int(received[:me].sum())
    end = at + int(received[me])
    return x[at:end], None if topk_weights is None else topk_weights[at:end].float()


def _reduce(comm, rows, weights, counts, send_ids, num_tokens, bias, own):
    """Per-token sums of the rows this rank got back (``rows`` [n, H], grouped by expert rank,
    ``counts[d]`` each; ``weights`` [n, K] or None) over the active ranks, plus ``bias``; its
    own rows and weights from ``own`` (_own_rows), not from ``rows``, as nothing copied them
    there. Returns ``(combined_x, combined_topk_weights or None)``."""
    bounds = np.concatenate([[0], np.cumsum(counts)])
    live = [d for d in range(comm.num_ranks) if comm.active[d]]
    me = comm.rank

    def part(d, t, mine):
        return mine if d == me else t[bounds[d]:bounds[d + 1]]

    segments = [part(d, rows, own[0]) for d in live]
    ids = [send_ids[d] for d in live]
    out, = outputs(comm.outputs, "combine", [(num_tokens, rows.shape[1], rows.dtype)],
                   comm.poison)
    out = sum_rows_per_token(segments, ids, num_tokens, rows.dtype, bias, out=out)
    combined_w = None
    if weights is not None:
        combined_w = torch.zeros(num_tokens, weights.shape[1], dtype=torch.float32)
        for d in live:
            combined_w.index_add_(0, send_ids[d], part(d, weights, own[1]))
    return out, combined_w


def _relays(comm):
    """The host's relays (relay.py) when calls may go hierarchical: a group on several hosts
    with MOE_COMM_RELAY on; else None (the flat protocol). It depends on nothing that changes
    between calls, so every rank sizes its count row and decides on eager slots alike before
    the notify; the relays of a call are then picked among the ranks the notify agreement
    kept (Relays.among), and a call that loses one of them mid-call is redone flat
    (relay.RelayLost)."""
    return comm.relays


def _rotation(me: int, R: int):
    """Peers starting after ``me``: spreads the first writes of all ranks over all peers."""
    return [(me + 1 + i) % R for i in range(R)]
