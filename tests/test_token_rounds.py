"""Relayed calls in token rounds (#16): a batch several times larger than the buffer, on a
group spread over hosts, still goes by relays - each round a relayed call over a slice of
every rank's tokens (moe_comm/token_rounds.py, moe_comm/host/relay_rounds.py) - so the
results are the reference's and each token still crosses to each other host once.

Host backend, 3 network-namespace hosts x 2 ranks: dispatch, combine and a cached dispatch of
test_streaming's cases (the largest receive region >= 4x the heap) against the reference and
bit for bit against a heap large enough for one copy; the bytes on the host links within the
issue's bound of the ideal; a controller's mask between a dispatch in rounds and its combine.
"""
from __future__ import annotations

import io
import os
import signal
import time

import numpy as np
import pytest
import torch

import moe_comm
from checks import assert_same_bits, check_normal
from moe_comm.host import relay_rounds
from moe_comm.testing import netns
from moe_comm.token_rounds import RowPlacer, capped, largest_chunk, num_rounds, token_span
from test_elastic import _check_survivors
from test_hierarchical import _two_steps, _wire
from test_normal_mode import _run_cases
from test_streaming import LARGE_HEAP, SMALL_HEAP
from test_streaming import _cases as streaming_cases

HOSTS, PER_HOST = 3, 2
N = HOSTS * PER_HOST
TCP = {"MOE_COMM_TRANSPORT": "tcp"}
WIRE_RATIO_MAX = 1.10          # issue #16: bytes on the links over the ideal, normal mode
WHY_NOT = netns.available()
on_hosts = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")


def test_token_rounds_arithmetic():
    assert largest_chunk(lambda c: c <= 37, 100) == 37
    assert largest_chunk(lambda c: c <= 500, 100) == 100
    assert largest_chunk(lambda c: False, 100) == 0
    assert largest_chunk(lambda c: True, 0) == 0
    assert capped(np.array([[0, 5], [9, 2]]), 3).tolist() == [[0, 3], [3, 2]]
    assert num_rounds([10, 0, 25], 10) == 3 and num_rounds([0, 0], 4) == 1
    assert token_span(2, 10, 25) == (20, 25) and token_span(3, 10, 25) == (25, 25)
    # two sources (3 and 2 rows in all), placed over two rounds in the one-copy order
    placer = RowPlacer(np.array([3, 2]))
    assert placer.next_round(np.array([2, 1])).tolist() == [0, 1, 3]
    assert not placer.complete()
    assert placer.next_round(np.array([1, 1])).tolist() == [2, 4]
    assert placer.complete()
    with pytest.raises(RuntimeError, match="more rows"):
        placer.next_round(np.array([1, 0]))


def _cases_blob(rank, n, cases, heap):
    """test_normal_mode's cases on this rank, as torch.save bytes (results cross processes),
    with, for each dispatch that went in token rounds, whether each round went by relays."""
    seen, real = [], relay_rounds.dispatch

    def spy(comm, one_round, *args):
        def round_seen(lo, hi, r, aborted):
            got = one_round(lo, hi, r, aborted)
            seen[-1].append(got[-1].relay is not None)
            return got
        seen.append([])
        return real(comm, round_seen, *args)

    relay_rounds.dispatch = spy
    blob = io.BytesIO()
    torch.save((_run_cases(rank, n, cases, heap), seen), blob)
    return blob.getvalue()


def _on_hosts(cases, heap):
    blobs = netns.run_on_hosts(_cases_blob, HOSTS, PER_HOST, cases, heap, timeout=600, env=TCP)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]


@on_hosts
def test_a_relayed_batch_larger_than_the_heap_goes_in_token_rounds():
    cases = streaming_cases(N)
    small, seen = zip(*_on_hosts(cases, SMALL_HEAP))
    # a relay's partial sums are rounded to the payload dtype once more (DeepEP's scheme)
    check_normal(N, cases, small, tol=2e-2)
    # all but the smallest case went in rounds (fresh and cached dispatch), each by relays
    for r in range(N):
        assert len(seen[r]) == 2 * 4, [len(s) for s in seen[r]]
        assert all(len(s) >= 4 and all(s) for s in seen[r]), seen[r]
    large, seen = zip(*_on_hosts(cases, LARGE_HEAP))
    assert not any(seen)
    assert_same_bits(N, cases, small, large)


# the wire check: 4x more rows than the heap holds, rows large beside the per-round words
WIRE_TOKENS, WIRE_HIDDEN, WIRE_TOPK, WIRE_HEAP = 384, 2048, 4, 1 << 20


def _rounds_of(handle) -> tuple:
    """Whether the call's rows came to >= 4x the heap, and whether each of its rounds went by
    relays."""
    big = handle.num_recv_tokens * WIRE_HIDDEN * 2 >= 4 * WIRE_HEAP
    return big, [rd.handle.relay is not None for rd in handle.rounds or ()]


def _wire_in_rounds(rank, n):
    """test_hierarchical's wire check (two dispatch + combine pairs between barriers, a host's
    link counter around them) on a heap the calls are >= 4x larger than."""
    return _wire(rank, n, PER_HOST, WIRE_TOKENS, WIRE_HIDDEN, 2, WIRE_HEAP, 4, WIRE_TOPK,
                 _rounds_of)


@on_hosts
def test_token_rounds_cross_each_host_link_once():
    wires = netns.run_on_hosts(_wire_in_rounds, HOSTS, PER_HOST, timeout=300, env=TCP)
    for _, _, (big, rounds) in wires:
        assert big and len(rounds) >= 4 and all(rounds), (big, rounds)
    ratio = sum(s for s, _, _ in wires if s is not None) / sum(i for _, i, _ in wires)
    print(f"wire ratio in token rounds: {ratio:.3f} ({len(wires[0][2][1])} rounds)")
    assert ratio <= WIRE_RATIO_MAX, ratio


MASKED = 3                     # host 1, local index 1: a relay of host 0's and 2's index-1 ranks


def _masked_between(rank, n, heap):
    """A relayed dispatch (in token rounds when ``heap`` is small), then a controller masks
    rank MASKED on every rank, then the combine on the dispatch's handle and a cached dispatch:
    what the survivors get."""
    buf = moe_comm.Buffer(None, heap, timeout_s=30)
    g = torch.Generator().manual_seed(100 + rank)
    tokens, hidden, experts, topk = 300, 512, 4 * n, 4
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    w = torch.rand(tokens, topk, generator=g)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, experts)
    rx, _, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                           num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                           num_tokens_per_expert=nte)
    rounds = None if handle.rounds is None else len(handle.rounds)
    active = torch.ones(n, dtype=torch.int32)
    active[MASKED] = 0
    buf.set_active_ranks(active)
    out = None
    if rank != MASKED:
        y = (rx.float() * (rank + 1)).bfloat16()
        comb, comb_w, _ = buf.combine(y, handle, topk_weights=rw)
        rx2, *_ = buf.dispatch(x, handle=handle)
        out = dict(x=x, idx=idx, comb=comb, comb_w=comb_w, rx2=rx2.clone())
    buf.destroy()
    return rounds, out


@on_hosts
def test_a_mask_between_a_dispatch_in_rounds_and_its_combine():
    """The survivors' combine and cached dispatch on a handle of token rounds after a rank is
    masked: each round redoes its call flat over the survivors (its relays lost a rank), and
    the results are the same bits as a one-copy relayed call's (redone flat alike), and the
    combine sums the survivors' rows."""
    small = netns.run_on_hosts(_masked_between, HOSTS, PER_HOST, SMALL_HEAP, timeout=300,
                               env=TCP)
    large = netns.run_on_hosts(_masked_between, HOSTS, PER_HOST, LARGE_HEAP, timeout=300,
                               env=TCP)
    assert all(rounds >= 2 for rounds, _ in small)
    assert all(rounds is None for rounds, _ in large)
    for r in range(N):
        got, want = small[r][1], large[r][1]
        if r == MASKED:
            assert got is None and want is None
            continue
        for key in ("comb", "comb_w", "rx2"):
            assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), (r, key)
        dest = got["idx"] // 4                     # 4 experts per rank
        expect = torch.zeros(got["x"].shape, dtype=torch.float32)
        for d in range(N):
            if d != MASKED:
                hit = (dest == d).any(1)
                expect[hit] += (got["x"][hit].float() * (d + 1)).bfloat16().float()
        torch.testing.assert_close(got["comb"].float(), expect, rtol=2e-2, atol=5e-2)


# an elastic group loses a relay between two rounds of a dispatch: 3 hosts x 2 ranks, rank 2
# (host 1, local index 0) relays the tokens of ranks 0 and 4 onto host 1
ROUNDS_VICTIM, ROUNDS_TIMEOUT, TINY_HEAP = 2, 3.0, 16 << 10


def _relay_dies_between_rounds(rank, n):
    """test_elastic's step (dispatch, identity experts weighted by the routing weights,
    combine) on a heap so small that its dispatch runs in token rounds; the victim is
    SIGKILLed before its second round. The survivors' step, then one over re-placed experts."""
    real = relay_rounds.dispatch

    def dying(comm, one_round, *args):
        def round_or_die(lo, hi, r, aborted):
            if r == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return one_round(lo, hi, r, aborted)
        return real(comm, round_or_die, *args)

    if rank == ROUNDS_VICTIM:
        relay_rounds.dispatch = dying
    buf = moe_comm.Buffer(None, TINY_HEAP, timeout_s=ROUNDS_TIMEOUT, elastic=True)
    return _two_steps(buf, rank, n, lambda handles: {
        "rounds": [0 if h.rounds is None else len(h.rounds) for h in handles]})


@on_hosts
def test_an_elastic_relay_killed_between_rounds_leaves_survivors_exact():
    """The rounds after the victim's death go on among the survivors (by relays picked among
    them, or flat where the plan's bound, made with the victim's relays, no longer holds),
    and its rows of the rounds before are dropped: the first step sums what the surviving
    experts served, the second serves everything."""
    with netns.Hosts(HOSTS) as hosts:
        results = hosts.run(_relay_dies_between_rounds, PER_HOST,
                            expect_exit_ranks={ROUNDS_VICTIM}, timeout=120, env=TCP)
    assert results[ROUNDS_VICTIM] is None, "the victim was to die between two rounds"
    mask = torch.tensor([int(r != ROUNDS_VICTIM) for r in range(N)], dtype=torch.int32)
    _check_survivors(results, N, mask, "between rounds")
    assert all(results[r]["rounds"][0] >= 2 for r in range(N) if mask[r]), \
        [results[r]["rounds"] for r in range(N)]


FAIL_TIMEOUT = 10.0


def _combine_round_fails_here(rank, n):
    """A dispatch in token rounds, then rank 1 takes nearly all its heap (another micro-batch's
    output, say) and the combine on the rounds' handle fails in its first round there and at
    the ranks writing to it: every rank raises at once (the others in the next round), then,
    the heap given back, the same combine works on every rank."""
    buf = moe_comm.Buffer(None, 1 << 20, timeout_s=FAIL_TIMEOUT)
    g = torch.Generator().manual_seed(rank)
    tokens = 1000
    x = torch.randn(tokens, 256, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(tokens)])
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, 16)
    rx, _, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=ntr,
                                           is_token_in_rank=itr, num_tokens_per_expert=nte)
    heap = buf._comm.heap
    held = heap.alloc(heap.free_bytes // 4096 - 2) if rank == 1 else None
    start = time.monotonic()
    try:
        buf.combine(rx, handle)
        outcome = "no error"
    except Exception as e:          # noqa: BLE001 - which error each rank gets is the point
        outcome = type(e).__name__
    took = time.monotonic() - start
    if held is not None:
        heap.free(held)
    out, _, _ = buf.combine(rx, handle)
    buf.destroy()
    return len(handle.rounds), outcome, took, out, x, idx


@on_hosts
def test_a_round_failing_on_some_ranks_fails_the_call_on_every_rank():
    results = netns.run_on_hosts(_combine_round_fails_here, 2, 2, timeout=120, env=TCP)
    outcomes = [r[1] for r in results]
    assert outcomes[1] == "BufferTooSmallError", outcomes
    assert all(o in ("ReceiverFailed", "RoundFailed") for i, o in enumerate(outcomes)
               if i != 1), outcomes
    for rounds, _, took, out, x, idx in results:
        assert rounds >= 2
        assert took < FAIL_TIMEOUT / 2, took          # nobody waited out a deadline
        # identity experts: each token comes back once per destination rank it went to
        copies = torch.zeros(len(idx), 4).scatter_(1, idx // 4, 1.0).sum(1, keepdim=True)
        torch.testing.assert_close(out.float(), x.float() * copies, rtol=2e-2, atol=2e-2)
