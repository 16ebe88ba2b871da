"""Normal-mode dispatch/combine on real processes, checked against the reference.

Each rank count runs one process group through many cases (routing kinds, ragged and zero
token counts, dtypes, hidden sizes, cached handles, alignment, bias, num_worst_tokens). The
free heap is poisoned with 0xFF before every call, so a row nobody wrote shows up as NaN / -1.
"""
from __future__ import annotations

import pytest

import moe_comm
from checks import check_normal
from inputs import expert_fn, make_inputs
from ranks import run_ranks


def _cases(n):
    cases, seed = [], 0
    tok = [[64 + 13 * r for r in range(n)], [0] + [40] * (n - 1), [0] * n, [1] * n]
    for routing in ("random", "skewed", "holes", "empty", "one_rank"):
        for dtype, hidden in (("bfloat16", 256), ("float32", 128), ("fp8", 512)):
            for tokens in tok[:2] if routing != "empty" else tok[:1]:
                seed += 1
                cases.append(dict(seed=seed, tokens=tokens, hidden=hidden, experts=4 * n,
                                  topk=min(4, 4 * n), routing=routing, dtype=dtype,
                                  bias=seed % 2 == 0, alignment=1 + seed % 3 * 4,
                                  worst=0))
    seed += 1
    cases.append(dict(seed=seed, tokens=tok[2], hidden=128, experts=2 * n, topk=2,
                      routing="random", dtype="bfloat16", bias=False, alignment=1, worst=0))
    seed += 1
    cases.append(dict(seed=seed, tokens=tok[3], hidden=7168, experts=8 * n, topk=8,
                      routing="random", dtype="bfloat16", bias=True, alignment=128, worst=0))
    seed += 1
    cases.append(dict(seed=seed, tokens=[24] * n, hidden=7168, experts=8 * n, topk=8,
                      routing="skewed", dtype="fp8", bias=False, alignment=1, worst=0))
    seed += 1
    cases.append(dict(seed=seed, tokens=[30 + r for r in range(n)], hidden=128,
                      experts=4 * n, topk=3, routing="holes", dtype="float16", bias=False,
                      alignment=1, worst=30 * n + n * n))
    return cases


def _run_cases(rank, n, cases, heap=32 << 20):
    buf = moe_comm.Buffer(None, heap, timeout_s=30)
    out = []
    for case in cases:
        x, idx, w, bias = make_inputs(case, rank)
        ntr, per_host, nte, itr, _ = buf.get_dispatch_layout(idx, case["experts"])
        # num_tokens_per_rdma_rank: None on one host (tests/test_multihost.py checks hosts)
        assert (per_host is None) == (buf._comm.host_of is None)
        buf._comm.poison_free_heap()
        rx, ri, rw, counts, handle, ev = buf.dispatch(
            x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte,
            topk_idx=idx, topk_weights=w, expert_alignment=case["alignment"],
            num_worst_tokens=case["worst"])
        ev.current_stream_wait()
        y = expert_fn(rx, rank)
        buf._comm.poison_free_heap()
        comb, comb_w, _ = buf.combine(y, handle, topk_weights=rw, bias=bias)
        # the cached handle repeats the layout without top-k and without the count exchange
        buf._comm.poison_free_heap()
        rx2, ri2, rw2, counts2, handle2, _ = buf.dispatch(x, handle=handle)
        clone = (lambda t: tuple(a.clone() for a in t)) if isinstance(rx, tuple) else \
            (lambda t: t.clone())
        out.append(dict(rx=clone(rx), ri=ri.clone(), rw=rw.clone(), counts=counts,
                        comb=comb, comb_w=comb_w, y=y.clone(), rx2=clone(rx2), ri2=ri2,
                        counts2=counts2, handle2=handle2))
        del rx, ri, rw, y, rx2          # a small heap (tests/test_streaming.py) is free again
    buf.destroy()
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_dispatch_combine_match_reference(n):
    cases = _cases(n)
    if n == 8:                     # 8 ranks on 2 cores: keep the sweep, trim the repeats
        cases = cases[::2] + cases[-4:]
    results = run_ranks(_run_cases, n, cases, timeout=240)
    check_normal(n, cases, results)
