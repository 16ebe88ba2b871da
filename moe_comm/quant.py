"""FP8 (e4m3) per-128-channel quantisation used by low-latency dispatch, and UE8M0 packing.

scale = amax(|x| over 128 channels) / 448 (clamped to 1e-4/448 so all-zero blocks stay finite);
``round_scale`` rounds each scale up to a power of two; ``use_ue8m0`` stores those powers of
two as their biased exponent byte (UE8M0: byte = log2(scale) + 127), four bytes per int32,
little-endian (channel block 4g+i in byte i of word g).
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
BLOCK = 128


def quantize_fp8(x: torch.Tensor, round_scale: bool = False, chunk_tokens: int = 32):
    """``x`` [T, H] (H % 128 == 0) -> (float8_e4m3fn [T, H], float32 scales [T, H/128])."""
    t, h = x.shape
    data = torch.empty(t, h, dtype=torch.float8_e4m3fn)
    scales = torch.empty(t, h // BLOCK, dtype=torch.float32)
    # chunks of tokens, everything in place: the float32 temporary stays small and cached
    for t0 in range(0, t, chunk_tokens):
        t1 = min(t0 + chunk_tokens, t)
        # a copy even for float32 input: the division below works in place
        blocks = x[t0:t1].to(torch.float32, copy=True).view(t1 - t0, h // BLOCK, BLOCK)
        scale = torch.maximum(blocks.amax(-1), blocks.amin(-1).neg_()).clamp_(min=1e-4)
        scale.div_(FP8_MAX)
        if round_scale:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        blocks.div_(scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        data[t0:t1] = blocks.view(t1 - t0, h)
        scales[t0:t1] = scale
    return data, scales


def dequantize_fp8(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` (float32 out); ``scales`` float32 [..., H/128]."""
    shape = data.shape
    blocks = data.float().reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    return (blocks * scales.unsqueeze(-1)).reshape(shape)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """float32 power-of-two scales [..., G] (G % 4 == 0) -> int32 [..., G/4]."""
    exp = torch.log2(scales).round().to(torch.int32) + 127
    b = exp.clamp(0, 255).to(torch.uint8)
    return b.contiguous().view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., G/4] -> float32 scales [..., G]."""
    b = packed.contiguous().view(torch.uint8).to(torch.int32)
    return torch.exp2((b - 127).float())
