"""The relay rule both backends use (moe_comm/relay_map.py): the rank with the sender's local
index on each other host, wrapping on uneven hosts, picked among the active ranks only."""
from __future__ import annotations

import numpy as np
import pytest

from moe_comm.relay_map import Relays


@pytest.mark.parametrize("host_of", [[0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 1, 0, 1, 2, 2],
                                     [0, 1, 2], [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4])
def test_each_sender_has_one_relay_per_other_host_with_its_local_index(host_of):
    for rank in range(len(host_of)):
        r = Relays(host_of, rank)
        assert r.local == [q for q in range(len(host_of)) if host_of[q] == host_of[rank]]
        for s in range(len(host_of)):
            for h in range(r.num_hosts):
                ranks = r.ranks_on[h]
                assert r.relay(s, h) == ranks[r.local_index[s] % len(ranks)]
        for f in range(len(host_of)):     # relayed[f]: the other hosts' senders f serves
            assert r.relayed[f] == [s for s in range(len(host_of)) if host_of[s] != host_of[f]
                                    and r.relay(s, host_of[f]) == f]


def test_relays_of_an_uneven_host_wrap_around():
    r = Relays([0, 0, 0, 1], 3)
    assert [r.relay(s, 1) for s in range(3)] == [3, 3, 3]      # one rank takes all three
    assert r.relayed[3] == [0, 1, 2] and r.relayed[0] == [3]


def test_relays_are_picked_among_the_active_ranks():
    r = Relays([0, 0, 1, 1, 2, 2], 0)
    active = np.array([1, 1, 0, 1, 0, 0], bool)                # host 2 entirely gone
    m = r.among(active)
    assert m is r.among(active.copy())                           # one map per mask
    assert [m.relay(s, 1) for s in (0, 1)] == [3, 3]            # rank 2 out: 3 takes both
    assert m.relay(0, 2) is None                                 # no active rank there
    assert m.relayed[2] == [] and 4 not in sum(m.relayed, [])    # masked ranks relay nothing
    assert m.serve(active) and not m.serve(np.array([1, 1, 0, 0, 0, 0], bool))
    assert r.among(np.ones(6, bool)) is r and m.mask_cols == r.mask_cols == 2
