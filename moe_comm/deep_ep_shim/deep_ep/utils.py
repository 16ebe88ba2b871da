"""deep_ep.utils as moe_comm answers it: the event classes clients import from here
(Megatron-Core imports both in the same ``try`` as ``deep_ep.Buffer``)."""
from moe_comm.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
