"""Batches larger than the buffer stream through it (host backend, normal mode).

A receive region that does not fit the heap passes through half of it in rounds
(moe_comm/host/normal.py RoundPlan): the results must be the reference's, and equal bit for
bit to what a buffer large enough for a single copy returns - dispatch, cached dispatch and
combine (whose rows come back through the heap in rounds too). The heap here is at least 4x
smaller than what the largest receiver gets.
"""
from __future__ import annotations

import torch

import moe_comm
from checks import check_normal
from moe_comm.wire import SlabLayout
from ranks import run_ranks
from test_normal_mode import _run_cases

SMALL_HEAP = 256 << 10
LARGE_HEAP = 32 << 20


def _cases(n):
    base = dict(experts=4 * n, topk=4, bias=False, alignment=1, worst=0)
    return [
        dict(base, seed=1, tokens=[300 + 17 * r for r in range(n)], hidden=1024,
             routing="random", dtype="bfloat16", bias=True),
        dict(base, seed=2, tokens=[400] * n, hidden=1024, routing="skewed", dtype="fp8",
             alignment=4),
        dict(base, seed=3, tokens=[0] + [400] * (n - 1), hidden=512, routing="one_rank",
             dtype="float32"),
        dict(base, seed=4, tokens=[200 + r for r in range(n)], hidden=1024, routing="holes",
             dtype="bfloat16", worst=(200 + n) * n),
        dict(base, seed=5, tokens=[8] * n, hidden=256, routing="random", dtype="bfloat16"),
    ]


def _flat(value):
    return list(value) if isinstance(value, tuple) else [value]


def test_a_batch_larger_than_the_buffer_streams_exactly():
    n = 3
    cases = _cases(n)
    small = run_ranks(_run_cases, n, cases, SMALL_HEAP, timeout=300)
    check_normal(n, cases, small)
    # it did stream: the largest receive region of the first four cases is >= 4x the heap
    for ci, case in enumerate(cases[:4]):
        most = max(_flat(small[r][ci]["rx"])[0].shape[0] for r in range(n))
        elem = 1 if case["dtype"] == "fp8" else getattr(torch, case["dtype"]).itemsize
        row = case["hidden"] * elem
        assert SlabLayout(most, row, 0, case["topk"]).nbytes >= 4 * SMALL_HEAP, (ci, most)
    large = run_ranks(_run_cases, n, cases, LARGE_HEAP, timeout=300)
    for r in range(n):
        for ci in range(len(cases)):
            a, b = small[r][ci], large[r][ci]
            for key in ("rx", "rx2"):
                for g, e in zip(_flat(a[key]), _flat(b[key])):
                    assert torch.equal(g.view(torch.uint8), e.view(torch.uint8)), (r, ci, key)
            for key in ("ri", "rw", "comb", "comb_w"):
                assert torch.equal(a[key], b[key]), (r, ci, key)
            assert a["counts"] == b["counts"], (r, ci)


def _one_row_too_big(rank, n):
    buf = moe_comm.Buffer(None, 64 << 10, timeout_s=20)
    x = torch.randn(4, 32768).bfloat16()                   # 64 KiB rows: not one fits
    idx = torch.zeros(4, 1, dtype=torch.int64)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, 2 * n)
    try:
        buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                     num_tokens_per_expert=nte)
        got = "no error"
    except moe_comm.BufferTooSmallError as e:
        got = str(e)
    ok = torch.randn(4, 256).bfloat16()                     # the buffer is still usable
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, 2 * n)
    rx, *_ = buf.dispatch(ok, topk_idx=idx, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                          num_tokens_per_expert=nte)
    buf.destroy()
    return got, rx.shape[0]


def test_a_row_larger_than_half_the_buffer_is_refused_on_every_rank():
    results = run_ranks(_one_row_too_big, 2, timeout=60)
    for got, rows in results:
        assert "num_nvl_bytes too small" in got, got
    assert [rows for _, rows in results] == [8, 0]
