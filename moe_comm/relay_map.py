"""Who relays for whom in a group spread over hosts (hierarchical normal mode, #16).

The relay of sender ``s`` on host ``H`` (not its own) is the rank of ``H`` with ``s``'s local
index, modulo ``H``'s rank count: DeepEP's choice of the GPU with the same index, so each
(host pair, local index) is one rail and a host's relays share its senders evenly. Pure
geometry from the host index of every rank, for the CUDA backend's relays
(moe_comm/cuda/relay.py); moe_comm/host/relay.py's ``Relays`` follows the same rule.
"""
from __future__ import annotations


class Relays:
    """The relay map of a group seen from ``rank``: ``host_of[r]`` host index of rank r
    (hosts numbered 0..H-1)."""

    def __init__(self, host_of, rank: int):
        R = len(host_of)
        self.rank, self.host_of = rank, [int(h) for h in host_of]
        self.num_hosts = max(self.host_of) + 1
        # ranks_on[h]: host h's ranks in rank order (their local indices are the positions)
        self.ranks_on = [[r for r in range(R) if self.host_of[r] == h]
                         for h in range(self.num_hosts)]
        self.local_index = [self.ranks_on[h].index(r) for r, h in enumerate(self.host_of)]
        self.mask_cols = max(len(ranks) for ranks in self.ranks_on)   # one byte per rank
        self.local = self.ranks_on[self.host_of[rank]]
        # relayed[f]: the ranks of other hosts whose tokens rank f relays onto its host
        self.relayed = [[s for s in range(R) if self.host_of[s] != self.host_of[f]
                         and self.relay(s, self.host_of[f]) == f] for f in range(R)]

    def relay(self, s: int, host: int) -> int:
        """The rank of ``host`` that relays sender ``s``'s tokens there."""
        ranks = self.ranks_on[host]
        return ranks[self.local_index[s] % len(ranks)]
