"""Logical -> physical top-k mapping: exact balance over healthy replicas, -1 handling, weights."""

import pytest
import torch

from moe_comm.eplb.mapping import active_slot_mask, map_logical_to_physical
from moe_comm.eplb.policy import rebalance_experts

# 4 logical experts on 8 slots (4 ranks x 2): expert 0 on slots 0, 2, 5; expert 1 on 1, 6;
# expert 2 on 3; expert 3 on 4, 7.
LOG2PHY = torch.tensor([[0, 2, 5], [1, 6, -1], [3, -1, -1], [4, 7, -1]])
LOGCNT = torch.tensor([3, 2, 1, 2])


def per_slot_counts(phy, P):
    return torch.bincount(phy[phy >= 0], minlength=P)


def test_exact_balance_over_replicas():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(1, 32, generator=g) ** 3
    phy2log, log2phy, logcnt = rebalance_experts(w, 48, 4, 2, 8)
    # skewed token ids: expert e drawn with probability ~ w[e]
    ids = torch.multinomial(w[0], 4000 * 6, replacement=True, generator=g).view(4000, 6)
    phy, _ = map_logical_to_physical(ids, log2phy[0], logcnt[0])
    assert torch.equal(phy2log[0][phy], ids), "every entry lands on a slot holding its expert"
    counts = per_slot_counts(phy, 48)
    for e in range(32):
        slots = log2phy[0, e, : logcnt[0, e]]
        c = counts[slots]
        assert c.sum() == (ids == e).sum()
        assert c.max() - c.min() <= 1, (e, c)


def test_deterministic_and_round_robin():
    ids = torch.tensor([[0, 1], [0, 3], [0, 1], [3, 0]])
    phy, w = map_logical_to_physical(ids, LOG2PHY, LOGCNT)
    assert w is None
    # occurrences of expert 0 in row-major order: (0,0), (1,0), (2,0), (3,1) -> slots 0, 2, 5, 0
    assert phy.tolist() == [[0, 1], [2, 4], [5, 6], [7, 0]]
    assert torch.equal(phy, map_logical_to_physical(ids.clone(), LOG2PHY, LOGCNT)[0])


def test_minus_one_and_failed_replicas():
    ids = torch.tensor([[0, -1], [2, 3], [0, 2], [-1, -1], [0, 3]])
    active = active_slot_mask(torch.tensor([1, 0, 1, 1]), 8)  # rank 1 = slots 2, 3 down
    assert active.tolist() == [True, True, False, False, True, True, True, True]
    phy, _ = map_logical_to_physical(ids, LOG2PHY, LOGCNT, phy_active=active)
    # expert 0 -> healthy replicas [0, 5]; expert 2 has none -> -1; expert 3 -> [4, 7]
    assert phy.tolist() == [[0, -1], [-1, 4], [5, -1], [-1, -1], [0, 7]]
    # an int mask works the same
    phy_int, _ = map_logical_to_physical(ids, LOG2PHY, LOGCNT, phy_active=active.long())
    assert torch.equal(phy, phy_int)


def test_weights_and_renormalize():
    ids = torch.tensor([[0, 2], [2, -1], [1, 3]])
    w = torch.tensor([[0.6, 0.4], [1.0, 0.5], [0.25, 0.25]])
    active = torch.ones(8, dtype=torch.bool)
    active[3] = False  # expert 2's only replica
    phy, out = map_logical_to_physical(ids, LOG2PHY, LOGCNT, phy_active=active, topk_weights=w)
    assert phy.tolist() == [[0, -1], [-1, -1], [1, 4]]
    assert torch.allclose(out, torch.tensor([[0.6, 0.0], [0.0, 0.5], [0.25, 0.25]]))
    phy, out = map_logical_to_physical(ids, LOG2PHY, LOGCNT, phy_active=active, topk_weights=w,
                                       renormalize=True)
    # row 0 keeps its total 1.0 on expert 0; row 1 lost its only expert -> 0 (the -1 entry is
    # left alone); row 2 is untouched
    assert torch.allclose(out, torch.tensor([[1.0, 0.0], [0.0, 0.5], [0.25, 0.25]]))
    # no failure: renormalize is the identity on valid entries
    _, same = map_logical_to_physical(ids, LOG2PHY, LOGCNT, topk_weights=w, renormalize=True)
    assert torch.allclose(same, w)


def test_all_replicas_failed_after_policy():
    w = torch.rand(1, 16) + 0.1
    active_ranks = torch.tensor([1, 1, 0, 1])
    phy2log, log2phy, logcnt = rebalance_experts(w, 24, 4, 2, 4)
    ids = torch.arange(16).repeat(10, 1)[:, :8]
    mask = active_slot_mask(active_ranks, 24)
    phy, _ = map_logical_to_physical(ids, log2phy[0], logcnt[0], phy_active=mask)
    served = (phy >= 0)
    assert (mask[phy[served]]).all(), "only healthy slots are used"
    for e in range(8):
        healthy = mask[log2phy[0, e, : logcnt[0, e]]].any()
        assert bool(served[ids == e].all()) == bool(healthy)
        assert bool((~served[ids == e]).all()) == (not bool(healthy))


def test_empty_and_validation():
    phy, out = map_logical_to_physical(torch.empty(0, 4, dtype=torch.int64), LOG2PHY, LOGCNT,
                                       topk_weights=torch.empty(0, 4), renormalize=True)
    assert phy.shape == (0, 4) and out.shape == (0, 4)
    with pytest.raises(ValueError, match="topk_idx"):
        map_logical_to_physical(torch.tensor([[4]]), LOG2PHY, LOGCNT)
    with pytest.raises(TypeError, match="topk_idx"):
        map_logical_to_physical(torch.tensor([[0.0]]), LOG2PHY, LOGCNT)
    with pytest.raises(ValueError, match="logcnt"):
        map_logical_to_physical(torch.tensor([[0]]), LOG2PHY, LOGCNT[:3])
    with pytest.raises(ValueError, match="topk_weights"):
        map_logical_to_physical(torch.tensor([[0]]), LOG2PHY, LOGCNT, topk_weights=torch.ones(2, 1))
    with pytest.raises(ValueError, match="phy_active"):
        map_logical_to_physical(torch.tensor([[0]]), LOG2PHY, LOGCNT, phy_active=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_physical_experts"):
        active_slot_mask(torch.ones(3), 8)
