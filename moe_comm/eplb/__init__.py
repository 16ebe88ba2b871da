"""Expert-parallel load balancing (EPLB) for MoE.

* :func:`rebalance_experts` decides which logical expert each physical slot holds
  (DeepSeek-EPLB-compatible output, plus failed ranks and placement stickiness).
* :func:`map_logical_to_physical` routes top-k logical ids to physical slots.
* :class:`ExpertLoadRecorder` collects the per-expert load the policy needs.

Imports nothing outside ``moe_comm.eplb``.
"""

from .load import ExpertLoadRecorder
from .mapping import active_slot_mask, map_logical_to_physical
from .policy import balancedness, count_moved_experts, rank_loads, rebalance_experts

__all__ = [
    "rebalance_experts",
    "count_moved_experts",
    "rank_loads",
    "balancedness",
    "map_logical_to_physical",
    "active_slot_mask",
    "ExpertLoadRecorder",
]
