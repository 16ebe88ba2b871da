"""Small normal-mode calls in C (moe_comm/host/small.py) against the reference, and beside
ranks on the Python protocol: the two write the same words and bytes, so any mix of them
must give the reference's results.

A rank started with ``MOE_COMM_HOST_NATIVE=0`` has no C library, so all its calls take the
Python protocol; the others take small.py wherever it applies (each counts how often).
"""
from __future__ import annotations

import os
import time

import pytest

import moe_comm
from checks import check_normal
from inputs import expert_fn, make_inputs
from ranks import run_ranks
from moe_comm.host import small


def _cases(n):
    """Small calls of every kind, and calls only some pairs of which fit a slot (a rank's
    100 rows of 4 KiB are more than a slot holds: that pair is granted a region)."""
    cases = []
    for seed, (routing, dtype, hidden, tokens) in enumerate([
            ("random", "bfloat16", 1024, [64] * n),
            ("skewed", "fp8", 512, [40 + 7 * r for r in range(n)]),
            ("holes", "float32", 128, [0] + [33] * (n - 1)),
            ("random", "bfloat16", 2048, [4] + [100] * (n - 1)),      # mixed: grants too
            ("one_rank", "bfloat16", 256, [16] * n),
            ("empty", "bfloat16", 256, [8] * n)]):
        cases.append(dict(seed=100 + seed, tokens=tokens, hidden=hidden, experts=4 * n,
                          topk=min(4, 4 * n), routing=routing, dtype=dtype,
                          bias=seed % 2 == 0, alignment=1 + seed % 3, worst=0))
    return cases


def _count_small(counts):
    """Count this rank's calls finished by small.py's receive functions."""
    for name in ("receive_dispatch", "receive_combine"):
        real = getattr(small, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args, **kwargs)
        setattr(small, name, counted)


def _rank(rank, n, cases, python_ranks):
    if rank in python_ranks:
        os.environ["MOE_COMM_HOST_NATIVE"] = "0"
    counts = {}
    _count_small(counts)
    buf = moe_comm.Buffer(None, 32 << 20, timeout_s=30)
    out = []
    for case in cases:
        x, idx, w, bias = make_inputs(case, rank)
        ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, case["experts"])
        buf._comm.poison_free_heap()           # and small.py's outputs
        rx, ri, rw, cnt, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte,
            topk_idx=idx, topk_weights=w, expert_alignment=case["alignment"])
        y = expert_fn(rx, rank)
        comb, comb_w, _ = buf.combine(y, handle, topk_weights=rw, bias=bias)
        rx2, ri2, rw2, cnt2, handle2, _ = buf.dispatch(x, handle=handle)
        clone = (lambda t: tuple(a.clone() for a in t)) if isinstance(rx, tuple) else \
            (lambda t: t.clone())           # (a dtype view of received bytes: not picklable)
        out.append(dict(rx=clone(rx), ri=ri.clone(), rw=rw.clone(), counts=cnt, comb=comb,
                        comb_w=comb_w, y=y.clone(), rx2=clone(rx2), ri2=ri2, counts2=cnt2,
                        handle2=handle2))
    buf.destroy()
    return out, counts


@pytest.mark.parametrize("n, python_ranks", [(2, ()), (3, (1,)), (4, (0, 3))])
def test_small_calls_match_the_reference_beside_the_python_protocol(n, python_ranks):
    cases = _cases(n)
    results = run_ranks(_rank, n, cases, python_ranks, timeout=120)
    check_normal(n, cases, [r[0] for r in results])
    for rank, (_, counts) in enumerate(results):
        if rank in python_ranks:
            assert counts == {}, (rank, counts)
        else:      # every case but the mixed one finishes in C, dispatch (fresh, cached)
            assert counts["receive_dispatch"] == 2 * (len(cases) - 1), (rank, counts)
            assert counts["receive_combine"] == len(cases) - 1, (rank, counts)


def _silent_peer(rank, n, timeout_s):
    buf = moe_comm.Buffer(None, 8 << 20, timeout_s=timeout_s)
    x, idx, w, _ = make_inputs(_cases(n)[0], rank)
    layout = buf.get_dispatch_layout(idx, 4 * n)
    outcome = None
    if rank == 0:
        t0 = time.monotonic()
        try:
            buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                         num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)
        except moe_comm.CommTimeoutError as e:
            outcome = (time.monotonic() - t0, str(e))
    else:
        time.sleep(timeout_s + 4)        # never calls: rank 0 must give up at its deadline
    return outcome


def test_a_silent_peer_is_a_deadline_on_the_small_path():
    timeout_s = 2.0
    outcome = run_ranks(_silent_peer, 2, timeout_s, timeout=60)[0]
    assert outcome is not None, "rank 0's dispatch returned without its peer"
    took, message = outcome
    # the deadline, plus what a loaded 2-core machine may add (a wait polls every 0.2 ms)
    assert timeout_s <= took < timeout_s + 3, took
    assert "1" in message, message
