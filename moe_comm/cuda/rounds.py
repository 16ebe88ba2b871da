"""Token rounds on the CUDA backend: a relayed dispatch too large for one copy, as relayed calls.

moe_comm/token_rounds.py says why and holds the arithmetic both backends share; this module is
the CUDA backend's part. After the whole call's notify every rank holds the count matrix, each
rank's token count per host and its token count (the relayed notify's last word,
normal.py), so every rank picks the same ``chunk``: the most tokens per rank whose relayed call
(counts capped at ``chunk``: token_rounds.capped) fits the data region in one copy, dispatch
and its combine (:func:`chunk_for`). Round r is then a complete relayed dispatch of its own
(notify included; normal.dispatch with ``round_index``: it cannot go into rounds itself) over
tokens [r * chunk, (r + 1) * chunk) of every rank, and its output rows are copied into the whole
call's outputs at the rows the one-copy call would have used (token_rounds.RowPlacer). A round
that does not fit after all goes flat inside normal.dispatch, and a round that loses a relay is
redone flat there: correct either way.

Elastic groups: a rank dropped mid-operation costs the slabs it may still write until the
Buffer is rebuilt (normal.cuh Group floors), and a round fills its data region, so an elastic
call's rounds use at most half of what is left past the floors (:meth:`Planner.rooms`); after a
round whose agreement dropped a rank, every survivor picks the chunk of the rounds left again,
by relays among the survivors in the room left (:func:`_replan`; the same mask and floors on
every survivor).

The whole call's handle is the one-copy call's (count matrix, rank prefix matrix, layout: a
DeepEP-style client sees the same thing) plus :class:`TokenRounds`; a combine or a cached
dispatch on it runs one call per round with the round's handle (:func:`combine`,
:func:`cached_dispatch`). Rows of a source masked before all its rows arrived are padded as the
one-copy call pads them (x 0, ids -1, weights 0).

num_worst_tokens calls never come here: the host does not read their counts (no
synchronisation), and DeepEP refuses num_worst_tokens across hosts anyway; they stay flat.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from .. import token_rounds
from ..layout import DispatchLayout
from . import relay


@dataclass(frozen=True)
class Round:
    """One round of a call in token rounds: this rank's tokens [lo, hi), the round's own
    handle, and where its received rows lie in the whole call's output (int64, device)."""

    lo: int
    hi: int
    handle: object
    rows: torch.Tensor


@dataclass(frozen=True)
class TokenRounds:
    """The rounds of one dispatch (on its handle: ``CudaDispatchHandle.rounds``) and the
    output rows no round placed (sources masked before all their rows arrived: padded)."""

    rounds: tuple
    unplaced: torch.Tensor


def combine_row_bytes(hidden: int, dtype: torch.dtype) -> int:
    """The bytes of a row the dispatch's combine is assumed to return, for its fit test: the
    payload dtype's, at least 2 bytes a value (an fp8 dispatch's experts return bf16). A
    combine in a wider dtype that does not fit a round goes flat in that round (correct)."""
    return hidden * max(2, torch.empty(0, dtype=dtype).element_size())


def _fits(topo, matrix, host_matrix, room, row_bytes, scale_cols, topk, back_row_bytes,
          chunk: int) -> bool:
    """Whether a relayed call whose counts are at most ``chunk`` tokens per rank (every
    round's, token_rounds.capped) fits ``room`` (bytes per rank) in one copy, dispatch and
    combine."""
    routes = relay.Routes(topo, token_rounds.capped(matrix, chunk),
                          token_rounds.capped(host_matrix, chunk), None, None)
    return (relay.dispatch_fits(routes, room, row_bytes, scale_cols, topk) and
            relay.combine_fits(routes, room, back_row_bytes, topk))


def chunk_for(topo, matrix: np.ndarray, host_matrix: np.ndarray, tokens: np.ndarray, room,
              round_room, row_bytes: int, scale_cols: int, topk: int,
              back_row_bytes: int) -> int:
    """Tokens per rank and round of a relayed call whose ranks hold ``tokens`` (the same on
    every rank: only what the notify told everyone): 0 when the one-copy call fits ``room``
    (no rounds), or when not even one token a round fits ``round_room``; else the largest
    chunk that does, below the most tokens of a rank (so at least two rounds)."""
    sizes = (row_bytes, scale_cols, topk, back_row_bytes)
    most = int(np.max(tokens)) if len(tokens) else 0
    # capped at the most tokens of a rank = the whole call's counts
    if _fits(topo, matrix, host_matrix, room, *sizes, most):
        return 0
    fits = partial(_fits, topo, matrix, host_matrix, round_room, *sizes)
    return token_rounds.largest_chunk(fits, most - 1)


class Planner:
    """What the whole call's notify told every rank (count matrix, tokens per host, tokens
    per rank) and the row sizes, to pick the chunk alike on every rank: at the start, and
    again after a round in which an elastic group dropped a rank (other relays, and less
    room: the dropped rank's slabs stay abandoned, normal.cuh Group floors)."""

    def __init__(self, comm, matrix, host_matrix, tokens, row_bytes, scale_cols, topk,
                 back_row_bytes):
        self.comm, self.matrix, self.host_matrix = comm, matrix, host_matrix
        self.tokens = np.asarray(tokens, np.int64)
        self.sizes = (row_bytes, scale_cols, topk, back_row_bytes)

    def rooms(self):
        """(bytes per rank a one-copy call may use, bytes per rank a round may use): the data
        region (past the floors in an elastic group), and for a round, in an elastic group,
        half of it, so that a rank dropped mid-round, which costs the slabs it may still
        write (up to the round's whole use), leaves the other half to the rounds after it
        and to later calls."""
        room = relay.capacity(self.comm)
        return room, room if self.comm.floors is None else room // 2

    def most(self, start: int) -> int:
        """The most tokens a rank has left from token ``start`` on."""
        return int(np.clip(self.tokens - start, 0, None).max(initial=0))

    def chunk(self, topo, start: int) -> int:
        """The chunk of the rounds from token ``start`` on (0: the rest fits one relayed call,
        or not even one token a round does)."""
        return chunk_for(topo, self.matrix, self.host_matrix,
                         np.clip(self.tokens - start, 0, None), *self.rooms(), *self.sizes)


def round_layout(in_rank: torch.Tensor, lo: int, hi: int) -> DispatchLayout:
    """The layout of tokens [lo, hi) from the whole call's (masked) ``in_rank`` [T, R]: each
    token's row among the round's tokens for each rank (-1: not sent), no kernel."""
    part = in_rank[lo:hi]
    pos = part.cumsum(0, dtype=torch.int32) - 1
    send_pos = torch.where(part, pos, torch.full_like(pos, -1)).contiguous()
    return DispatchLayout(part.sum(0, dtype=torch.int32), None, part.contiguous(), send_pos)


def _part(t, lo: int, hi: int):
    return None if t is None else t[lo:hi]


def _round_args(args: dict, lo: int, hi: int) -> dict:
    """The whole call's dispatch arguments for its tokens [lo, hi)."""
    out = dict(args)
    for name in ("x_bytes", "scales", "topk_idx", "topk_weights"):
        out[name] = _part(args.get(name), lo, hi)
    return out


def _empty_like_rows(got: tuple, rows: int) -> list:
    """Whole-call outputs shaped like one round's (None stays None), ``rows`` rows each."""
    return [None if t is None else t.new_empty((rows,) + tuple(t.shape[1:])) for t in got]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A row-major output as bytes (fp8 rows included, which index_copy_ may not take)."""
    return t.view(torch.uint8)


def _place(outs: list, got: tuple, rows: torch.Tensor) -> None:
    for out, t in zip(outs, got):
        if out is not None and len(rows):
            _bytes(out).index_copy_(0, rows, _bytes(t))


def _pad(outs: list, rows: torch.Tensor) -> None:
    """The one-copy call's padding of a masked source's rows: x 0, scales 0, ids -1 (all
    bytes 0xFF), weights 0 (outputs in dispatch's order: x, scales, ids, weights)."""
    if not len(rows):
        return
    for i, out in enumerate(outs):
        if out is not None:
            _bytes(out).index_fill_(0, rows, 0xFF if i == 2 else 0)


def dispatch(run, comm, args: dict, in_rank: torch.Tensor, planner: Planner, chunk: int):
    """The whole call in rounds, ``chunk`` tokens per rank at first: ``run`` is
    normal.dispatch, ``args`` its keyword arguments for the whole call (without layout,
    handle, num_worst_tokens). Returns ``((recv_x, recv_scales, recv_idx, recv_w),
    expert_counts, TokenRounds)``, outputs in the one-copy call's row order."""
    me, dev = comm.rank, comm.device
    num_tokens = args["x_bytes"].shape[0]
    placer = token_rounds.RowPlacer(planner.matrix[:, me])
    outs, counts, rounds, start = None, None, [], 0
    mask = relay.current_mask(comm) if comm.elastic else None
    while start < planner.most(0):
        lo, hi = min(start, num_tokens), min(start + chunk, num_tokens)
        *got, handle = run(comm, **_round_args(args, lo, hi),
                           layout=round_layout(in_rank, lo, hi), handle=None,
                           num_worst_tokens=0, round_index=len(rounds))
        # raises, rather than place rows wrong, if a round got more than the notify counted
        rows = placer.next_round(handle.count_matrix[:, me]).to(dev)
        if outs is None:
            outs = _empty_like_rows(got, int(placer.total.sum()))
        _place(outs, got, rows)
        if handle.recv_expert_counts is not None:
            counts = handle.recv_expert_counts.clone() if counts is None else \
                counts + handle.recv_expert_counts
        rounds.append(Round(lo, hi, handle, rows))
        del got               # this round's received rows: only the whole call's copy stays
        start += chunk
        if comm.elastic and start < planner.most(0):
            chunk, mask = _replan(comm, planner, start, chunk, mask)
    unplaced = placer.unplaced().to(dev)
    _pad(outs, unplaced)
    return tuple(outs), counts, TokenRounds(tuple(rounds), unplaced)


def _replan(comm, planner: Planner, start: int, chunk: int, mask):
    """Elastic: after a round that dropped a rank (the agreed mask, the same on every
    survivor), the chunk of the rounds left, by relays among the survivors in the room left.
    Returns (chunk, mask)."""
    now = relay.current_mask(comm)
    if np.array_equal(now, mask):
        return chunk, mask
    # 0: the rest fits one round, or not even a token does (that round then goes flat)
    return planner.chunk(relay.topology(comm, now), start) or planner.most(start), now


def cached_dispatch(run, comm, plan: TokenRounds, args: dict, rows_out: int):
    """A cached dispatch on a handle in rounds: per round, a cached dispatch with the round's
    handle, its rows placed as the fresh dispatch placed them. Returns (recv_x,
    recv_scales)."""
    outs = None
    for rd in plan.rounds:
        got = run(comm, **_round_args(args, rd.lo, rd.hi), layout=None, handle=rd.handle,
                  num_worst_tokens=0)[:2]
        if outs is None:
            outs = _empty_like_rows(got, rows_out)
        _place(outs, got, rd.rows)
    _pad(outs, plan.unplaced)
    return tuple(outs)


def combine(run, comm, plan: TokenRounds, *, x: torch.Tensor, topk_weights, bias,
            num_tokens: int, num_sms: int):
    """A combine on a handle in rounds: per round, the round's rows of ``x`` (and of
    ``topk_weights``) combined with the round's handle give its tokens' results (``bias``
    sliced likewise). ``run`` is normal.combine. Returns (combined_x [T, H], weights or
    None)."""
    out = x.new_empty(num_tokens, x.shape[1])
    w_out = None
    for rd in plan.rounds:
        w = None if topk_weights is None else topk_weights.index_select(0, rd.rows)
        got_x, got_w = run(comm, x=x.index_select(0, rd.rows), handle=rd.handle,
                           topk_weights=w, bias=tuple(b[rd.lo:rd.hi] for b in bias or ()),
                           num_sms=num_sms)
        out[rd.lo:rd.hi] = got_x
        if got_w is not None:
            if w_out is None:
                w_out = got_w.new_empty(num_tokens, got_w.shape[1])
            w_out[rd.lo:rd.hi] = got_w
    return out, w_out
