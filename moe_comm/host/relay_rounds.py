"""Token rounds on the host backend: a hierarchical call too big for the heap, by relays still.

A relayed call (relay.py) holds every rank's output and staging regions in its heap at once;
when they do not fit, normal.py used to stream the call flat, crossing the host links once
per destination rank. Instead the call now runs as token rounds (moe_comm/token_rounds.py):
round r is a relayed dispatch of its own (notify, stage, forward) over tokens
``[r * chunk, (r + 1) * chunk)`` of every rank, its rows moved out of the heap into the whole
call's output at the rows a one-copy call would have used, so the heap holds one round at a
time and each token crosses to each other host once. The whole call's handle keeps the
rounds: a combine runs one relayed combine per round (a round's rows gathered from the
expert output; its result is that round's tokens'), a cached dispatch one cached dispatch per
round.

A round is a complete call: it has its own deadline and agreement, a round that loses a relay
is redone flat on its own (relay.RelayLost), and the rows of a source masked by the end are
dropped from the whole output as the one-copy call drops them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..errors import CallMismatchError, RoundFailed
from ..handle import DispatchHandle
from ..layout import DispatchLayout
from ..token_rounds import RowPlacer, capped, largest_chunk, num_rounds, token_span
from . import relay
from .exchange import keeps_in_step


@dataclass(eq=False)
class Round:
    """One round of a whole call, as this rank sees it: its tokens ``[lo, hi)``, the round's
    own handle, and the rows of the whole call's output its received rows went to."""

    lo: int
    hi: int
    handle: DispatchHandle
    rows: torch.Tensor


def plan(relays, matrix, host_counts, tokens, row_bytes, scale_cols, topk, free_bytes,
         combine_row_bytes):
    """``(chunk, rounds)`` of a call whose relayed regions do not fit in one copy: the most
    tokens per rank a round can carry so that any round's dispatch and its combine fit every
    active rank's free heap (relay.fits on the counts capped at the chunk), or None when not
    even one token does. Only from what the notify told every rank: the same everywhere."""
    R = len(matrix)

    def fits(c):
        m = capped(matrix, c)
        routes = relay.Routes(relays, m, capped(host_counts, c))
        return relay.fits(routes, R, [int(n) for n in m.sum(0)], row_bytes, scale_cols, topk,
                          free_bytes, combine_row_bytes, output_held=False) and \
            routes.combine_fits

    live = np.asarray(tokens)[relays.active]
    chunk = largest_chunk(fits, int(live.max()) if len(live) else 0)
    return (chunk, num_rounds(live, chunk)) if chunk else None


def dispatch(comm, one_round, counts_in, rows_out: int, widths, wanted, num_tokens: int,
             spans):
    """Run the rounds (:func:`in_step`): ``one_round(lo, hi, r, aborted)`` dispatches tokens
    ``[lo, hi)`` and returns
    ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, handle)`` of that round;
    ``spans``: the rounds' token spans. Returns the whole output (``rows_out`` rows, by
    source then token as ``counts_in[s]`` rows of each source fix it) and the rounds."""
    me = comm.rank
    placer = RowPlacer(counts_in)
    recv = [torch.empty(rows_out, w, dtype=dt) if want else None
            for (w, _, dt), want in zip(widths, wanted)]
    rounds = []

    def place(r, got):
        *got, sub = got
        rows = placer.next_round(sub.count_matrix[:, me])
        for out, part in zip(recv, got):
            if out is not None:
                out[rows] = part[:len(rows)].view(out.dtype).view(len(rows), out.shape[1])
        rounds.append(Round(*spans[r], sub, rows))

    in_step(len(spans), "dispatch", lambda r, aborted: one_round(*spans[r], r, aborted), place)
    if not placer.complete(comm.active):
        raise RuntimeError(f"dispatch: token rounds brought rank {me} "
                           f"{placer.done.tolist()} rows by source, the notify counted "
                           f"{placer.total.tolist()}")
    return recv, rounds


def in_step(count: int, op: str, one_round, use) -> None:
    """Run rounds ``r = 0..count-1``, ``use(r, one_round(r, aborted))``, in step with every
    rank: a round that fails on some ranks only (a capacity or consistency outcome,
    exchange.keeps_in_step) must not leave the others in the next round alone. So a rank
    whose round failed runs the next one ``aborted`` (signature.CALLS "round after a failed
    one"): its signature differs, every rank raises there before any payload moves - it its
    own error, the others RoundFailed - and the group stays in step. A failure in the last
    round ends the call as a one-round call's would. Deadlines and masks end it at once."""
    failure = None
    for r in range(count):
        try:
            got = one_round(r, failure is not None)
        except CallMismatchError as e:
            if failure is not None:
                raise failure from None
            raise RoundFailed(f"{op}: a round of token rounds failed on another rank ({e}); "
                              "nothing of the next one moved") from e
        except Exception as e:
            if failure is not None or not keeps_in_step(e) or r == count - 1:
                raise
            failure = e
            continue
        if failure is not None:            # every rank's round before failed: all raise
            raise failure
        use(r, got)
        got = None              # the round's heap region goes back before the next round


def spans_of(chunk: int, rounds: int, num_tokens: int) -> list:
    return [token_span(r, chunk, num_tokens) for r in range(rounds)]


def round_layout(in_rank: torch.Tensor) -> DispatchLayout:
    """The layout of one round's tokens (their rows of the whole call's ``in_rank``)."""
    return DispatchLayout(per_rank=in_rank.sum(0, dtype=torch.int32), per_expert=None,
                          in_rank=in_rank)


def survivors(rounds: list, kept: torch.Tensor, total: int, active, me: int) -> list:
    """The rounds once the whole output keeps only its rows ``kept`` (of ``total``: those of
    sources still active, normal.py's ``_rows_of``): each round's handle without the masked
    sources, its rows renumbered."""
    new_row = torch.full((total,), -1, dtype=torch.long)
    new_row[kept] = torch.arange(len(kept))
    out = []
    for rd in rounds:
        rows = new_row[rd.rows]
        out.append(Round(rd.lo, rd.hi, rd.handle.without_inactive(active, me), rows[rows >= 0]))
    return out


def combine(one_round, *, x, handle, topk_weights, bias):
    """Combine on a handle of token rounds: ``one_round(x, handle, topk_weights, bias,
    aborted)`` is one combine (normal.combine). Each round's rows are gathered from ``x`` and
    combined with the round's handle; the result is the round's tokens' rows of the whole
    result."""
    T, hidden = handle.num_tokens, x.shape[1]
    out = torch.empty(T, hidden, dtype=x.dtype)
    out_w = None if topk_weights is None else torch.zeros(T, topk_weights.shape[1],
                                                          dtype=torch.float32)
    rounds = handle.rounds

    def combine_round(r, aborted):        # (bias: Buffer's tuple of float32 [T, H] tensors)
        rd = rounds[r]
        return one_round(x[rd.rows], rd.handle,
                         None if topk_weights is None else topk_weights[rd.rows],
                         tuple(b[rd.lo:rd.hi] for b in bias), aborted)

    def use(r, got):
        rd = rounds[r]
        out[rd.lo:rd.hi] = got[0]
        if out_w is not None:
            out_w[rd.lo:rd.hi] = got[1]

    in_step(len(rounds), "combine", combine_round, use)
    return out, out_w


def with_rounds(handle: DispatchHandle, rounds: list) -> DispatchHandle:
    return replace(handle, relay=None, rounds=rounds)
