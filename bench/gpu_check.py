#!/usr/bin/env python3
"""gpu_check: everything the CUDA backend needs checked on a GPU machine, in one command.

    python3 bench/gpu_check.py --json $OUT/gpu_check.json    # all steps, 9 min at most
    python3 bench/gpu_check.py --skip-tests --skip-sanitizer --iters 5     # the table only
    python3 bench/gpu_check.py --dry-run --json DIR/gpu_check.json   # the same on the CPU

Steps, each in a fresh process with a deadline (the whole run stays within --budget seconds;
each step's deadline shrinks to what is left, keeping some for the steps after it):

1. build     every kernel variant (moe_comm.jit.variants.all_variants) compiled with NVRTC
             for this GPU's arch, in parallel threads, into one cache folder that every step
             then reads (MOE_COMM_CACHE_DIR); with nvshmem4py installed also the IBGDA builds
             (nvcc + NVSHMEM) that the NVSHMEM tests load.
2. tests     pytest -v --durations=0 tests/test_cuda_gpu.py tests/test_ibgda_gpu.py, with the
             cases' comm deadlines capped at --test-timeout seconds (MOE_COMM_TEST_TIMEOUT_S,
             tests/cuda_cases.py) so a hang costs seconds; skip reasons are recorded (the
             NVSHMEM tests skip without nvshmem4py: docs/PERF.md says how to carry it).
             CI runs the CPU-only compile tests, so they are not repeated here.
3. timing    moe_comm on 8 ranks sharing this GPU as 8 streams of one process (threads,
             moe_comm.cuda.groups.local_group): normal 4096 tokens and low-latency 128
             tokens, H=7168,
             top-8, 256 experts; all ranks' calls are queued behind one gate kernel so they
             start together, each rank's time is taken with CUDA events, the slowest rank's
             mean per call is reported. Also the device copy bandwidth (copy_gbps).
4. baseline  the same exchanges with torch.distributed all_to_all_single on 8 processes
             (NCCL refuses two ranks on one GPU, so this is gloo: tensors staged through host
             memory). A lower bar than NCCL over NVLink; it says so in the JSON. --baseline ll
             (the default) runs the LL specs only: the normal ones move gigabytes through the
             host and could eat the run's time.
5. memcheck, racecheck: compute-sanitizer (if installed; API errors not reported) on a
             small case: every kernel on 1 rank, then 2 processes through CUDA IPC, a result
             line after each part.

Failures stay local: a step that fails or runs past its deadline is recorded (exit code, error,
the end of its log) and the next step runs; inside the build, timing and baseline steps each
program or spec records its own error (text and traceback tail) and the next one runs.

Output, all in the folder of --json (default $OUT/gpu_check.json where $OUT is set, else
bench_out/): the JSON (rows, step records, meta), rewritten after every step, and one log per
step (<stem>_<step>.log, the two sanitizer steps share one), written while the step runs, so a
step killed at its deadline still leaves what it printed: 6 files at most, what the device tool
brings back. Steps report results as "@gpu_check {json}" lines of their log. stdout gets a line
per step and the table (bench/bench_all_to_all.py's columns). GB/s: DeepEP's convention,
payload bytes a rank receives in dispatch (sends back in combine) per second. Normal-mode
timings use a cached handle (no count exchange on the host, like DeepEP's tuning runs); the
notify barrier still runs on the GPU. On one GPU the 8 ranks share its SMs and memory
bandwidth, so the numbers are a kernel-efficiency check, not NVLink numbers.

--dry-run runs the same steps on the CPU kernel emulator (CudaComm on device "cpu", what CI
checks with tests/test_gpu_check.py): build = the emulator libraries of the variants it uses,
tests = two quick emulator tests, timing and baseline with tiny shapes (2 ranks, H=256) through
the same code, timed with perf_counter; the sanitizer is skipped with the reason.

Internal: --step {build,timing,baseline,small-case} runs one step's work in this process.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
# the repository (moe_comm), the tests (the small case runs their GPU cases) and this folder
# (the modules shared with bench_all_to_all.py: the tests load this file by its path)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), BENCH]
# moe_comm is imported inside the step functions, not here: while the kernels and their Python
# side change, an import error then fails the step that needs it, not the whole run. The shared
# modules import torch only.
from a2a_baseline import PaddedExchange, byte_rows, normal_exchange  # noqa: E402
from call_timing import copy_gbps, seconds_per_call, sync, timed_across_ranks  # noqa: E402
from result_table import header_line, row_line  # noqa: E402
from routed_inputs import per_block_fp8, random_routed_inputs, token_bytes  # noqa: E402

MARK = "@gpu_check "                 # a step's result line in its log (see emit)


@dataclass(frozen=True)
class Shape:
    """What the timing and baseline steps run: ``ranks`` ranks, ``hidden`` channels, top-``topk``
    routing over ``experts`` experts; ``specs``: (mode, tokens per rank, dispatch dtype), combine
    is bf16 everywhere; ``copy_bytes``: the buffer of the copy-bandwidth measurement."""

    ranks: int
    hidden: int
    topk: int
    experts: int
    specs: tuple
    copy_bytes: int


GPU_SHAPE = Shape(8, 7168, 8, 256, (("normal", 4096, "bfloat16"), ("normal", 4096, "fp8"),
                                    ("ll", 128, "fp8"), ("ll", 128, "bfloat16")), 1 << 30)
# The dry run: the same specs, tiny. One rank count and one hidden size, so the emulator builds
# only 8 libraries (g++, seconds each) and they are the ones tests/test_cuda_emulator.py uses.
DRY_SHAPE = Shape(2, 256, 4, 8, (("normal", 32, "bfloat16"), ("normal", 32, "fp8"),
                                 ("ll", 16, "fp8"), ("ll", 16, "bfloat16")), 16 << 20)


def spec_label(spec) -> str:
    return f"{spec[0]}-{spec[2]}"


def row_label(row) -> str:
    return f"{row['mode']}-{row['dtype']}"


# ---- results: lines of a step's log, failures as records ---------------------------------------
def emit(kind, **data):
    """One result of a step as a line of its log: the log is written as the step goes, so a
    step killed at its deadline keeps every result it finished."""
    print(MARK + json.dumps(dict(data, kind=kind)), flush=True)


def read_results(text):
    out = []
    for line in text.splitlines():
        if line.startswith(MARK):
            try:
                out.append(json.loads(line[len(MARK):]))
            except ValueError:      # the last line of a killed step may be cut short
                pass
    return out


def failure(exc) -> dict:
    """An exception as the JSON records it: its text and the end of its traceback."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return dict(error=f"{type(exc).__name__}: {exc}"[:3000], traceback=trace[-3000:])


class InjectedFailure(RuntimeError):
    """--inject-failure: a planted failure, to check that it does not hide the rest."""


def inject(names, what):
    if what in names:
        raise InjectedFailure(f"injected failure in {what} (--inject-failure)")


# ---- devices --------------------------------------------------------------------------------
def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else \
        "CPU (kernel emulator)"


# ---- shared inputs ----------------------------------------------------------------------------
def make_inputs(shape, mode, tokens, dtype, rank, device):
    """x (bf16, or (fp8, f32 scales) for normal fp8), topk_idx, topk_weights on ``device``:
    uniform random top-k routing (DeepEP's benchmark routing)."""
    x, idx, w = random_routed_inputs(tokens, shape.hidden, shape.experts, shape.topk,
                                     seed=1234 + rank, device=device)
    if mode == "normal" and dtype == "fp8":
        return per_block_fp8(x), idx, w
    return x.bfloat16(), idx, w


def ll_variants(hidden):
    """The 7 LL programs of one hidden size (what tests/cuda_cases.preload builds for it)."""
    from moe_comm.jit import variants as V
    flags = ((False, False), (True, False), (True, True))
    return ([V.ll_dispatch_send(hidden, a, b) for a, b in flags] +
            [V.ll_dispatch_recv(hidden, a, b) for a, b in flags] + [V.ll_combine(hidden)])


def timing_variants(shape):
    from moe_comm.jit import variants as V
    return [V.intranode()] + ll_variants(shape.hidden)


# ---- step: timing (ranks = streams of this process, or threads on the emulator) ----------------
def time_calls(ops, comms, iters, timeout):
    """Seconds per call of the slowest rank, all ranks starting together (``ops[r]``: one call
    of rank r)."""
    if comms[0].device.type == "cuda":
        return _time_gated(ops, comms, iters)
    return _time_threads(ops, comms, iters, timeout)


def _time_gated(ops, comms, iters):
    """GPU: every rank's ``iters`` calls queued behind one gate (a sleep kernel on its own
    stream), so all ranks start together; each rank timed with CUDA events."""
    from moe_comm.testing.local_cuda import rank_streams
    streams = rank_streams(len(ops), comms[0].device)  # one hardware queue each
    for r, op in enumerate(ops):                       # warm: kernels, allocator, handles
        with torch.cuda.stream(streams[r]):
            op()
    torch.cuda.synchronize()
    gate = torch.cuda.Stream()
    cycles = 200_000_000
    for _ in range(4):
        with torch.cuda.stream(gate):
            torch.cuda._sleep(cycles)
        opened = torch.cuda.Event()
        opened.record(gate)
        marks = []
        for r, op in enumerate(ops):
            s = streams[r]
            s.wait_event(opened)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            with torch.cuda.stream(s):
                for _ in range(iters):
                    op()
            b.record(s)
            marks.append((a, b))
        gated = not opened.query()       # the gate was still closed when everything was queued
        torch.cuda.synchronize()
        for c in comms:
            c.check()
        if gated:
            return max(a.elapsed_time(b) for a, b in marks) / iters / 1e3
        cycles *= 4
    raise RuntimeError("could not queue all ranks' calls behind the gate")


def _time_threads(ops, comms, iters, timeout):
    """Emulator: a launch returns when its kernel is done, so each rank's thread times its own
    calls with perf_counter; a barrier after the warm-up starts them together."""
    from moe_comm.testing.local_cuda import run_local
    start = threading.Barrier(len(ops))

    def rank(comm):
        op = ops[comm.rank]
        op()                                           # warm
        start.wait(timeout)
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        return time.perf_counter() - t0

    return max(run_local(rank, comms, timeout=timeout)) / iters


def time_normal(comms, shape, spec, iters, timeout):
    from moe_comm.cuda import normal as cn
    from moe_comm.testing.local_cuda import run_local
    _, tokens, dtype = spec
    dev, H = comms[0].device, shape.hidden
    ins = [make_inputs(shape, "normal", tokens, dtype, r, dev) for r in range(shape.ranks)]
    sync(dev)       # built on the default stream; the ranks' streams do not wait for it

    def first(comm):
        x, idx, w = ins[comm.rank]
        data, scales = x if isinstance(x, tuple) else (x, None)
        rx, rs, _, _, handle = cn.dispatch(
            comm, x_bytes=data.view(torch.uint8), dtype=data.dtype, hidden=H, scales=scales,
            topk_idx=idx, topk_weights=w, layout=None,
            handle=None, num_experts=shape.experts, num_worst_tokens=0, buffer_key=("bench",))
        y = (rx.float() if rs is None else rx.float() * rs.repeat_interleave(128, 1)).bfloat16()
        recv_bytes = rx.numel() * rx.element_size() + (0 if rs is None else rs.numel() * 4)
        return handle, y, recv_bytes

    state = run_local(first, comms, timeout=timeout)

    def dispatch(r):
        x = ins[r][0]
        data, scales = x if isinstance(x, tuple) else (x, None)
        return lambda: cn.dispatch(
            comms[r], x_bytes=data.view(torch.uint8), dtype=data.dtype, hidden=H,
            scales=scales, topk_idx=None, topk_weights=None, layout=None, handle=state[r][0],
            num_experts=None, num_worst_tokens=0, buffer_key=("bench",))

    def combine(r):
        return lambda: cn.combine(comms[r], x=state[r][1], handle=state[r][0],
                                  topk_weights=None, bias=())

    ranks = range(shape.ranks)
    t_d = time_calls([dispatch(r) for r in ranks], comms, iters, timeout)
    t_c = time_calls([combine(r) for r in ranks], comms, iters, timeout)
    recv = statistics.mean(s[2] for s in state)
    back = statistics.mean(s[1].numel() * 2 for s in state)
    return t_d, t_c, recv, back


def time_ll(comms, shape, spec, iters, timeout):
    from moe_comm.cuda import ll as cll
    from moe_comm.testing.local_cuda import run_local
    from moe_comm.wire import LLLayout
    _, tokens, dtype = spec
    dev, fp8, R, H = comms[0].device, dtype == "fp8", shape.ranks, shape.hidden
    lay = LLLayout(tokens, H, R, shape.experts)
    L, rows = lay.num_local, R * tokens
    ins = [make_inputs(shape, "ll", tokens, dtype, r, dev) for r in range(R)]
    outs = [dict(x=torch.empty(L, rows, H, dtype=torch.float8_e4m3fn if fp8 else
                               torch.bfloat16, device=dev),
                 s=torch.empty(L, rows, H // 128, device=dev) if fp8 else None,
                 cnt=torch.zeros(L, dtype=torch.int32, device=dev),
                 y=torch.randn(L, rows, H, device=dev).bfloat16(),
                 out=torch.empty(tokens, H, dtype=torch.bfloat16, device=dev))
            for _ in range(R)]
    sync(dev)       # built on the default stream; the ranks' streams do not wait for it

    def dispatch(r):
        comm, (x, idx, _), o = comms[r], ins[r], outs[r]

        def op():
            h = cll.dispatch_send(comm, x=x, topk_idx=idx, lay=lay, use_fp8=fp8,
                                  round_scale=False, buffer_key=("bench",))
            cll.dispatch_recv(comm, h, lay, recv_x=o["x"], recv_scales=o["s"],
                              recv_count=o["cnt"], use_fp8=fp8, use_ue8m0=False, stats=None)
            o["handle"] = h
        return op

    def first(comm):
        dispatch(comm.rank)()
        return int(outs[comm.rank]["cnt"].sum())

    msgs = run_local(first, comms, timeout=timeout)

    def combine(r):
        comm, (_, idx, w), o = comms[r], ins[r], outs[r]

        def op():
            seq, buf = cll.combine_send(comm, x=o["y"], handle=o["handle"], lay=lay)
            cll.combine_recv(comm, seq, buf, lay, handle=o["handle"], topk_idx=idx,
                             topk_weights=w, out=o["out"])
        return op

    t_d = time_calls([dispatch(r) for r in range(R)], comms, iters, timeout)
    t_c = time_calls([combine(r) for r in range(R)], comms, iters, timeout)
    msg_bytes = token_bytes(H, fp8)
    return t_d, t_c, statistics.mean(msgs) * msg_bytes, statistics.mean(msgs) * 2 * H


def time_spec(shape, spec, device, iters, comm_timeout):
    from moe_comm.cuda import groups
    from moe_comm.wire import LLLayout, SlabLayout
    mode, tokens, _ = spec
    R, H = shape.ranks, shape.hidden
    if mode == "normal":
        heap = SlabLayout(tokens * R, H * 2, H // 128, shape.topk).nbytes
        comms = groups.local_group(R, heap, 0, comm_timeout, device)
    else:
        ll_bytes = LLLayout(tokens, H, R, shape.experts).nbytes
        comms = groups.local_group(R, 1 << 20, ll_bytes, comm_timeout, device)
    # the host side of one spec (threads, first calls): a few comm deadlines at most
    outer = max(30.0, 6 * comm_timeout)
    try:
        fn = time_normal if mode == "normal" else time_ll
        t_d, t_c, recv, back = fn(comms, shape, spec, iters, outer)
    finally:
        destroy(comms)
    return dict(dispatch_us=t_d * 1e6, combine_us=t_c * 1e6, dispatch_gbps=recv / t_d / 1e9,
                combine_gbps=back / t_c / 1e9)


def destroy(comms):
    """Free a group, even one a failure left out of step (a destroy error must not hide the
    failure that caused it)."""
    for c in comms:
        try:
            c.destroy()
        except Exception as e:  # noqa: BLE001 - printed to the log, the spec's error stands
            print(f"destroy of rank {c.rank} failed: {type(e).__name__}: {e}", flush=True)
    if comms and comms[0].device.type == "cuda":
        torch.cuda.empty_cache()


def device_copy_gbps(device, nbytes, iters=20):
    """The device's copy bandwidth, one process copying (the ranks share one device here)."""
    return copy_gbps(nbytes, device, lambda fn: seconds_per_call(device, fn, iters))


def spec_row(shape, spec):
    mode, tokens, dtype = spec
    return dict(mode=mode, ranks=shape.ranks, tokens=tokens, hidden=shape.hidden,
                topk=shape.topk, experts=shape.experts, dtype=dtype)


def run_timing(shape, device, iters, comm_timeout, injected):
    """One row per spec, each written to the log when done; a spec that fails records its
    error and the next one runs. Returns the exit code."""
    from moe_comm.jit.nvrtc import preload
    ok = True
    emit("meta", device=device_name(device), torch=torch.__version__,
         ranks_as=(f"{shape.ranks} CUDA streams of one process (threads) on one GPU"
                   if device.type == "cuda" else
                   f"{shape.ranks} threads on the CPU kernel emulator"),
         normal_dispatch="cached handle (no host count exchange)", comm_timeout_s=comm_timeout,
         iters=iters)
    try:
        emit("copy", copy_gbps=device_copy_gbps(device, shape.copy_bytes))
    except Exception as e:  # noqa: BLE001 - recorded, the specs still run
        ok = False
        emit("copy", **failure(e))
    try:
        preload(timing_variants(shape), device)    # before ranks start waiting on each other
    except Exception as e:  # noqa: BLE001 - each spec then fails with its own error
        ok = False
        emit("preload", **failure(e))
    for spec in shape.specs:
        row, t0 = dict(label=spec_label(spec)), time.monotonic()
        try:
            inject(injected, spec_label(spec))
            row.update(time_spec(shape, spec, device, iters, comm_timeout))
        except Exception as e:  # noqa: BLE001 - recorded, the next spec runs
            ok = False
            row.update(failure(e))
        row["seconds"] = round(time.monotonic() - t0, 1)
        emit("row", **row)
    return 0 if ok else 1


# ---- step: all_to_all_single baseline (processes) ---------------------------------------------
_STAGED = False


def _a2a(out, inp, out_splits=None, in_splits=None):
    """all_to_all_single; gloo may refuse CUDA tensors: stage through host memory."""
    import torch.distributed as dist
    global _STAGED
    if not _STAGED:
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits)
            return
        except (RuntimeError, ValueError):
            if out.device.type == "cpu":
                raise
            _STAGED = True
    host = torch.empty(out.shape, dtype=out.dtype)
    dist.all_to_all_single(host, inp.cpu(), out_splits, in_splits)
    out.copy_(host)


def _normal_baseline(shape, x, idx, w):
    """normal_exchange; its combine sends back zeros of the received rows' shape."""
    from moe_comm.layout import dispatch_layout
    per_rank, _, in_rank = dispatch_layout(idx, shape.experts, shape.ranks)
    exchange, give_back = normal_exchange(x, idx, w, in_rank, per_rank, _a2a)
    received = {}

    def dispatch():
        received["rows"] = exchange().shape[0]

    def combine():
        return give_back(torch.zeros(received["rows"], shape.hidden, dtype=torch.bfloat16,
                                     device=idx.device))

    return dispatch, combine


def _ll_baseline(shape, x, idx, w, tokens, fp8):
    """PaddedExchange as it is: messages in, zeros of the slots' shape back."""
    padded = PaddedExchange(idx, w, shape.experts, shape.ranks, tokens, _a2a)

    def dispatch():
        padded.dispatch(byte_rows(*per_block_fp8(x)) if fp8 else x.view(torch.uint8))

    def combine():
        return padded.combine(torch.zeros(shape.ranks, padded.slots, shape.hidden,
                                          dtype=torch.bfloat16, device=x.device))

    return dispatch, combine


def _baseline_rank(rank, n, shape, spec, iters, device_type):
    """One spec on one rank (a forked process of moe_comm.testing.processes.run_ranks)."""
    dev = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)

    def timed(fn):
        return timed_across_ranks(fn, iters, dev, repeats=1)

    mode, tokens, dtype = spec
    x, idx, w = make_inputs(shape, mode, tokens, dtype, rank, dev)
    d, c = (_normal_baseline(shape, x, idx, w) if mode == "normal" else
            _ll_baseline(shape, x, idx, w, tokens, dtype == "fp8"))
    return dict(baseline_dispatch_us=timed(d) * 1e6, baseline_combine_us=timed(c) * 1e6), _STAGED


def run_baseline(shape, device_type, which, iters, deadline, injected):
    """One spec at a time, each its own set of processes with its own deadline (a fair share of
    what is left), so a spec that fails or hangs costs only its share. Returns the exit code."""
    from moe_comm.testing.processes import run_ranks
    specs = [s for s in shape.specs if which == "all" or s[0] == "ll"]
    end, ok, staged = time.monotonic() + deadline, True, False
    for i, spec in enumerate(specs):
        timeout = max(10.0, (end - time.monotonic() - 5) / (len(specs) - i))
        row, t0 = dict(label=spec_label(spec)), time.monotonic()
        try:
            inject(injected, spec_label(spec))
            got, was_staged = run_ranks(_baseline_rank, shape.ranks, shape, spec, iters,
                                        device_type, timeout=timeout)[0]
            row.update(got)
            staged |= was_staged
        except Exception as e:  # noqa: BLE001 - recorded, the next spec runs
            ok = False
            row.update(failure(e))
        row["seconds"] = round(time.monotonic() - t0, 1)
        emit("baseline", **row)
    where = "on one GPU" if device_type == "cuda" else "on the CPU"
    emit("meta", baseline=f"torch.distributed all_to_all_single, gloo, {shape.ranks} processes "
         f"{where}" + (" (CUDA tensors staged through host memory)" if staged else ""))
    return 0 if ok else 1


# ---- step: build every variant into the one cache folder -------------------------------------
def _nvshmem_missing():
    """Why the NVSHMEM tests will skip (then their IBGDA builds are not needed), or None."""
    from moe_comm.ibgda.runtime import missing_stack
    return missing_stack()


def build_jobs(shape, dry_run):
    """(label, function) per program this run loads."""
    if dry_run:
        from moe_comm.jit import emulator
        return [(f"{v.label} (emulator)", functools.partial(emulator.build, v))
                for v in timing_variants(shape)]
    from moe_comm.jit import variants as V
    from moe_comm.jit.nvrtc import compile_cubin, device_arch
    arch = device_arch(torch.device("cuda", 0))
    jobs = [(f"{v.label} {arch}", functools.partial(compile_cubin, v, arch))
            for v in V.all_variants()]
    why = _nvshmem_missing()
    if why:
        emit("note", note=f"IBGDA builds skipped: {why}")
        return jobs
    from moe_comm.jit.nvcc import build_cubin, kernel_program, selftest_program
    # what tests/test_ibgda_gpu.py and test_two_processes_through_nvshmem load (2 ranks,
    # generic hidden size)
    programs = [selftest_program(), kernel_program(V.intranode())] + \
        [kernel_program(v) for v in ll_variants(128)]
    return jobs + [(f"{p.label} {arch} (nvcc + NVSHMEM)", functools.partial(build_cubin, p, arch))
                   for p in programs]


def run_build(shape, dry_run):
    """Compile in parallel threads (NVRTC releases the GIL; g++ and nvcc are processes); every
    program records its own failure. Returns the exit code."""
    t0 = time.monotonic()
    jobs = build_jobs(shape, dry_run)
    workers = os.cpu_count() or 1

    def one(label, fn):
        start = time.monotonic()
        try:
            fn()
            return label, time.monotonic() - start, None
        except Exception as e:  # noqa: BLE001 - recorded, the other programs still build
            return label, time.monotonic() - start, failure(e)

    failed = []
    with ThreadPoolExecutor(workers) as pool:
        for done in as_completed([pool.submit(one, *job) for job in jobs]):
            label, seconds, err = done.result()
            print(f"built {label} in {seconds:.1f} s" + (" FAILED" if err else ""), flush=True)
            if err:
                failed.append(label)
                emit("build_error", program=label, **err)
    emit("build", programs=len(jobs), failed=failed, workers=workers,
         target="emulator" if dry_run else "cubin",
         build_seconds=round(time.monotonic() - t0, 1))
    return 1 if failed else 0


# ---- step: small case for compute-sanitizer ----------------------------------------------------
def run_small_case():
    """Every kernel on one rank (no rank waits on another thread's kernel, so a sanitizer that
    serialises launches cannot deadlock it), then 2 processes through CUDA IPC; a result line
    after each part, so a run killed at its deadline still says what it checked."""
    import cuda_cases as C        # the GPU tests' cases (tests/ is on sys.path)
    import test_cuda_gpu as T
    n, dev = 1, torch.device("cuda", torch.cuda.current_device())
    normal = [c for c in C.normal_cases(n) if c["routing"] == "random"][:4] + \
        [c for c in C.normal_cases(n) if c["worst"]]
    C.check_normal_group(n, dev, normal)
    emit("small", part="normal", cases=len(normal))
    ll = [c for c in C.ll_cases(n) if c["hidden"] <= 512]
    C.check_ll_group(n, dev, ll)
    emit("small", part="ll", cases=len(ll))
    T.test_two_processes_through_cuda_ipc()
    emit("small", part="two processes (CUDA IPC)")
    print("small case OK")
    return 0


# ---- orchestration ----------------------------------------------------------------------------
# Per step: (most seconds it may take, seconds kept for the steps after it). A step's deadline
# is the smaller of its cap and what is left of --budget minus what it keeps, so the late steps
# still run when an early one hangs; a step left with under MIN_STEP_S is skipped.
PLAN = {"build": (120, 330), "tests": (240, 150), "timing": (150, 60), "baseline": (60, 60),
        "memcheck": (120, 30), "racecheck": (120, 0)}
MIN_STEP_S = 15
# The two quick emulator tests of the dry run: comm deadlines, both modes, 2 ranks (the same
# libraries as DRY_SHAPE's timing).
DRY_TESTS = ("tests/test_cuda_emulator.py::test_silent_rank_is_named_not_hung",)
GPU_TESTS = ("tests/test_cuda_gpu.py", "tests/test_ibgda_gpu.py")
PACKAGES = ("torch", "cuda-core", "cuda-bindings", "nvidia-nvshmem-cu13", "nvshmem4py-cu13",
            "pytest", "pytest-timeout")


class Run:
    """One gpu_check run: its JSON (rewritten after every step) and the step logs beside it."""

    def __init__(self, args, shape):
        self.json = os.path.abspath(args.json)
        self.folder = os.path.dirname(self.json)
        self.stem = os.path.splitext(os.path.basename(self.json))[0]
        self.budget, self.started = args.budget, time.monotonic()
        os.makedirs(self.folder, exist_ok=True)
        self.rows = [spec_row(shape, s) for s in shape.specs]
        self.steps, self.meta = {}, dict(packages=_versions(), dry_run=args.dry_run)
        self.head = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                         argv=sys.argv[1:], budget_s=args.budget, cache_dir=args.cache_dir,
                         shape=asdict(shape))

    def left(self):
        return self.budget - (time.monotonic() - self.started)

    def deadline(self, step):
        cap, keep = PLAN[step]
        return min(cap, self.left() - keep)

    def log_path(self, step):
        return os.path.join(self.folder, f"{self.stem}_{step}.log")

    def row(self, label):
        return next(r for r in self.rows if row_label(r) == label)

    def failed(self):
        bad = [k for k, v in self.steps.items() if v.get("status") in ("failed", "timeout")]
        return bad + [row_label(r) for r in self.rows if "dispatch_us" not in r]

    def save(self):
        data = dict(self.head, rows=self.rows, meta=self.meta, steps=self.steps,
                    failed=self.failed(), seconds=round(time.monotonic() - self.started, 1))
        tmp = self.json + ".tmp"          # atomic: a reader never sees half a file
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.json)


def _versions():
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _kill_group(proc):
    """The step's whole process group: on a timeout the ranks it forked or spawned die with it,
    instead of holding GPU contexts that time-slice the GPU under the next steps."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_from(path, start):
    with open(path, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")


def run_step(run, name, cmd, deadline, env, log_name=None):
    """Run one step's command with its output streamed into its log; returns (record, the
    log text of this step)."""
    log = run.log_path(log_name or name)
    start = os.path.getsize(log) if log_name and os.path.exists(log) else 0   # a shared log
    rec = run.steps[name] = dict(status="running", cmd=shlex.join(cmd),
                                 deadline_s=round(deadline), log=os.path.basename(log))
    run.save()
    t0 = time.monotonic()
    with open(log, "ab" if start else "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:                  # also when this run is interrupted: no orphaned ranks
            _kill_group(proc)
    text = _read_from(log, start)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    rec.update(rc=rc, seconds=round(time.monotonic() - t0, 1), tail=text[-6000:],
               status="ok" if rc == 0 else "timeout" if rc == "timeout" else "failed")
    if rc == "timeout":
        rec["error"] = (f"killed at its deadline of {deadline:.0f} s; its log ends with: "
                        f"{lines[-1].strip() if lines else '(nothing)'}")
    elif rc != 0:
        rec["error"] = f"exit code {rc}"
    return rec, text


def step_env(args, cache, extra=(), cap_deadlines=True, **more):
    env = dict(os.environ, MOE_COMM_CACHE_DIR=cache, PYTHONUNBUFFERED="1", **dict(extra),
               **more)
    if cap_deadlines and args.test_timeout > 0:
        env["MOE_COMM_TEST_TIMEOUT_S"] = str(args.test_timeout)
    return env


# ranks as threads of one process on a GPU: moe_comm/testing/local_cuda.py SHARED_GPU_ENV (a
# copy: moe_comm is imported by the steps only; tests/test_gpu_check.py checks they agree)
EAGER = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32",
         "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
LAZY = {"CUDA_MODULE_LOADING": "LAZY"}


def _me(args):
    """This script as a step runs it: the same shape and output options."""
    cmd = [sys.executable, os.path.abspath(__file__)]
    if args.dry_run:
        cmd.append("--dry-run")
    for name in args.inject_failure or ():
        cmd += ["--inject-failure", name]
    return cmd


def _failing(name):
    """--inject-failure STEP: the step's command replaced by one that fails."""
    return [sys.executable, "-c", f"print('injected failure in step {name}'); raise "
            f"SystemExit(3)"]


def step_build(run, args, deadline):
    cmd = _me(args) + ["--step", "build"]
    rec, text = run_step(run, "build", cmd, deadline, step_env(args, args.cache_dir, EAGER))
    for res in read_results(text):
        if res["kind"] == "build":
            rec.update(programs=res["programs"], build_seconds=res["build_seconds"],
                       workers=res["workers"], target=res["target"])
        elif res["kind"] == "build_error":
            rec.setdefault("failures", []).append(
                {k: res[k] for k in ("program", "error", "traceback")})
        elif res["kind"] == "note":
            rec.setdefault("notes", []).append(res["note"])


def _pytest_cmd(args):
    cmd = [sys.executable, "-m", "pytest", "-v", "--durations=0", "-rfEs", "-p",
           "no:cacheprovider"]
    # a per-test bound where pytest-timeout is installed (the GPU image has it): a test hung
    # past its comm deadlines is stopped (its threads' stacks printed) and the next ones still
    # run. Just above the tests' own outer bound (12 capped comm deadlines,
    # tests/cuda_cases.py outer_timeout), so their own messages come first
    if importlib.util.find_spec("pytest_timeout") and args.test_timeout > 0:
        cmd.append(f"--timeout={max(60, 13 * args.test_timeout):.0f}")
    return cmd + list(DRY_TESTS if args.dry_run else GPU_TESTS)


def step_tests(run, args, deadline):
    # tests/conftest.py writes each failure as a result line the moment it happens
    rec, text = run_step(run, "tests", _pytest_cmd(args), deadline,
                         step_env(args, args.cache_dir, EAGER, MOE_COMM_FAILURE_PREFIX=MARK))
    rec["skipped"] = re.findall(r"^SKIPPED \[\d+\] (.+)$", text, re.M)
    rec["failures"] = re.findall(r"^(?:FAILED|ERROR) (.+)$", text, re.M)
    rec["failure_texts"] = [{k: res[k] for k in ("test", "when", "message", "error")}
                            for res in read_results(text) if res["kind"] == "test_failure"]
    summary = re.findall(r"^=+ (.*\b(?:passed|failed|skipped|error|errors)\b.*) =+$", text,
                         re.M)
    if summary:
        rec["summary"] = summary[-1]


def step_timing(run, args, deadline):
    cmd = _me(args) + ["--step", "timing", "--iters", str(args.iters), "--comm-timeout",
                       str(args.comm_timeout)]
    rec, text = run_step(run, "timing", cmd, deadline, step_env(args, args.cache_dir, EAGER))
    for res in read_results(text):
        kind = res.pop("kind")
        if kind == "row":
            run.row(res.pop("label")).update(res)
        elif kind == "meta":
            run.meta.update(res)
        elif kind == "copy":
            if "copy_gbps" in res:
                for row in run.rows:
                    row["copy_gbps"] = res["copy_gbps"]
            else:
                rec["copy_error"] = res
        elif kind == "preload":
            rec["preload_error"] = res
    for row in run.rows:
        if "dispatch_us" not in row and "error" not in row:
            row["error"] = f"not timed: the timing step ended first ({rec['status']})"
        if "error" in row:
            rec.setdefault("failures", []).append(dict(spec=row_label(row), error=row["error"]))


def step_baseline(run, args, deadline):
    cmd = _me(args) + ["--step", "baseline", "--baseline", args.baseline, "--baseline-iters",
                       str(args.baseline_iters), "--deadline", str(deadline)]
    # a little longer than the specs' own deadlines: they end first and say which spec hung
    rec, text = run_step(run, "baseline", cmd, deadline + 15,
                         step_env(args, args.cache_dir, LAZY))
    for res in read_results(text):
        kind = res.pop("kind")
        if kind == "meta":
            run.meta.update(res)
            continue
        row = run.row(res.pop("label"))
        if "error" in res:
            rec.setdefault("failures", []).append(dict(spec=row_label(row), **res))
        else:
            row.update(baseline_dispatch_us=res["baseline_dispatch_us"],
                       baseline_combine_us=res["baseline_combine_us"])


def sanitizer_tool():
    found = shutil.which("compute-sanitizer")
    for cand in ("/usr/local/cuda/bin/compute-sanitizer",
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if not found and os.path.exists(cand):
            found = cand
    return found


def step_sanitizer(kind):
    def step(run, args, deadline):
        # API errors not reported: cuda-bindings probes driver entry points that this driver
        # lacks, and on the first GPU run their reports filled the log and the deadline
        cmd = [sanitizer_tool(), "--tool", kind, "--target-processes", "all",
               "--report-api-errors", "no", "--error-exitcode", "99", "--print-limit", "30"] + \
            _me(args) + ["--step", "small-case"]
        # no deadline cap: instrumented kernels run many times slower, and a short comm
        # deadline would report a slow peer as a silent one
        rec, text = run_step(run, kind, cmd, deadline,
                             step_env(args, args.cache_dir, LAZY, cap_deadlines=False),
                             log_name="sanitizer")
        rec["checked"] = [res["part"] for res in read_results(text) if res["kind"] == "small"]
    return step


def _skip_reason(name, args):
    """Why a step does not run, or None."""
    if name == "tests" and args.skip_tests:
        return "--skip-tests"
    if name == "baseline" and args.baseline == "none":
        return "--baseline none"
    if name == "sanitizer":
        if args.dry_run:
            return "dry run: compute-sanitizer checks the kernels on a GPU"
        if args.skip_sanitizer:
            return "--skip-sanitizer"
        if sanitizer_tool() is None:
            return "compute-sanitizer not found"
    return None


def _steps(args):
    steps = [("build", step_build), ("tests", step_tests), ("timing", step_timing),
             ("baseline", step_baseline)]
    if _skip_reason("sanitizer", args):
        return steps + [("sanitizer", None)]
    return steps + [("memcheck", step_sanitizer("memcheck")),
                    ("racecheck", step_sanitizer("racecheck"))]


def attempt(run, name, fn, args):
    """Run one step; whatever goes wrong is recorded as that step's failure."""
    why = _skip_reason(name, args)
    deadline = run.deadline(name) if fn else 0
    if why is None and deadline < MIN_STEP_S:
        why = f"out of time ({run.left():.0f} s of the budget left)"
    if why:
        run.steps[name] = dict(status="skipped", reason=why)
    elif name in (args.inject_failure or ()):
        run_step(run, name, _failing(name), deadline, step_env(args, args.cache_dir))
    else:
        try:
            fn(run, args, deadline)
        except Exception as e:  # noqa: BLE001 - recorded, the next step runs
            run.steps[name] = dict(run.steps.get(name, {}), status="failed", **failure(e))
    run.save()
    rec = run.steps[name]
    took = f" in {rec['seconds']:.0f} s" if "seconds" in rec else ""
    print(f"[{name}] {rec['status']}{took}" + (f": {rec['reason']}" if why else ""), flush=True)
    if rec["status"] in ("failed", "timeout"):
        print(rec.get("error", ""), rec.get("tail", rec.get("traceback", ""))[-3000:], sep="\n",
              flush=True)


def table(rows):
    lines = [header_line(12)] + [row_line(row, 12) for row in rows]
    for row in rows:
        if "error" in row:
            lines.append(f"{row_label(row)}: {row['error']}")
    return "\n".join(lines)


def orchestrate(args):
    shape = DRY_SHAPE if args.dry_run else GPU_SHAPE
    run = Run(args, shape)
    problem = _device_problem(args)
    if problem:
        run.steps["setup"] = dict(status="failed", error=problem)
        run.save()
        print(f"gpu_check: {problem}")
        return 2
    try:
        for name, fn in _steps(args):
            attempt(run, name, fn, args)
    finally:                      # also when interrupted: the JSON says how far it got
        for rec in run.steps.values():
            if rec.get("status") == "running":
                rec["status"] = "interrupted"
        run.save()
    print(table(run.rows))
    print(f"wrote {run.json} ({time.monotonic() - run.started:.0f} s); logs beside it")
    bad = run.failed()
    if bad:
        print(f"FAILED: {', '.join(bad)}")
    return 1 if bad else 0


def _device_problem(args):
    if args.dry_run:
        try:
            from moe_comm.jit import emulator
            found = emulator.available()
        except Exception as e:  # noqa: BLE001 - reported as the run's problem
            return f"the kernel emulator does not load: {type(e).__name__}: {e}"
        return None if found else \
            "the dry run needs the kernel emulator's C++ compiler (g++; set CXX)"
    if not torch.cuda.is_available():
        return "gpu_check needs a CUDA GPU (torch.cuda.is_available() is False); " \
               "--dry-run runs it on the CPU kernel emulator"
    return None


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)    # unwinds run_step: the step's processes are killed


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # $OUT: the device tool brings back only what is written there
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT") or
                                                  os.path.join(ROOT, "bench_out"),
                                                  "gpu_check.json"),
                   help="the JSON; the step logs go beside it")
    p.add_argument("--dry-run", action="store_true",
                   help="the same steps on the CPU kernel emulator with tiny shapes (CI)")
    p.add_argument("--iters", type=int, help="timed calls per rank (10; dry run 2)")
    p.add_argument("--baseline", choices=("ll", "all", "none"), default="ll",
                   help="gloo all_to_all baseline for the LL specs only (default), all, none")
    p.add_argument("--skip-baseline", action="store_const", dest="baseline", const="none",
                   help="same as --baseline none")
    p.add_argument("--baseline-iters", type=int, default=3)
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all steps")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-sanitizer", action="store_true")
    p.add_argument("--test-timeout", type=float, default=10.0,
                   help="cap on the tests' comm deadlines, seconds (0: the tests' own)")
    p.add_argument("--comm-timeout", type=float,
                   help="comm deadline of the timing step, seconds (10; dry run 30: the "
                        "emulator on a busy CI machine is slow)")
    p.add_argument("--cache-dir", default=None,
                   help="the kernel cache every step uses (default: $MOE_COMM_CACHE_DIR, else "
                        "/tmp/moe_comm_gpu_check/kernels; dry run: the emulator tests' "
                        "~/.cache/moe_comm/kernels)")
    p.add_argument("--step", choices=("build", "timing", "baseline", "small-case"),
                   help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--inject-failure", action="append", metavar="STEP_OR_SPEC",
                   help=argparse.SUPPRESS)     # tests: e.g. "tests" or "normal-fp8"
    args = p.parse_args(argv)
    if args.iters is None:
        args.iters = 2 if args.dry_run else 10
    if args.comm_timeout is None:
        args.comm_timeout = 30.0 if args.dry_run else 10.0
    if args.cache_dir is None:
        # a bare GPU machine: somewhere surely writable, not $OUT; the dry run shares
        # moe_comm.jit.nvrtc.cache_dir()'s default with the emulator tests (CI builds once)
        args.cache_dir = os.environ.get("MOE_COMM_CACHE_DIR") or (
            os.path.join(os.path.expanduser("~"), ".cache", "moe_comm", "kernels")
            if args.dry_run else "/tmp/moe_comm_gpu_check/kernels")
    return args


def main(argv=None):
    args = parse_args(argv)
    shape = DRY_SHAPE if args.dry_run else GPU_SHAPE
    device = torch.device("cpu") if args.dry_run else None
    injected = args.inject_failure or ()
    if args.step == "build":
        return run_build(shape, args.dry_run)
    if args.step == "timing":
        device = device or torch.device("cuda", torch.cuda.current_device())
        return run_timing(shape, device, args.iters, args.comm_timeout, injected)
    if args.step == "baseline":
        return run_baseline(shape, "cpu" if args.dry_run else "cuda", args.baseline,
                            args.baseline_iters, args.deadline, injected)
    if args.step == "small-case":
        return run_small_case()
    signal.signal(signal.SIGTERM, _on_sigterm)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
