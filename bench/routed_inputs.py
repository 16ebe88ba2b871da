"""The inputs both bench scripts time: random tokens with uniform random top-k routing
(DeepEP's benchmark routing), and the fp8 format dispatch sends them in."""
from __future__ import annotations

import torch


def random_routed_inputs(tokens, hidden, experts, topk, seed, device="cpu"):
    """x float32 [tokens, hidden], topk_idx int64 [tokens, topk], topk_weights float32
    [tokens, topk], drawn in that order on ``device`` from a generator seeded with ``seed``
    (the same seed and device give the same tensors in every process)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device)
    idx = torch.rand(tokens, experts, generator=gen, device=device).topk(topk, dim=1).indices
    w = torch.rand(tokens, topk, generator=gen, device=device)
    return x, idx, w


def per_block_fp8(x):
    """[T, H] -> (float8_e4m3fn [T, H], float32 scales [T, H/128]), one scale per 128
    channels (amax / 448, the e4m3 maximum); on x's device, unlike moe_comm.quant's CPU cast."""
    t, h = x.shape
    blocks = x.float().view(t, h // 128, 128)
    scales = blocks.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (blocks / scales.unsqueeze(-1)).view(t, h).to(torch.float8_e4m3fn), scales


def token_bytes(hidden, fp8):
    """Bytes one token's x takes in a low-latency message: bf16, or fp8 plus its float32
    scales. GB/s divide by these payload bytes (DeepEP's convention)."""
    return hidden + hidden // 128 * 4 if fp8 else 2 * hidden
