"""Who relays for whom in a group spread over hosts (hierarchical normal mode, #16), for
both backends (moe_comm/host/relay.py, moe_comm/cuda/relay.py).

The relay of sender ``s`` on host ``H`` (not its own) is the active rank of ``H`` with ``s``'s
local index, modulo ``H``'s active rank count: DeepEP's choice of the GPU with the same index,
so each (host pair, local index) is one rail and a host's relays share its senders evenly.
Pure geometry from the host index of every rank and the active mask, so every rank that holds
the same mask derives the same choice.
"""
from __future__ import annotations

import numpy as np


class Relays:
    """Who relays for whom, seen from ``rank``: ``host_of[r]`` the host index of rank r
    (hosts numbered 0..H-1) and the ranks still active (built once per communicator, then
    once per mask: :meth:`among`)."""

    def __init__(self, host_of, rank: int, active=None):
        host_of = [int(h) for h in host_of]
        R = len(host_of)
        self.rank, self.host_of = rank, host_of
        self.active = np.ones(R, bool) if active is None else np.array(active, bool)
        self.num_hosts = max(host_of) + 1
        self.ranks_on = [[r for r in range(R) if host_of[r] == h] for h in range(self.num_hosts)]
        self.local_index = [self.ranks_on[h].index(r) for r, h in enumerate(host_of)]
        # relays are picked among a host's active ranks; a host with none gets nothing (its
        # ranks' tokens are masked anyway). Mask columns stay one per rank of the host.
        self.active_on = [[r for r in ranks if self.active[r]] for ranks in self.ranks_on]
        self.mask_cols = max(len(ranks) for ranks in self.ranks_on)   # one byte per rank
        self.local = self.ranks_on[host_of[rank]]
        # relayed[f]: the active ranks of other hosts whose tokens rank f relays onto its host
        self.relayed = [[s for s in range(R) if self.active[s] and host_of[s] != host_of[f]
                         and self.relay(s, host_of[f]) == f] for f in range(R)]
        self._among = {}

    def relay(self, s: int, host: int):
        """The relay of rank s on ``host``: the host's active rank with s's local index,
        modulo their count (None when the host has no active rank)."""
        ranks = self.active_on[host]
        return ranks[self.local_index[s] % len(ranks)] if ranks else None

    def among(self, active) -> Relays:
        """These relays chosen among the ranks ``active`` (bool [R]) marks: every rank that
        holds the same mask derives the same choice."""
        active = np.asarray(active, bool)
        if np.array_equal(active, self.active):
            return self
        key = active.tobytes()
        if key not in self._among:
            self._among[key] = Relays(self.host_of, self.rank, active)
        return self._among[key]

    def serve(self, active) -> bool:
        """Whether every rank these relays were chosen among is still active."""
        return not (self.active & ~np.asarray(active, bool)).any()

    def rows_per_host(self, matrix: np.ndarray) -> np.ndarray:
        """[R, hosts]: rows each rank sends to the ranks of each host (sum over ranks)."""
        out = np.zeros((matrix.shape[0], self.num_hosts), np.int64)
        np.add.at(out.T, self.host_of, matrix.T)
        return out
