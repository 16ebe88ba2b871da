"""The backend contract: what a Buffer asks of the backend that owns its tensors' device, and
which backend that is.

Two backends implement it: the host backend (moe_comm/host/backend.py; CPU tensors,
processes sharing memory) and the CUDA backend (moe_comm/cuda/backend.py; GPU tensors,
kernels). Each is a :class:`Backend` whose ``normal`` and ``ll`` are its mode modules,
implementing :class:`NormalMode` and :class:`LowLatencyMode` with the same keyword
arguments; tests/test_backend_contract.py checks both against these protocols. A Buffer
validates every argument first (moe_comm/validate.py), so a backend receives only
consistent, checked input, and computes the dispatch layout once (:meth:`Backend.layout`)
for the whole call.
"""
from __future__ import annotations

import os
from typing import Protocol

import torch

from .cuda.backend import CudaBackend
from .event import EventOverlap
from .handle import DispatchHandle, LowLatencyHandle
from .host.backend import HostBackend
from .layout import DispatchLayout
from .wire import LLLayout


class NormalMode(Protocol):
    """Normal (high-throughput) mode: one collective dispatch and one combine."""

    def dispatch(self, comm, *, x_bytes: torch.Tensor, dtype: torch.dtype, hidden: int,
                 scales, topk_idx, topk_weights, layout: DispatchLayout | None,
                 handle: DispatchHandle | None, num_experts, num_worst_tokens: int,
                 buffer_key) -> tuple:
        """Send every token (``x_bytes``: x as uint8 [T, row bytes]) to the ranks of
        ``layout`` (fresh routing), or to those of ``handle`` (cached: the same rows again).
        Returns ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, handle)``."""

    def combine(self, comm, *, x: torch.Tensor, handle: DispatchHandle, topk_weights,
                bias) -> tuple:
        """Return every received row to its source rank and sum per token. Returns
        ``(combined_x, combined_topk_weights)``."""


class LowLatencyMode(Protocol):
    """Low-latency mode: each call split in a send half and a receive half (the hook), on
    double-buffered regions laid out by ``lay``."""

    def dispatch_send(self, comm, *, x: torch.Tensor, topk_idx: torch.Tensor, lay: LLLayout,
                      use_fp8: bool, round_scale: bool, buffer_key) -> LowLatencyHandle: ...

    def dispatch_recv(self, comm, handle: LowLatencyHandle, lay: LLLayout, *, recv_x,
                      recv_scales, recv_count, use_fp8: bool, use_ue8m0: bool,
                      stats) -> None: ...

    def combine_send(self, comm, *, x: torch.Tensor, handle: LowLatencyHandle,
                     lay: LLLayout, use_logfmt: bool) -> tuple: ...

    def combine_recv(self, comm, seq: int, buf: int, lay: LLLayout, *, handle, topk_idx,
                     topk_weights, out, use_logfmt: bool) -> None: ...


class Backend(Protocol):
    """One rank's backend behind a Buffer."""

    normal: NormalMode
    ll: LowLatencyMode
    comm: object          # the backend's communicator (HostComm / CudaComm)
    device: torch.device
    job: str              # a token naming this Buffer's job (segment names, logs)

    def layout(self, topk_idx: torch.Tensor, num_experts: int,
               num_ranks: int) -> DispatchLayout:
        """The dispatch layout of ``topk_idx`` under the current rank mask."""

    def given_layout(self, topk_idx: torch.Tensor, num_experts: int, per_rank, per_expert,
                     in_rank) -> DispatchLayout | None:
        """The caller's layout (get_dispatch_layout's outputs) as the dispatch layout, where a
        cheap check shows it is ``topk_idx``'s under the current mask; None where it does not
        (the Buffer then computes :meth:`layout` and says what differs)."""

    def masked(self, per_rank, per_expert, in_rank) -> tuple:
        """Layout tensors (any may be None) with the masked ranks' share zeroed."""

    def active_ranks(self) -> torch.Tensor: ...

    def mask(self, ranks, why: str) -> None: ...

    def read_active_arg(self, active_ranks: torch.Tensor) -> None: ...

    def expert_counts(self, recv_idx, handle, num_local: int, alignment: int) -> list: ...

    def empty(self, key, shape, dtype) -> torch.Tensor: ...

    def event(self) -> EventOverlap: ...

    def meet(self, why: str) -> None:
        """A meeting of the group's ranks outside a call (clean_low_latency_buffer), bounded:
        it never waits forever on a rank that died."""

    def destroy(self) -> None: ...


def emulate_cuda() -> bool:
    """``MOE_COMM_CPU_BACKEND=emulator``: a Buffer on the CPU drives the CUDA backend with its
    kernels in the CPU kernel emulator (moe_comm/jit/emulator.py) instead of the host
    backend. For testing the CUDA backend's Buffer path without a GPU; slow."""
    return os.environ.get("MOE_COMM_CPU_BACKEND", "") == "emulator"


def pick_device(device) -> torch.device:
    """The device a Buffer serves: ``device`` if given, else ``MOE_COMM_DEVICE`` if set, else
    (DeepEP's rule) the current CUDA device wherever CUDA is available, whatever the group's
    backend: vLLM builds its Buffer from a gloo CPU group and passes GPU tensors. Without CUDA,
    the CPU. ``device="cpu"`` keeps the CPU backend on a GPU machine."""
    device = device if device is not None else os.environ.get("MOE_COMM_DEVICE") or None
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:   # tensors say cuda:N, not cuda
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def open_backend(group, device: torch.device, num_nvl_bytes: int, num_rdma_bytes: int,
                 timeout_s: float, *, elastic: bool, transport: str) -> Backend:
    """Collective over ``group``: the backend for ``device`` (CUDA for a GPU, or for the CPU
    under :func:`emulate_cuda`; the host backend otherwise)."""
    if device.type == "cuda" or emulate_cuda():
        return CudaBackend(group, num_nvl_bytes, num_rdma_bytes, timeout_s, device=device,
                           elastic=elastic, transport=transport)
    return HostBackend(group, num_nvl_bytes, num_rdma_bytes, timeout_s, elastic=elastic,
                       transport=transport)
