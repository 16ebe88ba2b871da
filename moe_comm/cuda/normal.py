"""Normal (high-throughput) mode on the CUDA backend.

Same calls, inputs and outputs as moe_comm/host/normal.py (``dispatch``/``combine`` with the
keyword arguments Buffer passes), for CUDA tensors. The protocol, as kernels queued on the
current stream (csrc/kernels/normal.cuh has the device side and the memory ordering):

dispatch, epoch e:
  layout    (fresh routing only) per-rank counts, is_token_in_rank, send positions [T, R]
  notify    count rows to every rank; the R x R matrix; the flow-control barrier
  [host]    without num_worst_tokens the host reads the matrix (the one synchronisation of
            the call): output sizes and the rounds (Rounds: one, or streamed), identical on
            every rank
  send      each token written once per destination rank straight into its data region at
            row = (tokens of lower source ranks) + (token's position among this rank's tokens
            for that destination): order by source rank, then token index
  wait      DONE from every rank
  copy-out  received region -> output tensors (padding rows with num_worst_tokens)
  (streamed: send / wait / copy-out once per round, each round after the first behind a
  barrier notify)
combine, epoch e: notify (as a barrier) -> send rows back into the owners' staging regions ->
  wait -> per-token float32 sum (+ bias) in the owner (streamed: send / wait / copy to a local
  staging tensor per round, then the one sum from it).

Across hosts (``comm.host_of``), a dispatch without num_worst_tokens whose regions fit in one
copy goes by relays (moe_comm/cuda/relay.py, csrc/kernels/relay.cuh): its notify also carries
each rank's token count per host, the send becomes stage / own rows / forward so a token
crosses to each other host once, and its combine (when it fits too) has each host's rows of a
token summed by the owner's relay there; copy-out and the reduce are the ones below. The same
outputs and handles. Relays are picked among the active ranks; an elastic call that loses a
rank the relays were picked among is redone flat over the survivors (relay.py).
A relayed call whose one copy does not fit (dispatch, or its combine at the dispatch's row
size, at least bf16) goes in token rounds (moe_comm/cuda/rounds.py): after the whole call's
notify, which then also carries each rank's token count, rounds of relayed calls over token
chunks, each with its own notify, their rows placed at the one-copy call's rows; the handle
is the whole call's and keeps the rounds for its combine and cached dispatches.
MOE_COMM_RELAY=0 goes flat, and so does every num_worst_tokens call (the host never reads
its counts, and DeepEP refuses num_worst_tokens across hosts): it streams when it must.

With ``num_worst_tokens`` the host never synchronises: every slab has exactly that many rows;
a receiver that would get more reports an overflow (raised as CudaCommError at the next call).

Buffer size and streaming. The single copy needs, in every rank's data region (``heap_bytes``,
the Buffer's num_nvl_bytes less the header), one wire.SlabLayout of the rows it receives:
dispatch ``max_d SlabLayout(n_d, row_bytes, scale_cols, topk).nbytes`` with n_d = the rows rank
d receives (sum_s m[s][d], or num_worst_tokens), combine ``max_s SlabLayout(c_s, hidden * elem,
0, topk).nbytes`` with c_s = the rows owner s gets back (sum_d m[s][d]); a SlabLayout of n rows
is about n * (row_bytes + 4 * scale_cols + 12 * topk) bytes (each sub-array rounded up to
wire.SLAB_ALIGN, the whole to a page). A call whose regions do not fit streams (:class:`Rounds`):
every region passes through a slab of ``chunk`` rows (as many as fit half the data region,
wire.stream_chunk_rows; the same on every rank, from the count matrix or num_worst_tokens and
the equal heap size) in ``ceil(max rows / chunk)`` rounds. Round r moves the rows
[r * chunk, (r + 1) * chunk) of every region into its slab at row - r * chunk; the receiver
copies them out (dispatch: into the outputs at row r * chunk; combine: into a local staging
tensor of c_me rows, reduced once at the end, so the result is the single copy's bit for bit).
Each round after the first starts with a barrier notify, so no sender overwrites a window its
receiver has not copied out. Each round has its own epoch, all taken when the geometry is
known, so ranks stay in step whatever fails; each wait has the group deadline; a rank that
fails a round marks its later signals failed and its peers fail at once. Cost per extra round:
one notify among all ranks, one send kernel that scans every token, one wait and one copy;
combine also holds a device tensor of SlabLayout(c_me) bytes and copies each row once more.
Only a row larger than half the data region is refused (BufferTooSmallError on every rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import relay, rounds
from .. import signature
from ..errors import BufferTooSmallError
from ..handle import DispatchHandle
from ..jit import variants
from ..jit.kernel_args import call_args, pack
from ..jit.launch import launch
from ..jit.nvrtc import load_kernels
from ..jit.variants import EXPERTS_PER_LAYOUT_BLOCK, THREADS
from ..layout import DispatchLayout
from ..wire import SlabLayout, stream_chunk_rows
from .comm import SIGNAL_STRIDE, CudaComm
from .elastic import agree
from .kernel_inputs import errors, group

DEFAULT_NUM_SMS = 20         # blocks of the data kernels (DeepEP's Buffer.num_sms default)
REDUCE_KERNEL = {torch.bfloat16: "moe_combine_reduce_bf16", torch.float16: "moe_combine_reduce_f16",
                 torch.float32: "moe_combine_reduce_f32"}


@dataclass(eq=False)
class CudaDispatchHandle(DispatchHandle):
    """A DispatchHandle whose tables live on the GPU.

    ``count_matrix`` (numpy) is None when the dispatch used num_worst_tokens (the host never
    saw it); ``num_recv_tokens`` is then num_worst_tokens. ``send_token_ids`` is unused (None).
    Device tensors: ``per_rank`` int32 [R] (this rank's notify row), ``send_pos`` int32 [T, R]
    (row of token t among this rank's tokens for rank d, -1 = not sent), ``matrix`` int32
    [R, R], ``recv_expert_counts`` int32 [E/R] rows received per local expert (or None
    without top-k).
    """

    per_rank: torch.Tensor = None
    send_pos: torch.Tensor = None
    matrix: torch.Tensor = None
    recv_expert_counts: torch.Tensor = None
    streamed: bool = False           # the dispatch streamed (see Rounds)
    # a dispatch that may go by relays (relay.wanted): its relay.Routes, kept for cached
    # dispatches and the combine; ``relay`` (DispatchHandle's field) is the same object when
    # this dispatch went by relays (then the combine may too), else None
    routes: object = None
    # a dispatch in token rounds (rounds.py): its rounds, each with its own handle; the
    # fields above are the whole call's (as the one-copy call's), for DeepEP-style clients
    rounds: object = None

    def rank_prefix_matrix(self) -> torch.Tensor:
        """DeepEP's ``handle[0]`` from the device matrix (no host synchronisation; also with
        num_worst_tokens, where the host never saw the counts)."""
        return self.matrix.cumsum(0, dtype=torch.int32)


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                    want_experts: bool = True) -> DispatchLayout:
    """CUDA twin of moe_comm.layout.dispatch_layout, with the send positions: ``topk_idx``
    int64 [T, K] (-1 = unused) -> DispatchLayout (per_rank, per_expert unless not
    ``want_experts``, in_rank, send_pos), computed by one kernel, no host synchronisation."""
    return DispatchLayout(*_layout(topk_idx, num_experts, num_ranks,
                                   want_experts=want_experts, want_pos=True))


def get_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """``(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)`` of
    :func:`dispatch_layout` (the tuple DeepEP's get_dispatch_layout returns)."""
    lay = dispatch_layout(topk_idx, num_experts, num_ranks)
    return lay.per_rank, lay.per_expert, lay.in_rank


def _layout(topk_idx, num_experts, num_ranks, *, want_experts, want_pos):
    device = topk_idx.device
    topk_idx = topk_idx.contiguous()
    num_tokens, topk = topk_idx.shape
    per_rank = torch.empty(num_ranks, dtype=torch.int32, device=device)
    per_expert = torch.empty(num_experts, dtype=torch.int32, device=device) if want_experts \
        else None
    in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=device)
    send_pos = torch.empty(num_tokens, num_ranks, dtype=torch.int32, device=device) if want_pos \
        else None
    grid = num_ranks + (-(-num_experts // EXPERTS_PER_LAYOUT_BLOCK) if want_experts else 0)
    layout_kernel = load_kernels(variants.intranode(), device)["moe_layout"]
    launch(layout_kernel, grid, THREADS["moe_layout"],
           pack("moe_layout", topk_idx=topk_idx, num_tokens=num_tokens, topk=topk,
                num_experts=num_experts, num_ranks=num_ranks, per_rank=per_rank,
                per_expert=per_expert, in_rank=in_rank, send_pos=send_pos), device=device)
    return per_rank, per_expert, in_rank, send_pos


def _notify(comm: CudaComm, k, epoch: int, counts, matrix, op: str, call_row,
            host_counts=None, host_matrix=None) -> None:
    """Notify (normal.cuh), carrying the call's signature ``call_row`` (moe_comm/signature.py):
    ranks that disagree about the call fail it together (CallMismatchError). A hierarchical
    dispatch also sends ``host_counts`` int32 [H] and gets ``host_matrix`` int32 [R, H]."""
    notify_off, call_off = comm.next_notify_offsets()
    launch(k["moe_notify"], 1, THREADS["moe_notify"],
           pack("moe_notify", **group(comm), **errors(comm, op), notify_off=notify_off,
                row_words=comm.layout.row_words, epoch=epoch, counts=counts, matrix=matrix,
                call_off=call_off, **call_args(call_row), host_counts=host_counts,
                num_hosts=0 if host_counts is None else int(host_counts.shape[0]),
                host_matrix=host_matrix), device=comm.device)


def _wait_done(comm: CudaComm, k, epoch: int, op: str) -> None:
    launch(k["moe_wait_done"], 1, THREADS["moe_wait_done"],
           pack("moe_wait_done", **group(comm), **errors(comm, op), done_off=comm.done_offset(),
                done_stride=SIGNAL_STRIDE, epoch=epoch), device=comm.device)


@dataclass(frozen=True)
class Rounds:
    """How one call's receive regions pass through the data regions: ``chunk`` 0 = the
    single copy (one round, every region whole); else every region streams through a slab of
    ``chunk`` rows, round r moving its rows [r * chunk, (r + 1) * chunk). ``epochs``: one per
    round. The same on every rank (computed from what every rank knows)."""

    chunk: int
    epochs: tuple

    def window(self, r: int, rows: int):
        """``(first, n)``: the rows of a region of ``rows`` rows that round r moves."""
        if not self.chunk:
            return 0, rows
        first = r * self.chunk
        return first, max(0, min(self.chunk, rows - first))


def _plan(comm: CudaComm, what: str, epoch: int, region_rows, row_bytes: int, scale_cols: int,
          topk: int) -> Rounds:
    """The rounds of a call whose receivers' regions hold ``region_rows`` rows (every rank's,
    known everywhere): one when every region's slab fits the data region, else streamed. Takes
    the extra rounds' epochs now. Raises BufferTooSmallError (on every rank alike) when not
    even one row fits half the data region."""
    most = max((int(n) for n in region_rows), default=0)
    if SlabLayout(most, row_bytes, scale_cols, topk).nbytes <= comm.heap_bytes:
        return Rounds(0, (epoch,))
    chunk = stream_chunk_rows(most, row_bytes, scale_cols, topk, comm.heap_bytes)
    if chunk <= 0:
        raise BufferTooSmallError(f"{what} (one row, streamed through half the buffer)",
                                  2 * SlabLayout(1, row_bytes, scale_cols, topk).nbytes,
                                  comm.heap_bytes)
    rounds = -(-most // chunk)
    return Rounds(chunk, (epoch,) + tuple(comm.next_epoch() for _ in range(rounds - 1)))


def _grid_for_rows(rows: int, num_sms: int) -> int:
    return max(1, min(-(-rows // (THREADS["moe_dispatch_copy_out"] // 32)), 4 * num_sms))


def dispatch(comm: CudaComm, *, x_bytes, dtype, hidden, scales, topk_idx, topk_weights,
             layout, handle, num_experts, num_worst_tokens, buffer_key,
             num_sms: int = DEFAULT_NUM_SMS, flat: bool = False, round_index=None):
    """Run one normal dispatch. ``x_bytes`` is x as uint8 ``[T, row_bytes]`` (CUDA).

    ``layout``: the DispatchLayout of ``topk_idx`` with its send positions (the Buffer's, from
    :func:`dispatch_layout`); None with a cached ``handle``, or to have it computed here.
    Returns ``(recv_x [N, H] dtype, recv_scales [N, S] in scales' dtype (float32 or int32)
    or None, recv_topk_idx int64
    [N, K] or None, recv_topk_weights f32 [N, K] or None, handle)``.
    One copy when every receiver's SlabLayout fits the data region, else streamed in rounds
    (module doc); raises BufferTooSmallError on every rank when one row exceeds half of it.
    ``flat``: no relays (the redo of a relayed call that lost a relay). A relayed call whose
    one copy does not fit goes in token rounds of relayed calls (rounds.py), unless it is
    itself round ``round_index`` of one (signed so: a rank left behind in a round never
    pairs with its peers' next call); num_worst_tokens calls stay flat (never rounds)."""
    comm.begin_call()
    if handle is not None and handle.rounds is not None:
        recv_x, recv_scales = rounds.cached_dispatch(
            dispatch, comm, handle.rounds,
            dict(x_bytes=x_bytes, dtype=dtype, hidden=hidden, scales=scales, topk_idx=None,
                 topk_weights=None, num_experts=num_experts, buffer_key=buffer_key,
                 num_sms=num_sms), handle.num_recv_tokens)
        return recv_x, recv_scales, None, None, handle
    args = dict(x_bytes=x_bytes, dtype=dtype, hidden=hidden, scales=scales, topk_idx=topk_idx,
                topk_weights=topk_weights, layout=layout, handle=handle,
                num_experts=num_experts, num_worst_tokens=num_worst_tokens,
                buffer_key=buffer_key, num_sms=num_sms, round_index=round_index)
    me, R, dev = comm.rank, comm.num_ranks, comm.device
    k = comm.kernels(variants.intranode())
    num_tokens, row_bytes = x_bytes.shape
    x_bytes = x_bytes.contiguous()
    scale_cols = 0 if scales is None else scales.shape[1]
    cached = handle is not None
    relaying = not flat and relay.wanted(comm, num_worst_tokens)
    host_counts = host_matrix = routes = None
    if relaying and cached:
        # relays picked among the mask the routes were made with, if it is still the mask
        # (read before the notify: what the last agreement left, the same on every rank)
        mask = relay.current_mask(comm)
        routes = handle.routes
        relaying = routes is not None and (
            mask is None or np.array_equal(routes.topo.relays.active, mask))
        routes = routes if relaying else None
    if cached:
        per_rank, in_rank, send_pos, matrix = (handle.per_rank, handle.is_token_in_rank,
                                               handle.send_pos, handle.matrix)
        topk, num_local, matrix_host = 0, 0, handle.count_matrix
    else:
        topk_idx = topk_idx.contiguous()
        topk = topk_idx.shape[1]
        num_local = num_experts // R
        if layout is None or layout.send_pos is None:
            layout = dispatch_layout(topk_idx, num_experts, R, want_experts=False)
        per_rank, in_rank, send_pos = layout.per_rank, layout.in_rank, layout.send_pos
        matrix = torch.empty(R, R, dtype=torch.int32, device=dev)
        matrix_host = None
        if relaying:
            # the notify also carries this rank's token count per host, then its token count
            # (the number of token rounds, if the call needs them: rounds.py); R + H + 1
            # words fit a NOTIFY row (row_words >= 2R + 1)
            topo = relay.topology(comm)
            host_counts, host_pos = relay.host_positions(topo, in_rank)
            host_counts = torch.cat([host_counts, torch.tensor(
                [num_tokens], dtype=torch.int32, device=dev)])
            host_matrix = torch.empty(R, topo.num_hosts + 1, dtype=torch.int32, device=dev)
    epoch = comm.next_epoch()
    call_row = signature.of_dispatch(hidden=hidden, dtype=dtype, scales=scales,
                                     topk_idx=topk_idx, num_experts=num_experts or 0,
                                     num_worst_tokens=num_worst_tokens, handle=handle,
                                     round_index=round_index)
    _notify(comm, k, epoch, per_rank, None if cached else matrix, "dispatch/notify", call_row,
            host_counts, host_matrix)
    if not cached:        # elastic: one mask, and one count matrix, on every survivor
        agree(comm, "dispatch/notify", matrix)

    if num_worst_tokens:
        rows_out = num_worst_tokens
        # every rank checks every column (a cached handle's matrix is known everywhere), so
        # all raise together and no peer is left waiting for rows
        most = int(matrix_host.sum(0).max()) if matrix_host is not None else 0
        if most > num_worst_tokens:
            raise ValueError(f"num_worst_tokens={num_worst_tokens} is smaller than the "
                             f"{most} tokens a rank receives")
        region_rows = [num_worst_tokens] * R      # the geometry needs no matrix
    else:
        if matrix_host is None:
            matrix_host = matrix.cpu().numpy().astype(np.int64)   # waits for notify
            comm.check()
            if relaying:      # relays among the ranks the notify's agreement kept
                topo = relay.topology(comm, relay.current_mask(comm))
        region_rows = matrix_host.sum(0)
        rows_out = int(region_rows[me])
    if relaying and not cached:
        host_tokens = host_matrix.cpu().numpy().astype(np.int64)  # [R, H] tokens, [R] tokens
        planner = rounds.Planner(comm, matrix_host, host_tokens[:, :-1], host_tokens[:, -1],
                                 row_bytes, scale_cols, topk,
                                 rounds.combine_row_bytes(hidden, dtype))
        chunk = 0 if round_index is not None else planner.chunk(topo, 0)
        if chunk:
            return _dispatch_in_rounds(comm, args, epoch, planner, chunk, per_rank, in_rank,
                                       send_pos, matrix, rows_out)
    plan = _plan(comm, "dispatch", epoch, region_rows, row_bytes, scale_cols, topk)
    if relaying and not cached:
        routes = relay.Routes(topo, matrix_host, host_tokens[:, :-1], host_pos,
                              relay.first_per_host(topo, send_pos))
    by_relay = routes is not None and not plan.chunk and relay.dispatch_fits(
        routes, relay.capacity(comm), row_bytes, scale_cols, topk)

    recv_x = torch.empty(rows_out, row_bytes, dtype=torch.uint8, device=dev)
    # the kernels copy scale_cols 4-byte words per row (declared float*): int32 scales
    # (UE8M0 packed) travel as the same bytes and come back in their own dtype
    recv_scales = torch.empty(rows_out, scale_cols, dtype=scales.dtype, device=dev) \
        if scales is not None else None
    recv_idx = torch.empty(rows_out, topk, dtype=torch.int64, device=dev) if topk else None
    recv_w = torch.empty(rows_out, topk, dtype=torch.float32, device=dev) if topk else None
    expert_counts = torch.zeros(num_local, dtype=torch.int32, device=dev) if topk else None
    send = dict(x=x_bytes, num_tokens=num_tokens, row_bytes=row_bytes,
                scales=None if scales is None else scales.contiguous(), scale_cols=scale_cols,
                topk_idx=topk_idx if topk else None,
                topk_w=None if topk_weights is None or not topk else topk_weights.contiguous(),
                topk=topk, num_local=num_local, send_pos=send_pos, matrix=matrix,
                worst=num_worst_tokens)
    outs = dict(recv_x=recv_x, recv_scales=recv_scales, recv_idx=recv_idx, recv_w=recv_w,
                expert_counts=expert_counts)
    if by_relay:          # one copy, through the relays (relay.py), then the flat copy-out
        if routes.relay_pos is None:
            routes.relay_pos = torch.full((routes.stage_rows(me), len(routes.topo.local)), -1,
                                          dtype=torch.int32, device=dev)
        relay.dispatch(comm, k, routes, (comm.next_epoch(), epoch), send, num_sms,
                       routes.relay_pos)
        if comm.elastic:
            agree(comm, "dispatch/payload", floors=comm.floors, late=relay.PATIENT_TIMEOUTS)
            if relay.lost(comm, routes):
                # a rank the relays were picked among is gone: it may have been relaying
                # healthy ranks' rows. Every survivor sees it in the same agreed mask and
                # redoes the call flat over the survivors (host/normal.py does the same)
                if cached:
                    handle.relay = handle.routes = None
                return dispatch(comm, **args, flat=True)
        _copy_out(comm, k, plan, 0, rows_out, send, outs, num_sms)
    for r, ep in enumerate(() if by_relay else plan.epochs):
        if r:        # the barrier: every receiver has copied the last window out
            _notify(comm, k, ep, None, None, "dispatch/notify", call_row)
        first, n = plan.window(r, rows_out)
        _dispatch_round(comm, k, plan, ep, first, n, send, outs, num_sms)
    if not cached:
        handle = CudaDispatchHandle(
            buffer_key, num_tokens, hidden, matrix_host, in_rank, None,
            rows_out, num_worst_tokens, call_id=epoch, per_rank=per_rank, send_pos=send_pos,
            matrix=matrix, recv_expert_counts=expert_counts, streamed=bool(plan.chunk),
            routes=routes, relay=routes if by_relay else None)
    return recv_x.view(dtype), recv_scales, recv_idx, recv_w, handle


def _dispatch_in_rounds(comm: CudaComm, args: dict, epoch: int, planner, chunk: int,
                        per_rank, in_rank, send_pos, matrix, rows_out: int):
    """A relayed dispatch whose one copy does not fit, after its notify: token rounds of
    relayed calls (rounds.py). The handle is the whole call's, with the rounds on it."""
    whole = {name: args[name] for name in ("x_bytes", "dtype", "hidden", "scales", "topk_idx",
                                           "topk_weights", "num_experts", "buffer_key",
                                           "num_sms")}
    (recv_x, recv_scales, recv_idx, recv_w), expert_counts, plan = rounds.dispatch(
        dispatch, comm, whole, in_rank, planner, chunk)
    handle = CudaDispatchHandle(
        args["buffer_key"], args["x_bytes"].shape[0], args["hidden"], planner.matrix, in_rank,
        None, rows_out, 0, call_id=epoch, per_rank=per_rank, send_pos=send_pos, matrix=matrix,
        recv_expert_counts=expert_counts, rounds=plan)
    return recv_x, recv_scales, recv_idx, recv_w, handle


def _send_window(comm: CudaComm, k, kind: str, plan: Rounds, epoch: int, first: int,
                 send: dict, num_sms: int) -> None:
    """``kind`` ("dispatch" or "combine"): send this round's window of every receiver's
    region, wait for every sender's DONE, agree on the mask (elastic)."""
    kernel = f"moe_{kind}_send"
    launch(k[kernel], max(1, num_sms), THREADS[kernel],
           pack(kernel, **group(comm), **errors(comm, f"{kind}/send"), **send,
                chunk=plan.chunk, first=first, done_off=comm.done_offset(),
                done_stride=SIGNAL_STRIDE, epoch=epoch, counter=comm.counter(f"{kind}_send")),
           device=comm.device)
    _wait_done(comm, k, epoch, f"{kind}/payload")
    agree(comm, f"{kind}/payload", floors=comm.floors)


def _dispatch_round(comm: CudaComm, k, plan: Rounds, epoch: int, first: int, rows: int,
                    send: dict, outs: dict, num_sms: int) -> None:
    """One round of a dispatch (the only one of a single copy): send this round's window of
    every receiver's region, wait for every sender's DONE, agree on the mask (elastic), copy
    this rank's ``rows`` rows of the window into the outputs from row ``first``."""
    _send_window(comm, k, "dispatch", plan, epoch, first, send, num_sms)
    _copy_out(comm, k, plan, first, rows, send, outs, num_sms)


def _copy_out(comm: CudaComm, k, plan: Rounds, first: int, rows: int, send: dict, outs: dict,
              num_sms: int) -> None:
    """This rank's ``rows`` rows of its slab (this round's window) into the outputs from row
    ``first``."""
    if not rows:
        return
    at = {name: None if t is None else t[first:first + rows] for name, t in outs.items()
          if name != "expert_counts"}
    topk, scale_cols = send["topk"], send["scale_cols"]
    launch(k["moe_dispatch_copy_out"], _grid_for_rows(rows, num_sms),
           THREADS["moe_dispatch_copy_out"],
           pack("moe_dispatch_copy_out", **group(comm), row_bytes=send["row_bytes"],
                scale_cols=scale_cols, topk=topk, matrix=send["matrix"], worst=send["worst"],
                chunk=plan.chunk, first=first, rows_out=rows, **at,
                expert_counts=outs["expert_counts"], num_local=send["num_local"]),
           device=comm.device)


def aligned_expert_counts(handle: CudaDispatchHandle, alignment: int) -> torch.Tensor:
    """Rows received per local expert, each rounded up to ``alignment`` (int32 device tensor,
    no host synchronisation; ``.tolist()`` gives DeepEP's num_recv_tokens_per_expert_list)."""
    c = handle.recv_expert_counts
    return (c + alignment - 1) // alignment * alignment


def combine(comm: CudaComm, *, x, handle: CudaDispatchHandle, topk_weights, bias,
            num_sms: int = DEFAULT_NUM_SMS):
    """Run one normal combine. ``x`` [N, H] bf16/fp16/fp32 (CUDA): this rank's expert outputs
    in received order (only the real rows are read when N = num_worst_tokens);
    ``topk_weights`` f32 [N, K] or None; ``bias`` a tuple of up to two f32 [T, H] tensors.
    Returns ``(combined_x [T, H] in x's dtype, combined_topk_weights f32 [T, K] or None)``.
    Streams (module doc) when an owner's returned rows do not fit the data region; the result
    is the single copy's bit for bit."""
    comm.begin_call()
    dev = comm.device
    k = comm.kernels(variants.intranode())
    if x.dtype not in REDUCE_KERNEL:
        raise TypeError(f"combine x must be bf16, fp16 or fp32, got {x.dtype}")
    x = x.contiguous()
    if handle.rounds is not None:       # one combine per round, with the round's handle
        return rounds.combine(combine, comm, handle.rounds, x=x, topk_weights=topk_weights,
                              bias=bias, num_tokens=handle.num_tokens, num_sms=num_sms)
    hidden, num_tokens = x.shape[1], handle.num_tokens
    row_bytes = hidden * x.element_size()
    topk = 0 if topk_weights is None else topk_weights.shape[1]
    routes = handle.relay
    if routes is not None and comm.active is not None:
        # relays picked at the dispatch serve only while the mask is the same (read before
        # the notify: what the last agreement left, the same on every rank); else flat, and
        # the handle loses its relays
        mask = relay.current_mask(comm)
        if not np.array_equal(routes.topo.relays.active, mask):
            handle.relay = routes = None
    epoch = comm.next_epoch()
    call_row = signature.of_combine(x=x, topk_weights=topk_weights, handle=handle)
    _notify(comm, k, epoch, None, None, "combine/notify", call_row)
    plan, rows_back = _combine_plan(comm, handle, epoch, row_bytes, topk)
    by_relay = (routes is not None and relay.wanted(comm, 0) and not plan.chunk
                and relay.combine_fits(routes, relay.capacity(comm), row_bytes, topk))
    # a streamed combine gathers its rows here, off the communication buffer, and reduces
    # them once at the end: the single copy's reduction over the same rows, in the same order
    staged = torch.empty(SlabLayout(rows_back, row_bytes, 0, topk).nbytes, dtype=torch.uint8,
                         device=dev) if plan.chunk else None
    send = dict(x=x, row_bytes=row_bytes,
                topk_w=None if topk_weights is None else topk_weights.contiguous(), topk=topk,
                matrix=handle.matrix)
    if by_relay:          # every row this rank sums into its slab, through the relays
        relay.combine(comm, k, routes, epoch, x=x, topk_weights=send["topk_w"],
                      num_sms=num_sms)
        if comm.elastic:
            agree(comm, "combine/payload", floors=comm.floors, late=relay.PATIENT_TIMEOUTS)
            if relay.lost(comm, routes):
                # a rank the relays were picked among is gone (it may have held partial sums
                # of healthy ranks' rows): every survivor redoes the combine flat, and the
                # handle loses its relays (dispatch's redo, above)
                handle.relay = None
                return combine(comm, x=x, handle=handle, topk_weights=topk_weights,
                               bias=bias, num_sms=num_sms)
    for r, ep in enumerate(() if by_relay else plan.epochs):
        if r:        # the barrier: every owner has copied the last window out
            _notify(comm, k, ep, None, None, "combine/notify", call_row)
        first, n = plan.window(r, rows_back)
        _combine_round(comm, k, plan, ep, first, n, rows_back, send, staged, num_sms)

    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=dev)
    w_out = torch.empty(num_tokens, topk, dtype=torch.float32, device=dev) if topk else None
    biases = [None, None]
    for i, b in enumerate(bias or ()):
        biases[i] = b.to(device=dev, dtype=torch.float32).contiguous()
    if num_tokens:
        reduce = REDUCE_KERNEL[x.dtype]
        launch(k[reduce], min(num_tokens, 8 * max(1, num_sms)), THREADS[reduce],
               pack(reduce, **group(comm), hidden=hidden, topk=topk, matrix=handle.matrix,
                    send_pos=routes.send_pos_first if by_relay else handle.send_pos,
                    num_tokens=num_tokens, bias0=biases[0],
                    bias1=biases[1], out=out, w_out=w_out, staged=staged), device=dev)
    return out, w_out


def _combine_plan(comm: CudaComm, handle: CudaDispatchHandle, epoch: int, row_bytes: int,
                  topk: int):
    """``(Rounds, rows this rank gets back)``. Owner s gets back sum_d m[s][d] rows. A
    num_worst_tokens handle's matrix never reached the host: its combine keeps the single copy
    (a receiver that would overflow reports it, as before) unless its dispatch streamed - a
    batch too large for one copy - when the host reads the matrix once, here, to size the
    rounds (the same on every rank: the matrix is after the mask agreement)."""
    counts = handle.count_matrix
    if counts is None and handle.streamed:
        counts = handle.matrix.cpu().numpy().astype(np.int64)
        comm.check()
    if counts is None:
        return Rounds(0, (epoch,)), 0
    back = counts.sum(1)
    return (_plan(comm, "combine", epoch, back, row_bytes, 0, topk),
            int(back[comm.rank]))


def _combine_round(comm: CudaComm, k, plan: Rounds, epoch: int, first: int, rows: int,
                   rows_back: int, send: dict, staged, num_sms: int) -> None:
    """One round of a combine (the only one of a single copy): send this round's window of
    every owner's staging rows, wait for DONE, agree on the mask (elastic), and, streamed,
    copy this rank's ``rows`` rows of the window into ``staged`` from row ``first``."""
    _send_window(comm, k, "combine", plan, epoch, first, send, num_sms)
    if staged is None or not rows:
        return
    launch(k["moe_combine_stage"], _grid_for_rows(rows, num_sms), THREADS["moe_combine_stage"],
           pack("moe_combine_stage", **group(comm), row_bytes=send["row_bytes"],
                topk=send["topk"], chunk=plan.chunk, first=first, rows=rows, total=rows_back,
                staged=staged), device=comm.device)
