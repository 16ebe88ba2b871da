"""``CudaComm``: one rank's view of the CUDA communication buffers of a group.

The buffers of a group are built by moe_comm/cuda/groups.py (``from_group``: one process
per rank; ``local_group``: all ranks in one process); this class holds one rank's view of
them: ``bases[R]``, the kernels' addresses of every rank's buffer (a peer's mapping, a mirror
drained by the host proxy, or a symmetric-heap address), the error word, epochs and masks.

Errors: kernels never trap. A wait that passes its deadline writes the silent rank into an
error word in pinned host memory; :meth:`CudaComm.check` (called at the start of every
operation and after every host synchronisation) raises ``moe_comm.CommTimeoutError`` naming the
silent ranks. The first error a rank's kernels report stops its later kernels (they skip their
work) and is what it raises; its signals to peers then carry a failure mark, so a peer raises
``CudaCommError`` naming it at once rather than at its deadline. After an error the group is
out of step: destroy it.

Rank masking: ``active`` (int32 [R] on the device, 1 = taking part) once a rank can be masked
(``elastic=True``, or after :meth:`CudaComm.mask`). Kernels send nothing to and await nothing
from a rank at 0. Elastic, a wait past its deadline masks the rank instead of reporting it,
and moe_comm/cuda/elastic.py makes the survivors agree on the mask.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist

from . import memory
from .. import signature
from ..errors import CommTimeoutError, RankMaskedError
from ..jit.nvrtc import load_kernels
from ..jit.variants import check_num_ranks
from ..wire import (CALL_WORDS, ERR_MASKED, ERR_MISMATCH, ERR_OVERFLOW, ERR_PEER_FAILED,
                    ERR_PROXY, ERR_TIMEOUT, ERROR_HEADER, LINE_WORDS, LL_CALL_FIELDS,
                    MAX_EPOCH, MAX_ERROR_RANKS, NORMAL_CALL_FIELDS, VALUE_MASK, HeaderLayout)

log = logging.getLogger("moe_comm")


# Phase ids passed to kernels (the `op` argument) and the names errors report.
OPS = ("", "dispatch/notify", "dispatch/send", "dispatch/payload", "combine/notify",
       "combine/send", "combine/payload", "low_latency_dispatch/send",
       "low_latency_dispatch/recv", "low_latency_combine/send", "low_latency_combine/recv",
       "clean_low_latency_buffer")
OP = {name: i for i, name in enumerate(OPS)}

# Block counters (csrc/kernels/sync.cuh last_block_arrives), one per kernel that uses one, so
# kernels that may run on different streams (LL send vs. a later receive hook) never share.
SIGNAL_STRIDE = LINE_WORDS * 8   # bytes between one-per-rank signal slots (one line each)

COUNTER = {"dispatch_send": 0, "combine_send": 1, "ll_dispatch_recv": 2, "ll_combine_send": 3,
           "ll_combine_recv": 4, "relay_stage": 5, "relay_forward": 6, "relay_ranges": 7,
           "relay_reduce": 8}


class CudaCommError(RuntimeError):
    """A device-side failure other than a timeout (receive overflow, missing transport)."""


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


class CudaComm:
    """One rank of a CUDA group, built by moe_comm/cuda/groups.py.

    Attributes the mode modules use: ``rank``, ``num_ranks``, ``device``, ``layout``
    (HeaderLayout), ``heap_offset``/``heap_bytes`` (data region), ``ll_offset``/``ll_bytes``,
    ``bases`` (int64 [R] device tensor of buffer addresses), ``timeout_ns``, ``ll_seq``,
    ``active`` (the kernels' mask argument: None, or int32 [R] on the device), ``elastic``.
    """

    def __init__(self, *, rank: int, num_ranks: int, device: torch.device, pointers: list,
                 heap_bytes: int, ll_bytes: int, timeout_s: float, own_allocation: bool,
                 opened: list, group=None, host_buffers=None, elastic: bool = False,
                 proxy=None, nvshmem=None, registered=None, host_of=None):
        check_num_ranks(num_ranks)
        self.rank, self.num_ranks, self.group = rank, num_ranks, group
        # int64 [R] host index of every rank (ranks that map each other's memory share one);
        # None on one host (layout.tokens_per_host)
        self.host_of = None if host_of is None or len(set(host_of)) < 2 else \
            torch.tensor(list(host_of), dtype=torch.int64)
        self.device = torch.device(device)
        self.layout = HeaderLayout(num_ranks)
        self.heap_offset = self.layout.nbytes
        self.heap_bytes = heap_bytes
        self.ll_offset = self.heap_offset + heap_bytes
        self.ll_bytes = ll_bytes
        self.timeout_s = float(timeout_s)
        self.timeout_ns = int(timeout_s * 1e9)
        self.pointers = list(pointers)
        # the kernels' bases[R] (csrc/kernels/transport.cuh): a view from word 1, word 0
        # (bases[-1]) being what network ranks need: the host proxy's command ring, or this
        # rank's own symmetric buffer for IBGDA (moe_comm/ibgda/path.py), else 0
        self.proxy, self.nvshmem = proxy, nvshmem
        first = proxy.address if proxy is not None else \
            self.pointers[rank] if nvshmem is not None else 0
        self.bases = memory.bases_tensor(first, self.pointers, device)
        self._registered = registered if registered is not None else []  # pinned host ranges
        # pinned: the kernels write it through its UVA address, the host reads it any time
        # (a CPU "device" only serves argument checks in CI: nothing runs there)
        self.err_host = torch.zeros(ERROR_HEADER + MAX_ERROR_RANKS, dtype=torch.int32,
                                    pin_memory=self.device.type == "cuda")
        self._err = self.err_host.numpy()
        self.err_dev = torch.zeros(4, dtype=torch.int32, device=device)
        self.counters = torch.zeros(len(COUNTER), dtype=torch.int32, device=device)
        # rank mask (csrc/kernels/transport.cuh Active): None until a rank can be masked, so
        # a plain group's kernels skip every check; else words 1.. of int32 [1 + R], word 0
        # telling the kernels whether a missed deadline masks (elastic) or is reported
        self.elastic = bool(elastic)
        self.active = None
        self.told = None                 # elastic: the ranks the last agreement kept
        self.masked_out = False          # this rank was masked by a mask the host knows
        self.agree_seq = 0
        # elastic: int64 [2R + 1], where each rank's normal-mode slabs start in its data
        # region (moved past the slabs a rank dropped mid-operation may still write: a late
        # writer), where the operation in flight ends there, and whether the next operation
        # moves them (csrc/kernels/normal.cuh Group)
        # elastic: int64 [4R], the LL combine rows held back from masked ranks that may still
        # write them (csrc/kernels/low_latency.cuh ReturnRows)
        self.floors = self.ll_holds = None
        if self.elastic:
            self._enable_masking()
            self.floors = torch.zeros(2 * num_ranks + 1, dtype=torch.int64, device=self.device)
            self.ll_holds = torch.zeros(4 * num_ranks, dtype=torch.int64, device=self.device)
        # int32 [R]: each rank's use_logfmt as the last LL combine receive read it from its
        # DONE word (-1: not heard); the kernel rewrites all of it every call, so it is
        # allocated once (no fill kernel on the combine's path). Read on a mismatch (check).
        self.ll_logfmt_seen = torch.full((num_ranks,), -1, dtype=torch.int32,
                                         device=self.device)
        self.epoch = 0
        self.notify_seq = 0
        # whose signatures a mismatch error reads (check): ("normal" / "ll", parity), or
        # ("ll_combine", the use_logfmt flags its receive kernel saw)
        self.last_call = ("normal", 0)
        self.ll_seq = {"dispatch": 0, "combine": 0}
        self.ll_layout = None            # the low-latency layout in use (signature.py)
        self._own_allocation = own_allocation
        self._opened = opened                       # peer pointers from cuIpcOpenMemHandle
        self._host_buffers = host_buffers           # emulator: the tensors behind `pointers`
        self._alive = True

    # -- kernels -----------------------------------------------------------------------------
    def kernels(self, variant) -> dict:
        """``{name: kernel}`` of ``variant`` as this group runs it: the NVRTC build (or the
        emulator's), or the IBGDA build (nvcc + NVSHMEM) when network ranks go through
        NVSHMEM."""
        if self.nvshmem is not None:
            return self.nvshmem.kernels(variant)
        return load_kernels(variant, self.device)

    # -- per-operation state -----------------------------------------------------------------
    def next_epoch(self) -> int:
        self.epoch = self.epoch % MAX_EPOCH + 1
        return self.epoch

    def next_notify_offsets(self):
        """Byte offsets of NOTIFY[parity][0] and CALL[parity][0] for the next notify (parities
        alternate; every normal op has one notify, which carries its call signature)."""
        parity = self.notify_seq % 2
        self.notify_seq += 1
        self.last_call = ("normal", parity)
        return self.layout.notify(parity, 0) * 8, self.layout.call(parity, 0) * 8

    def _call_rows(self) -> dict:
        """{rank: signature values} of the last call checked (``last_call``: a normal call's
        CALL rows or an LL dispatch's LL_CALL rows), read from this rank's header once the
        stream is idle: what the ranks said about it."""
        kind, which = self.last_call
        first = self.layout.call(which, 0) if kind == "normal" else self.layout.ll_call(which, 0)
        n = self.num_ranks * CALL_WORDS
        words = memory.read_words(self.device, self.pointers[self.rank] + first * 8, n)
        rows = words.reshape(self.num_ranks, CALL_WORDS) & VALUE_MASK
        live = self.active_ranks().cpu().tolist()
        return {r: rows[r] for r in range(self.num_ranks) if live[r]}

    def _mismatch_rows(self):
        """({rank: values}, field names) of the call a kErrMismatch was about: the call
        signatures (:meth:`_call_rows`), or for an LL combine receive (``last_call`` =
        ("ll_combine", int32 [R] device tensor)) each rank's use_logfmt as its DONE word said
        it (-1: not heard; csrc/kernels/low_latency.cuh ll_logfmt_agrees)."""
        kind, which = self.last_call
        if kind == "ll_combine":
            live = self.active_ranks().cpu().tolist()
            seen = which.cpu().tolist()
            return ({r: [v] for r, v in enumerate(seen) if v >= 0 and live[r]},
                    ("use_logfmt",))
        return self._call_rows(), NORMAL_CALL_FIELDS if kind == "normal" else LL_CALL_FIELDS

    def done_offset(self) -> int:
        return self.layout.done(0) * 8

    # -- rank masking --------------------------------------------------------------------------
    def _enable_masking(self) -> None:
        if self.active is not None:
            return
        words = torch.ones(1 + self.num_ranks, dtype=torch.int32, device=self.device)
        words[0] = int(self.elastic)
        self.active = words[1:]                 # the view keeps word 0 alive
        self.told = torch.ones(self.num_ranks, dtype=torch.int32, device=self.device)

    def mask(self, ranks, why: str) -> None:
        """Mask ``ranks`` (a list the host knows, e.g. from set_active_ranks), on the current
        stream: kernels queued after this skip them."""
        ranks = sorted(int(r) for r in ranks)
        if not ranks:
            return
        self._enable_masking()
        self.active[ranks] = 0
        if self.rank in ranks:
            self.masked_out = True
        log.warning("moe_comm rank %d: masking rank(s) %s (%s)", self.rank, ranks, why)

    def mask_where(self, keep: torch.Tensor) -> None:
        """Mask the ranks where ``keep`` (any device, [R]) is 0, without a host
        synchronisation (the Buffer's ``active_ranks=`` argument, Mooncake's device tensor).
        A host tensor that masks this rank makes the call raise RankMaskedError at once; a
        device tensor that does is only seen by the kernels (elastic: the call's agreement
        reports it)."""
        self._enable_masking()
        if keep.device.type == "cpu" and not bool(keep[self.rank]):
            self.masked_out = True
        self.active.mul_((keep.to(self.device, non_blocking=True) != 0).to(torch.int32))

    def _note_masked(self) -> None:
        """A kernel found this rank fenced or dropped by the survivors (kErrMasked, read from
        pinned memory without a synchronisation): this rank is out, in its own mask too."""
        if self._alive and int(self._err[0]) == ERR_MASKED and not self.masked_out:
            self.masked_out = True
            self._enable_masking()
            self.active[self.rank] = 0

    def active_ranks(self) -> torch.Tensor:
        """int32 [R] on the device (a copy; all ones while nothing was masked)."""
        self._note_masked()
        if self.active is None:
            return torch.ones(self.num_ranks, dtype=torch.int32, device=self.device)
        return self.active.clone()

    def masked_may_write(self) -> bool:
        """Whether a masked rank may still write late: any masked rank (this backend sees no
        processes). Reads the mask (a synchronisation; asked only on a layout change)."""
        return self.active is not None and bool((self.active == 0).any())

    def begin_call(self) -> None:
        """Start one call (or one half of a low-latency call): raise a pending error, refuse
        a rank masked out."""
        self.check()
        if self.masked_out:
            raise RankMaskedError(f"rank {self.rank} is masked out of this Buffer "
                                  "(active_ranks[rank] == 0); a new Buffer is needed to rejoin")

    def error_args(self, op: str):
        return (self.err_host, self.err_dev, OP[op])

    def counter(self, name: str) -> torch.Tensor:
        return self.counters[COUNTER[name]:COUNTER[name] + 1]

    # -- errors --------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a kernel of this rank reported an error (reads pinned memory, no sync)."""
        if not self._alive:
            raise RuntimeError("this CUDA communicator was destroyed")
        code = int(self._err[0])
        if code == 0:
            return
        op = OPS[int(self._err[1])] if 0 <= int(self._err[1]) < len(OPS) else "?"
        ranks = np.nonzero(self._err[ERROR_HEADER:ERROR_HEADER + self.num_ranks])[0].tolist()
        if code == ERR_TIMEOUT:
            raise CommTimeoutError(op, ranks, self.timeout_s)
        if code == ERR_MASKED:
            self.masked_out = True
            raise RankMaskedError(f"{op}: rank {self.rank} was masked out by its peers (it "
                                  "missed their deadline); a new Buffer is needed to rejoin")
        if code == ERR_PROXY:
            raise CudaCommError(f"{op}: the host proxy took no command for "
                                f"{2 * self.timeout_s + 5:g} s (moe_comm/cuda/kernel_proxy.py); "
                                "this communicator cannot reach other hosts any more: destroy "
                                "it")
        if code == ERR_MISMATCH:
            # every rank saw the same signatures and failed this call at its notify, before
            # any payload moved: once this rank's kernels of it are done, it is in step
            # with its peers again and the buffer serves the next call
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            rows, fields = self._mismatch_rows()
            self.err_host.zero_()
            self.err_dev.zero_()
            signature.check(op.split("/")[0], rows, fields)
            raise CudaCommError(f"{op}: the ranks' call signatures differ at rank(s) {ranks}")
        if code == ERR_PEER_FAILED:
            raise CudaCommError(f"{op}: rank(s) {ranks} failed this call (an error of their own, "
                                "which they raise); this communicator is out of step: destroy "
                                "it")
        if code == ERR_OVERFLOW:
            raise CudaCommError(f"{op}: more rows than the receive region holds at rank(s) "
                                f"{ranks} (num_worst_tokens or the buffer too small, or, "
                                "elastic, too little of it left beside what is held back from "
                                "a rank masked mid-call that may still write there; "
                                f"rows={int(self._err[3])})")
        raise CudaCommError(f"{op}: rank(s) {ranks} are not reachable by pointer and no "
                            "network transport is configured")

    def synchronize(self) -> None:
        """Wait for this rank's current stream, then :meth:`check`."""
        if self.device.type == "cuda":           # emulated kernels are done when launched
            torch.cuda.current_stream(self.device).synchronize()
        self.check()

    # -- tests ---------------------------------------------------------------------------------
    def poison_data(self, byte: int = 0xFF) -> None:
        """Fill this rank's normal-mode data region with ``byte`` on the current stream
        (tests: a row nobody wrote shows up as NaN / -1). Safe between operations: peers write
        there only after this rank's next notify, which the stream runs after the fill. (The
        LL region has no such barrier: a peer may already be writing the next call there.)"""
        memory.memset(self.device, self.pointers[self.rank] + self.heap_offset, byte,
                      self.heap_bytes)

    def poison_free_heap(self, byte: int = 0xFF) -> None:
        """The host backend's name for :meth:`poison_data` (the Buffer tests call it)."""
        self.poison_data(byte)

    def poison_ll(self, byte: int = 0xFF) -> None:
        """Fill this rank's low-latency region with ``byte`` (tests; between barriers only)."""
        memory.memset(self.device, self.pointers[self.rank] + self.ll_offset, byte,
                      self.ll_bytes, on_stream=False)

    def reset_ll(self) -> None:
        """Zero this rank's low-latency region and LL header slots and restart the LL call
        numbers (Buffer.clean_low_latency_buffer: collective, barriers around it, nothing in
        flight). Waits for the memset, so the caller's second barrier means "all clean"."""
        base = self.pointers[self.rank]
        first = self.layout.ll_first * 8
        memory.memset(self.device, base + first, 0, self.layout.num_words * 8 - first)
        memory.memset(self.device, base + self.ll_offset, 0, self.ll_bytes)
        if self.ll_holds is not None:   # the DONE words held rows wait on now read 0
            self.ll_holds[3 * self.num_ranks:] = 0
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.ll_seq = {"dispatch": 0, "combine": 0}

    # -- lifetime ------------------------------------------------------------------------------
    def _destroy_host_buffers(self, barrier: bool) -> None:
        """destroy() of buffers in host memory (emulator, local_group on the CPU, the proxy
        path): hand the proxy's last commands to the wire, meet the peers (nobody sends any
        more), stop the proxy and its transport, then unmap."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.proxy is not None:          # everything queued is on the wire before we meet
            self.proxy.flush(min(self.timeout_s, 5.0))
            self.proxy.transport.flush(raise_on_timeout=False)
        if barrier:
            _barrier(self.group)
        if self.proxy is not None:
            self.proxy.close()
            self.proxy.transport.close()
        memory.unregister_host(self._registered)
        if self.nvshmem is not None:       # the emulated symmetric heap: its last user frees
            self.nvshmem.release()
        buffers, self._host_buffers = self._host_buffers, None
        for b in buffers:                     # segments of from_group; local tensors just go
            if b is not None and hasattr(b, "close"):
                b.close()

    def destroy(self, barrier: bool = True) -> None:
        """Unmap peers and free this rank's buffer once the device is idle. With
        :meth:`from_group` it is collective (``barrier``): every rank unmaps its peers, meets
        the others, then frees its own buffer, so no allocation is freed while a peer still
        maps it (or, across hosts, still sends to it). Pass ``barrier=False`` when peers are
        gone (teardown after a failure); it is implied once a rank is masked, this one
        included (it may be dead: a group barrier would fail; and the survivors skip it too)."""
        if not self._alive:
            return
        self._note_masked()
        self._alive = False
        barrier = barrier and self.group is not None and not self.masked_out and (
            self.active is None or bool(self.active.all()))
        if self._host_buffers is not None:
            self._destroy_host_buffers(barrier)
            return
        torch.cuda.synchronize(self.device)
        if self.nvshmem is not None:       # symmetric heap: freeing is collective
            if barrier:
                _barrier(self.group)
            self.nvshmem.close(collective=barrier)
            return
        for p in self._opened:
            memory.ipc_close(p)
        self._opened = []
        if barrier:
            _barrier(self.group)
        if self._own_allocation:
            memory.free(self.pointers[self.rank])
