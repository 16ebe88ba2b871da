"""The host backend as a Buffer drives it (moe_comm/backend.py's contract): CPU tensors,
processes of one machine sharing memory, other hosts through the transport."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import direct, ll, ll_direct, native, normal
from ..errors import refuse_if_masked
from ..event import EventOverlap
from ..layout import DispatchLayout, aligned_expert_counts, dispatch_layout
from .comm import HostComm
from .pool import OutputPool


class HostBackend:
    def __init__(self, group, num_nvl_bytes, num_rdma_bytes, timeout_s, *, elastic,
                 transport):
        self.normal, self.ll = normal, ll
        self.device = torch.device("cpu")
        # built (once, cached) now, not inside the first call's deadline; read once a Buffer
        # where a call's Python costs count (given_layout)
        self._lib = native.library()
        self.comm = HostComm(group, num_nvl_bytes, num_rdma_bytes, timeout_s,
                             elastic=elastic, transport=transport)
        self.job = self.comm.job
        self._pool = OutputPool()

    def given_layout(self, topk_idx, num_experts, per_rank, per_expert, in_rank):
        # (not with relays: a relayed combine reads the handle's in_rank, which is then the
        # caller's tensor, not a copy of ours)
        if self.comm.relays is None and self.comm.active.all() and native.layout_matches(
                self._lib, topk_idx, num_experts, per_rank, per_expert, in_rank):
            return DispatchLayout(per_rank, per_expert, in_rank)
        return None

    def direct_calls(self, buffer_key):
        """Small calls straight from the Buffer's arguments (host/direct.py)."""
        return direct.DirectCalls(self.comm, buffer_key)

    def ll_direct_calls(self, buffer_key):
        """Low-latency halves straight from the Buffer's arguments (host/ll_direct.py)."""
        return ll_direct.LLDirectCalls(self.comm, buffer_key, self.empty)

    def layout(self, topk_idx, num_experts, num_ranks) -> DispatchLayout:
        per_rank, per_expert, in_rank = native.dispatch_layout(
            topk_idx, num_experts, num_ranks) or dispatch_layout(topk_idx, num_experts, num_ranks)
        return DispatchLayout(*self.masked(per_rank, per_expert, in_rank))

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
        counted = getattr(handle, "recv_expert_counts", None)     # host/small.py counted them
        if counted is None:
            counted = native.expert_counts(recv_idx, num_local)    # (None: torch counts them)
        if counted is None:
            return aligned_expert_counts(recv_idx, num_local, alignment)
        return [(int(c) + alignment - 1) // alignment * alignment for c in counted]

    def empty(self, key, shape, dtype) -> torch.Tensor:
        return self._pool.empty(key, shape, dtype)

    def event(self) -> EventOverlap:
        return EventOverlap()             # host calls are complete when they return

    def meet(self, why: str) -> None:
        """Elastic (DeepEP's shrink mode): meet the survivors through the mask agreement, whose
        waits have a deadline and mask the ranks that stay silent. Else a group barrier,
        refused once a rank is masked (it would wait on a rank that may be dead)."""
        if self.comm.elastic:
            self.comm.start_call()
            self.comm.agree(why)
            return
        refuse_if_masked(self.active_ranks(), why)
        dist.barrier(group=self.comm.group)

    def destroy(self) -> None:
        self.comm.destroy()
