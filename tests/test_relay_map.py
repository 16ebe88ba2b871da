"""The CUDA backend's relay map (moe_comm/relay_map.py) follows the host backend's rule
(moe_comm/host/relay.py): the same relay for every (sender, host), on even, uneven and
interleaved host layouts, so both backends put a token on the same rail."""
from __future__ import annotations

import pytest

from moe_comm.host.relay import Relays as HostRelays
from moe_comm.relay_map import Relays


@pytest.mark.parametrize("host_of", [[0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 1, 0, 1, 2, 2],
                                     [0, 1, 2], [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4])
def test_same_relays_as_the_host_backend(host_of):
    for rank in range(len(host_of)):
        mine, theirs = Relays(host_of, rank), HostRelays(host_of, rank)
        assert (mine.ranks_on, mine.local, mine.relayed, mine.mask_cols, mine.local_index) == \
            (theirs.ranks_on, theirs.local, theirs.relayed, theirs.mask_cols, theirs.local_index)
        for s in range(len(host_of)):
            for h in range(mine.num_hosts):
                assert mine.relay(s, h) == theirs.relay(s, h)


def test_relays_of_an_uneven_host_wrap_around():
    r = Relays([0, 0, 0, 1], 3)
    assert [r.relay(s, 1) for s in range(3)] == [3, 3, 3]      # one rank takes all three
    assert r.relayed[3] == [0, 1, 2] and r.relayed[0] == [3]
