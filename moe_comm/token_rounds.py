"""Token rounds: a hierarchical normal call that does not fit the buffer, by relays still.

A relayed call (moe_comm/relay_map.py; host/relay.py, cuda/relay.py) needs each rank's whole
output region and its staging regions in the buffer at once. When they do not fit, the call
runs as *token rounds*: round ``r`` is a relayed call of its own (notify, stage, forward;
combine mirrors it) over tokens ``[r * chunk, (r + 1) * chunk)`` of every rank, so each
token still crosses to each destination host once, and the buffer only ever holds one
round. Each round's output rows (by source, then token, as every dispatch orders them) are
moved into the whole call's output at the rows the one-copy call would have used; a combine
gathers a round's rows back from the expert output in the same order, and its result is the
round's tokens' result (every token is in exactly one round).

Every rank derives ``chunk`` and the number of rounds alike from what the whole call's notify
told every rank (count matrix, tokens per host, tokens and free buffer per rank): a round's
counts are at most ``min(count, chunk)``, so a chunk whose capped counts fit fits every round.
The backends own the fit test and the rounds' calls; this module holds the arithmetic both
share.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch


def largest_chunk(fits: Callable[[int], bool], most: int) -> int:
    """The largest token count ``c`` in ``[1, most]`` with ``fits(c)`` (``fits`` must be
    monotone: true up to some count, false above), or 0 when not even one token fits."""
    lo, hi = 0, int(most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def capped(counts: np.ndarray, chunk: int) -> np.ndarray:
    """An upper bound of any round's counts: a round holds at most ``chunk`` tokens of each
    rank, so at most that many of them go to any one rank or host."""
    return np.minimum(counts, chunk)


def num_rounds(tokens_per_rank, chunk: int) -> int:
    """Rounds for every rank to send all its tokens, ``chunk`` per round (at least one)."""
    most = int(np.max(tokens_per_rank)) if len(tokens_per_rank) else 0
    return max(1, -(-most // chunk))


def token_span(r: int, chunk: int, num_tokens: int) -> tuple:
    """This rank's tokens ``[lo, hi)`` in round ``r`` (empty once they run out)."""
    return min(r * chunk, num_tokens), min((r + 1) * chunk, num_tokens)


class RowPlacer:
    """Where each round's received rows go in the whole call's output, for one receiver:
    ``row0[s]`` the first output row of source s (the one-copy call's order), and how many of
    s's rows earlier rounds placed."""

    def __init__(self, counts_in: np.ndarray):
        counts_in = np.asarray(counts_in, np.int64)
        self.row0 = np.cumsum(counts_in) - counts_in
        self.total = counts_in.copy()
        self.done = np.zeros_like(counts_in)

    def next_round(self, round_counts_in: np.ndarray) -> torch.Tensor:
        """The output rows of one round's received rows (``round_counts_in[s]`` from source
        s, grouped by source, each source's in token order); the next round goes after."""
        round_counts_in = np.asarray(round_counts_in, np.int64)
        if (self.done + round_counts_in > self.total).any():
            raise RuntimeError("token rounds: a round received more rows from a source than "
                               "the whole call's notify counted")
        parts = [np.arange(a, a + n) for a, n in
                 zip(self.row0 + self.done, round_counts_in) if n]
        self.done += round_counts_in
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    def unplaced(self) -> torch.Tensor:
        """The output rows no round placed (int64, ascending): the rows of sources that were
        masked before all their rows arrived, which a backend pads or drops as its one-copy
        call does."""
        parts = [np.arange(a + d, a + t) for a, d, t in zip(self.row0, self.done, self.total)
                 if t > d]
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    def complete(self, active=None) -> bool:
        """Whether every (active) source's rows were all placed."""
        keep = slice(None) if active is None else np.asarray(active, bool)
        return bool((self.done[keep] == self.total[keep]).all())
