"""Elastic mode: a rank killed with SIGKILL mid-step is masked, the survivors finish every call
within the deadline, agree on the mask, and their results equal the reference over the healthy
ranks; the next step, with experts re-placed over the survivors, serves every token again.

Experts are identities scaled by the routing weight, so a token's combined output is
``x * (sum of the weights of its slots that were served)``: exact expectations for "what the
healthy ranks sent", and for "every expert served" after re-placement.

Every test runs on both backends: the host backend, and the CUDA backend (its kernels and mask
agreement, moe_comm/cuda/elastic.py) in the CPU kernel emulator with the ranks as processes.
"""
from __future__ import annotations

import ctypes
import functools
import os
import random
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm import eplb
from moe_comm.jit import emulator
from moe_comm.cuda import comm as cuda_comm
from moe_comm.cuda import normal as cuda_normal
from moe_comm.host import native
from moe_comm.host.comm import AGREE_GRACE_S, HostComm
from moe_comm.testing.processes import run_ranks
from moe_comm.wire import agree_round_tag, mask_words, tag

R, VICTIM = 4, 2
LOGICAL, SLOTS_PER_RANK, TOPK, HIDDEN, MAX_TOKENS = 8, 4, 3, 128, 24
TIMEOUT = 1.5
AGREE_WAIT = TIMEOUT + min(TIMEOUT, AGREE_GRACE_S)   # the longest an agreement waits


@pytest.fixture(autouse=True, params=["host", "cuda_emulated"])
def backend(request, monkeypatch):
    """The forked ranks inherit the environment: MOE_COMM_CPU_BACKEND=emulator makes their CPU
    Buffers drive the CUDA backend."""
    if request.param == "cuda_emulated":
        if not emulator.available():
            pytest.skip("the kernel emulator needs a C++ compiler (g++)")
        import cuda_cases
        for n in (2, 3, 4):                  # built before any rank starts its deadline
            cuda_cases.preload("cpu", n, {HIDDEN}, ll=True)
        monkeypatch.setenv("MOE_COMM_CPU_BACKEND", "emulator")
    return request.param


def _inputs(rank, seed=0):
    gen = torch.Generator().manual_seed(100 * seed + rank)
    t = [17, 5, 24, 0][rank % 4]                # ragged, and a rank with no tokens
    x = torch.randn(t, HIDDEN, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(LOGICAL, generator=gen)[:TOPK] for _ in range(t)]) \
        if t else torch.empty(0, TOPK, dtype=torch.int64)
    if t:
        idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1       # unused slots
    w = torch.rand(t, TOPK, generator=gen)
    return x, idx, w


def _slots(buf_or_n):
    n = buf_or_n if isinstance(buf_or_n, int) else buf_or_n.group_size
    return SLOTS_PER_RANK * n


def _placement(n, active=None):
    load = torch.ones(1, LOGICAL)
    _, log2phy, logcnt = eplb.rebalance_experts(load, _slots(n), 1, 1, n, active_ranks=active)
    return log2phy[0], logcnt[0]


def _route(idx, w, n, active=None):
    log2phy, logcnt = _placement(n, active)
    phy_active = None if active is None else eplb.active_slot_mask(active, _slots(n))
    return eplb.map_logical_to_physical(idx, log2phy, logcnt, phy_active=phy_active,
                                        topk_weights=w)


def _normal_step(buf, x, phy, w, kill_between=False, handles=None):
    """dispatch -> identity experts weighted by the routing weights -> combine. ``handles``
    (a list), when given, gets the dispatch's handle."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(phy, _slots(buf))
    rx, ri, rw, _, handle, _ = buf.dispatch(x, topk_idx=phy, topk_weights=w,
                                            num_tokens_per_rank=per_rank,
                                            is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert)
    if handles is not None:
        handles.append(handle)
    if kill_between:
        os.kill(os.getpid(), signal.SIGKILL)
    y = (rx.float() * torch.where(ri >= 0, rw, 0).sum(1, keepdim=True)).bfloat16()
    t0 = time.monotonic()
    out, _, _ = buf.combine(y, handle)
    return rx, out, time.monotonic() - t0


def _ll_step(buf, x, phy, w, kill_in_hook=False):
    """low-latency dispatch with a receive hook -> identity experts -> weighted combine."""
    rx, count, handle, _, hook = buf.low_latency_dispatch(
        x, phy, MAX_TOKENS, _slots(buf), use_fp8=False, return_recv_hook=True)
    if kill_in_hook:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    hook()
    out, _, _ = buf.low_latency_combine(rx, phy, w, handle)
    return count.clone(), out, time.monotonic() - t0


def _worker(rank, n, point, timeout_s):
    buf = moe_comm.Buffer(None, 64 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        MAX_TOKENS, HIDDEN, n, _slots(n)), low_latency_mode=True, timeout_s=timeout_s,
        elastic=True)
    x, idx, w = _inputs(rank)
    phy, pw = _route(idx, w, n)
    victim = rank == VICTIM % n
    if point == "before_dispatch" and victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    if point == "ll_hook":
        count, out, _ = _ll_step(buf, x, phy, pw, kill_in_hook=victim)
        first = {"count": count}
    else:
        rx, out, _ = _normal_step(buf, x, phy, pw, kill_between=victim and point == "between")
        first = {"rx": rx}
    first.update(out=out, elapsed=time.monotonic() - t0)
    mask = buf.active_ranks
    # the next step: experts re-placed over the survivors, ids remapped
    phy2, w2 = _route(idx, w, n, active=mask)
    step = _ll_step if point == "ll_hook" else _normal_step
    t1 = time.monotonic()
    second = step(buf, x, phy2, w2)
    first["fault_free"] = time.monotonic() - t1    # the same step's work, no peer to wait for
    arg = torch.ones(n, dtype=torch.int32)
    buf.get_dispatch_layout(phy2, _slots(n), active_ranks=arg)      # Mooncake-style argument
    buf.destroy()
    return {"mask": mask, "first": first, "second_out": second[1], "phy": phy, "arg": arg}


def _served_sum(x, phy, w, n, active):
    """x * the total weight of the slots whose expert lives on an active rank (bf16 path)."""
    owner = phy.clamp(min=0) // SLOTS_PER_RANK
    served = (phy >= 0) & active.bool()[owner]
    return (x.float() * torch.where(served, w, 0).sum(1, keepdim=True))


def _check_survivors(results, n, mask, why):
    """Each survivor (``mask[r]`` 1) of a group whose masked ranks died: it agreed on ``mask``,
    its first step summed what the surviving experts served (``out``), and the step after the
    experts were re-placed over the survivors served everything (``second_out``)."""
    for r in range(n):
        if not mask[r]:
            continue
        got = results[r]
        assert torch.equal(got["mask"], mask), (why, r, got["mask"])
        x, idx, w = _inputs(r)
        want = _served_sum(x, got["phy"], _route(idx, w, n)[1], n, mask)
        torch.testing.assert_close(got["out"].float(), want, rtol=2e-2, atol=2e-2)
        full = x.float() * torch.where(idx >= 0, w, 0).sum(1, keepdim=True)
        torch.testing.assert_close(got["second_out"].float(), full, rtol=2e-2, atol=2e-2)


def _check_run(results, n, point):
    survivors = [r for r in range(n) if r != VICTIM % n]
    mask = torch.ones(n, dtype=torch.int32)
    mask[VICTIM % n] = 0
    for r in survivors:
        got = results[r]
        assert torch.equal(got["mask"], mask), (point, r, got["mask"])
        assert torch.equal(got["arg"], mask), (point, r, "active_ranks argument")
        # At most one wait for the dead rank (the agreement's deadline plus grace) on top of
        # the step's own work, which a loaded machine stretches: measured as the fault-free
        # step after it in the same run, with slack for load that varies between the two.
        bound = AGREE_WAIT + 2 * got["first"]["fault_free"] + 1.0
        assert got["first"]["elapsed"] < bound, (point, r, got["first"], bound)
        x, idx, w = _inputs(r)
        # step 1: what the healthy ranks served (identity experts, bf16 rows)
        want = _served_sum(x, got["phy"], _route(idx, w, n)[1], n, mask)
        torch.testing.assert_close(got["first"]["out"].float(), want, rtol=2e-2, atol=2e-2)
        # step 2: every expert of every token served again
        full = x.float() * torch.where(idx >= 0, w, 0).sum(1, keepdim=True)
        torch.testing.assert_close(got["second_out"].float(), full, rtol=2e-2, atol=2e-2)


def _check_dispatch_rows(results, n, point):
    """Normal-mode recv_x equals the reference over the ranks alive during the dispatch."""
    alive = [r for r in range(n) if not (point == "before_dispatch" and r == VICTIM % n)]
    xs, ids = [], []
    for r in range(n):
        x, idx, w = _inputs(r)
        phy, _ = _route(idx, w, n)
        if r not in alive:
            x, phy = x[:0], phy[:0]
        elif len(alive) < n:
            phy = torch.where(phy // SLOTS_PER_RANK == VICTIM % n, -1, phy)
        xs.append(x)
        ids.append(phy)
    ref = moe_comm.reference_dispatch(xs, ids, _slots(n))
    for r in alive:
        if r == VICTIM % n:
            continue
        assert torch.equal(results[r]["first"]["rx"], ref[r]["recv_x"]), (point, r)


@pytest.mark.parametrize("point", ["before_dispatch", "between", "ll_hook"])
def test_survivors_mask_the_killed_rank_and_finish(point):
    results = run_ranks(_worker, R, point, TIMEOUT, timeout=60, expect_exit=(VICTIM,))
    _check_run(results, R, point)
    if point != "ll_hook":
        _check_dispatch_rows(results, R, point)


def test_without_elastic_a_dead_rank_raises_naming_it():
    def worker(rank, n):
        buf = moe_comm.Buffer(None, 16 << 20, timeout_s=1.0)
        x, idx, w = _inputs(rank)
        phy, pw = _route(idx, w, n)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            _normal_step(buf, x, phy, pw)
        except moe_comm.CommTimeoutError as e:
            return sorted(e.silent_ranks)
        return None

    results = run_ranks(worker, 3, timeout=60, expect_exit=(1,))
    assert results[0] == [1] and results[2] == [1]


def test_set_active_ranks_excludes_a_rank_without_waiting():
    """A controller masks rank 3 on every rank; rank 3 stays away. No deadline is spent."""
    def worker(rank, n):
        buf = moe_comm.Buffer(None, 16 << 20, timeout_s=30.0)
        gone = torch.tensor([1, 1, 1, 0])
        buf.set_active_ranks(gone)
        x, idx, w = _inputs(rank)
        phy, pw = _route(idx, w, n, active=gone)
        if rank == 3:
            try:
                _normal_step(buf, x, phy, pw)
            except RuntimeError as e:
                return str(e)
        t0 = time.monotonic()
        _, out, _ = _normal_step(buf, x, phy, pw)
        return out, time.monotonic() - t0

    results = run_ranks(worker, 4, timeout=60)
    assert "masked out" in results[3]
    for r in range(3):
        x, idx, w = _inputs(r)
        full = x.float() * torch.where(idx >= 0, w, 0).sum(1, keepdim=True)
        torch.testing.assert_close(results[r][0].float(), full, rtol=2e-2, atol=2e-2)
        assert results[r][1] < 10.0


def test_bad_active_ranks_is_refused_before_anything_moves():
    def worker(rank, n):
        buf = moe_comm.Buffer(None, 16 << 20, timeout_s=10.0, elastic=True)
        errors = []
        for bad in (torch.ones(n + 1, dtype=torch.int32), torch.ones(n), [[1, 1]]):
            try:
                buf.set_active_ranks(bad)
            except ValueError as e:
                errors.append(str(e))
        x, idx, w = _inputs(rank)
        phy, pw = _route(idx, w, n)
        try:
            buf.get_dispatch_layout(phy, _slots(n), active_ranks=torch.ones(n))
        except ValueError as e:
            errors.append(str(e))
        _, out, _ = _normal_step(buf, x, phy, pw)            # still usable, all ranks active
        return errors, buf.active_ranks, out

    results = run_ranks(worker, 2, timeout=60)
    for r, (errors, mask, out) in enumerate(results):
        assert len(errors) == 4 and all("active_ranks" in e or "mask" in e for e in errors)
        assert mask.tolist() == [1, 1]


def _trial_plan(seed, n):
    rng = random.Random(seed)
    return rng.choice(["before_dispatch", "between", "ll_hook"]), rng.randrange(n)


def _trial_worker(rank, n, seed):
    point, victim = _trial_plan(seed, n)
    buf = moe_comm.Buffer(None, 16 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        MAX_TOKENS, HIDDEN, n, _slots(n)), low_latency_mode=True, timeout_s=1.0, elastic=True)
    x, idx, w = _inputs(rank, seed)
    phy, pw = _route(idx, w, n)
    if point == "before_dispatch" and rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "ll_hook":
        _ll_step(buf, x, phy, pw, kill_in_hook=rank == victim)
    else:
        _normal_step(buf, x, phy, pw, kill_between=point == "between" and rank == victim)
    return buf.active_ranks


def test_twenty_kill_trials_never_hang():
    for seed in range(20):
        _, v = _trial_plan(seed, 3)
        results = run_ranks(_trial_worker, 3, seed, timeout=30, expect_exit=(v,))
        masks = [results[r] for r in range(3) if r != v]
        assert all(torch.equal(m, masks[0]) for m in masks), (seed, masks)
        assert masks[0][v] == 0 and int(masks[0].sum()) == 2, (seed, masks)


def test_masked_rank_leaves_every_combined_weight_in_place():
    """Ranks masked before a dispatch that computes its own layout: the combined top-k weights
    still come back to the right tokens (only the masked rank's slots are missing)."""
    def worker(rank, n):
        buf = moe_comm.Buffer(None, 16 << 20, timeout_s=30.0)
        buf.set_active_ranks(torch.tensor([1, 0, 1]))
        if rank == 1:
            return None
        x, idx, w = _inputs(rank)
        phy, pw = _route(idx, w, n)
        per_expert = buf.get_dispatch_layout(phy, _slots(n))[2]   # (it must match topk_idx)
        rx, ri, rw, _, handle, _ = buf.dispatch(x, topk_idx=phy, topk_weights=pw,
                                                num_tokens_per_expert=per_expert)
        _, comb_w, _ = buf.combine(rx, handle, topk_weights=rw)
        return phy, pw, comb_w

    results = run_ranks(worker, 3, timeout=60)
    for r in (0, 2):
        phy, pw, comb_w = results[r]
        served = (phy >= 0) & (phy // SLOTS_PER_RANK != 1)
        torch.testing.assert_close(comb_w, torch.where(served, pw, 0.0))


def test_a_rank_that_is_only_late_learns_it_was_masked():
    def worker(rank, n):
        buf = moe_comm.Buffer(None, 16 << 20, timeout_s=1.0, elastic=True)
        x, idx, w = _inputs(rank)
        phy, pw = _route(idx, w, n)
        if rank == 2:
            time.sleep(3.0)                 # alive, but past the deadline and the grace
        try:
            _normal_step(buf, x, phy, pw)
        except RuntimeError as e:
            return type(e).__name__
        return buf.active_ranks.tolist()

    results = run_ranks(worker, 3, timeout=60)
    assert results[0] == results[1] == [1, 1, 0]
    assert results[2] == "RankMaskedError"


def _die_mid_round(comm, *, reach):
    """Stand-in for the victim's first agreement: it writes its round-1 estimate (every rank
    active) into the MASK row of the ranks in ``reach`` only, then dies - a rank killed in
    the middle of the round, its row seen by some survivors and not by others."""
    lay, me, R = comm.layout, comm.rank, comm.num_ranks
    row = tag(agree_round_tag(1, 1, R), 0) | mask_words(np.ones(R, dtype=bool))
    for p in reach:
        at = lay.mask(1, me) * 8
        if isinstance(comm, HostComm):
            comm.words[p][at // 8:at // 8 + row.size] = row
        else:                                   # the emulator's buffers are host memory
            words = (ctypes.c_int64 * row.size).from_address(comm.pointers[p] + at)
            words[:] = row.tolist()
    os.kill(os.getpid(), signal.SIGKILL)


def _split_worker(rank, n, timeout_s):
    buf = moe_comm.Buffer(None, 16 << 20, timeout_s=timeout_s, elastic=True)
    x, idx, w = _inputs(rank)
    phy, pw = _route(idx, w, n)
    if rank == VICTIM:
        comm = buf._comm
        die = functools.partial(_die_mid_round, comm, reach=[0])
        if isinstance(comm, HostComm):
            comm.agree = lambda op: die()
        else:
            cuda_normal.agree = lambda comm, op, matrix=None, floors=None: die()
    t0 = time.monotonic()
    rx, out, _ = _normal_step(buf, x, phy, pw)
    elapsed = time.monotonic() - t0
    t1 = time.monotonic()
    _normal_step(buf, x, phy, pw)
    return {"mask": buf.active_ranks, "rx": rx, "out": out, "phy": phy, "elapsed": elapsed,
            "fault_free": time.monotonic() - t1}


def test_a_rank_dying_mid_round_cannot_split_the_survivors(backend):
    """The victim's round-1 row reaches rank 0 only: rank 0 hears everyone in round 1 and
    decides with the victim still in; ranks 1 and 3 find it silent, and in round 2 take rank
    0's decision instead of deciding alone. All three keep the victim through the dispatch's
    notify (its counts are in every matrix alike), drop it when its payload never comes, and
    their results equal the reference over the survivors. (One round of mask words leaves
    rank 0 with the victim and the others without: different row offsets, wrong rows.)"""
    results = run_ranks(_split_worker, R, TIMEOUT, timeout=90, expect_exit=(VICTIM,))
    mask = torch.tensor([1, 1, 0, 1], dtype=torch.int32)
    for r in (0, 1, 3):
        got = results[r]
        assert torch.equal(got["mask"], mask), (r, got["mask"])
        # two waits for the victim (the notify agreement's round 1, the payload), the step's
        # own work stretched by load as in _check_run
        bound = 2 * AGREE_WAIT + 2 * got["fault_free"] + 1.0
        assert got["elapsed"] < bound, (r, got["elapsed"], bound)
        x, idx, w = _inputs(r)
        want = _served_sum(x, got["phy"], _route(idx, w, R)[1], R, mask)
        torch.testing.assert_close(got["out"].float(), want, rtol=2e-2, atol=2e-2)
    # the victim's counts were agreed on, its rows never came: the reference over the ranks
    # that sent (the host backend compacts the rows; the CUDA backend keeps the victim's
    # rows in place, zeroed, as for any source masked after the notify agreement)
    xs, ids = [], []
    for r in range(R):
        x, idx, w = _inputs(r)
        phy, _ = _route(idx, w, R)
        xs.append(x)
        ids.append(torch.where(phy // SLOTS_PER_RANK == VICTIM, -1, phy))
    ref = moe_comm.reference_dispatch(xs, ids, _slots(R))
    for r in (0, 1, 3):
        want = ref[r]["recv_x"]
        if backend == "cuda_emulated":
            per_src = [int(((ids[s] // SLOTS_PER_RANK == r) & (ids[s] >= 0)).any(1).sum())
                       for s in range(R)]
            at = sum(per_src[:VICTIM])
            want = want.clone()
            want[at:at + per_src[VICTIM]] = 0
        else:
            xs_alive = [x if s != VICTIM else x[:0] for s, x in enumerate(xs)]
            ids_alive = [i if s != VICTIM else i[:0] for s, i in enumerate(ids)]
            want = moe_comm.reference_dispatch(xs_alive, ids_alive, _slots(R))[r]["recv_x"]
        assert torch.equal(results[r]["rx"], want), r


def _freeze_self_on_first_call(obj, name):
    """Make ``obj.name(...)`` stop this process (SIGSTOP) the first time it is called; a
    peer resumes it (SIGCONT) and the call goes on as if nothing happened."""
    real = getattr(obj, name)
    state = {"frozen": False}

    def frozen(*args, **kwargs):
        if not state["frozen"]:
            state["frozen"] = True
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(*args, **kwargs)
    setattr(obj, name, frozen)


def _resume_victim_and_wait(rank, pids, flag):
    """Rank 0 resumes the victim (SIGCONT); every survivor waits until it is done."""
    if rank == 0:
        os.kill(pids[VICTIM], signal.SIGCONT)
    deadline = time.monotonic() + 60.0
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)


def _step_holding_rows_while_victim_resumes(buf, x, idx, w, n, mask, rank, pids, flag):
    """A normal step over the survivors ``mask`` whose received rows this rank holds while
    the frozen victim resumes and does whatever it still does. Returns (whether the held
    rows stayed unchanged, the combined output, the dispatch's handle)."""
    phy, pw = _route(idx, w, n, active=mask)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(phy, _slots(n))
    rx, ri, rw, _, handle, _ = buf.dispatch(x, topk_idx=phy, topk_weights=pw,
                                            num_tokens_per_rank=per_rank,
                                            is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert)
    held = [t.clone() for t in (rx, ri, rw)]
    _resume_victim_and_wait(rank, pids, flag)
    unchanged = all(torch.equal(a, b) for a, b in zip((rx, ri, rw), held))
    y = (rx.float() * torch.where(ri >= 0, rw, 0).sum(1, keepdim=True)).bfloat16()
    return unchanged, buf.combine(y, handle)[0], handle


def _resume_before_second_copy_out(rank, pids, flag):
    """CUDA backend: the survivors' received rows are copies, made by the copy-out kernel
    from the data region after the payload agreement; resume the victim right there in the
    next dispatch, after this step's rows arrived and before they are read (where its late
    stores would land in rows a survivor reads, but for the floors moved past them)."""
    real, seen = cuda_normal.agree, []

    def agree(comm, op, matrix=None, floors=None):
        real(comm, op, matrix, floors)
        if op == "dispatch/payload" and not seen:
            seen.append(op)
            _resume_victim_and_wait(rank, pids, flag)
    cuda_normal.agree = agree


def _check_fenced(results, first, later):
    """The late-writer tests' promises: the resumed victim raised RankMaskedError; each
    survivor saw its flag, held tensors unchanged, agreed on the mask; ``first[i]`` (the i-th
    survivor's output of the step that masked the victim) is what the surviving experts
    served, and every output in ``later[i]`` (steps over the re-placed experts) is exact."""
    assert results[VICTIM] == "RankMaskedError"
    mask = torch.tensor([int(r != VICTIM) for r in range(R)], dtype=torch.int32)
    survivors = [r for r in range(R) if r != VICTIM]
    for r, out, outs in zip(survivors, first, later):
        got = results[r]
        assert got["flag"] and got["unchanged"], (r, got)
        assert torch.equal(got["mask"], mask), (r, got["mask"])
        x, idx, w = _inputs(r)
        want = _served_sum(x, got["phy"], _route(idx, w, R)[1], R, mask)
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
        full = x.float() * torch.where(idx >= 0, w, 0).sum(1, keepdim=True)
        for o in outs:
            torch.testing.assert_close(o.float(), full, rtol=2e-2, atol=2e-2)


def _late_writer_worker(rank, n, point, flag, timeout_s):
    # mid_write: into a granted region (eager slots off); mid_eager_write: into its eager slot
    os.environ["MOE_COMM_EAGER"] = "0" if point == "mid_write" else "1"
    pids = [None] * n
    dist.all_gather_object(pids, os.getpid())
    buf = moe_comm.Buffer(None, 16 << 20, timeout_s=timeout_s, elastic=True)
    x, idx, w = _inputs(rank)
    phy, pw = _route(idx, w, n)
    host = isinstance(buf._comm, HostComm)
    if rank == VICTIM:
        if point.startswith("mid_") and host:   # between its fence check and its write
            _freeze_self_on_first_call(buf._comm, "peer_heap")
        elif point == "mid_write":          # the emulator stops its dispatch send there
            os.environ["MOE_EMU_STOP_AT_OP"] = str(cuda_comm.OP["dispatch/send"])
        try:
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(phy, _slots(n))
            rx, ri, rw, _, handle, _ = buf.dispatch(
                x, topk_idx=phy, topk_weights=pw, num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
            if point == "between":
                os.kill(os.getpid(), signal.SIGSTOP)
            buf.combine(rx, handle)
            # (the CUDA backend's kernels, fenced, wrote nothing; the host hears of it at
            # its next call, as of any kernel error)
            buf.dispatch(x, handle=handle)
            outcome = "finished"
        except moe_comm.RankMaskedError:
            outcome = "RankMaskedError"
        with open(flag, "w") as f:        # the survivors look at their memory after this
            f.write(outcome)
        return outcome
    _, out1, _ = _normal_step(buf, x, phy, pw)
    mask = buf.active_ranks
    # step 2 over the survivors; its received rows are held (heap views on the host backend)
    # while the victim resumes and does whatever it still does
    if point == "mid_write" and not host:
        _resume_before_second_copy_out(rank, pids, flag)
    unchanged, out2, _ = _step_holding_rows_while_victim_resumes(buf, x, idx, w, n, mask, rank,
                                                                 pids, flag)
    # what was set aside for the late writer: quarantined heap bytes (host), or how far the
    # slabs moved in this rank's data region (CUDA)
    quarantined = buf._comm.heap.bytes_quarantined if host else \
        int(buf._comm.floors[buf._comm.rank])
    return {"mask": mask, "out1": out1, "out2": out2, "phy": phy, "unchanged": unchanged,
            "flag": os.path.exists(flag), "quarantined": quarantined}


@pytest.mark.parametrize("point", ["between", "mid_write", "mid_eager_write"])
def test_a_frozen_rank_that_resumes_is_fenced(backend, point, tmp_path):
    """The victim stops (SIGSTOP) past the deadline: between dispatch and combine, or in its
    dispatch between the fence check and its write into a peer's granted region (CUDA
    backend: a block of its dispatch send kernel, stopped by the emulator's test hook). The
    survivors mask and fence it, run the next step and hold its received rows; then the
    victim resumes (CUDA: inside the survivors' next dispatch, after its rows arrived and
    before the copy-out reads them). It raises RankMaskedError (between: before it writes
    anything; mid_write: its pending write lands in the region granted to it, which the
    survivors quarantined, or on the CUDA backend in the slabs of the operation it was in,
    which the survivors' later operations no longer use; mid_eager_write: in its eager slot,
    which nobody reads once it is masked), and nothing the survivors hold or compute
    changes."""
    if point == "mid_eager_write" and backend != "host":
        pytest.skip("eager slots are the host backend's")
    flag = str(tmp_path / "victim_done")
    results = run_ranks(_late_writer_worker, R, point, flag, TIMEOUT, timeout=120)
    _check_fenced(results, [r["out1"] for r in results[:VICTIM] + results[VICTIM + 1:]],
                  [[r["out2"]] for r in results[:VICTIM] + results[VICTIM + 1:]])
    if point == "mid_write":       # the receivers kept the region it may write aside
        assert any(results[r]["quarantined"] for r in (0, 1, 3))


def _freeze_on_first_peer_write(comm, armed):
    """Stop this process (SIGSTOP) the first time, once ``armed["on"]``, that it takes a view
    of a peer's low-latency region: right after its fence check, before its copy."""
    real = comm.peer_ll

    def peer_ll(rank):
        if armed["on"] and rank != comm.rank:
            armed["on"] = False
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(rank)
    comm.peer_ll = peer_ll


def _ll_victim(buf, x, phy, pw, point, flag):
    """The victim's LL step: it stops between its fence check and its first write into a
    peer (in the dispatch send, or the combine send; CUDA: block 0 of that kernel, stopped
    by the emulator); resumed, it must raise."""
    armed = {"on": False}
    # the host backend's direct halves write in C (host/ll_direct.py): stopped there
    lib = native.library() if isinstance(buf._comm, HostComm) else None

    def arm(on):
        """Returns whether the C stop was still armed (it never fired)."""
        armed["on"] = on
        return lib is not None and bool(lib.moe_ll_stop_before_peer_write(int(on)))

    if isinstance(buf._comm, HostComm):
        if buf._ll_direct is not None:     # its addresses (peer_ll views) built before
            buf._ll_direct._layout(MAX_TOKENS, HIDDEN, _slots(buf))
        _freeze_on_first_peer_write(buf._comm, armed)
    else:
        os.environ["MOE_EMU_STOP_AT_OP"] = str(cuda_comm.OP[f"low_latency_{point}/send"])
    try:
        arm(point == "dispatch")
        rx, _, handle, _, hook = buf.low_latency_dispatch(
            x, phy, MAX_TOKENS, _slots(buf), use_fp8=False, return_recv_hook=True)
        hook()
        arm(point == "combine")
        buf.low_latency_combine(rx, phy, pw, handle)
        _ll_step(buf, x, phy, pw)
        outcome = "finished"
    except moe_comm.RankMaskedError:
        outcome = "RankMaskedError"
    finally:
        never_stopped = arm(False)
    with open(flag, "w") as f:            # the survivors go on reading after this
        f.write(outcome)
    if never_stopped:
        raise AssertionError(f"the victim's {point} send ran without reaching its stop in C")
    return outcome


def _rows_held_back(comm) -> bool:
    """Whether this rank holds LL combine rows back from a masked rank (host: host/late_rows.py;
    CUDA: low_latency.cuh ReturnRows, [lo, hi) per rank)."""
    if isinstance(comm, HostComm):
        return bool(comm.late_rows.held)
    R = comm.num_ranks
    return bool((comm.ll_holds[R:2 * R] > comm.ll_holds[:R]).any())


def _ll_late_writer_worker(rank, n, point, flag, timeout_s):
    pids = [None] * n
    dist.all_gather_object(pids, os.getpid())
    buf = moe_comm.Buffer(None, 16 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        MAX_TOKENS, HIDDEN, n, _slots(n)), low_latency_mode=True, timeout_s=timeout_s,
        elastic=True)
    x, idx, w = _inputs(rank)
    phy, pw = _route(idx, w, n)
    if rank == VICTIM:
        return _ll_victim(buf, x, phy, pw, point, flag)
    _, out1, _ = _ll_step(buf, x, phy, pw)
    mask = buf.active_ranks
    phy2, w2 = _route(idx, w, n, active=mask)
    _, out2, _ = _ll_step(buf, x, phy2, w2)
    # step 3 uses the buffers of step 1 again (calls alternate between two), where the
    # victim was writing: it resumes between the survivors' send and receive halves
    held_back = _rows_held_back(buf._comm)
    # a new LL layout (8 tokens per rank) while the victim may still write into the rows of
    # the old one: every survivor refuses it (LayoutLockedError) and the old layout goes on;
    # twice, so step 3 still reuses step 1's buffers (CUDA reports a call's failure at the
    # next synchronisation: CudaComm.synchronize)
    locked = []
    for _ in range(2):
        try:
            buf.low_latency_dispatch(x[:8], phy2[:8], 8, _slots(buf), use_fp8=False)
            if not isinstance(buf._comm, HostComm):
                buf._comm.synchronize()
            locked.append("took it")
        except moe_comm.LayoutLockedError as e:
            locked.append(e.ranks)

    def resume_and_wait():
        if rank == 0:
            os.kill(pids[VICTIM], signal.SIGCONT)
        deadline = time.monotonic() + 60.0
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)

    rx, count, handle, _, hook = buf.low_latency_dispatch(
        x, phy2, MAX_TOKENS, _slots(buf), use_fp8=False, return_recv_hook=True)
    if point == "dispatch":
        resume_and_wait()
    hook()
    held = [rx.view(torch.int16).clone(), count.clone()]    # (bits: unused rows may be NaN)
    out3, _, combine_hook = buf.low_latency_combine(rx, phy2, w2, handle, return_recv_hook=True)
    if point == "combine":
        resume_and_wait()
    combine_hook()
    unchanged = torch.equal(rx.view(torch.int16), held[0]) and torch.equal(count, held[1])
    return {"mask": mask, "outs": (out1, out2, out3), "phy": phy, "unchanged": unchanged,
            "flag": os.path.exists(flag), "held_back": held_back, "locked": locked}


@pytest.mark.parametrize("point", ["dispatch", "combine"])
def test_a_frozen_rank_that_resumes_mid_low_latency_write_is_fenced(backend, point, tmp_path):
    """The victim stops (SIGSTOP) past the deadline between its fence check and its first
    write into a peer's low-latency region: in its dispatch send, or its combine send. The
    survivors mask it, run the next step, and in the step after (the same LL buffers again)
    let it resume between their send and receive halves. It raises RankMaskedError, and
    every survivor's results are exact: its late messages land in its own per-source
    blocks, which nobody reads again; its late combine rows land in rows the owner held back
    (host/late_rows.py; CUDA: low_latency.cuh ReturnRows) and placed its later calls' rows
    around. Meanwhile a call with another LL layout, which would move those blocks and rows,
    is refused by every survivor (LayoutLockedError) and leaves the buffer in step."""
    flag = str(tmp_path / "victim_done")
    results = run_ranks(_ll_late_writer_worker, R, point, flag, TIMEOUT, timeout=120)
    _check_fenced(results, [r["outs"][0] for r in results[:VICTIM] + results[VICTIM + 1:]],
                  [r["outs"][1:] for r in results[:VICTIM] + results[VICTIM + 1:]])
    if point == "combine":        # the owner it was writing to held those rows back
        assert any(results[r]["held_back"] for r in (0, 1, 3))
    for r in (0, 1, 3):
        assert results[r]["locked"] == [[0, 1, 3]] * 2, (r, results[r]["locked"])
