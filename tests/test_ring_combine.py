"""Normal combines streamed through the eager slots in parts (moe_comm/host/ring.py), bit for
bit against moe_comm.reference_combine.

The slots are made small here (256 KiB a pair, parts of 63 KiB: 4 rows of H=7168), so calls
of a few hundred rows go through many parts, each slot's parts reused several times; pairs
whose rows fit a slot whole still go eagerly beside the streamed ones. The free heap and the
pooled outputs are poisoned (0xFF) before every call, so an output row nobody wrote shows up
as NaN; the slots are not (a peer may be writing into them already), but consecutive calls
at a slot's parity carry other cases' rows, so a part read before it came shows up as a
wrong sum.
"""
from __future__ import annotations

import os
import time

import pytest

import moe_comm
import moe_comm.host.comm as host_comm
from checks import check_combine_bits, combine_biases
from inputs import expert_fn, make_inputs
from ranks import run_ranks
from moe_comm.host import ring

SLOT = 256 << 10


def _cases(n):
    def case(seed, tokens, routing, dtype, hidden, biases, weights=True):
        return dict(seed=seed, tokens=tokens, hidden=hidden, experts=4 * n, topk=4,
                    routing=routing, dtype=dtype, bias=biases > 0, biases=biases,
                    weights=weights)

    return [case(1, [48 + 7 * r for r in range(n)], "random", "bfloat16", 7168, 2),
            case(2, [500] * n, "holes", "float32", 300, 1),            # -1 slots
            case(3, [0] + [233] * (n - 1), "skewed", "bfloat16", 1024, 0),  # a rank of none
            case(4, [1100] * n, "one_rank", "bfloat16", 130, 1, False),  # one rank, no weights
            # rank 0's few rows fit a slot whole (eager), the others' stream
            case(5, [3] + [300] * (n - 1), "random", "bfloat16", 1024, 0)]


def _counted(calls):
    real = ring.combine

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    ring.combine = counted


def _run(rank, n, cases, ring_off_at, late=0.0):
    """Each case dispatched, then combined twice; with ``late``, the last rank starts the
    first case's second combine that many seconds after the others (their waits end their
    50 ms slices and go on from where they were)."""
    if rank == ring_off_at:
        os.environ[ring.ENV] = "0"
    host_comm.eager_slot_bytes = lambda R: SLOT
    calls = []
    _counted(calls)
    buf = moe_comm.Buffer(None, 32 << 20, timeout_s=30)
    out = []
    for case in cases:
        x, idx, w, bias = make_inputs(case, rank)
        ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, case["experts"])
        rx, _, rw, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr,
                                               is_token_in_rank=itr,
                                               num_tokens_per_expert=nte, topk_idx=idx,
                                               topk_weights=w)
        y = expert_fn(rx, rank)
        before = len(calls)
        for i in range(2):           # twice: the second call's slots at the other parity
            buf._comm.poison_free_heap()
            if i and late and rank == n - 1 and case is cases[0]:
                time.sleep(late)
            comb, comb_w, _ = buf.combine(y, handle, topk_weights=rw if case["weights"] else
                                          None, bias=combine_biases(case, bias))
        out.append(dict(y=y.clone(), comb=comb, comb_w=comb_w, streamed=len(calls) - before))
        del rx, rw, y, handle
    buf.destroy()
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_streamed_combines_are_the_references_bit_for_bit(n):
    cases = _cases(n)
    results = run_ranks(_run, n, cases, None, 0.3 if n == 3 else 0.0, timeout=240)
    check_combine_bits(n, cases, results)
    for ci in range(len(cases)):         # every case streamed somewhere: all ranks alike
        assert [results[r][ci]["streamed"] for r in range(n)] == [2] * n, ci


def test_one_rank_without_it_turns_it_off_for_all():
    """MOE_COMM_RING=0 on one rank: every rank's combines go through granted regions (the
    ranks agreed at the Buffer's creation), with the same sums."""
    n = 3
    cases = _cases(n)[:2]
    results = run_ranks(_run, n, cases, 1, timeout=240)
    check_combine_bits(n, cases, results)
    assert all(results[r][ci]["streamed"] == 0 for r in range(n) for ci in range(2))


def _dispatched(rank, n, timeout_s):
    """A Buffer with small slots and the first case dispatched on it: ``(buf, case, y, rw,
    handle, bias)``, y the expert outputs."""
    host_comm.eager_slot_bytes = lambda R: SLOT
    buf = moe_comm.Buffer(None, 32 << 20, timeout_s=timeout_s)
    case = _cases(n)[0]
    x, idx, w, bias = make_inputs(case, rank)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, case["experts"])
    rx, _, rw, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                           num_tokens_per_expert=nte, topk_idx=idx,
                                           topk_weights=w)
    return buf, case, expert_fn(rx, rank), rw, handle, bias


def _one_granted(rank, n, timeout_s):
    """Rank 1 takes the granted path for a combine that rank 0 streams (as if the ranks
    had not agreed): neither gets what it waits for, and each must raise at its deadline,
    rank 0 naming rank 1."""
    buf, _, y, rw, handle, _ = _dispatched(rank, n, timeout_s)
    if rank == 1:
        ring.usable = lambda *args: False
    t0 = time.monotonic()
    try:
        buf.combine(y, handle, topk_weights=rw)
        outcome = "returned"
    except moe_comm.CommTimeoutError as e:
        outcome = (type(e).__name__, e.silent_ranks)
    return outcome, time.monotonic() - t0


def test_a_peer_that_does_not_stream_is_a_deadline():
    timeout_s = 2.0
    results = run_ranks(_one_granted, 2, timeout_s, timeout=60)
    (outcome0, took0), (outcome1, took1) = results
    assert outcome0 == ("CommTimeoutError", [1]), outcome0
    assert outcome1[0] == "CommTimeoutError", outcome1
    # the deadline, plus what a loaded 2-core machine may add (waits sleep 1 ms at most)
    for took in (took0, took1):
        assert timeout_s <= took < timeout_s + 3, took


def _differs(rank, n, timeout_s, field):
    """Rank 1 combines without the weights rank 0 sends (``field`` "topk": both stream the
    same rows a part, and could finish) or rows of 6144 channels instead of 7168 ("hidden":
    other parts, so neither gets all it waits for): both raise CallMismatchError naming the
    field at their deadline, and the next combine, on which they agree, is the
    reference's."""
    buf, case, y, rw, handle, bias = _dispatched(rank, n, timeout_s)
    t0 = time.monotonic()
    try:
        if field == "topk":
            buf.combine(y, handle, topk_weights=rw if rank == 0 else None)
        elif rank == 0:
            buf.combine(y, handle, topk_weights=rw)
        else:          # (past Buffer.combine's check of x against the handle)
            buf._be.normal.combine(buf._comm, x=y[:, :6144].contiguous(), handle=handle,
                                   topk_weights=rw, bias=())
        error = None
    except moe_comm.CallMismatchError as e:
        error = str(e)
    took = time.monotonic() - t0
    comb, comb_w, _ = buf.combine(y, handle, topk_weights=rw, bias=combine_biases(case, bias))
    buf.destroy()
    return error, took, dict(y=y, comb=comb, comb_w=comb_w)


@pytest.mark.parametrize("field, says", [("topk", "topk: rank 0 has 4, rank 1 has 0"),
                                         ("hidden", "hidden: rank 0 has 7168, rank 1 has 6144")])
def test_ranks_whose_streamed_combines_differ_raise_call_mismatch_and_go_on(field, says):
    timeout_s = 3.0
    n = 2
    results = run_ranks(_differs, n, timeout_s, field, timeout=60)
    for error, took, _ in results:
        assert error and says in error, error
        assert timeout_s <= took < timeout_s + 3, took
    check_combine_bits(n, _cases(n)[:1], [[r[2]] for r in results])
