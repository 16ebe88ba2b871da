"""LogFMT (moe_comm/logfmt.py), the encoding of low_latency_combine(use_logfmt=True): the
relative error bound per value, zeros and signs kept, the byte size, and a hidden size that
is not a multiple of 128 refused by name."""
from __future__ import annotations

import pytest
import torch

from moe_comm import logfmt


def test_round_trip_error_is_within_half_a_level():
    g = torch.Generator().manual_seed(0)
    # rows of very different scales, a zero block, single zeros, a constant row
    x = torch.randn(32, 512, generator=g) * torch.exp(3 * torch.randn(32, 1, generator=g))
    x[0, :128] = 0
    x[1, 7] = 0
    x[2] = -3.0
    x = x.bfloat16()
    enc = logfmt.encode(x)
    assert enc.dtype == torch.uint8 and enc.shape == (32, logfmt.row_bytes(512))
    assert logfmt.row_bytes(512) == 4 * (8 + 160) < 2 * 512
    got = logfmt.decode(enc, 512)
    want = x.float()
    assert torch.equal(got[0, :128], torch.zeros(128)) and got[1, 7] == 0
    assert torch.equal(got[2], torch.full((512,), -3.0))
    assert torch.equal(torch.sign(got), torch.sign(want))
    # per block: half a level of its log2 range (at most LOG_RANGE), as a relative error
    span = want.abs().view(32, 4, 128).clamp(min=1e-38).log2()
    span = (span.amax(-1) - span.amin(-1)).clamp(max=logfmt.LOG_RANGE)
    bound = torch.exp2(span / (logfmt.LEVELS - 1) / 2) - 1 + 1e-6
    rel = ((got - want).abs() / want.abs().clamp(min=1e-38)).view(32, 4, 128)
    nz = want.view(32, 4, 128) != 0
    assert (rel[nz] <= bound.unsqueeze(-1).expand_as(rel)[nz]).all()


def test_values_far_below_the_block_maximum_are_zero():
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1] = 1.0, 2.0 ** -40
    got = logfmt.decode(logfmt.encode(x), 128)
    assert got[0, 0] == 1.0 and got[0, 1] == 0


def test_hidden_not_a_multiple_of_128_is_refused_by_name():
    with pytest.raises(ValueError, match="use_logfmt"):
        logfmt.row_bytes(200)
