"""Which backend a Buffer drives: the host backend for CPU tensors, the CUDA backend for GPU
tensors. Both expose the same mode modules (``normal``: dispatch/combine; ``ll``: the four
low-latency halves, same keyword arguments); this module holds the few things that differ
(how the layout is computed, where outputs are allocated, what an event is).
"""
from __future__ import annotations

import os
import secrets

import torch
import torch.distributed as dist

from .event import EventOverlap, capture_event
from .host.pool import OutputPool
from .layout import aligned_expert_counts, dispatch_layout


def emulate_cuda() -> bool:
    """``MOE_COMM_CPU_BACKEND=emulator``: a Buffer on the CPU drives the CUDA backend with its
    kernels in the CPU kernel emulator (moe_comm/jit/emulator.py) instead of the host
    backend. For testing the CUDA backend's Buffer path without a GPU; slow."""
    return os.environ.get("MOE_COMM_CPU_BACKEND", "") == "emulator"


def pick_device(group, device) -> torch.device:
    """``device`` if given; else CUDA (the current device) for an NCCL group, else CPU."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:   # tensors say cuda:N, not cuda
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class HostBackend:
    """CPU tensors: processes on one machine share memory; other hosts via the transport."""

    def __init__(self, group, num_nvl_bytes, num_rdma_bytes, timeout_s, *, elastic,
                 transport):
        from .host import ll, normal
        from .host.comm import HostComm
        self.normal, self.ll = normal, ll
        self.device = torch.device("cpu")
        self.comm = HostComm(group, num_nvl_bytes, num_rdma_bytes, timeout_s,
                             elastic=elastic, transport=transport)
        self.job = self.comm.job
        self._pool = OutputPool()

    def layout(self, topk_idx, num_experts, num_ranks):
        return self.masked(*dispatch_layout(topk_idx, num_experts, num_ranks))

    def masked(self, per_rank, per_expert, in_rank):
        """The layout with the masked ranks' experts counting no tokens (new tensors where a
        rank is masked, the same ones otherwise; any of the three may be None)."""
        if self.comm.active.all():
            return per_rank, per_expert, in_rank
        keep = torch.from_numpy(self.comm.active)
        return (None if per_rank is None else per_rank * keep.to(per_rank.dtype),
                None if per_expert is None else
                (per_expert.view(len(keep), -1) * keep[:, None].to(per_expert.dtype)).flatten(),
                None if in_rank is None else in_rank & keep)

    # rank masks: numpy bool [R] in HostComm.active
    def active_ranks(self) -> torch.Tensor:
        return torch.from_numpy(self.comm.active.astype("int32"))

    def mask(self, ranks, why: str) -> None:
        self.comm.mask(ranks, why)

    def read_active_arg(self, active_ranks: torch.Tensor) -> None:
        self.comm.mask((active_ranks.cpu() == 0).nonzero().flatten().tolist(),
                       "active_ranks argument")

    def expert_counts(self, recv_idx, handle, num_local, alignment) -> list:
        return aligned_expert_counts(recv_idx, num_local, alignment)

    def empty(self, key, shape, dtype) -> torch.Tensor:
        return self._pool.empty(key, shape, dtype)

    def event(self) -> EventOverlap:
        return EventOverlap()             # host calls are complete when they return

    def destroy(self) -> None:
        self.comm.destroy()


class CudaBackend:
    """GPU tensors: kernels on torch's current stream, peers of one node through CUDA IPC,
    ranks on other hosts through the kernels' host proxy (moe_comm/cuda/kernel_proxy.py)."""

    def __init__(self, group, num_nvl_bytes, num_rdma_bytes, timeout_s, *, device, elastic,
                 transport):
        from .cuda import ll, normal
        from .cuda.comm import CudaComm
        self.normal, self.ll = normal, ll
        self.device = device
        self.comm = CudaComm.from_group(group, num_nvl_bytes, num_rdma_bytes, timeout_s,
                                        device=device, elastic=elastic, transport=transport)
        self.job = secrets.token_hex(8)

    def layout(self, topk_idx, num_experts, num_ranks):
        return self.masked(*self.normal.get_dispatch_layout(topk_idx, num_experts, num_ranks))

    def masked(self, per_rank, per_expert, in_rank):
        """The layout with the masked ranks' experts counting no tokens (new tensors once a
        rank can be masked, on the device: no host synchronisation; any may be None)."""
        keep = self.comm.active
        if keep is None:
            return per_rank, per_expert, in_rank
        return (None if per_rank is None else per_rank * keep.to(per_rank.dtype),
                None if per_expert is None else
                (per_expert.view(keep.shape[0], -1) * keep[:, None].to(per_expert.dtype))
                .flatten(),
                None if in_rank is None else in_rank & keep.bool())

    # rank masks: int32 [R] on the device (CudaComm.active), read and written on the stream
    def active_ranks(self) -> torch.Tensor:
        return self.comm.active_ranks()

    def mask(self, ranks, why: str) -> None:
        self.comm.mask(ranks, why)

    def read_active_arg(self, active_ranks: torch.Tensor) -> None:
        self.comm.mask_where(active_ranks)

    def expert_counts(self, recv_idx, handle, num_local, alignment) -> list:
        if recv_idx is None:
            return []
        return self.normal.aligned_expert_counts(handle, alignment).tolist()

    def empty(self, key, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def event(self) -> EventOverlap:
        return capture_event()            # marks the kernels just queued on this stream

    def destroy(self) -> None:
        self.comm.destroy(barrier=True)
