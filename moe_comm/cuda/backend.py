"""The CUDA backend as a Buffer drives it (moe_comm/backend.py's contract): GPU tensors,
kernels on torch's current stream, peers of one node through CUDA IPC, other hosts through
IBGDA or the kernels' host proxy."""
from __future__ import annotations

import secrets

import torch
import torch.distributed as dist

from . import elastic, groups, ll, normal
from ..errors import refuse_if_masked
from ..event import EventOverlap, capture_event
from ..layout import DispatchLayout


class CudaBackend:
    def __init__(self, group, num_nvl_bytes, num_rdma_bytes, timeout_s, *, device, elastic,
                 transport):
        self.normal, self.ll = normal, ll
        self.device = device
        self.comm = groups.from_group(group, num_nvl_bytes, num_rdma_bytes, timeout_s,
                                      device=device, elastic=elastic, transport=transport)
        self.job = secrets.token_hex(8)

    def given_layout(self, topk_idx, num_experts, per_rank, per_expert, in_rank):
        return None           # the layout kernel computes send_pos too: it runs anyway

    def layout(self, topk_idx, num_experts, num_ranks) -> DispatchLayout:
        """One layout kernel: counts, membership and the send positions dispatch needs."""
        lay = self.normal.dispatch_layout(topk_idx, num_experts, num_ranks)
        per_rank, per_expert, in_rank = self.masked(lay.per_rank, lay.per_expert, lay.in_rank)
        return DispatchLayout(per_rank, per_expert, in_rank, lay.send_pos)

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

    def meet(self, why: str) -> None:
        """Elastic (DeepEP's shrink mode): meet the survivors through the mask agreement
        kernel, whose waits have a deadline and mask the ranks that stay silent (a
        dist.barrier would wait for a dead rank as long as the process group's own timeout).
        Waits for the agreement, so the caller knows every survivor has arrived. Else a group
        barrier, refused once a rank is masked (it would wait on a rank that may be dead)."""
        if self.comm.elastic:
            self.comm.begin_call()
            elastic.agree(self.comm, why)
            self.comm.synchronize()
            return
        refuse_if_masked(self.active_ranks(), why)
        dist.barrier(group=self.comm.group)

    def destroy(self) -> None:
        self.comm.destroy(barrier=True)
