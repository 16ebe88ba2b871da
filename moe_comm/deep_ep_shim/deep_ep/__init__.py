"""deep_ep as moe_comm answers it: importable only where the user put moe_comm/deep_ep_shim on
the module path (the opt-in; moe_comm/deep_ep_alias.py explains it). DeepEP's names, with
moe_comm's implementation behind them. Where a real DeepEP is installed as well, importing this
raises instead of silently standing in for it."""
from moe_comm.deep_ep_alias import Buffer, Config, EventOverlap, refuse_to_shadow, topk_idx_t

refuse_to_shadow()

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
