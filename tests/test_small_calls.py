"""Small normal-mode calls in C (moe_comm/host/small.py) against the reference, and beside
ranks on the Python protocol: the two write the same words and bytes, so any mix of them
must give the reference's results.

A rank started with ``MOE_COMM_HOST_NATIVE=0`` has no C library, so all its calls take the
Python protocol; the others take small.py wherever it applies (each counts how often).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import moe_comm
from checks import check_normal
from inputs import expert_fn, make_inputs
from ranks import run_ranks
from moe_comm.handle import DispatchHandle
from moe_comm.host import direct, small


def _cases(n):
    """Small calls of every kind, and calls only some pairs of which fit a slot (a rank's
    400 rows of 14 KiB are more than a slot holds, 4 MiB at most: that pair is granted a
    region)."""
    cases = []
    for seed, (routing, dtype, hidden, tokens) in enumerate([
            ("random", "bfloat16", 1024, [64] * n),
            ("skewed", "fp8", 512, [40 + 7 * r for r in range(n)]),
            ("holes", "float32", 128, [0] + [33] * (n - 1)),
            ("random", "bfloat16", 7168, [4] + [400] * (n - 1)),      # mixed: grants too
            ("one_rank", "bfloat16", 256, [16] * n),
            ("empty", "bfloat16", 256, [8] * n)]):
        cases.append(dict(seed=100 + seed, tokens=tokens, hidden=hidden, experts=4 * n,
                          topk=min(4, 4 * n), routing=routing, dtype=dtype,
                          bias=seed % 2 == 0, alignment=1 + seed % 3, worst=0))
    return cases


def _count_small(counts):
    """Count this rank's calls finished in C: by small.py's receive functions, or by
    direct.py (counted as the receive functions' calls) where a fresh dispatch was neither
    handed on to the Python protocol ("handed on") nor granted regions there ("granted":
    one round, no source's rows in this rank's slots, DirectCalls._granted)."""
    def count(name):
        counts[name] = counts.get(name, 0) + 1

    for name in ("receive_dispatch", "receive_combine"):
        real = getattr(small, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            count(_name)
            return _real(*args, **kwargs)
        setattr(small, name, counted)
    calls = direct.DirectCalls
    for method, name in (("dispatch", "receive_dispatch"), ("cached", "receive_dispatch"),
                         ("combine", "receive_combine"), ("_go_on", "handed on"),
                         ("_granted", "granted")):
        real = getattr(calls, method)

        def counted(*args, _real=real, _name=name, **kwargs):
            before = counts.get("handed on", 0) + counts.get("granted", 0)
            got = _real(*args, **kwargs)
            if got is not None and counts.get("handed on", 0) + counts.get("granted",
                                                                            0) == before:
                count(_name)
            return got
        setattr(calls, method, counted)


def _strided(t):
    """``t``'s values in a tensor whose rows are not contiguous (every other column of a
    wider one): what the C code must read at its strides, as torch does."""
    return None if t is None else torch.stack([t, t], 2)[:, :, 0]


def _rank(rank, n, cases, python_ranks, strided=False, cores=None):
    if rank in python_ranks:
        os.environ["MOE_COMM_HOST_NATIVE"] = "0"
    if cores:                       # the ranks share this many cores, on any machine
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    counts = {}
    _count_small(counts)
    buf = moe_comm.Buffer(None, 32 << 20, timeout_s=30)
    out = []
    for case in cases:
        x, idx, w, bias = make_inputs(case, rank)
        if strided:
            idx, w = _strided(idx), _strided(w)
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
        # rank 0's 4 tokens fit slots where its peers' 400 do not: every rank on the direct
        # path begins the mixed case in direct.py (the rows that fit a slot sent there) and
        # hands it on to the Python protocol
        assert counts.pop("handed on", 0) == (rank not in python_ranks), counts
        if rank in python_ranks:
            assert counts == {}, (rank, counts)
        else:      # every case but the mixed one finishes in C, dispatch (fresh, cached)
            assert counts["receive_dispatch"] == 2 * (len(cases) - 1), (rank, counts)
            assert counts["receive_combine"] == len(cases) - 1, (rank, counts)


@pytest.mark.parametrize("python_ranks", [(), (1,)])
def test_a_dispatch_beyond_its_share_of_a_slot_is_granted_its_combine_goes_in_slots(
        python_ranks):
    """Where ranks outnumber cores (4 ranks on 2 here), a dispatch pair goes through a slot
    only up to 16 MiB / R^2 (eager.room: 1 MiB on 4 ranks, 72 rows of 14 KiB with their top-4
    ids and weights), a combine's up to the slot (2 MiB, 145 rows): 128 tokens of H=7168
    routed to 4 of 16 experts send a rank ~93 rows (each token reaches a rank with
    probability 0.73), so every pair dispatches through a granted region, fresh and cached,
    and comes back through the slots, summed in C from the handle the granted dispatch made;
    also beside a rank on the Python protocol, which must decide alike which pairs went
    through slots."""
    n = 4
    case = dict(seed=7, tokens=[128] * n, hidden=7168, experts=4 * n, topk=4,
                routing="random", dtype="bfloat16", bias=False, alignment=1, worst=0)
    results = run_ranks(_rank, n, [case], python_ranks, False, 2, timeout=120)
    check_normal(n, [case], [r[0] for r in results])
    for rank, (_, counts) in enumerate(results):
        want = {} if rank in python_ranks else {"granted": 1, "receive_combine": 1}
        assert counts == want, (rank, counts)


def _held_granted(rank, n):
    counts = {}
    _count_small(counts)
    buf = moe_comm.Buffer(None, 96 << 20, timeout_s=30)
    held = []
    for call in range(4):             # each call's results held through the calls after it
        case = dict(seed=50 + call, tokens=[512] * n, hidden=4096, experts=4 * n, topk=2,
                    routing="random", dtype="float32", bias=False, alignment=1, worst=0)
        x, idx, w, _ = make_inputs(case, rank)
        ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, case["experts"])
        rx, ri, rw, *_ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                      num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)
        held.append(((rx, ri, rw), (rx.clone(), ri.clone(), rw.clone())))
    same = [all(torch.equal(a, b) for a, b in zip(*h)) for h in held]
    buf.destroy()
    return same, counts


def test_granted_dispatch_results_held_are_never_overwritten():
    """A fresh dispatch whose rows go to granted regions in one round (direct.py _granted:
    rows of 16 KiB, ~340 a pair, beyond a slot) returns views of its region: each call's
    results, held while the later calls run, keep their values."""
    for same, counts in run_ranks(_held_granted, 3, timeout=120):
        assert same == [True] * 4
        assert counts == {"granted": 4}, counts


def _granted_with_empty_ranks(rank, n):
    counts = {}
    _count_small(counts)
    buf = moe_comm.Buffer(None, 96 << 20, timeout_s=30)
    g = torch.Generator().manual_seed(rank)
    T, H, E = 512, 4096, 4 * n
    x = torch.randn(T, H, generator=g)
    # experts of ranks 0 and 1 only (rank 2 receives nothing), and rank 1 sends nothing
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])
    if rank == 1:
        x, idx = x[:0].contiguous(), idx[:0].contiguous()
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    rx, ri, rw, cnt, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                              num_tokens_per_expert=nte, topk_idx=idx)
    out, _, _ = buf.combine(rx, handle)
    buf.destroy()
    return x, idx, rx, ri, cnt, out, counts


def test_granted_dispatch_of_ranks_that_send_or_receive_nothing():
    """direct.py's one-round granted path where a rank sends no token and another receives
    none: identity experts give each token back once per rank it reached."""
    n = 3
    results = run_ranks(_granted_with_empty_ranks, n, timeout=120)
    for rank, (x, idx, rx, ri, cnt, out, counts) in enumerate(results):
        assert counts.get("granted") == 1, counts
        want_rows = sum(int((r[1] // 4 == rank).any(1).sum()) for r in results)
        assert rx.shape == (want_rows, 4096) and ri.shape == (want_rows, 2)
        assert sum(cnt) == sum(int((r[1] // 4 == rank).sum()) for r in results)
        copies = torch.tensor([len({int(e) // 4 for e in row}) for row in idx])
        torch.testing.assert_close(out, x * copies[:, None].float())
    assert results[2][2].shape[0] == 0


def test_strided_routing_tensors_match_the_reference():
    n = 2
    cases = _cases(n)[:2]
    results = run_ranks(_rank, n, cases, (), True, timeout=120)
    check_normal(n, cases, [r[0] for r in results])
    assert all(r[1]["receive_dispatch"] == 2 * len(cases) for r in results), results


def _disagreeing(rank, n, timeout_s, small_on):
    """Rank 0 dispatches afresh while rank 1 repeats a cached dispatch: both must raise
    CallMismatchError at once (rank 1 never posts the counts rank 0 would wait for), and the
    next call must find both at the same NOTIFY parity."""
    os.environ["MOE_COMM_SMALL"] = small_on
    buf = moe_comm.Buffer(None, 8 << 20, timeout_s=timeout_s)
    x, idx, w, _ = make_inputs(_cases(n)[0], rank)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, 4 * n)
    args = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte,
                topk_idx=idx, topk_weights=w)
    handle = buf.dispatch(x, **args)[4]
    t0 = time.monotonic()
    try:
        buf.dispatch(x, **args) if rank == 0 else buf.dispatch(x, handle=handle)
        outcome = "returned"
    except moe_comm.CallMismatchError:
        outcome = "CallMismatchError"
    took = time.monotonic() - t0
    buf.dispatch(x, **args)               # and the next call on which they agree works
    buf.destroy()
    return outcome, took


@pytest.mark.parametrize("small_on", ["1", "0"])
def test_ranks_that_disagree_raise_at_once_and_go_on(small_on):
    timeout_s = 10.0
    for outcome, took in run_ranks(_disagreeing, 2, timeout_s, small_on, timeout=60):
        assert outcome == "CallMismatchError"
        assert took < timeout_s / 2, took       # not a deadline: the signatures said it


def _interrupted(rank, n, timeout_s):
    """Rank 0 waits for a silent peer; a signal handler raises after 1 s."""
    buf = moe_comm.Buffer(None, 8 << 20, timeout_s=timeout_s)
    x, idx, w, _ = make_inputs(_cases(n)[0], rank)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, 4 * n)
    if rank == 1:
        time.sleep(timeout_s + 2)        # never calls
        return None

    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    t0 = time.monotonic()
    try:
        buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                     num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    return outcome, time.monotonic() - t0


def test_a_signal_interrupts_a_small_wait():
    """The C waits come back to Python every 50 ms, so Ctrl-C works as in the Python
    protocol's waits, not only at the deadline."""
    timeout_s = 12.0
    outcome, took = run_ranks(_interrupted, 2, timeout_s, timeout=60)[0]
    assert outcome == "KeyboardInterrupt"
    assert 1.0 <= took < timeout_s / 2, took


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


def _edge_calls(rank, n, use_direct):
    """Calls at the edges of what direct.py takes, on a Buffer with it or without it (the
    Buffer's whole path): each one's results (shapes, dtypes, values) or error."""
    buf = moe_comm.Buffer(None, 8 << 20, timeout_s=20)
    if not use_direct:
        buf._direct = None
    T, H, E = 6, 64, 4 * n
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    out = {}

    def record(name, call):
        try:
            got = call()
        except Exception as e:      # noqa: BLE001 - the error is the result
            got = f"{type(e).__name__}: {e}"
        out[name] = [t.clone() if isinstance(t, torch.Tensor) else t
                     for t in (got if isinstance(got, tuple) else (got,))
                     if not isinstance(t, (moe_comm.EventOverlap, DispatchHandle))]
        return got

    def layout(idx):
        ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
        return dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte)

    none = torch.empty(T, 0, dtype=torch.int64)                   # top-k of width 0
    record("top-0 dispatch", lambda: buf.dispatch(x, topk_idx=none, **layout(none)))
    idx = torch.randint(-1, E, (T, 2), generator=g)
    w = torch.rand(T, 2, generator=g)
    got = record("dispatch", lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                  expert_alignment=4, **layout(idx)))
    rx, handle = got[0], got[4]
    record("combine, weights of width 0",
           lambda: buf.combine(rx, handle, topk_weights=torch.empty(rx.shape[0], 0)))
    record("combine, no weights", lambda: buf.combine(rx, handle))
    record("cached, alignment 0", lambda: buf.dispatch(x, handle=handle, expert_alignment=0))
    record("cached", lambda: buf.dispatch(x, handle=handle))
    record("dispatch, no weights", lambda: buf.dispatch(x, topk_idx=idx, **layout(idx)))
    buf.destroy()
    return out


def test_the_direct_path_and_the_whole_path_agree_at_the_edges():
    """direct.py declines what it does not take (nothing moved), and what it takes comes out
    as the Buffer's whole path gives it: the same tensors (or None), values and errors."""
    n = 2
    direct_out = run_ranks(_edge_calls, n, True, timeout=60)
    whole_out = run_ranks(_edge_calls, n, False, timeout=60)
    for rank in range(n):
        assert direct_out[rank].keys() == whole_out[rank].keys()
        for name, got in direct_out[rank].items():
            want = whole_out[rank][name]
            assert len(got) == len(want), (rank, name, got, want)
            for a, b in zip(got, want):
                if isinstance(b, torch.Tensor):
                    assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and \
                        a.shape == b.shape and torch.equal(a, b), (rank, name, a, b)
                else:
                    assert a == b, (rank, name, a, b)
