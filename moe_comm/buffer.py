"""``Buffer``: the public object. One method per operation, DeepEP V1 signatures.

Every call goes down the layers once: moe_comm/validate.py checks all its arguments (clear
errors before any byte moves), the backend that owns the tensors' device runs it (the host
backend for CPU tensors: processes on one machine, shared memory; the CUDA backend for GPU
tensors), and the results are wrapped in DeepEP's return tuple.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading

import numpy as np
import torch
import torch.distributed as dist

from . import validate
from .backend import emulate_cuda, open_backend, pick_device
from .config import Config, normal_buffer_size_hint
from .deps.cuda_bindings import nvrtc
from .event import EventOverlap, RecvHook, capture_event
from .handle import DispatchHandle, LowLatencyHandle
from .layout import DispatchLayout, tokens_per_host
from .logs import log
from .wire import LL_NUM_BUFFERS, LLLayout

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_NVL_BYTES = 256 << 20


class _CudaBytes:
    """A device byte range torch can view without copying (__cuda_array_interface__)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 3}


def _raw_bytes(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over memory the Buffer's backend owns at ``address`` (on the GPU, or
    host memory for the CPU kernel emulator); it does not keep that memory alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        return torch.as_tensor(_CudaBytes(address, nbytes), device=device)
    host = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.from_numpy(np.ctypeslib.as_array(host))


def nvrtc_targets(sm: int) -> bool:
    """Whether the installed NVRTC can compile for ``sm_<sm>``."""
    try:
        result, archs = nvrtc().nvrtcGetSupportedArchs()
    except ImportError:
        return False
    return result == nvrtc().nvrtcResult.NVRTC_SUCCESS and sm in archs


def _one_thread(method):
    """Run ``method`` as the Buffer's only call in progress (see Buffer._exclusive)."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        with self._exclusive(method.__name__):
            return method(self, *args, **kwargs)
    return guarded


class Buffer:
    """A communication buffer shared by the ranks of ``group`` for expert-parallel
    dispatch/combine.

    Args:
        group: torch.distributed ProcessGroup (gloo for CPU tensors), or None for the default
            group. Every rank of the group must construct the Buffer with the same arguments.
        num_nvl_bytes: bytes of intranode receive memory per rank (normal mode). 0 picks
            256 MiB. See :meth:`get_normal_buffer_size_hint`.
        num_rdma_bytes: bytes of low-latency receive memory per rank (see
            :meth:`get_low_latency_rdma_size_hint`); 0 if low-latency mode is unused.
        low_latency_mode: enable the low-latency calls.
        num_qps_per_rank: DeepEP's RDMA queue pairs per peer (a positive int); no effect here:
            moe_comm's transports size their own queues.
        allow_nvlink_for_low_latency_mode: DeepEP lets low-latency traffic between GPUs of one
            node use NVLink; moe_comm always reaches same-host ranks through their memory
            (CUDA IPC, /dev/shm), so a bool with no effect.
        allow_mnnvl, use_fabric: DeepEP's multi-node NVLink and fabric memory handles; no
            effect on this library's transports (bools, checked).
        explicitly_destroy: DeepEP releases resources only in :meth:`destroy` when set;
            moe_comm releases them in :meth:`destroy` or when the Buffer is collected, either
            way (a bool, kept as an attribute).
        enable_shrink: DeepEP's shrink mode: ranks that miss a deadline are masked instead of
            failing the call; here it turns on ``elastic`` (below), and the shrink calls
            (:meth:`low_latency_update_mask_buffer` and friends) read and set the same mask.
        comm: DeepEP's ``mpi4py`` communicator for a Buffer without ``group``; moe_comm needs
            a torch.distributed group, so only None is taken when ``group`` is None (with a
            group, a communicator is ignored, as DeepEP does).
        timeout_s: deadline of every wait on a peer; a missed deadline raises
            :class:`moe_comm.CommTimeoutError` naming the silent ranks (or, with
            ``elastic=True``, masks them).
        elastic: survive failed ranks: a peer that misses a deadline in any call is marked 0
            in :attr:`active_ranks` and the call completes with what the healthy ranks sent
            (nothing is sent to or awaited from a masked rank afterwards; combine sums only
            healthy contributions). The survivors end every call with the same mask (an
            agreement of flooding rounds that converges whenever ranks die, at any moment;
            docs/ARCHITECTURE.md), at the cost of one round of signal words per call without
            failures (two for a dispatch with notify). A rank its peers masked (frozen past
            the deadline) raises :class:`moe_comm.RankMaskedError` once it resumes, before it
            writes again. Every rank must issue calls (and receive hooks) in the same order.
        transport: how ranks on other hosts (machines or network namespaces) are reached:
            "auto" (the ``MOE_COMM_TRANSPORT`` environment variable, else, for CUDA tensors,
            IBGDA where every rank has NVSHMEM and a ConnectX NIC, else the host proxy of
            moe_comm/transport over NIXL where every rank has it and an RDMA device, else
            over verbs where every rank has an RDMA device, else TCP),
            "ibgda" (CUDA tensors: GPU-initiated RDMA through NVSHMEM,
            moe_comm/ibgda/path.py), "nixl", "verbs" or "tcp" (the host proxy). Ranks on this host
            share memory directly (CUDA IPC; NVSHMEM's P2P mappings under "ibgda").
        device: where the tensors live: a CUDA device drives the CUDA backend (kernels,
            CUDA IPC between the ranks of one node), the CPU the host backend. Default
            (DeepEP's rule): ``MOE_COMM_DEVICE`` if set, else the current CUDA device
            wherever CUDA is available, whatever the group's backend (a gloo group serves
            GPU tensors, as vLLM builds it), else the CPU; ``device="cpu"`` keeps the host
            backend on a GPU machine.

    Every call also takes ``active_ranks=``: an int32 [R] tensor (1 = active) that is read
    (ranks it marks 0 are masked first) and updated in place with the mask after the call,
    Mooncake EP's convention.
    """

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, elastic: bool = False,
                 transport: str = "auto", device=None):
        validate.buffer_args(num_nvl_bytes, num_rdma_bytes, timeout_s, transport)
        validate.deepep_buffer_args(
            group, comm, num_qps_per_rank=num_qps_per_rank, low_latency_mode=low_latency_mode,
            allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode,
            allow_mnnvl=allow_mnnvl, use_fabric=use_fabric,
            explicitly_destroy=explicitly_destroy, enable_shrink=enable_shrink,
            elastic=elastic)
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call "
                               "dist.init_process_group first (gloo for CPU tensors)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes = num_nvl_bytes or DEFAULT_NVL_BYTES
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.timeout_s = float(timeout_s)
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.elastic = bool(elastic or enable_shrink)      # shrink mode is elastic masking
        self.device = pick_device(device)
        if self.device.type != "cuda" and not emulate_cuda():
            validate.host_transport(transport, self.device)
        self._be = open_backend(self.group, self.device, self.num_nvl_bytes, num_rdma_bytes,
                                self.timeout_s, elastic=self.elastic, transport=transport)
        self._comm = self._be.comm
        log.info("moe_comm rank %d of %d: %s on %s, %d NVL + %d RDMA bytes, waits time out "
                 "after %.0f s", self.rank, self.group_size, type(self._be).__name__,
                 "the CPU kernel emulator" if emulate_cuda() else self.device,
                 self.num_nvl_bytes, num_rdma_bytes, self.timeout_s)
        self._key = (id(self), self._be.job)
        self._facts = validate.BufferFacts(self.group_size, self.device, self._key,
                                           self.low_latency_mode)
        # the backend's path for small calls (host/direct.py), or None
        direct = getattr(self._be, "direct_calls", None)
        self._direct = direct(self._key) if direct is not None else None
        # and for low-latency calls (host/ll_direct.py), or None
        ll_direct = getattr(self._be, "ll_direct_calls", None)
        self._ll_direct = ll_direct(self._key) if ll_direct is not None and \
            self.low_latency_mode else None
        self._owner_lock = threading.Lock()
        self._owner = None                  # (thread id, call) of the call in progress
        self._depth = 0
        # per LL kind, the receive hook still pending on each of the two buffers
        self._ll_pending = {"dispatch": [None] * LL_NUM_BUFFERS,
                            "combine": [None] * LL_NUM_BUFFERS}
        self._zero_copy = [None] * LL_NUM_BUFFERS

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """One thread at a time: a call (or receive hook) while another thread is inside one
        raises RuntimeError before anything moves. Interleaving them is never safe: every
        rank must issue its collective calls in one order, which two threads sharing a Buffer
        cannot promise, and the call numbers, pending hooks and pooled outputs are per
        Buffer. The same thread may nest (a call using another public method)."""
        me = threading.get_ident()
        with self._owner_lock:
            if self._owner is not None and self._owner[0] != me:
                raise RuntimeError(f"{what}: another thread is inside {self._owner[1]} on this "
                                   "Buffer; calls on one Buffer must come from one thread at a "
                                   "time (or give each thread its own Buffer and group)")
            if self._owner is None:
                self._owner = (me, what)
            self._depth += 1
        try:
            yield
        finally:
            with self._owner_lock:
                self._depth -= 1
                if not self._depth:
                    self._owner = None

    @contextlib.contextmanager
    def _hook_call(self, what: str):
        """A receive hook runs like a call: not after destroy(), not beside another thread's
        call (refused before the hook is used up, so it can be called again)."""
        if self._comm is None:
            raise RuntimeError(f"{what} called after this Buffer was destroyed")
        with self._exclusive(what):
            yield

    # -- static helpers (DeepEP) ----------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        Buffer.num_sms = validate.num_sms(new_num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap marking the work queued so far on the current stream."""
        return capture_event()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_normal_buffer_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int,
                                    topk: int = 8, elem_size: int = 2, fp8: bool = False,
                                    keep_alive: int = 1) -> int:
        """``num_nvl_bytes`` that always suffices for tokens of ``hidden`` channels of
        ``elem_size`` bytes (1 with ``fp8=True``, which adds the scales), with ``keep_alive``
        dispatch results held by the caller at once."""
        row = hidden * (1 if fp8 else elem_size)
        return normal_buffer_size_hint(num_max_tokens_per_rank, row, num_ranks, topk,
                                       hidden // 128 * 4 if fp8 else 0, keep_alive)

    # -- rank health -------------------------------------------------------------------------
    @property
    def active_ranks(self) -> torch.Tensor:
        """int32 [R] on the Buffer's device: 1 for ranks taking part, 0 for masked ones (a
        copy)."""
        self._live()
        return self._be.active_ranks()

    @_one_thread
    def set_active_ranks(self, mask) -> None:
        """Mask ranks a controller knows are gone (entries 0); a mask never re-activates a
        rank (a rank that left needs a new Buffer). Call it with the same mask on every
        surviving rank before their next call."""
        self._live()
        mask = validate.set_active_ranks_args(self._facts, mask)
        self._be.mask((mask.cpu() == 0).nonzero().flatten().tolist(), "set_active_ranks")

    # -- DeepEP's shrink mode: the same mask, DeepEP's calls and convention (1 = masked) -----
    @_one_thread
    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask ``rank_to_mask`` (``mask=True``): nothing is sent to it or awaited from it in
        any later call, low-latency and normal alike (DeepEP masks it in the low-latency
        calls). Like :meth:`set_active_ranks`, it is this rank's view: give every surviving
        rank the same update (with ``enable_shrink`` the survivors also agree on it at their
        next call). ``mask=False`` on an active rank does nothing; on a masked one it raises
        ValueError: moe_comm cannot take a rank back into a Buffer whose calls went on
        without it (its call numbers fell behind); a new Buffer can."""
        self._live()
        rank_to_mask = validate.rank_index("rank_to_mask", rank_to_mask, self.group_size)
        validate.flag("mask", mask)
        if mask:
            self._be.mask([rank_to_mask], "low_latency_update_mask_buffer")
        else:
            self._refuse_unmask([rank_to_mask], "low_latency_update_mask_buffer")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Fill ``mask_status`` (int32 [R], DeepEP's convention: 1 = masked, 0 = taking
        part) with this rank's mask, :attr:`active_ranks` inverted (on the stream, no host
        synchronisation on the CUDA backend)."""
        validate.mask_status_args(self._facts, mask_status)
        mask_status.copy_(1 - self.active_ranks)

    @_one_thread
    def low_latency_clean_mask_buffer(self) -> None:
        """DeepEP: unmask every rank. With no rank masked this does nothing; with one masked
        it raises ValueError, for the reason :meth:`low_latency_update_mask_buffer` gives."""
        self._live()
        masked = (self._be.active_ranks() == 0).nonzero().flatten().tolist()
        self._refuse_unmask(masked, "low_latency_clean_mask_buffer")

    def _refuse_unmask(self, ranks, what: str) -> None:
        still = [r for r in ranks if not bool(self._be.active_ranks()[r])]
        if still:
            raise ValueError(f"{what}: rank(s) {still} are masked, and moe_comm cannot take a "
                             "masked rank back into a Buffer (the calls it missed went on "
                             "without it); build a new Buffer with every rank to start over")

    # -- DeepEP's buffer access and build facts ------------------------------------------
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this rank's own receive memory: the normal-mode region
        (``num_nvl_bytes``), or with ``use_rdma_buffer`` the low-latency one
        (``num_rdma_bytes``), from byte ``offset`` (as DeepEP's runtime counts it), as
        ``dtype``: flat, or shaped ``size``. Peers write there during calls and received
        tensors live there (normal mode), so it is for inspection between calls; valid until
        :meth:`destroy`."""
        validate.flag("use_rdma_buffer", use_rdma_buffer)
        region = self._local_region(bool(use_rdma_buffer))
        count = validate.local_buffer_args(dtype, size, offset, region.numel())
        elem = torch.empty((), dtype=dtype).element_size()
        flat = region[offset:offset + count * elem].view(dtype)
        return flat if size is None else flat.view(size)

    def _local_region(self, low_latency: bool) -> torch.Tensor:
        """This rank's normal-mode or low-latency region as uint8."""
        comm = self._live()
        if hasattr(comm, "peer_heap"):           # host backend: mapped segments
            # (its heap view runs on over the eager slots, which are not the user's)
            return comm.peer_ll(comm.rank) if low_latency else \
                comm.peer_heap(comm.rank)[:comm.heap_bytes]
        start = comm.pointers[comm.rank] + (comm.ll_offset if low_latency else comm.heap_offset)
        return _raw_bytes(start, comm.ll_bytes if low_latency else comm.heap_bytes,
                          comm.device)

    def get_comm_stream(self):
        """DeepEP's communication stream. moe_comm's CUDA kernels run on the caller's current
        stream, so that is what this returns; None on the host backend (its calls run on the
        calling thread and are complete when they return)."""
        self._live()
        if self.device.type == "cuda":
            return torch.cuda.current_stream(self.device)
        return None

    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP: whether its kernels were built for sm_90 (Hopper). moe_comm builds its
        kernels at run time with NVRTC, so: whether this installation's NVRTC can build for
        sm_90 (False without cuda-bindings)."""
        return nvrtc_targets(90)

    def _enter(self, active_ranks) -> None:
        """Start a call: apply a caller's ``active_ranks`` tensor (checked with the call's
        other arguments)."""
        if active_ranks is not None:
            self._be.read_active_arg(active_ranks)

    def _leave(self, active_ranks) -> None:
        """Write the mask after a call back into the caller's ``active_ranks`` tensor (on the
        stream, no host synchronisation on the CUDA backend)."""
        if active_ranks is not None and self._comm is not None:
            active_ranks.copy_(self._be.active_ranks())

    # -- normal mode ----------------------------------------------------------------------
    def _live(self):
        if self._comm is None:
            raise RuntimeError("this Buffer was destroyed")
        return self._comm

    @_one_thread
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False,
                            active_ranks: torch.Tensor | None = None):
        """Where each token goes (tokens are not sent to masked ranks: their experts count
        no tokens).

        Args:
            topk_idx: int64 [T, K], expert ids in [0, num_experts) or -1 for an unused slot.
            num_experts: total experts E (divisible by the group size).
        Returns:
            num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [hosts] (tokens
            that go to at least one rank of each host, hosts numbered in the order of their
            first rank; None when the group is on one host), num_tokens_per_expert int32 [E],
            is_token_in_rank bool [T, R], EventOverlap.
        """
        validate.layout_args(self._facts, topk_idx, num_experts, active_ranks)
        self._live()
        self._enter(active_ranks)
        lay = self._be.layout(topk_idx, num_experts, self.group_size)
        self._leave(active_ranks)
        # DeepEP's num_tokens_per_rdma_rank: only here, dispatch has no use for it
        per_host = tokens_per_host(lay.in_rank, self._comm.host_of)
        return lay.per_rank, per_host, lay.per_expert, lay.in_rank, self._be.event()

    @_one_thread
    def dispatch(self, x, handle: DispatchHandle | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event: EventOverlap | None = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False,
                 active_ranks: torch.Tensor | None = None):
        """Send each token once to every rank owning one of its top-k experts.

        Args:
            x: [T, H] bf16/fp16/fp32, or a tuple (float8_e4m3fn [T, H], scales [T, S]): the
                scales float32 or int32 (e.g. UE8M0 packed, four per int32), any S >= 1,
                row-major or column-major (stride (1, T)); they travel as S 4-byte columns
                and come back in the same dtype, row-major (as DeepEP returns them).
            handle: a handle from an earlier dispatch of the same routing: repeats its layout
                without the count exchange (then pass no topk_idx/topk_weights).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: the outputs of
                :meth:`get_dispatch_layout` (computed from topk_idx when omitted).
            topk_idx: int64 [T, K] expert ids, -1 for unused slots. Without it (and without
                handle) is_token_in_rank says where each token goes, no top-k travels, and
                the per-expert list is the sum of every source's num_tokens_per_expert for
                this rank's experts (as in DeepEP: one all_gather of those counts over the
                group, so every rank must be active).
            topk_weights: float32 [T, K] or None.
            expert_alignment: round each entry of the per-expert count list up to this.
            num_worst_tokens: if > 0, received tensors have exactly this many rows (padding
                rows have topk ids -1 and zero weights); must be >= the rows received. The
                per-expert list is then empty (DeepEP: no host synchronisation).
            config, previous_event, async_finish, allocate_on_comm_stream: DeepEP
                compatibility; host-backend calls are complete when they return.
            active_ranks: int32 [R] or None, read and updated in place (see the class).
        Returns:
            recv_x: [N, H] (or (fp8 [N, H], scales [N, S] of x[1]'s dtype, row-major)), rows
                ordered by source rank then source token index; on the host backend it
                lives in the buffer's memory until you drop it (except a small call's:
                moe_comm/host/small.py). Masked ranks send and receive nothing;
            recv_topk_idx: int64 [N, K] local expert ids (-1 = not on this rank), or None
                without topk_idx;
            recv_topk_weights: float32 [N, K] (0 where the id is -1) or None;
            num_recv_tokens_per_expert_list: list of E/R ints, aligned ([] with
                num_worst_tokens);
            handle: for combine and cached dispatch (indexable like DeepEP's tuple:
                moe_comm/handle.py);
            event: EventOverlap.
            A cached dispatch (``handle=``) returns ``(recv_x, None, None, None, None,
            event)``, as DeepEP does: combine takes the handle it was given.
        """
        comm = self._live()
        if self._direct is not None:         # a small call, straight into C (or None)
            got = self._direct.dispatch(
                self._be, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                topk_idx, topk_weights, expert_alignment, num_worst_tokens, active_ranks) \
                if handle is None else self._direct.cached(
                    x, handle, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                    active_ranks)
            if got is not None:
                return got
        args = validate.dispatch_args(
            self._facts, x, handle, num_tokens_per_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
            active_ranks)
        data, scales, num_experts = args.data, args.scales, args.num_experts
        cached = handle is not None
        if cached:
            layout = None
        elif topk_idx is not None:
            layout = self._layout_of(topk_idx, num_experts, num_tokens_per_rank,
                                     num_tokens_per_expert, is_token_in_rank)
        else:
            layout = self._layout_of_membership(num_tokens_per_rank, num_tokens_per_expert,
                                                is_token_in_rank)
            # no routing ids travel: the backends take that as top-k of width 0
            topk_idx = torch.empty(data.shape[0], 0, dtype=torch.int64, device=self.device)
        self._enter(active_ranks)
        recv_x, recv_s, recv_i, recv_w, handle = self._be.normal.dispatch(
            comm, x_bytes=data.view(torch.uint8), dtype=data.dtype, hidden=data.shape[1],
            scales=scales, topk_idx=topk_idx, topk_weights=topk_weights,
            layout=layout, handle=handle, num_experts=num_experts,
            num_worst_tokens=num_worst_tokens, buffer_key=self._key)
        self._leave(active_ranks)
        out_x = recv_x if recv_s is None else (recv_x, recv_s)
        if cached:
            return out_x, None, None, None, None, self._be.event()
        if num_worst_tokens:
            counts = []
        elif recv_i is None:
            counts = self._expert_counts_from_peers(num_tokens_per_expert, expert_alignment)
        else:
            counts = self._be.expert_counts(recv_i, handle, num_experts // self.group_size,
                                            expert_alignment)
        return out_x, recv_i, recv_w, counts, handle, self._be.event()

    @_one_thread
    def combine(self, x: torch.Tensor, handle: DispatchHandle,
                topk_weights: torch.Tensor | None = None, bias=None,
                config: Config | None = None, previous_event: EventOverlap | None = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False,
                active_ranks: torch.Tensor | None = None):
        """Send expert outputs back to the tokens' ranks and sum them per token (rows of
        masked ranks are left out).

        Args:
            x: [N, H] bf16/fp16/fp32, this rank's rows in the order dispatch returned them
                (N = rows received, or num_worst_tokens rows of which the first N count).
            handle: the dispatch handle.
            topk_weights: float32 [N, K] or None; summed per token the same way.
            bias: None, a [T, H] tensor or a tuple of up to two, added to the result.
            active_ranks: int32 [R] or None, read and updated in place (see the class).
        Returns:
            combined_x [T, H] in x's dtype (summed in float32), combined_topk_weights
            float32 [T, K] or None, EventOverlap.
        """
        comm = self._live()
        if self._direct is not None:         # a small call, straight into C (or None)
            got = self._direct.combine(x, handle, topk_weights, bias, active_ranks)
            if got is not None:
                return got
        biases = validate.combine_args(self._facts, x, handle, topk_weights, bias, active_ranks)
        n = handle.num_recv_tokens       # x may have num_worst_tokens rows: past n is padding
        if topk_weights is not None:
            topk_weights = topk_weights[:n].contiguous()
        self._enter(active_ranks)
        out, w = self._be.normal.combine(comm, x=x[:n].contiguous(), handle=handle,
                                     topk_weights=topk_weights,
                                     bias=tuple(b.float() for b in biases))
        self._leave(active_ranks)
        return out, w, self._be.event()

    def _layout_of(self, topk_idx, num_experts, num_tokens_per_rank, num_tokens_per_expert,
                   is_token_in_rank):
        """The layout dispatch uses (moe_comm/layout.py DispatchLayout, computed once here and
        handed to the backend): ``topk_idx``'s under the current mask, after checking that
        what the caller passed agrees with it (masked the same way, so a layout made before
        a rank was masked still passes)."""
        lay = self._be.given_layout(topk_idx, num_experts, num_tokens_per_rank,
                                    num_tokens_per_expert, is_token_in_rank)
        if lay is not None:
            return lay
        lay = self._be.layout(topk_idx, num_experts, self.group_size)
        given = self._be.masked(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)
        validate.layout_matches(
            {"num_tokens_per_rank": given[0], "num_tokens_per_expert": given[1],
             "is_token_in_rank": given[2]},
            {"num_tokens_per_rank": lay.per_rank, "num_tokens_per_expert": lay.per_expert,
             "is_token_in_rank": lay.in_rank})
        return lay

    def _layout_of_membership(self, num_tokens_per_rank, num_tokens_per_expert,
                              is_token_in_rank):
        """The layout of a dispatch without topk_idx, from the caller's is_token_in_rank
        (and num_tokens_per_rank, which must agree with it). Every rank must be active: the
        per-expert list then needs every rank's counts (:meth:`_expert_counts_from_peers`)."""
        validate.all_active(self._be.active_ranks(), "dispatch without topk_idx")
        per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        if num_tokens_per_rank is not None:
            validate.layout_matches({"num_tokens_per_rank": num_tokens_per_rank},
                                    {"num_tokens_per_rank": per_rank})
        # token t's row among this rank's rows for rank d (-1: not sent): the order by token
        # index the receivers expect (the CUDA backend's kernels need it; the host derives it)
        rows = is_token_in_rank.cumsum(0, dtype=torch.int32) - 1
        send_pos = torch.where(is_token_in_rank, rows, torch.full_like(rows, -1))
        return DispatchLayout(per_rank, num_tokens_per_expert, is_token_in_rank, send_pos)

    def _expert_counts_from_peers(self, num_tokens_per_expert, alignment) -> list:
        """DeepEP's per-expert list without topk_idx: every source's num_tokens_per_expert
        summed for this rank's experts, each rounded up to ``alignment``. One all_gather over
        the group, after the dispatch (whose signature check already made every rank agree
        that no topk_idx travels)."""
        mine = num_tokens_per_expert.to(torch.int64).contiguous()
        gathered = [torch.empty_like(mine) for _ in range(self.group_size)]
        dist.all_gather(gathered, mine, group=self.group)
        num_local = mine.shape[0] // self.group_size
        first = self.rank * num_local
        counts = torch.stack(gathered)[:, first:first + num_local].sum(0).tolist()
        return [(c + alignment - 1) // alignment * alignment for c in counts]

    # -- low-latency mode -------------------------------------------------------------------
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """``num_rdma_bytes`` a low-latency buffer needs for these shapes (both buffers)."""
        return LLLayout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts).nbytes

    def _ll_reserve(self, kind: str, seq: int):
        """Refuse a third call in flight: buffer ``seq % 2`` must have no pending hook."""
        buf = seq % LL_NUM_BUFFERS
        pending = self._ll_pending[kind][buf]
        if pending is not None and not pending.done:
            raise RuntimeError(f"two low-latency {kind} calls are already in flight; call the "
                               f"receive hook of the earlier one before starting another")
        return buf

    def _ll_finish(self, kind, buf, receive, return_recv_hook):
        if not return_recv_hook:
            receive()
            return lambda: None
        what = f"low_latency_{kind} receive hook"
        hook = RecvHook(receive, enter=lambda: self._hook_call(what))
        self._ll_pending[kind][buf] = hook
        return hook

    @_one_thread
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False,
                             active_ranks: torch.Tensor | None = None):
        """Low-latency dispatch: one message per (token, expert), no count exchange first.

        Args:
            x: bf16 [T, H], T <= num_max_dispatch_tokens_per_rank, H % 128 == 0.
            topk_idx: int64 [T, K] expert ids (-1 = unused slot), K <= 16.
            num_max_dispatch_tokens_per_rank: the most tokens any rank dispatches (M).
            num_experts: total experts E; rank r owns [r*E/R, (r+1)*E/R).
            cumulative_local_expert_recv_stats: int32 [E/R] or None; received counts are
                added to it (for EPLB).
            dispatch_wait_recv_cost_stats: int64 [R] or None; the receive adds, per source
                rank, how long it waited for that source's messages, in nanoseconds (DeepEP:
                GPU clock cycles; a rank that is slow to send shows up). The CUDA backend's
                wait kernels time it on the device (%globaltimer), without a host sync.
            use_fp8: cast to float8_e4m3fn with one float32 scale per 128 channels before
                sending; round_scale: scales rounded up to powers of two; use_ue8m0: scales
                packed as UE8M0 bytes, four per int32 (needs round_scale, H % 512 == 0).
            return_recv_hook: only send; the returned ``hook()`` receives. At most two calls
                may await their hook at once.
            active_ranks: int32 [R] or None, read and updated in place (see the class; with a
                hook, updated again when the hook has received).
        Returns:
            recv_x: bf16 [E/R, R*M, H], or (float8_e4m3fn [E/R, R*M, H], scales float32
                [E/R, R*M, H/128] or int32 [E/R, R*M, H/512] with use_ue8m0); rows of expert
                le past recv_count[le] are undefined;
            recv_count: int32 [E/R] rows received per local expert;
            handle: for low_latency_combine; event: EventOverlap; hook: the receive half (a
                no-op when return_recv_hook is False).
        """
        comm = self._live()
        if self._ll_direct is not None:      # each half one C call (or None)
            got = self._ll_direct.dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                round_scale, use_ue8m0, active_ranks,
                lambda: self._ll_reserve("dispatch", comm.ll_seq["dispatch"] + 1))
            if got is not None:
                out_x, recv_count, handle, receive = got
                return (out_x, recv_count, handle, self._be.event(),
                        self._ll_finish("dispatch", handle.buf, receive, return_recv_hook))
        lay = validate.ll_dispatch_args(
            self._facts, comm.ll_bytes, x, topk_idx, num_max_dispatch_tokens_per_rank,
            num_experts, cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0,
            active_ranks)
        validate.wait_cost_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats,
                                 self._facts)
        hidden, num_local = x.shape[1], lay.num_local
        stats = cumulative_local_expert_recv_stats
        buf = self._ll_reserve("dispatch", comm.ll_seq["dispatch"] + 1)
        self._enter(active_ranks)
        x = x.contiguous()
        handle = self._be.ll.dispatch_send(comm, x=x, topk_idx=topk_idx, lay=lay, use_fp8=use_fp8,
                                       round_scale=round_scale, buffer_key=self._key)
        rows = self.group_size * num_max_dispatch_tokens_per_rank
        pool = self._be
        recv_x = pool.empty(("ll_x", buf), (num_local, rows, hidden),
                            torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
        recv_scales = None
        if use_ue8m0:
            recv_scales = pool.empty(("ll_s", buf), (num_local, rows, hidden // 512),
                                     torch.int32)
        elif use_fp8:
            recv_scales = pool.empty(("ll_s", buf), (num_local, rows, hidden // 128),
                                     torch.float32)
        recv_count = torch.zeros(num_local, dtype=torch.int32, device=self.device)

        def receive():
            try:
                self._be.ll.dispatch_recv(comm, handle, lay, recv_x=recv_x,
                                          recv_scales=recv_scales, recv_count=recv_count,
                                          use_fp8=use_fp8, use_ue8m0=use_ue8m0, stats=stats,
                                          wait_stats=dispatch_wait_recv_cost_stats)
            finally:
                self._leave(active_ranks)

        self._leave(active_ranks)
        hook = self._ll_finish("dispatch", buf, receive, return_recv_hook)
        out_x = (recv_x, recv_scales) if use_fp8 else recv_x
        return out_x, recv_count, handle, self._be.event(), hook

    @_one_thread
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """bf16 [E/R, R*M, H]: write expert outputs here and call
        ``low_latency_combine(..., zero_copy=True)`` to send them without another copy."""
        comm = self._live()
        validate.ll_handle(handle, self._key)
        buf = (comm.ll_seq["combine"] + 1) % LL_NUM_BUFFERS
        shape = (handle.num_experts // self.group_size, self.group_size * handle.max_tokens,
                 handle.hidden)
        t = self._zero_copy[buf]
        if t is None or tuple(t.shape) != shape:
            t = self._zero_copy[buf] = torch.empty(shape, dtype=torch.bfloat16,
                                                   device=self.device)
        return t

    @_one_thread
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None,
                            active_ranks: torch.Tensor | None = None):
        """Send expert outputs back and take each token's top-k weighted sum.

        Args:
            x: bf16 [E/R, R*M, H] expert outputs in the layout low_latency_dispatch returned
                (ignored with zero_copy=True: the combine buffer is read instead).
            topk_idx: int64 [T, K], the ids passed to the dispatch of ``handle``.
            topk_weights: float32 [T, K]; -1 slots contribute nothing.
            handle: the dispatch handle (its receive hook must have run).
            use_logfmt: send the rows back in a log-domain 10-bit encoding (moe_comm/logfmt.py,
                DeepEP's option of that name: 0.66x the bytes, about 1% relative error per
                value; hidden a multiple of 128). Every rank must pass the same value
                (CallMismatchError on every rank otherwise; on the CUDA backend when the
                rank next checks its kernels' errors, at the latest its next call; the call
                after works). It sits where DeepEP V1 puts it, so positional calls land on
                the same arguments.
            zero_copy: x was written into get_next_low_latency_combine_buffer(handle).
            return_recv_hook: only send; ``hook()`` receives and fills the output.
            out: optional bf16 [T, H] to write the result into.
            combine_wait_recv_cost_stats: int64 [R] or None; the receive adds the nanoseconds
                it waited for each expert rank's rows (as ``dispatch_wait_recv_cost_stats`` of
                low_latency_dispatch).
            active_ranks: int32 [R] or None, read and updated in place (see the class).
        Returns:
            combined_x bf16 [T, H], event, hook.
        """
        comm = self._live()
        if self._ll_direct is not None and (zero_copy is False or zero_copy is True):
            got = self._ll_direct.combine(
                self.get_next_low_latency_combine_buffer(handle) if zero_copy else x,
                topk_idx, topk_weights, handle, use_logfmt, out, combine_wait_recv_cost_stats,
                active_ranks, lambda: self._ll_reserve("combine", comm.ll_seq["combine"] + 1))
            if got is not None:
                out, buf, receive = got
                return out, self._be.event(), self._ll_finish("combine", buf, receive,
                                                              return_recv_hook)
        lay = validate.ll_combine_args(self._facts, comm.ll_bytes, x, topk_idx, topk_weights,
                                       handle, use_logfmt, zero_copy, out, active_ranks)
        validate.wait_cost_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats,
                                 self._facts)
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        if out is None:
            out = self._be.empty(("ll_out", comm.ll_seq["combine"] % LL_NUM_BUFFERS),
                                 (handle.num_tokens, handle.hidden), torch.bfloat16)
        buf = self._ll_reserve("combine", comm.ll_seq["combine"] + 1)
        self._enter(active_ranks)
        seq, buf = self._be.ll.combine_send(comm, x=x.contiguous(), handle=handle, lay=lay,
                                            use_logfmt=bool(use_logfmt))
        self._leave(active_ranks)

        def receive():
            try:
                self._be.ll.combine_recv(comm, seq, buf, lay, handle=handle, topk_idx=topk_idx,
                                         topk_weights=topk_weights, out=out,
                                         use_logfmt=bool(use_logfmt),
                                         wait_stats=combine_wait_recv_cost_stats)
            finally:
                self._leave(active_ranks)

        hook = self._ll_finish("combine", buf, receive, return_recv_hook)
        return out, self._be.event(), hook

    @_one_thread
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Reset the low-latency buffers (collective: every rank calls it; no LL call may be
        in flight). Normal-mode calls never touch them, so interleaving needs no cleaning;
        this is for starting LL over, e.g. after an aborted call. With ``enable_shrink`` /
        ``elastic`` (both backends), a rank that does not arrive within the deadline is
        masked through the mask agreement, as in DeepEP's shrink mode, instead of being
        waited for."""
        comm = self._live()
        validate.ll_layout(self._facts, comm.ll_bytes, num_max_dispatch_tokens_per_rank,
                           hidden, num_experts)
        for kind, hooks in self._ll_pending.items():
            if any(h is not None and not h.done for h in hooks):
                raise RuntimeError(f"a low-latency {kind} still awaits its receive hook")
        self._be.meet("clean_low_latency_buffer")       # bounded: a dead rank is not awaited
        comm.reset_ll()
        self._be.meet("clean_low_latency_buffer")

    # -- lifetime ---------------------------------------------------------------------------
    @_one_thread
    def destroy(self) -> None:
        """Release the shared memory (received tensors still alive keep their pages mapped
        until they are dropped; nothing outlives the process)."""
        if self._comm is not None:
            self._comm = None
            self._be.destroy()

    def __del__(self):
        try:
            self.destroy()
        except Exception:
            pass
