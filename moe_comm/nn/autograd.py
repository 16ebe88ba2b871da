"""Differentiable normal-mode dispatch and combine.

Dispatch copies each token to the ranks of its experts; its adjoint sums the gradients of
those copies back per token, which is exactly a combine with the same handle. Combine sums
expert outputs per token; its adjoint sends the token's gradient to every copy, which is a
dispatch with the cached handle (no count exchange). So the backward of one is the other,
run with the forward's handle.

Collective order: every rank builds the same graph (same layers, same calls), and the
autograd engine runs it in the same order everywhere, so the backward communication lines up
across ranks. :meth:`moe_comm.nn.experts.LocalExperts.compute_rows` keeps every rank's graph
connected even when it received no rows, so no rank skips a backward call that its peers
make.

Low-latency calls are not differentiable (their combine weights tokens on the owner, whose
adjoint would need every expert output row there); MoELayer uses normal mode whenever a
gradient is needed.
"""
from __future__ import annotations

import torch


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, num_experts, sink):
        ntr, _, nte, itr, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte,
            topk_idx=topk_idx, topk_weights=topk_weights)
        # ids and weights are small: copy them out, so holding them (the expert graph saves
        # the weights) does not pin the received region of the buffer's heap
        recv_idx = recv_idx.clone()
        recv_w = recv_w.clone() if recv_w is not None else None
        ctx.buffer, ctx.handle = buffer, handle
        ctx.x_dtype, ctx.has_w = x.dtype, topk_weights is not None
        ctx.local = recv_idx >= 0
        ctx.mark_non_differentiable(recv_idx)
        sink["handle"] = handle
        if recv_w is None:
            return recv_x, recv_idx
        return recv_x, recv_idx, recv_w

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_w=None):
        gw = None
        if ctx.has_w:
            # a slot whose expert lives elsewhere received a constant 0, not the weight
            gw = torch.where(ctx.local, grad_w.float(), 0.0).contiguous()
        gx, gw, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=gw)
        return gx.to(ctx.x_dtype), gw, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, buffer, handle):
        ctx.buffer, ctx.handle = buffer, handle
        out, _, _ = buffer.combine(y.contiguous(), handle)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_y = ctx.buffer.dispatch(grad_out.contiguous(), handle=ctx.handle)[0]
        return grad_y, None, None


def dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor,
             topk_weights: torch.Tensor | None, num_experts: int):
    """Differentiable :meth:`moe_comm.Buffer.dispatch` (normal mode).

    Args:
        buffer: the :class:`moe_comm.Buffer` of the group.
        x: [T, H] bf16/fp16/fp32 tokens (gradient flows back to it).
        topk_idx: int64 [T, K] expert ids in [0, num_experts), -1 for unused slots.
        topk_weights: float32 [T, K] or None (gradient flows back to it).
        num_experts: total experts E (physical slots when replicas are used).
    Returns:
        recv_x [N, H] (a view of the buffer's heap until dropped), recv_topk_idx int64 [N, K]
        (local ids, -1 elsewhere), recv_topk_weights float32 [N, K] or None, handle.
    """
    sink = {}
    out = _Dispatch.apply(x, topk_weights, buffer, topk_idx, num_experts, sink)
    recv_x, recv_idx = out[0], out[1]
    recv_w = out[2] if len(out) > 2 else None
    return recv_x, recv_idx, recv_w, sink["handle"]


def combine(buffer, x: torch.Tensor, handle) -> torch.Tensor:
    """Differentiable :meth:`moe_comm.Buffer.combine` (normal mode, no weights or bias).

    Args:
        buffer: the Buffer that made ``handle``.
        x: [N, H] this rank's expert outputs in received order (gradient flows back to it).
        handle: the dispatch handle.
    Returns:
        [T, H] per-token sums in x's dtype.
    """
    return _Combine.apply(x, buffer, handle)
