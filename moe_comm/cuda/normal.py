"""Normal (high-throughput) mode on the CUDA backend.

Same calls, inputs and outputs as moe_comm/host/normal.py (``dispatch``/``combine`` with the
keyword arguments Buffer passes), for CUDA tensors. The protocol, as kernels queued on the
current stream (csrc/kernels/normal.cuh has the device side and the memory ordering):

dispatch, epoch e:
  layout    (fresh routing only) per-rank counts, is_token_in_rank, send positions [T, R]
  notify    count rows to every rank; the R x R matrix; the flow-control barrier
  [host]    without num_worst_tokens the host reads the matrix (the one synchronisation of
            the call): output sizes and the capacity check, identical on every rank
  send      each token written once per destination rank straight into its data region at
            row = (tokens of lower source ranks) + (token's position among this rank's tokens
            for that destination): order by source rank, then token index
  wait      DONE from every rank
  copy-out  received region -> output tensors (padding rows with num_worst_tokens)
combine, epoch e: notify (as a barrier) -> send rows back into the owners' staging regions ->
  wait -> per-token float32 sum (+ bias) in the owner.

With ``num_worst_tokens`` the host never synchronises: every slab has exactly that many rows;
a receiver that would get more reports an overflow (raised as CudaCommError at the next call).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import signature
from ..errors import BufferTooSmallError
from ..handle import DispatchHandle
from ..jit import variants
from ..jit.kernel_args import call_args, pack
from ..jit.launch import launch
from ..jit.nvrtc import load_kernels
from ..jit.variants import EXPERTS_PER_LAYOUT_BLOCK, THREADS
from ..layout import DispatchLayout
from ..wire import SlabLayout
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


def _notify(comm: CudaComm, k, epoch: int, counts, matrix, op: str, call_row) -> None:
    """Notify (normal.cuh), carrying the call's signature ``call_row`` (moe_comm/signature.py):
    ranks that disagree about the call fail it together (CallMismatchError)."""
    notify_off, call_off = comm.next_notify_offsets()
    launch(k["moe_notify"], 1, THREADS["moe_notify"],
           pack("moe_notify", **group(comm), **errors(comm, op), notify_off=notify_off,
                row_words=comm.layout.row_words, epoch=epoch, counts=counts, matrix=matrix,
                call_off=call_off, **call_args(call_row)), device=comm.device)


def _wait_done(comm: CudaComm, k, epoch: int, op: str) -> None:
    launch(k["moe_wait_done"], 1, THREADS["moe_wait_done"],
           pack("moe_wait_done", **group(comm), **errors(comm, op), done_off=comm.done_offset(),
                done_stride=SIGNAL_STRIDE, epoch=epoch), device=comm.device)


def _check_capacity(comm: CudaComm, what: str, layouts) -> None:
    need = max((lay.nbytes for lay in layouts), default=0)
    if need > comm.heap_bytes:
        raise BufferTooSmallError(what, need, comm.heap_bytes)


def _grid_for_rows(rows: int, num_sms: int) -> int:
    return max(1, min(-(-rows // (THREADS["moe_dispatch_copy_out"] // 32)), 4 * num_sms))


def dispatch(comm: CudaComm, *, x_bytes, dtype, hidden, scales, topk_idx, topk_weights,
             layout, handle, num_experts, num_worst_tokens, buffer_key,
             num_sms: int = DEFAULT_NUM_SMS):
    """Run one normal dispatch. ``x_bytes`` is x as uint8 ``[T, row_bytes]`` (CUDA).

    ``layout``: the DispatchLayout of ``topk_idx`` with its send positions (the Buffer's, from
    :func:`dispatch_layout`); None with a cached ``handle``, or to have it computed here.
    Returns ``(recv_x [N, H] dtype, recv_scales [N, S] in scales' dtype (float32 or int32)
    or None, recv_topk_idx int64
    [N, K] or None, recv_topk_weights f32 [N, K] or None, handle)``."""
    comm.begin_call()
    me, R, dev = comm.rank, comm.num_ranks, comm.device
    k = comm.kernels(variants.intranode())
    num_tokens, row_bytes = x_bytes.shape
    x_bytes = x_bytes.contiguous()
    scale_cols = 0 if scales is None else scales.shape[1]
    cached = handle is not None
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
    epoch = comm.next_epoch()
    call_row = signature.of_dispatch(hidden=hidden, dtype=dtype, scales=scales,
                                     topk_idx=topk_idx, num_experts=num_experts or 0,
                                     num_worst_tokens=num_worst_tokens, handle=handle)
    _notify(comm, k, epoch, per_rank, None if cached else matrix, "dispatch/notify", call_row)
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
        _check_capacity(comm, "dispatch",
                        [SlabLayout(num_worst_tokens, row_bytes, scale_cols, topk)])
    else:
        if matrix_host is None:
            matrix_host = matrix.cpu().numpy().astype(np.int64)   # waits for notify
            comm.check()
        recv_rows = matrix_host.sum(0)
        rows_out = int(recv_rows[me])
        _check_capacity(comm, "dispatch", [SlabLayout(int(n), row_bytes, scale_cols, topk)
                                           for n in recv_rows])

    launch(k["moe_dispatch_send"], max(1, num_sms), THREADS["moe_dispatch_send"],
           pack("moe_dispatch_send", **group(comm), **errors(comm, "dispatch/send"), x=x_bytes,
                num_tokens=num_tokens, row_bytes=row_bytes,
                scales=None if scales is None else scales.contiguous(), scale_cols=scale_cols,
                topk_idx=topk_idx if topk else None,
                topk_w=None if topk_weights is None or not topk else topk_weights.contiguous(),
                topk=topk, num_local=num_local, send_pos=send_pos, matrix=matrix,
                worst=num_worst_tokens, done_off=comm.done_offset(), done_stride=SIGNAL_STRIDE,
                epoch=epoch, counter=comm.counter("dispatch_send")), device=dev)
    _wait_done(comm, k, epoch, "dispatch/payload")
    agree(comm, "dispatch/payload", floors=comm.floors)

    recv_x = torch.empty(rows_out, row_bytes, dtype=torch.uint8, device=dev)
    # the kernels copy scale_cols 4-byte words per row (declared float*): int32 scales
    # (UE8M0 packed) travel as the same bytes and come back in their own dtype
    recv_scales = torch.empty(rows_out, scale_cols, dtype=scales.dtype, device=dev) \
        if scales is not None else None
    recv_idx = torch.empty(rows_out, topk, dtype=torch.int64, device=dev) if topk else None
    recv_w = torch.empty(rows_out, topk, dtype=torch.float32, device=dev) if topk else None
    expert_counts = torch.zeros(num_local, dtype=torch.int32, device=dev) if topk else None
    if rows_out:
        launch(k["moe_dispatch_copy_out"], _grid_for_rows(rows_out, num_sms),
               THREADS["moe_dispatch_copy_out"],
               pack("moe_dispatch_copy_out", **group(comm), row_bytes=row_bytes,
                    scale_cols=scale_cols, topk=topk, matrix=matrix, worst=num_worst_tokens,
                    rows_out=rows_out, recv_x=recv_x, recv_scales=recv_scales,
                    recv_idx=recv_idx, recv_w=recv_w, expert_counts=expert_counts,
                    num_local=num_local), device=dev)
    if not cached:
        handle = CudaDispatchHandle(
            buffer_key, num_tokens, hidden, matrix_host, in_rank, None,
            rows_out, num_worst_tokens, call_id=epoch, per_rank=per_rank, send_pos=send_pos,
            matrix=matrix, recv_expert_counts=expert_counts)
    return recv_x.view(dtype), recv_scales, recv_idx, recv_w, handle


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
    Returns ``(combined_x [T, H] in x's dtype, combined_topk_weights f32 [T, K] or None)``."""
    comm.begin_call()
    R, dev = comm.num_ranks, comm.device
    k = comm.kernels(variants.intranode())
    if x.dtype not in REDUCE_KERNEL:
        raise TypeError(f"combine x must be bf16, fp16 or fp32, got {x.dtype}")
    x = x.contiguous()
    hidden, num_tokens = x.shape[1], handle.num_tokens
    row_bytes = hidden * x.element_size()
    topk = 0 if topk_weights is None else topk_weights.shape[1]
    epoch = comm.next_epoch()
    _notify(comm, k, epoch, None, None, "combine/notify",
            signature.of_combine(x=x, topk_weights=topk_weights, handle=handle))
    if handle.count_matrix is not None:
        sent = handle.count_matrix.sum(1)
        _check_capacity(comm, "combine", [SlabLayout(int(n), row_bytes, 0, topk) for n in sent])
    launch(k["moe_combine_send"], max(1, num_sms), THREADS["moe_combine_send"],
           pack("moe_combine_send", **group(comm), **errors(comm, "combine/send"), x=x,
                row_bytes=row_bytes,
                topk_w=None if topk_weights is None else topk_weights.contiguous(), topk=topk,
                matrix=handle.matrix, done_off=comm.done_offset(), done_stride=SIGNAL_STRIDE,
                epoch=epoch, counter=comm.counter("combine_send")), device=dev)
    _wait_done(comm, k, epoch, "combine/payload")
    agree(comm, "combine/payload", floors=comm.floors)

    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=dev)
    w_out = torch.empty(num_tokens, topk, dtype=torch.float32, device=dev) if topk else None
    biases = [None, None]
    for i, b in enumerate(bias or ()):
        biases[i] = b.to(device=dev, dtype=torch.float32).contiguous()
    if num_tokens:
        reduce = REDUCE_KERNEL[x.dtype]
        launch(k[reduce], min(num_tokens, 8 * max(1, num_sms)), THREADS[reduce],
               pack(reduce, **group(comm), hidden=hidden, topk=topk, matrix=handle.matrix,
                    send_pos=handle.send_pos, num_tokens=num_tokens, bias0=biases[0],
                    bias1=biases[1], out=out, w_out=w_out), device=dev)
    return out, w_out
