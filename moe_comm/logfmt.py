"""LogFMT: a log-domain 10-bit encoding of bf16 rows, for the rows low-latency combine sends
back (``low_latency_combine(use_logfmt=True)``, DeepEP's option of that name).

Each block of 128 channels is stored as its log2-magnitude range (two float32: the smallest
and largest log2|x| kept) and one 10-bit code per value: a sign bit and a 9-bit level, 0 for
zero and 1..511 spread evenly over the range in the log domain. A value's relative error is
at most half a level, ``2 ** (range / 1020) - 1`` (about 1% for a block spanning 2^15). Values
more than ``2 ** -LOG_RANGE`` below the block's largest are sent as zero: they are below
bf16's resolution of the sums they join. A row of H channels takes ``H / 128 * 168`` bytes
instead of ``2 * H`` (0.66x). Four codes pack into five bytes, little-endian.

Written from the format's description (log-domain quantisation per block), not from
DeepEP's code: the bits differ from DeepEP's, the meaning (compressed combine rows, decoded
on receipt, summed in float32) is the same.
"""
from __future__ import annotations

import torch

BLOCK = 128
LEVELS = 511                  # 9-bit magnitude codes 1..511; 0 is zero
LOG_RANGE = 32.0              # log2 span a block keeps below its largest value
HEADER_BYTES = 8              # per block: float32 smallest and largest log2|x|
CODE_BYTES = BLOCK * 10 // 8  # 128 ten-bit codes


def row_bytes(hidden: int) -> int:
    """Bytes of one encoded row of ``hidden`` channels (a multiple of 128)."""
    if hidden % BLOCK:
        raise ValueError(f"use_logfmt needs a hidden size that is a multiple of {BLOCK}, "
                         f"got {hidden}")
    return hidden // BLOCK * (HEADER_BYTES + CODE_BYTES)


def encode(x: torch.Tensor) -> torch.Tensor:
    """bf16 (or float) ``[n, H]`` -> uint8 ``[n, row_bytes(H)]``: per row, the blocks' ranges
    (float32 pairs), then the blocks' packed codes."""
    n, hidden = x.shape
    blocks = hidden // BLOCK
    row_bytes(hidden)
    v = x.float().view(n, blocks, BLOCK)
    mag = v.abs()
    logs = torch.log2(mag)                               # -inf at zero
    top = logs.amax(-1, keepdim=True)                    # -inf for an all-zero block
    kept = mag > 0
    kept &= logs >= top - LOG_RANGE
    low = torch.where(kept, logs, torch.full_like(logs, float("inf"))).amin(-1, keepdim=True)
    empty = ~kept.any(-1, keepdim=True)
    top = torch.where(empty, torch.zeros_like(top), top)
    low = torch.where(empty, torch.zeros_like(low), low)
    span = top - low
    step = torch.where(span > 0, span / (LEVELS - 1), torch.ones_like(span))
    level = torch.round((logs - low) / step).clamp_(0, LEVELS - 1) + 1
    level = torch.where(kept, level, torch.zeros_like(level)).to(torch.int64)
    codes = level | ((v < 0) & kept).to(torch.int64) << 9
    header = torch.cat([low, top], -1).view(n, blocks * 2).contiguous()
    return torch.cat([header.view(torch.uint8).view(n, blocks * HEADER_BYTES),
                      _pack(codes.view(n, hidden))], 1)


def decode(data: torch.Tensor, hidden: int) -> torch.Tensor:
    """uint8 ``[n, row_bytes(hidden)]`` -> float32 ``[n, hidden]``."""
    n = data.shape[0]
    blocks = hidden // BLOCK
    head = blocks * HEADER_BYTES
    ranges = data[:, :head].contiguous().view(torch.float32).view(n, blocks, 2)
    low, top = ranges[..., :1], ranges[..., 1:]
    step = torch.where(top > low, (top - low) / (LEVELS - 1), torch.ones_like(low))
    codes = _unpack(data[:, head:], hidden).view(n, blocks, BLOCK)
    level = codes & LEVELS
    mag = torch.exp2(low + (level - 1).float() * step)
    mag = torch.where(level > 0, mag, torch.zeros_like(mag))
    return torch.where(codes >> 9 == 1, -mag, mag).view(n, hidden)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """int64 ten-bit codes ``[n, H]`` -> uint8 ``[n, H * 10 / 8]``, four codes per 5 bytes."""
    n, hidden = codes.shape
    c = codes.view(n, hidden // 4, 4)
    word = c[..., 0] | c[..., 1] << 10 | c[..., 2] << 20 | c[..., 3] << 30
    shifts = torch.arange(0, 40, 8, dtype=torch.int64)
    return ((word.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).view(n, hidden // 4 * 5)


def _unpack(packed: torch.Tensor, hidden: int) -> torch.Tensor:
    n = packed.shape[0]
    b = packed.reshape(n, hidden // 4, 5).to(torch.int64)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24 | b[..., 4] << 32
    shifts = torch.arange(0, 40, 10, dtype=torch.int64)
    return ((word.unsqueeze(-1) >> shifts) & 0x3FF).view(n, hidden)
