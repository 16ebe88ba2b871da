"""Low-latency halves straight from the Buffer's arguments (moe_comm/host/ll_direct.py):
the direct path and host/ll.py's Python path give the same bits, ranks on either pair with
each other, a peer late past a wait's slice is waited for, and the direct path is the one
that runs where it should."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.host import ll, ll_direct, native
from checks import check_ll, expert_ll, ll_combine, ll_inputs
from moe_comm.quant import dequantize_fp8, quantize_fp8
from moe_comm.reference import reference_ll_dispatch
from moe_comm.wire import LL_ROWS_DIRECT
from ranks import run_ranks


def _buffer(case, n, timeout_s=30):
    return moe_comm.Buffer(None, 1 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        case["max_tokens"], case["hidden"], n, case["experts"]), low_latency_mode=True,
        timeout_s=timeout_s, elastic=case.get("elastic", False))


class _Counting:
    """Counts the Python path's send halves (the direct path never calls them)."""

    def __init__(self, monkey):
        self.sends = 0
        for name in ("dispatch_send", "combine_send"):
            real = getattr(ll, name)
            monkey.setattr(ll, name, self._counted(real))

    def _counted(self, real):
        def call(*args, **kwargs):
            self.sends += 1
            return real(*args, **kwargs)
        return call


def _call(buf, case, rank, stats, python):
    """One dispatch and combine of ``case``; ``python``: on host/ll.py's path."""
    if python:
        buf._ll_direct = None
    x, idx, w = ll_inputs(case, rank)
    rx, cnt, handle, _, hook = buf.low_latency_dispatch(
        x, idx, case["max_tokens"], case["experts"], cumulative_local_expert_recv_stats=stats,
        use_fp8=case["fp8"], return_recv_hook=case["hook"])
    hook()
    y = expert_ll(rx, rank)
    combined, hook = ll_combine(buf, case, y, idx, w, handle,
                                x.shape[0] if case["out"] else None)
    hook()
    rx = tuple(t.clone() for t in rx) if isinstance(rx, tuple) else rx.clone()
    return dict(rx=rx, cnt=cnt.clone(), stats=stats.clone(), y=y, combined=combined.clone(),
                meta=handle.recv_meta.clone(), ranges=handle.recv_ranges.clone(),
                base=handle.return_base.clone(), tok=handle.send_tok.clone())


def _cases(n):
    M = 16
    specs = [  # (hidden, fp8, hook, zero_copy, out, routing, stats dtype)
        (128, False, False, False, False, "random", torch.int32),
        (256, True, True, False, True, "holes", torch.int64),
        (512, True, False, True, False, "skewed", torch.int32),
        (1024, True, True, True, False, "random", torch.int64),
    ]
    return [dict(seed=40 + s, hidden=h, fp8=fp8, round_scale=False, ue8m0=False, hook=hook,
                 zero_copy=zc, out=out, routing=rt, stats=sd, max_tokens=M,
                 tokens=[M if r == 0 else (0 if r == 1 else (2 + 5 * r) % M + 1)
                         for r in range(n)],
                 experts=4 * n, topk=min(4, 4 * n))
            for s, (h, fp8, hook, zc, out, rt, sd) in enumerate(specs)]


def _mixed(rank, n, cases, python_ranks, monkeypatch_sends):
    """Every case on ``python_ranks`` through ll.py, on the others directly; returns the
    results and how many Python send halves ran on this rank."""
    mp = pytest.MonkeyPatch()
    counting = _Counting(mp) if monkeypatch_sends else None
    out = []
    try:
        for case in cases:
            buf = _buffer(case, n)
            stats = torch.full((case["experts"] // n,), 5, dtype=case["stats"])
            out.append(_call(buf, case, rank, stats, rank in python_ranks))
            buf.destroy()
    finally:
        mp.undo()
    return out, None if counting is None else counting.sends


@pytest.mark.parametrize("n,python_ranks", [(1, ()), (2, ()), (3, (1,)), (4, (0, 3))])
def test_direct_and_python_halves_pair_and_match_the_reference(n, python_ranks):
    cases = _cases(n)
    results = run_ranks(_mixed, n, cases, python_ranks, True, timeout=300)
    check_ll(n, cases, [[dict(r, stats=r["stats"].int()) for r in res] for res, _ in results],
             quantize_fp8)
    for rank, (_, sends) in enumerate(results):
        # the direct path ran on every other rank (rank 1's dispatches are of no tokens)
        want = 2 * len(cases) if rank in python_ranks else 0
        assert sends == want, (rank, sends, want)


def _both(rank, n, case):
    """The same calls on both paths of one Buffer, the direct path first; and how many of the
    Python path's send halves ran in the direct path's calls."""
    buf = _buffer(case, n)
    got = []
    mp = pytest.MonkeyPatch()
    counting = _Counting(mp)
    try:
        for python in (False, True):
            stats = torch.zeros(case["experts"] // n, dtype=torch.int32)
            got.append(_call(buf, case, rank, stats, python))
            got.append(counting.sends)
    finally:
        mp.undo()
    buf.destroy()
    return got[0], got[2], got[1]


@pytest.mark.parametrize("fp8,elastic", [(True, False), (False, False), (True, True)])
def test_the_direct_path_gives_the_python_paths_bits(fp8, elastic):
    case = dict(seed=7, hidden=512, fp8=fp8, round_scale=False, ue8m0=False, hook=elastic,
                zero_copy=False, out=False, routing="skewed", max_tokens=12, tokens=[12, 9],
                experts=8, topk=3, elastic=elastic)
    for direct, python, python_sends in run_ranks(_both, 2, case, timeout=120):
        assert python_sends == 0
        for key in ("cnt", "stats", "meta", "ranges", "base", "tok", "combined"):
            assert torch.equal(direct[key], python[key]), key
        counts = direct["cnt"].tolist()
        for part, want in zip(direct["rx"] if fp8 else (direct["rx"],),
                              python["rx"] if fp8 else (python["rx"],)):
            for le, c in enumerate(counts):       # rows past an expert's count are undefined
                assert torch.equal(part[le, :c].view(torch.uint8),
                                   want[le, :c].view(torch.uint8)), le


def _small_calls_get_areas():
    """This rank's receives give areas for calls of any size (the tests' calls are small)."""
    ll_direct.AREA_MIN_BYTES = 0


def _in_areas(comm, t) -> bool:
    """Whether tensor ``t`` lies in this rank's receive areas (host/ll_direct.py)."""
    base = comm.ll_areas[comm.rank].ctypes.data
    return base <= t.data_ptr() < base + comm.ll_areas[comm.rank].nbytes


PY_RANK = 1       # the rank on ll.py's path in some rounds: one before it, one after


def _rounds_held(rank, n, case, rounds, python_rounds):
    """``rounds`` dispatches and combines of ``case`` (its seed + the round: new tokens and
    routes each time) on one Buffer, every received tensor held unchanged to the end; rank
    PY_RANK on ll.py's path in ``python_rounds`` (rank 2's rows then go through the blocks
    after it waited for PY_RANK's announce in vain, and PY_RANK's receive copies rank 0's
    out of its area). Returns each round's results and whether its recv_x was an area of
    this rank, and which of its ll.py receives found rows in its area."""
    buf = _buffer(case, n)
    _small_calls_get_areas()
    direct = buf._ll_direct
    held = []
    copied = []                 # ll.py receives that took rows out of this rank's area
    mp = pytest.MonkeyPatch()
    real = native.ll_recv
    mp.setattr(native, "ll_recv", lambda *a, **k: copied.append(
        k.get("direct") is not None and k["direct"].any()) or real(*a, **k))
    for i in range(rounds):
        c = dict(case, seed=case["seed"] + i)
        buf._ll_direct = None if rank == PY_RANK and i in python_rounds else direct
        x, idx, w = ll_inputs(c, rank)
        stats = torch.full((c["experts"] // n,), 5, dtype=torch.int64)
        rx, cnt, handle, _, hook = buf.low_latency_dispatch(
            x, idx, c["max_tokens"], c["experts"], cumulative_local_expert_recv_stats=stats,
            use_fp8=c["fp8"], return_recv_hook=c["hook"])
        hook()
        y = expert_ll(rx, rank)
        combined, hook = ll_combine(buf, c, y, idx, w, handle, None)
        hook()
        held.append((dict(rx=rx, cnt=cnt, stats=stats, y=y, combined=combined.clone(),
                          meta=handle.recv_meta.clone()),
                     _in_areas(direct.comm, rx[0] if c["fp8"] else rx)))
    mp.undo()
    buf._ll_direct = direct
    dist.barrier()
    buf.destroy()
    return held, copied


@pytest.mark.parametrize("n,fp8,python_rounds", [(2, True, ()), (3, False, ()),
                                                 (3, True, (3, 4))])
def test_receive_areas_never_overwrite_what_the_caller_holds(n, fp8, python_rounds):
    """From a Buffer's third dispatch on, senders write their rows straight into a receive
    area the receiver gave (recv_x is a view of it): every round's result, all of them held
    to the end, matches the reference; once the caller holds every area, the rows go through
    the region's blocks into a tensor of the pool; ranks on ll.py's path pair with them."""
    case = dict(seed=60, hidden=256, fp8=fp8, round_scale=False, ue8m0=False, hook=True,
                zero_copy=False, out=False, routing="random", max_tokens=16,
                tokens=[16, 11, 7][:n], experts=4 * n, topk=4)
    rounds = 8
    results = run_ranks(_rounds_held, n, case, rounds, python_rounds, timeout=300)
    cases = [dict(case, seed=case["seed"] + i) for i in range(rounds)]
    check_ll(n, cases, [[got for got, _ in res] for res, _ in results], quantize_fp8)
    for rank, (res, copied) in enumerate(results):
        # PY_RANK's receives on ll.py's path found rank 0's rows in its area
        want = [True] * len(python_rounds) if rank == PY_RANK else []
        assert copied == want, (rank, copied)
        in_areas = [area for _, area in res]
        # the first two calls have no area; then one per call until the caller holds all
        # four (PY_RANK on ll.py's path never gets one)
        want = [False, False] + [True] * 4 + [False] * (rounds - 6)
        if rank == PY_RANK:
            want = [a and i not in python_rounds for i, a in enumerate(want)]
        if not python_rounds:
            assert in_areas == want, (rank, in_areas)
        else:
            assert not any(in_areas[i] for i in python_rounds if rank == PY_RANK), in_areas


def _newest_first(rank, n, case, rounds, drop):
    """Dispatches two at a time with receive hooks, the newer one's hook called first; every
    result held to the end, or (``drop``) each dropped once checked, but for one recv_scales
    kept from round 2. Returns each round's (recv_x and scales, or their copies where
    dropped, the counts, the area offset of recv_x or None) and whether the kept scales
    stayed as they were."""
    buf = _buffer(case, n)
    _small_calls_get_areas()
    comm = buf._ll_direct.comm
    base, size = comm.ll_areas[rank].ctypes.data, comm.ll_areas[rank].nbytes
    out, kept = [], None
    for first in range(0, rounds, 2):
        calls = []
        for i in (first, first + 1):
            c = dict(case, seed=case["seed"] + i)
            x, idx, _ = ll_inputs(c, rank)
            calls.append(buf.low_latency_dispatch(x, idx, c["max_tokens"], c["experts"],
                                                  use_fp8=True, return_recv_hook=True))
        for call in reversed(calls):
            call[4]()
        for i, ((rx, scales), cnt, *_) in zip((first, first + 1), calls):
            at = rx.data_ptr() - base if base <= rx.data_ptr() < base + size else None
            if drop and i == 2:
                kept = (scales, scales.clone())
            out.append(((rx.clone(), scales.clone()) if drop else (rx, scales), cnt, at))
        del calls, rx, scales
    same = kept is None or torch.equal(kept[0], kept[1])
    dist.barrier()
    buf.destroy()
    return out, same


@pytest.mark.parametrize("drop", [False, True])
def test_receive_areas_with_hooks_called_newest_first(drop):
    """Two dispatches in flight whose hooks run newest first: the areas given for the calls
    after them differ (one given twice would put two calls' rows in one area), every result
    matches the reference; results the caller drops free their areas for reuse, and scales
    kept alone keep theirs out of use."""
    n, rounds = 2, 10
    case = dict(seed=70, hidden=256, fp8=True, round_scale=False, ue8m0=False,
                routing="random", max_tokens=16, tokens=[16, 11], experts=4 * n, topk=4)
    results = run_ranks(_newest_first, n, case, rounds, drop, timeout=300)
    for i in range(rounds):
        c = dict(case, seed=case["seed"] + i)
        ins = [ll_inputs(c, r) for r in range(n)]
        ref = reference_ll_dispatch([t[0] for t in ins], [t[1] for t in ins], c["experts"],
                                    c["max_tokens"])
        for rank, (res, _) in enumerate(results):
            (rx, scales), cnt, _ = res[i]
            assert torch.equal(cnt, ref[rank]["recv_count"]), (i, rank)
            for le, k in enumerate(cnt.tolist()):
                q, s = quantize_fp8(ref[rank]["recv_x"][le, :k])
                assert torch.equal(rx[le, :k].view(torch.uint8), q.view(torch.uint8)), \
                    (i, rank, le)
                assert torch.equal(scales[le, :k], s), (i, rank, le)
    for rank, (res, same) in enumerate(results):
        assert same, rank
        areas = [at for _, _, at in res]
        assert areas[:2] == [None, None] and None not in areas[2:6], areas
        held = [at for at in areas if at is not None]
        if not drop:      # each area once, until the caller holds all four
            assert len(set(held)) == len(held) == 4, areas
        else:             # reused (more calls than areas), never the kept scales' area
            assert len(held) > 4 and areas.count(areas[2]) == 1, areas


def _lower_sender_late(rank, n, case, rounds, late_s):
    """``rounds`` dispatches, rank 0 starting each ``late_s`` after the others from the third
    on. Returns each round's results (held) and, per round, which sources' count rows at this
    rank say their rows came straight into its area."""
    buf = _buffer(case, n)
    _small_calls_get_areas()
    lay = buf._ll_direct._layout(case["max_tokens"], case["hidden"], case["experts"])[0]
    out = []
    for i in range(rounds):
        c = dict(case, seed=case["seed"] + i)
        x, idx, w = ll_inputs(c, rank)
        if rank == 0 and i >= 2:
            time.sleep(late_s)
        stats = torch.full((c["experts"] // n,), 5, dtype=torch.int64)
        rx, cnt, handle, _, hook = buf.low_latency_dispatch(
            x, idx, c["max_tokens"], c["experts"], cumulative_local_expert_recv_stats=stats,
            use_fp8=True, return_recv_hook=True)
        hook()
        rows = ll.tag_value(ll._count_rows(buf._ll_direct.comm, lay, handle.buf))
        direct = ((rows[:, lay.num_local] & LL_ROWS_DIRECT) != 0).tolist()
        y = expert_ll(rx, rank)
        combined, hook = ll_combine(buf, c, y, idx, w, handle, None)
        hook()
        out.append((dict(rx=rx, cnt=cnt, stats=stats, y=y, combined=combined.clone()), direct))
    dist.barrier()
    buf.destroy()
    return out


def test_a_late_lower_sender_sends_the_later_ones_through_the_blocks():
    """A sender places its rows in a receive area after those of the sources before it, once
    they announced their counts; where one is late (rank 0 here, 0.2 s), the later senders
    write into the blocks after DIRECT_WAIT_NS (2 ms) instead of waiting for it, and every
    result still matches the reference."""
    n, rounds = 3, 5
    case = dict(seed=80, hidden=256, fp8=True, round_scale=False, ue8m0=False, hook=True,
                zero_copy=False, out=False, routing="random", max_tokens=16,
                tokens=[16, 11, 7], experts=4 * n, topk=4)
    results = run_ranks(_lower_sender_late, n, case, rounds, 0.2, timeout=300)
    cases = [dict(case, seed=case["seed"] + i) for i in range(rounds)]
    check_ll(n, cases, [[got for got, _ in res] for res in results], quantize_fp8)
    # rank 0 has no source before it: its rows go into the areas; rank 2's into rank 1's
    # came through the blocks in some late round (each waited 2 ms against rank 0's 200)
    for rank in (1, 2):
        assert all(results[rank][i][1][0] for i in range(2, rounds)), results[rank]
    assert not all(results[1][i][1][2] for i in range(2, rounds)), results[1]


LATE_S = 0.3          # several of a C wait's 50 ms slices: the halves go on past a slice


def _late(rank, n, case, rounds):
    """``rounds`` dispatch + combine rounds; the last rank sleeps before each call and each
    receive, so the others' receives wait past a slice, and from the third call on their
    sends wait for its FREE pushes."""
    buf = _buffer(case, n)
    out = []
    for _ in range(rounds):
        x, idx, w = ll_inputs(case, rank)
        if rank == n - 1:
            time.sleep(LATE_S)
        rx, _, handle, _, hook = buf.low_latency_dispatch(
            x, idx, case["max_tokens"], case["experts"], use_fp8=case["fp8"],
            return_recv_hook=True)
        if rank == n - 1:
            time.sleep(LATE_S)
        hook()
        combined, _, _ = buf.low_latency_combine(expert_ll(rx, rank), idx, w, handle)
        out.append(combined.clone())
    sent_by_python = buf._ll_direct is None
    dist.barrier()
    buf.destroy()
    return out, sent_by_python


def test_a_late_peer_is_waited_for_past_a_slice():
    case = dict(seed=3, hidden=256, fp8=True, round_scale=False, ue8m0=False, routing="random",
                max_tokens=8, tokens=[8, 6, 7], experts=6, topk=2)
    n, rounds = 3, 4
    results = run_ranks(_late, n, case, rounds, timeout=120)
    for rank, (outs, by_python) in enumerate(results):
        assert not by_python
        # the same inputs every round: the same sums (a round that read a stale buffer, or
        # lost a peer's rows, would differ from the first)
        for got in outs[1:]:
            assert torch.equal(got, outs[0]), rank
        # each row came back from its expert's rank r scaled by r + 1 (expert_ll)
        x, idx, w = ll_inputs(case, rank)
        row = dequantize_fp8(*quantize_fp8(x))
        owner = torch.where(idx >= 0, idx // (case["experts"] // n), -1)
        want = sum(torch.where(owner[:, k:k + 1] >= 0, w[:, k:k + 1], 0.0) *
                   (row * (owner[:, k:k + 1] + 1)).bfloat16().float()
                   for k in range(case["topk"]))
        torch.testing.assert_close(outs[0].float(), want, rtol=1e-2, atol=1e-2)


def _send_waits(rank, n, case):
    """Two dispatches and two combines that the last rank receives only after LATE_S (both
    through receive hooks), then a third of each: the other ranks' third sends wait for its
    FREE pushes, past several slices. Returns the three sums and how often a send half went
    on in Python after its C call stopped."""
    buf = _buffer(case, n)
    direct = type(buf._ll_direct)
    drives = []
    mp = pytest.MonkeyPatch()
    real = direct._drive_send
    mp.setattr(direct, "_drive_send", lambda self, *a: drives.append(1) or real(self, *a))
    late = rank == n - 1
    x, idx, w = ll_inputs(case, rank)
    M, E = case["max_tokens"], case["experts"]
    try:
        calls = [buf.low_latency_dispatch(x, idx, M, E, return_recv_hook=late)
                 for _ in range(2)]
        if late:
            time.sleep(LATE_S)
            for call in calls:
                call[4]()
        calls.append(buf.low_latency_dispatch(x, idx, M, E))
        ys = [expert_ll(call[0], rank) for call in calls]
        sums = [buf.low_latency_combine(ys[i], idx, w, calls[i][2], return_recv_hook=late)
                for i in range(2)]
        if late:
            time.sleep(LATE_S)
            for s in sums:
                s[2]()
        sums.append(buf.low_latency_combine(ys[2], idx, w, calls[2][2]))
    finally:
        mp.undo()
    out = [s[0].clone() for s in sums]
    dist.barrier()
    buf.destroy()
    return out, len(drives)


def test_sends_wait_for_a_late_receivers_free_push_past_a_slice():
    case = dict(seed=5, hidden=256, fp8=True, round_scale=False, ue8m0=False, routing="random",
                max_tokens=8, tokens=[8, 5, 8], experts=6, topk=2)
    n = 3
    for rank, (sums, drives) in enumerate(run_ranks(_send_waits, n, case, timeout=120)):
        assert torch.equal(sums[0], sums[1]) and torch.equal(sums[0], sums[2]), rank
        assert drives >= (0 if rank == n - 1 else 2), (rank, drives)


MASKED = dict(seed=11, hidden=512, routing="random", max_tokens=12, tokens=[12, 7, 9],
              experts=6, topk=3)


def _masked_before_hook(rank, n, python, half, elastic):
    """Rank 2 is masked after every rank's send of ``half`` is out, before the receive hooks
    run: by ranks 0 and 1 (not elastic), or by rank 1 alone (elastic: rank 0 hears all its
    words, then learns of the mask from the survivors' agreement; rank 2, fenced, raises).
    Returns what the survivors received and hold, and which of ll.py's receives ran."""
    buf = moe_comm.Buffer(None, 1 << 20, 1 << 24, low_latency_mode=True, timeout_s=10,
                          elastic=elastic)
    if python:
        buf._ll_direct = None
    ran = []
    mp = pytest.MonkeyPatch()
    for name in ("dispatch_recv", "dispatch_pack", "combine_recv", "combine_sum"):
        real = getattr(ll, name)
        mp.setattr(ll, name, lambda *a, _r=real, _n=name, **k: ran.append(_n) or _r(*a, **k))
    x, idx, w = ll_inputs(MASKED, rank)

    def mask_rank_2(now):
        if now:
            dist.barrier()                  # every rank's send is out
            if rank == 1 or (rank == 0 and not elastic):
                buf.low_latency_update_mask_buffer(2, True)

    try:
        rx, cnt, handle, _, hook = buf.low_latency_dispatch(
            x, idx, 12, 6, use_fp8=False, return_recv_hook=half == "dispatch")
        mask_rank_2(half == "dispatch")
        hook()
        if half == "dispatch" and rank == 2:      # its peers left it: no combine with them
            return None
        out, _, hook = buf.low_latency_combine(expert_ll(rx, rank), idx, w, handle,
                                               return_recv_hook=half == "combine")
        mask_rank_2(half == "combine")
        hook()
    except moe_comm.RankMaskedError:     # rank 2, fenced by the survivors (elastic)
        return None
    finally:
        mp.undo()
    if rank == 2:
        return None
    return (cnt.clone(), out.clone(), handle.sent_to.copy(),
            [h[:3] for h in buf._comm.late_rows.held], ran)


@pytest.mark.parametrize("half", ["dispatch", "combine"])
@pytest.mark.parametrize("elastic", [False, True])
def test_a_rank_masked_between_send_and_hook_is_left_out_on_both_paths(half, elastic):
    direct, python = (run_ranks(_masked_before_hook, 3, p, half, elastic, timeout=60)
                      for p in (False, True))
    for rank in (0, 1):
        for got, want in zip(direct[rank][:2], python[rank][:2]):
            assert torch.equal(got, want), rank
        assert (direct[rank][2] == python[rank][2]).all() and \
            direct[rank][3] == python[rank][3], rank
    if elastic:       # rank 0's direct receive read in ll.py once the agreement masked rank 2
        assert direct[0][4][0] == ("dispatch_pack" if half == "dispatch" else "combine_sum")
    if half == "dispatch":        # rank 2's rows are missing from the counts
        full = run_ranks(_masked_before_hook, 3, False, "none", elastic, timeout=60)
        assert not torch.equal(direct[0][0], full[0][0])


def _zero_max_tokens(rank, n):
    buf = moe_comm.Buffer(None, 1 << 20, 1 << 24, low_latency_mode=True, timeout_s=10)
    x, idx = torch.empty(0, 512).bfloat16(), torch.empty(0, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        buf.low_latency_dispatch(x, idx, 0, 6)
    buf.destroy()


def test_zero_max_tokens_is_refused_on_every_rank():
    run_ranks(_zero_max_tokens, 2, timeout=60)


MID_SEND_TIMEOUT_S = 1.0


def _masked_mid_send(rank, n, python, kind):
    """Elastic: rank 2 stalls (2.5 deadlines) after the agreement of its first receive of
    ``kind``, before its FREE push; ranks 0 and 1 have two calls of ``kind`` out (hooks) and
    send a third, which waits for that push: rank 2 is masked in the middle of their send,
    which goes on without it (sent_to says so)."""
    buf = moe_comm.Buffer(None, 1 << 20, 1 << 24, low_latency_mode=True,
                          timeout_s=MID_SEND_TIMEOUT_S, elastic=True)
    if python:
        buf._ll_direct = None
    comm = buf._comm
    x, idx, w = ll_inputs(MASKED, rank)
    if rank == 2:
        real, agreed = comm.agree, []

        def agree(op, *args, **kwargs):
            real(op, *args, **kwargs)
            agreed.append(op)
            if len(agreed) == (1 if kind == "dispatch" else 2):
                time.sleep(2.5 * MID_SEND_TIMEOUT_S)
        comm.agree = agree
    try:
        if kind == "dispatch":
            calls = [buf.low_latency_dispatch(x, idx, 12, 6, use_fp8=False,
                                              return_recv_hook=True) for _ in range(2)]
            calls[0][4]()
            calls.append(buf.low_latency_dispatch(x, idx, 12, 6, use_fp8=False,
                                                  return_recv_hook=True))
            calls[1][4]()
            calls[2][4]()
            rx, cnt, handle = calls[2][:3]
            out, _, _ = buf.low_latency_combine(expert_ll(rx, rank), idx, w, handle)
        else:
            rx, cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, 12, 6, use_fp8=False)
            y = expert_ll(rx, rank)
            sums = [buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
                    for _ in range(2)]
            sums[0][2]()
            sums.append(buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True))
            sums[1][2]()
            sums[2][2]()
            out = sums[2][0]
    except moe_comm.RankMaskedError:
        return None
    return (cnt.clone(), out.clone(), handle.sent_to.copy(),
            [h[:3] for h in comm.late_rows.held], buf.active_ranks.clone())


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_a_destination_masked_mid_send_is_left_out_alike_on_both_paths(kind):
    direct, python = (run_ranks(_masked_mid_send, 3, p, kind, timeout=60)
                      for p in (False, True))
    assert direct[2] is None and python[2] is None
    for rank in (0, 1):
        for got, want in zip(direct[rank][:2] + direct[rank][4:],
                             python[rank][:2] + python[rank][4:]):
            assert torch.equal(got, want), rank
        assert direct[rank][4].tolist() == [1, 1, 0]
        assert (direct[rank][2] == python[rank][2]).all() and \
            direct[rank][3] == python[rank][3], rank
    if kind == "dispatch":        # the third dispatch went to ranks 0 and 1 only
        assert direct[0][2].tolist() == [True, True, False]
