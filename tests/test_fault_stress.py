"""Randomised faults: ranks killed (SIGKILL) or frozen (SIGSTOP, resumed by a peer with SIGCONT)
at random moments of a dispatch + combine, in both modes, on both backends.

Each run is one set of rank processes doing several trials, each on a fresh elastic Buffer:
freeze trials first (the frozen rank is alive again afterwards and joins the next Buffer), then
one kill trial (a dead rank joins nothing more). A trial's victim, moment and freeze length come
from the run's seed. Freezes are short (under half the deadline: the rank must never be masked),
long (past the deadline and the agreement's grace) or in between; a rank frozen long is masked
unless it stopped after its last word of the step. Every trial checks:

- no hang (the run's bound follows from the deadlines);
- every survivor leaves the step with the same mask, and a victim that finished has it too;
- exact results over the agreed mask (identity experts: a token's output is x times the weight
  of its slots served by the ranks left active);
- nothing a survivor holds (its received rows) changed after the victim resumed;
- a resumed victim that was masked raises RankMaskedError.

The figures of a run are written to $MOE_COMM_STRESS_REPORT (JSON lines) when set; docs/PERF.md
has the last ones.
"""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.jit import emulator
from moe_comm.testing.processes import run_ranks

from test_elastic import (HIDDEN, MAX_TOKENS, _inputs, _ll_step, _normal_step, _route,
                          _served_sum, _slots)

pytestmark = pytest.mark.stress

R = 3
TIMEOUT = 1.0                      # each wait's deadline in the trials
GRACE = min(TIMEOUT, 1.0)          # HostComm.AGREE_GRACE_S / elastic.AGREE_GRACE_NS
SHORT = (0.02, 0.4 * TIMEOUT)      # never masked
LONG = (2 * (TIMEOUT + GRACE) + 0.5, 2 * (TIMEOUT + GRACE) + 1.5)   # past deadline + grace
FREEZE_TRIALS = 4                  # per run, then one kill trial
RUNS = 5                           # per (backend, mode): 25 trials each, 50 per mode


@pytest.fixture(params=["host", "cuda_emulated"])
def backend(request, monkeypatch):
    if request.param == "cuda_emulated":
        if not emulator.available():
            pytest.skip("the kernel emulator needs a C++ compiler (g++)")
        import cuda_cases
        cuda_cases.preload("cpu", R, {HIDDEN}, ll=True)
        monkeypatch.setenv("MOE_COMM_CPU_BACKEND", "emulator")
    return request.param


def _plan(seed, trial):
    """(kind, victim, moment into the step as a fraction of a fault-free step, freeze length
    in s or None)."""
    rng = random.Random(seed * 1000 + trial)
    kind = "kill" if trial == FREEZE_TRIALS else "freeze"
    victim = rng.randrange(1, R)          # rank 0 resumes frozen ranks
    delay = rng.uniform(0.0, 1.0)
    length = None
    if kind == "freeze":
        span = rng.choice([SHORT, SHORT, LONG, LONG, (SHORT[1], LONG[0])])
        length = rng.uniform(*span)
    return kind, victim, delay, length


def _stopped(pid) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _resume_after(pid, length):
    """Once ``pid`` has stopped (its own timer sends SIGSTOP: it may come late on a loaded
    machine), let it stay stopped ``length`` seconds, then resume it."""
    deadline = time.monotonic() + 60.0
    while not _stopped(pid) and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(length)
    os.kill(pid, signal.SIGCONT)


def _step(buf, mode, x, phy, pw):
    if mode == "normal":
        rx, out, _ = _normal_step(buf, x, phy, pw)
        return out, [rx]
    count, out, _ = _ll_step(buf, x, phy, pw)
    return out, [count]


def _trial(rank, n, mode, seed, trial, pids):
    kind, victim, delay, length = _plan(seed, trial)
    buf = moe_comm.Buffer(None, 16 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        MAX_TOKENS, HIDDEN, n, _slots(n)), low_latency_mode=True, timeout_s=TIMEOUT,
        elastic=True)
    x, idx, w = _inputs(rank, seed * 10 + trial)
    phy, pw = _route(idx, w, n)
    # the fault lands at a random moment of the step: a fault-free step first says how long
    # one takes; then one start time for all (CLOCK_MONOTONIC is the machine's), from which
    # the victim's fault and rank 0's SIGCONT are timed
    began = time.monotonic()
    _step(buf, mode, x, phy, pw)
    took = [None] * n
    dist.all_gather_object(took, time.monotonic() - began)
    starts = [None] * n
    dist.all_gather_object(starts, time.monotonic() + 0.05)
    t0 = max(starts)
    delay *= max(took)
    timers = []
    if rank == victim:
        sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
        timers.append(threading.Timer(max(0.0, t0 + delay - time.monotonic()), os.kill,
                                      (os.getpid(), sig)))
    if rank == 0 and kind == "freeze":
        timers.append(threading.Thread(target=_resume_after, args=(pids[victim], length)))
    for t in timers:
        t.start()
    while time.monotonic() < t0:
        time.sleep(0.001)
    began = time.monotonic()
    outcome, out, held = "finished", None, []
    try:
        out, held = _step(buf, mode, x, phy, pw)
    except moe_comm.RankMaskedError:
        outcome = "RankMaskedError"
    elapsed = time.monotonic() - began
    copies = [t.clone() for t in held]
    mask = buf.active_ranks
    if outcome == "finished" and not mask[rank]:
        # masked while its last kernels ran (CUDA backend): the host hears of it at the next
        # call, which must refuse before it moves anything
        try:
            _step(buf, mode, x, phy, pw)
        except moe_comm.RankMaskedError:
            outcome = "RankMaskedError"
    if kind == "freeze":
        for t in timers:
            t.join()
        dist.barrier()                   # the victim has resumed and finished its step
    unchanged = all(torch.equal(a, b) for a, b in zip(held, copies))
    ok = None
    if out is not None:
        want = _served_sum(x, phy, pw, n, mask)
        ok = bool(torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2))
    if kind == "freeze":                 # (destroy is collective: not with a dead rank)
        buf.destroy()
    return {"outcome": outcome, "mask": mask.tolist(), "exact": ok, "unchanged": unchanged,
            "elapsed": elapsed}


def _run(rank, n, mode, seed, log_dir):
    """Each trial's record goes to a file as soon as it is known: a rank killed in the last
    trial has still told how its freeze trials went."""
    pids = [None] * n
    dist.all_gather_object(pids, os.getpid())
    with open(os.path.join(log_dir, f"rank{rank}.jsonl"), "w") as f:
        for trial in range(FREEZE_TRIALS + 1):
            f.write(json.dumps(_trial(rank, n, mode, seed, trial, pids)) + "\n")
            f.flush()
    if rank == _plan(seed, FREEZE_TRIALS)[1]:
        # the kill trial's victim, alive if its timer came after its step: it dies now, not
        # later while it may hold the lock of the queue the ranks report through
        os.kill(os.getpid(), signal.SIGKILL)


def _records(log_dir):
    out = []
    for r in range(R):
        path = os.path.join(log_dir, f"rank{r}.jsonl")
        with open(path) as f:
            out.append([json.loads(line) for line in f])
    return out


def _check(results, mode, seed):
    """Assert every trial's promises; returns its figures."""
    figures = []
    for trial in range(FREEZE_TRIALS + 1):
        kind, victim, delay, length = _plan(seed, trial)
        alive = [r for r in range(R) if len(results[r]) > trial]
        survivors = [r for r in alive if r != victim]
        got = {r: results[r][trial] for r in alive}
        where = (mode, seed, trial, kind, victim, round(delay, 3), length and round(length, 2))
        masks = {tuple(got[r]["mask"]) for r in survivors}
        assert len(masks) == 1, (where, {r: got[r]["mask"] for r in survivors})
        mask = masks.pop()
        for r in survivors:
            assert got[r]["outcome"] == "finished", (where, r, got[r])
            assert got[r]["exact"], (where, r, got[r])
            assert got[r]["unchanged"], (where, r, got[r])
        masked = mask[victim] == 0
        if kind == "freeze":    # (a killed victim is masked, or died after its step)
            v = got[victim]
            if masked:
                assert v["outcome"] == "RankMaskedError", (where, v)
            else:
                assert v["outcome"] == "finished" and v["exact"] and tuple(v["mask"]) == mask, \
                    (where, v)
            if length < SHORT[1] + 1e-9:
                assert not masked, (where, "a rank frozen under half the deadline was masked")
            # (frozen longer, it may still be kept: stopped after its last word of the step)
        figures.append({"mode": mode, "seed": seed, "trial": trial, "kind": kind,
                        "masked": bool(masked), "length": length,
                        "max_s": max(got[r]["elapsed"] for r in survivors)})
    return figures


@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_random_kills_and_freezes(backend, mode, tmp_path):
    figures = []
    for seed in range(RUNS):
        kill_victim = _plan(seed, FREEZE_TRIALS)[1]
        # bound: per trial a buffer, at most two long freezes' worth of waiting, slack
        bound = 60 + (FREEZE_TRIALS + 1) * (LONG[1] + 4 * (TIMEOUT + GRACE) + 5)
        log_dir = tmp_path / f"seed{seed}"
        log_dir.mkdir()
        run_ranks(_run, R, mode, seed, str(log_dir), timeout=bound, expect_exit=(kill_victim,))
        figures += _check(_records(log_dir), mode, seed)
    report = os.environ.get("MOE_COMM_STRESS_REPORT")
    if report:
        with open(report, "a") as f:
            for fig in figures:
                f.write(json.dumps(dict(fig, backend=backend)) + "\n")
