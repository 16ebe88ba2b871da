"""Deterministic test inputs: the same (case, rank) gives the same tensors in the rank process
and in the parent that computes the reference."""
from __future__ import annotations

import torch

ROUTINGS = ("random", "skewed", "holes", "empty", "one_rank")


def routing(kind, num_tokens, num_experts, topk, gen):
    """int64 [T, K] expert ids (-1 = unused slot)."""
    if num_tokens == 0:
        return torch.empty(0, topk, dtype=torch.int64)
    if kind == "empty":
        return torch.full((num_tokens, topk), -1, dtype=torch.int64)
    if kind == "one_rank":          # every token's experts among the first K experts (rank 0)
        return torch.stack([torch.randperm(topk, generator=gen) for _ in range(num_tokens)])
    if kind == "skewed":            # Zipf-like popularity
        p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
        p = p[torch.randperm(num_experts, generator=gen)]
        return torch.multinomial(p.expand(num_tokens, -1), topk, generator=gen)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:topk]
                       for _ in range(num_tokens)])
    if kind == "holes":
        idx[torch.rand(idx.shape, generator=gen) < 0.35] = -1
    return idx


def per_block_fp8(x: torch.Tensor):
    """Cast [T, H] to (float8_e4m3fn [T, H], float32 scales [T, H/128]) with per-128 amax."""
    t, h = x.shape
    blocks = x.float().view(t, h // 128, 128)
    scale = blocks.abs().amax(-1).clamp(min=1e-4) / 448.0
    data = (blocks / scale.unsqueeze(-1)).view(t, h).to(torch.float8_e4m3fn)
    return data, scale


def make_inputs(case, rank):
    """x (tensor or fp8 tuple), topk_idx, topk_weights, bias or None for ``rank``."""
    gen = torch.Generator().manual_seed(case["seed"] * 1009 + rank)
    t = case["tokens"][rank]
    h, e, k = case["hidden"], case["experts"], case["topk"]
    x = torch.randn(t, h, generator=gen)
    idx = routing(case["routing"], t, e, k, gen)
    w = torch.rand(t, k, generator=gen)
    bias = torch.randn(t, h, generator=gen) if case.get("bias") else None
    dtype = case["dtype"]
    if dtype == "fp8":
        x = per_block_fp8(x)
    else:
        x = x.to(getattr(torch, dtype))
        bias = None if bias is None else bias.to(x.dtype)
    return x, idx, w, bias


def expert_fn(recv_x, rank):
    """What the 'experts' do on ``rank`` before combine: a rank-dependent scaling, in bf16 for
    fp8 input (combine sends bf16), else in the input dtype."""
    if isinstance(recv_x, tuple):
        data, scales = recv_x
        y = (data.float().view(data.shape[0], scales.shape[1], 128) * scales.unsqueeze(-1)).view(data.shape)
        return (y * (rank + 1)).bfloat16()
    return (recv_x.float() * (rank + 1)).to(recv_x.dtype)
