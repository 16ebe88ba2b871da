"""The Buffers MoE layers share: one per process group.

A Buffer maps large shared-memory segments; the layers of one group never call it at the same
time (a forward runs them one after another), so one set of segments per group is enough.
Which layers share is explicit: every layer is given a :class:`SharedBuffers` (by default
:data:`DEFAULT_SHARED_BUFFERS`, so independently built layers on one group share, as a model's
layers should); pass another instance to keep a set of layers apart.
"""
from __future__ import annotations

import torch.distributed as dist

from ..backend import pick_device
from ..buffer import Buffer


def world_if_none(group):
    return dist.group.WORLD if group is None else group


class SharedBuffers:
    """One :class:`moe_comm.Buffer` per process group, created or grown on demand."""

    def __init__(self):
        self._by_group: dict = {}          # id(group) -> (group, Buffer)

    def for_group(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                  device=None) -> Buffer:
        """The Buffer of ``group``, created or grown to at least these sizes, serving
        ``device`` (None: the one it has, or Buffer's default for a new one).

        Collective when it creates: every rank must make the same calls in the same order
        (layers built identically on every rank do). Growing destroys the old Buffer and makes
        a larger one (layers look it up at every call, so they follow); so does a call on
        another device (a model moved to the GPU after it was built: every rank moves alike).
        Tensors received from the old one stay valid until dropped.
        """
        group = world_if_none(group)
        entry = self._by_group.get(id(group))
        # the group itself is kept and compared: a dead group's id may be reused by a new one
        old = entry[1] if entry is not None and entry[0] is group else None
        live = old is not None and old._comm is not None
        same_device = device is None or (live and pick_device(device) == old.device)
        if live and same_device and old.num_nvl_bytes >= num_nvl_bytes and \
                (num_rdma_bytes == 0 or
                 (old.low_latency_mode and old.num_rdma_bytes >= num_rdma_bytes)):
            return old
        if live:
            num_nvl_bytes = max(num_nvl_bytes, old.num_nvl_bytes)
            num_rdma_bytes = max(num_rdma_bytes, old.num_rdma_bytes)
            if device is None:
                device = old.device
            old.destroy()
        buf = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=num_rdma_bytes > 0,
                     device=device)
        self._by_group[id(group)] = (group, buf)
        return buf

    def release(self) -> None:
        """Destroy every Buffer held (e.g. before destroying the process groups)."""
        for _, buf in self._by_group.values():
            buf.destroy()
        self._by_group.clear()


# The instance layers use unless given another: shared by every layer built in this process.
DEFAULT_SHARED_BUFFERS = SharedBuffers()
