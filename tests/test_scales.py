"""Scales of every kind DeepEP clients pass through normal dispatch, on both backends.

vLLM sends float32 scales [T, H/128] and UE8M0-packed int32 [T, H/128 / 4]; SGLang's
Blackwell path sends int32 [T, H/512] column-major (``s.t().contiguous().t()``, stride
(1, T)). Each must come back as the sender's rows, bit for bit (the int32 words are random
bit patterns, some of them NaN as floats: the scales are opaque 4-byte columns), in the
sender's dtype and row-major whatever the sender's layout (DeepEP allocates received scales
with torch::empty({N, S}): row-major), from a fresh dispatch, a cached one and one with
num_worst_tokens; and a combine on the same handle still sums right.

Both backends: the host backend, and the CUDA backend on the CPU kernel emulator (ranks as
processes, MOE_COMM_CPU_BACKEND=emulator). Ranks that disagree about the scales' dtype or
width raise CallMismatchError: tests/test_call_signature.py.
"""
from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm.jit import emulator
from inputs import routing
from ranks import run_ranks

N, E, K, H = 3, 12, 3, 1024
TOKENS = [37, 0, 21]
KINDS = {  # name: (dtype, columns, column-major)
    "float32 [T, H/128]": (torch.float32, H // 128, False),
    "int32 UE8M0 [T, H/512]": (torch.int32, H // 512, False),
    "int32 [T, H/512] column-major": (torch.int32, H // 512, True),
    "float32 [T, 3] column-major": (torch.float32, 3, True),
    "int32 [T, 1]": (torch.int32, 1, False),
}
WORST = 80


@pytest.fixture(params=["host", "cuda_emulated"])
def backend(request, monkeypatch):
    if request.param == "cuda_emulated":
        if not emulator.available():
            pytest.skip("the kernel emulator needs a C++ compiler (g++)")
        import cuda_cases
        cuda_cases.preload("cpu", N)                   # built before any deadline
        monkeypatch.setenv("MOE_COMM_CPU_BACKEND", "emulator")   # inherited by the ranks
    return request.param


def _inputs(rank, kind):
    """fp8 x [T, H], its scales as the kind says (random bit patterns), topk_idx."""
    dtype, cols, column_major = KINDS[kind]
    gen = torch.Generator().manual_seed(100 + rank)
    t = TOKENS[rank]
    data = torch.randn(t, H, generator=gen).to(torch.float8_e4m3fn)
    bits = torch.randint(-2 ** 31, 2 ** 31, (t, cols), generator=gen, dtype=torch.int64)
    scales = bits.to(torch.int32)
    if dtype == torch.float32:
        scales = torch.rand(t, cols, generator=gen) * 1e-2
    if column_major:
        scales = scales.t().contiguous().t()      # SGLang's layout: stride (1, T) for T > 1
        assert t <= 1 or scales.stride() == (1, t)
    return data, scales, routing("holes", t, E, K, gen)


def _layout_of(t: torch.Tensor) -> dict:
    """What the parent checks about a received tensor (strides do not survive the queue)."""
    return dict(dtype=t.dtype, shape=tuple(t.shape), stride=t.stride(),
                values=t.contiguous().clone())


def _rank(rank, n):
    buf = moe_comm.Buffer(None, 32 << 20, timeout_s=60)
    out = {}
    for kind in KINDS:
        data, scales, idx = _inputs(rank, kind)
        ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
        args = dict(topk_idx=idx, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                    num_tokens_per_expert=nte)
        (rx, rs), _, rw, _, handle, _ = buf.dispatch((data, scales), **args)
        (rx2, rs2), *_ = buf.dispatch((data, scales), handle=handle)
        (rx3, rs3), *_ = buf.dispatch((data, scales), num_worst_tokens=WORST, **args)
        # experts: the dequantised-looking rows as bf16 (values do not matter, the sums do)
        y = rx.float().bfloat16()
        combined, _, _ = buf.combine(y, handle)
        out[kind] = dict(x=rx.view(torch.uint8).clone(), fresh=_layout_of(rs),
                         cached=_layout_of(rs2), worst=_layout_of(rs3), combined=combined)
    buf.destroy()
    return out


def test_scales_come_back_as_sent(backend):
    results = run_ranks(_rank, N, timeout=300)
    for kind, (dtype, cols, column_major) in KINDS.items():
        ins = [_inputs(r, kind) for r in range(N)]
        ref = moe_comm.reference_dispatch([i[0] for i in ins], [i[2] for i in ins], E,
                                          scales=[i[1] for i in ins])
        for d in range(N):
            got, want = results[d][kind], ref[d]
            rows = want["recv_x"].shape[0]
            assert torch.equal(got["x"], want["recv_x"].view(torch.uint8)), (kind, d)
            for call in ("fresh", "cached", "worst"):
                s = got[call]
                expect_rows = WORST if call == "worst" else rows
                assert s["dtype"] == dtype and s["shape"] == (expect_rows, cols), (kind, call)
                assert s["stride"] == (cols, 1), (kind, call, s)      # row-major, as DeepEP
                assert torch.equal(s["values"][:rows].view(torch.int32),
                                   want["recv_scales"].view(torch.int32)), (kind, call, d)
            # combine on the handle: each token once per rank it went to
            x = ins[d][0].float().bfloat16().float()
            copies = torch.tensor([len({int(e) // (E // N) for e in row if e >= 0})
                                   for row in ins[d][2]], dtype=torch.float32)
            torch.testing.assert_close(got["combined"].float(), x * copies[:, None],
                                       rtol=1e-2, atol=1e-2)


def test_bad_scales_are_refused():
    """Checked before anything moves (no group needed beyond one rank)."""
    def rank_fn(rank, n):
        buf = moe_comm.Buffer(None, 8 << 20, timeout_s=20)
        data = torch.randn(4, 256).to(torch.float8_e4m3fn)
        idx = torch.zeros(4, 1, dtype=torch.int64)
        errors = []
        for scales in (torch.ones(4, 2, dtype=torch.float64), torch.ones(3, 2),
                       torch.ones(4, 0), torch.ones(4, 2, 1)):
            try:
                buf.dispatch((data, scales), topk_idx=idx,
                             num_tokens_per_expert=buf.get_dispatch_layout(idx, 2)[2])
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        buf.destroy()
        return errors

    errors = run_ranks(rank_fn, 1, timeout=60)[0]
    assert len(errors) == 4, errors
    assert "float32 or torch.int32" in errors[0]
    assert "has 3 rows but x[0] has 4 tokens" in errors[1]
    assert "between 1 and" in errors[2]
    assert "must be 2-D" in errors[3]


def _streamed_rank(rank, n):
    """A heap of 16 KiB: the receive regions (about 30 rows of 1 KiB) stream through it in
    rounds (host backend), scales copied out of each round in their own dtype."""
    buf = moe_comm.Buffer(None, 16 << 10, timeout_s=60)
    data, scales, idx = _inputs(rank, "int32 [T, H/512] column-major")
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    (rx, rs), *_ = buf.dispatch((data, scales), topk_idx=idx, num_tokens_per_rank=ntr,
                                is_token_in_rank=itr, num_tokens_per_expert=nte)
    buf.destroy()
    return rx.view(torch.uint8).clone(), _layout_of(rs)


def test_scales_stream_through_a_small_buffer():
    kind = "int32 [T, H/512] column-major"
    ins = [_inputs(r, kind) for r in range(N)]
    ref = moe_comm.reference_dispatch([i[0] for i in ins], [i[2] for i in ins], E,
                                      scales=[i[1] for i in ins])
    for d, (rx, s) in enumerate(run_ranks(_streamed_rank, N, timeout=120)):
        assert torch.equal(rx, ref[d]["recv_x"].view(torch.uint8)), d
        assert s["dtype"] == torch.int32 and s["stride"] == (H // 512, 1)
        assert torch.equal(s["values"], ref[d]["recv_scales"]), d
