"""moe_comm: expert-parallel all-to-all (dispatch/combine) for Mixture-of-Experts models."""
from .buffer import Buffer
from .config import Config
from .errors import BufferTooSmallError, CommTimeoutError
from .event import EventOverlap
from .handle import DispatchHandle
from .reference import reference_combine, reference_dispatch

__all__ = ["Buffer", "Config", "EventOverlap", "DispatchHandle", "CommTimeoutError",
           "BufferTooSmallError", "reference_dispatch", "reference_combine"]
__version__ = "0.1.0"
