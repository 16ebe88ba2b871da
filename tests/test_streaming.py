"""Batches larger than the buffer stream through it (host backend, normal mode).

A receive region that does not fit the heap passes through half of it in rounds
(moe_comm/host/normal.py RoundPlan): the results must be the reference's, and equal bit for
bit to what a buffer large enough for a single copy returns - dispatch, cached dispatch and
combine (whose rows come back through the heap in rounds too). The heap here is at least 4x
smaller than what the largest receiver gets.
"""
from __future__ import annotations

import os

import torch

import moe_comm
from checks import assert_same_bits, check_normal, flat
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


def test_a_batch_larger_than_the_buffer_streams_exactly():
    n = 3
    cases = _cases(n)
    small = run_ranks(_run_cases, n, cases, SMALL_HEAP, timeout=300)
    check_normal(n, cases, small)
    # it did stream: the largest receive region of the first four cases is >= 4x the heap
    for ci, case in enumerate(cases[:4]):
        most = max(flat(small[r][ci]["rx"])[0].shape[0] for r in range(n))
        elem = 1 if case["dtype"] == "fp8" else getattr(torch, case["dtype"]).itemsize
        row = case["hidden"] * elem
        assert SlabLayout(most, row, 0, case["topk"]).nbytes >= 4 * SMALL_HEAP, (ci, most)
    assert_same_bits(n, cases, small, run_ranks(_run_cases, n, cases, LARGE_HEAP, timeout=300))


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


def _held_heap_in_round_zero(rank, n):
    """Rank 1 holds a result that leaves less than half its heap free, then a batch streams:
    its grant of round 0 fails. Every rank still goes through every round (granting nothing
    after its failure) and raises at the end, well before the deadline, and the next call
    works."""
    import time
    from moe_comm.host.normal import ReceiverFailed
    os.environ["MOE_COMM_SMALL"] = "0"      # the held result in the heap (small calls' are not)
    buf = moe_comm.Buffer(None, SMALL_HEAP, timeout_s=DEADLINE_S)
    g = torch.Generator().manual_seed(rank)
    E = 4 * n

    def call(tokens):
        x = torch.randn(tokens, 1024, generator=g).bfloat16()
        idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        return buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=per_rank,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    held = call(40)                  # ~40 * 2 KiB from each rank: past half the heap
    if rank != 1:
        del held
    t0 = time.monotonic()
    try:
        call(400)
        outcome = "finished"
    except (moe_comm.BufferTooSmallError, ReceiverFailed) as e:
        outcome = type(e).__name__
    elapsed = time.monotonic() - t0
    held = None
    after = call(400)[0].shape[0]     # the next call streams and works on every rank
    buf.destroy()
    return outcome, elapsed, after


DEADLINE_S = 20.0


def test_a_round_failing_on_one_rank_keeps_every_rank_in_step():
    results = run_ranks(_held_heap_in_round_zero, 3, timeout=120)
    assert results[1][0] == "BufferTooSmallError", results
    assert all(o in ("finished", "ReceiverFailed", "BufferTooSmallError") for o, _, _ in results)
    for outcome, elapsed, after in results:
        assert elapsed < DEADLINE_S / 2, results        # nobody waited for the deadline
        assert after > 0
