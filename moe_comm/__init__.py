"""moe_comm: expert-parallel all-to-all (dispatch/combine) for Mixture-of-Experts models."""
import torch

from .buffer import Buffer
from .config import Config
from .errors import (BufferTooSmallError, CallMismatchError, CommTimeoutError, LayoutLockedError,
                     RankMaskedError, RoundFailed)
from .event import EventOverlap
from .handle import DispatchHandle
from .logs import apply_env_level
from .nn.layer import MoELayer
from .nn.replace import replace_moe_blocks
from .reference import reference_combine, reference_dispatch

# DeepEP's dtype of expert ids (topk_idx), under its name
topk_idx_t = torch.int64

__all__ = ["Buffer", "topk_idx_t", "Config", "EventOverlap", "DispatchHandle",
           "CommTimeoutError", "RankMaskedError", "BufferTooSmallError", "CallMismatchError",
           "RoundFailed",
           "LayoutLockedError",
           "reference_dispatch", "reference_combine", "MoELayer", "replace_moe_blocks"]
__version__ = "0.1.0"

apply_env_level()           # MOE_COMM_LOG_LEVEL (moe_comm/logs.py)
