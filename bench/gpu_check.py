#!/usr/bin/env python3
"""gpu_check: everything the CUDA backend needs checked on a GPU machine, in one command.

    python bench/gpu_check.py                       # all steps, ~10 min at most
    python bench/gpu_check.py --skip-tests --skip-sanitizer --iters 5     # the table only

Steps, each in a fresh process with a deadline (the whole run stays within --budget seconds):

1. tests     pytest tests/test_cuda_compile.py tests/test_cuda_launch_args.py
             tests/test_cuda_gpu.py tests/test_ibgda_gpu.py (the IBGDA build under NVSHMEM:
             2 processes on this GPU by P2P; the NIC variants skip without a NIC)
2. timing    moe_comm on 8 ranks sharing this GPU as 8 streams of one process (threads,
             CudaComm.local_group): normal 4096 tokens and low-latency 128 tokens, H=7168,
             top-8, 256 experts; all ranks' calls are queued behind one gate kernel so they
             start together, each rank's time is taken with CUDA events, the slowest rank's
             mean per call is reported. Also the device copy bandwidth (copy_gbps).
3. baseline  the same exchanges with torch.distributed all_to_all_single on 8 processes
             (NCCL refuses two ranks on one GPU, so this is gloo: tensors staged through host
             memory). A lower bar than NCCL over NVLink; it says so in the JSON.
4. sanitizer compute-sanitizer memcheck and racecheck (if installed) on --small-case: 1 rank
             (every kernel) and 2 processes through CUDA IPC.

The table uses bench/bench_all_to_all.py's columns; stdout gets the table, --json (default
$OUT/gpu_check.json where $OUT is set, else bench_out/) gets rows, step results and output
tails. GB/s: DeepEP's convention, payload bytes a rank receives in dispatch (sends back in combine) per second. Normal-mode
timings use a cached handle (no count exchange on the host, like DeepEP's tuning runs); the
notify barrier still runs on the GPU. On one GPU the 8 ranks share its SMs and memory
bandwidth, so the numbers are a kernel-efficiency check, not NVLink numbers.

Internal modes (what the steps run): --small-case, --timing PATH, --baseline PATH.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tests"))

COLUMNS = ("mode", "ranks", "tokens", "hidden", "topk", "experts", "dtype", "dispatch_us",
           "combine_us", "dispatch_gbps", "combine_gbps", "baseline_dispatch_us",
           "baseline_combine_us", "copy_gbps")
RANKS, HIDDEN, TOPK, EXPERTS = 8, 7168, 8, 256
SPECS = [  # (mode, tokens per rank, dispatch dtype); combine is bf16 everywhere
    ("normal", 4096, "bfloat16"),
    ("normal", 4096, "fp8"),
    ("ll", 128, "fp8"),
    ("ll", 128, "bfloat16"),
]


# ---- shared inputs ----------------------------------------------------------------------------
def _inputs(mode, tokens, dtype, rank, device):
    """x (bf16, or (fp8, f32 scales) for normal fp8), topk_idx, topk_weights on ``device``:
    uniform random top-8 routing (DeepEP's benchmark routing)."""
    import torch
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    x = torch.randn(tokens, HIDDEN, generator=gen, device=device)
    idx = torch.rand(tokens, EXPERTS, generator=gen, device=device).topk(TOPK, dim=1).indices
    w = torch.rand(tokens, TOPK, generator=gen, device=device)
    if mode == "normal" and dtype == "fp8":
        blocks = x.view(tokens, HIDDEN // 128, 128)
        s = blocks.abs().amax(-1).clamp(min=1e-4) / 448.0
        return ((blocks / s.unsqueeze(-1)).view(tokens, HIDDEN).to(torch.float8_e4m3fn), s), \
            idx, w
    return x.bfloat16(), idx, w


# ---- step 2: moe_comm timings (8 ranks = 8 streams of this process) ------------------------
def _gated(ops, streams, comms, iters):
    """Seconds per call: every rank's ``iters`` calls queued behind one gate (a sleep kernel
    on its own stream), so all ranks start together; slowest rank's mean."""
    import torch
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


def _time_normal(comms, tokens, dtype, iters):
    import torch
    from moe_comm.cuda import normal as cn
    from moe_comm.cuda.local import run_local
    dev = comms[0].device
    ins = [_inputs("normal", tokens, dtype, r, dev) for r in range(RANKS)]

    def first(comm):
        x, idx, w = ins[comm.rank]
        data, scales = x if isinstance(x, tuple) else (x, None)
        rx, rs, _, _, handle = cn.dispatch(
            comm, x_bytes=data.view(torch.uint8), dtype=data.dtype, hidden=HIDDEN,
            scales=scales, topk_idx=idx, topk_weights=w, is_token_in_rank=None,
            num_tokens_per_rank=None, handle=None, num_experts=EXPERTS, num_worst_tokens=0,
            buffer_key=("bench",))
        y = (rx.float() if rs is None else rx.float() * rs.repeat_interleave(128, 1)).bfloat16()
        recv_bytes = rx.numel() * rx.element_size() + (0 if rs is None else rs.numel() * 4)
        return handle, y, recv_bytes

    state = run_local(first, comms, timeout=300)

    def dispatch(r):
        x = ins[r][0]
        data, scales = x if isinstance(x, tuple) else (x, None)
        return lambda: cn.dispatch(
            comms[r], x_bytes=data.view(torch.uint8), dtype=data.dtype, hidden=HIDDEN,
            scales=scales, topk_idx=None, topk_weights=None, is_token_in_rank=None,
            num_tokens_per_rank=None, handle=state[r][0], num_experts=None,
            num_worst_tokens=0, buffer_key=("bench",))

    def combine(r):
        return lambda: cn.combine(comms[r], x=state[r][1], handle=state[r][0],
                                  topk_weights=None, bias=())

    streams = [torch.cuda.Stream() for _ in range(RANKS)]
    t_d = _gated([dispatch(r) for r in range(RANKS)], streams, comms, iters)
    t_c = _gated([combine(r) for r in range(RANKS)], streams, comms, iters)
    recv = statistics.mean(s[2] for s in state)
    back = statistics.mean(s[1].numel() * 2 for s in state)
    return t_d, t_c, recv, back


def _time_ll(comms, tokens, dtype, iters):
    import torch
    from moe_comm.cuda import ll as cll
    from moe_comm.cuda.local import run_local
    from moe_comm.wire import LLLayout
    dev, fp8 = comms[0].device, dtype == "fp8"
    lay = LLLayout(tokens, HIDDEN, RANKS, EXPERTS)
    L, rows = lay.num_local, RANKS * tokens
    ins = [_inputs("ll", tokens, dtype, r, dev) for r in range(RANKS)]
    outs = [dict(x=torch.empty(L, rows, HIDDEN, dtype=torch.float8_e4m3fn if fp8 else
                               torch.bfloat16, device=dev),
                 s=torch.empty(L, rows, HIDDEN // 128, device=dev) if fp8 else None,
                 cnt=torch.zeros(L, dtype=torch.int32, device=dev),
                 y=torch.randn(L, rows, HIDDEN, device=dev).bfloat16(),
                 out=torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device=dev))
            for _ in range(RANKS)]

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

    msgs = run_local(first, comms, timeout=300)

    def combine(r):
        comm, (_, idx, w), o = comms[r], ins[r], outs[r]

        def op():
            seq, buf = cll.combine_send(comm, x=o["y"], handle=o["handle"], lay=lay)
            cll.combine_recv(comm, seq, buf, lay, handle=o["handle"], topk_idx=idx,
                             topk_weights=w, out=o["out"])
        return op

    streams = [torch.cuda.Stream() for _ in range(RANKS)]
    t_d = _gated([dispatch(r) for r in range(RANKS)], streams, comms, iters)
    t_c = _gated([combine(r) for r in range(RANKS)], streams, comms, iters)
    msg_bytes = HIDDEN + HIDDEN // 128 * 4 if fp8 else 2 * HIDDEN
    return t_d, t_c, statistics.mean(msgs) * msg_bytes, statistics.mean(msgs) * 2 * HIDDEN


def _copy_gbps(nbytes=1 << 30, iters=20):
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        dst.copy_(src)
    b.record()
    torch.cuda.synchronize()
    return nbytes * iters / (a.elapsed_time(b) / 1e3) / 1e9


def run_timing(path, iters):
    import torch
    from moe_comm.cuda import variants
    from moe_comm.cuda.comm import CudaComm
    from moe_comm.cuda.compiler import preload
    from moe_comm.wire import LLLayout, SlabLayout
    dev = torch.device("cuda", torch.cuda.current_device())
    preload([variants.intranode(RANKS), variants.ll_combine(HIDDEN)] +
            [variants.ll_dispatch_send(HIDDEN, f, False) for f in (False, True)] +
            [variants.ll_dispatch_recv(HIDDEN, f, False) for f in (False, True)], dev)
    rows = []
    for mode, tokens, dtype in SPECS:
        t0 = time.monotonic()
        if mode == "normal":
            heap = SlabLayout(tokens * RANKS, HIDDEN * 2, HIDDEN // 128, TOPK).nbytes
            comms = CudaComm.local_group(RANKS, heap, 0, 60.0, dev)
        else:
            comms = CudaComm.local_group(RANKS, 1 << 20,
                                         LLLayout(tokens, HIDDEN, RANKS, EXPERTS).nbytes, 60.0,
                                         dev)
        try:
            fn = _time_normal if mode == "normal" else _time_ll
            t_d, t_c, recv, back = fn(comms, tokens, dtype, iters)
        finally:
            for c in comms:
                c.destroy()
            torch.cuda.empty_cache()
        rows.append(dict(mode=mode, ranks=RANKS, tokens=tokens, hidden=HIDDEN, topk=TOPK,
                         experts=EXPERTS, dtype=dtype, dispatch_us=t_d * 1e6,
                         combine_us=t_c * 1e6, dispatch_gbps=recv / t_d / 1e9,
                         combine_gbps=back / t_c / 1e9))
        print(f"timed {mode} {dtype} in {time.monotonic() - t0:.1f} s", flush=True)
    copy = _copy_gbps()
    for row in rows:
        row["copy_gbps"] = copy
    meta = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                ranks_as="8 CUDA streams of one process (threads) on one GPU",
                normal_dispatch="cached handle (no host count exchange)")
    with open(path, "w") as f:
        json.dump(dict(rows=rows, meta=meta), f, indent=1)


# ---- step 3: all_to_all_single baseline (8 processes) -------------------------------------
def _a2a(out, inp, out_splits=None, in_splits=None):
    """all_to_all_single on CUDA tensors; gloo may refuse CUDA tensors: stage through host."""
    import torch
    import torch.distributed as dist
    global _STAGED
    if not _STAGED:
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits)
            return
        except (RuntimeError, ValueError):
            _STAGED = True
    host = torch.empty(out.shape, dtype=out.dtype)
    dist.all_to_all_single(host, inp.cpu(), out_splits, in_splits)
    out.copy_(host)


_STAGED = False


def _normal_baseline(x, idx, w):
    """Permute, exchange counts, exchange payload rows (x, scales, top-k), unpermute."""
    import torch
    from moe_comm.layout import dispatch_layout
    R = RANKS
    data, scales = x if isinstance(x, tuple) else (x, None)
    per_rank, _, in_rank = dispatch_layout(idx, EXPERTS, R)
    parts = [data.view(torch.uint8)] + ([scales.view(torch.uint8)] if scales is not None
                                        else []) + [idx.view(torch.uint8), w.view(torch.uint8)]
    rows = torch.cat(parts, 1)
    send_ids = torch.cat([in_rank[:, d].nonzero().flatten() for d in range(R)])
    st = {}

    def dispatch():
        send = rows.index_select(0, send_ids)
        send_counts = per_rank.long()
        recv_counts = torch.empty_like(send_counts)
        _a2a(recv_counts, send_counts)
        rc, sc = recv_counts.tolist(), send_counts.tolist()
        recv = torch.empty(sum(rc), rows.shape[1], dtype=torch.uint8, device=rows.device)
        _a2a(recv, send, rc, sc)
        st.update(rc=rc, sc=sc, n=sum(rc))

    def combine():
        y = torch.zeros(st["n"], HIDDEN, dtype=torch.bfloat16, device=rows.device)
        back = torch.empty(len(send_ids), HIDDEN, dtype=torch.bfloat16, device=rows.device)
        _a2a(back.view(torch.uint8), y.view(torch.uint8), st["sc"], st["rc"])
        out = torch.zeros(data.shape[0], HIDDEN, device=rows.device)
        out.index_add_(0, send_ids, back.float())
        return out.bfloat16()

    return dispatch, combine


def _ll_baseline(x, idx, w, tokens, fp8):
    """The padded fixed-shape exchange an all_to_all needs without a count exchange: every
    rank sends each destination tokens x min(top-k, experts per rank) message slots."""
    import torch
    R, L = RANKS, EXPERTS // RANKS
    slots = tokens * min(TOPK, L)
    tok, k = (idx >= 0).nonzero(as_tuple=True)
    expert = idx[tok, k]
    order = torch.sort(expert, stable=True).indices
    tok, k, expert = tok[order], k[order], expert[order]
    dst = expert // L
    pos = torch.arange(tok.numel(), device=x.device) - torch.searchsorted(dst, dst)
    msg = HIDDEN + HIDDEN // 32 if fp8 else 2 * HIDDEN

    def dispatch():
        if fp8:
            blocks = x.float().view(x.shape[0], HIDDEN // 128, 128)
            s = blocks.abs().amax(-1).clamp(min=1e-4) / 448.0
            q = (blocks / s.unsqueeze(-1)).view(x.shape[0], HIDDEN).to(torch.float8_e4m3fn)
            msgs = torch.cat([q.view(torch.uint8), s.view(torch.uint8)], 1)
        else:
            msgs = x.view(torch.uint8)
        send = torch.zeros(R, slots, msg, dtype=torch.uint8, device=x.device)
        meta = torch.full((R, slots, 2), -1, dtype=torch.int64, device=x.device)
        send[dst, pos] = msgs[tok]
        meta[dst, pos, 0] = expert % L
        meta[dst, pos, 1] = tok
        _a2a(torch.empty_like(send), send)
        _a2a(torch.empty_like(meta), meta)

    def combine():
        back = torch.zeros(R, slots, HIDDEN, dtype=torch.bfloat16, device=x.device)
        recv = torch.empty_like(back)
        _a2a(recv.view(torch.uint8), back.view(torch.uint8))
        out = torch.zeros(x.shape[0], HIDDEN, device=x.device)
        out.index_add_(0, tok, recv[dst, pos].float() * w[tok, k, None])
        return out.bfloat16()

    return dispatch, combine


def _baseline_rank(rank, n, iters):
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        t = (time.perf_counter() - t0) / iters
        everyone = [None] * n
        dist.all_gather_object(everyone, t)
        return max(everyone)

    out = []
    for mode, tokens, dtype in SPECS:
        x, idx, w = _inputs(mode, tokens, dtype, rank, dev)
        d, c = (_normal_baseline(x, idx, w) if mode == "normal" else
                _ll_baseline(x, idx, w, tokens, dtype == "fp8"))
        out.append(dict(mode=mode, dtype=dtype, baseline_dispatch_us=timed(d) * 1e6,
                        baseline_combine_us=timed(c) * 1e6))
    return out, _STAGED


def run_baseline(path, iters):
    from moe_comm.launch import run_ranks
    results = run_ranks(_baseline_rank, RANKS, iters, timeout=540)
    rows, staged = results[0]
    with open(path, "w") as f:
        json.dump(dict(rows=rows, meta=dict(
            baseline="torch.distributed all_to_all_single, gloo, 8 processes on one GPU" +
            (" (CUDA tensors staged through host memory)" if staged else ""))), f, indent=1)


# ---- step 4 workload: small case for compute-sanitizer -------------------------------------
def run_small_case():
    """Every kernel on one rank (no rank waits on another thread's kernel, so a sanitizer that
    serialises launches cannot deadlock it), then 2 processes through CUDA IPC."""
    import torch
    import cuda_cases as C
    import test_cuda_gpu as T
    n, dev = 1, torch.device("cuda", torch.cuda.current_device())
    normal = [c for c in C.normal_cases(n) if c["routing"] == "random"][:4] + \
        [c for c in C.normal_cases(n) if c["worst"]]
    C.check_normal_group(n, dev, normal)
    C.check_ll_group(n, dev, [c for c in C.ll_cases(n) if c["hidden"] <= 512])
    T.test_two_processes_through_cuda_ipc()
    print("small case OK")


# ---- orchestration -------------------------------------------------------------------------
def _step(name, cmd, timeout, env_extra, log):
    env = dict(os.environ, **env_extra)
    t0 = time.monotonic()
    # its own process group: on a timeout the ranks it forked or spawned die with it, instead
    # of holding GPU contexts that time-slice the GPU under the next steps
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=max(1, timeout))
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = p.communicate()
    took = time.monotonic() - t0
    log[name] = dict(cmd=" ".join(cmd), rc=rc, seconds=round(took, 1), tail=out[-6000:])
    status = "ok" if rc == 0 else f"FAILED (rc={rc})"
    print(f"[{name}] {status} in {took:.0f} s", flush=True)
    if rc != 0:
        print(out[-3000:], flush=True)
    return rc == 0


def _sanitizer():
    found = shutil.which("compute-sanitizer")
    for cand in ("/usr/local/cuda/bin/compute-sanitizer",
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if not found and os.path.exists(cand):
            found = cand
    return found


def _table(rows):
    lines = [" ".join(f"{c:>12}" for c in COLUMNS)]
    for row in rows:
        lines.append(" ".join(f"{row.get(c, float('nan')):>12.1f}"
                              if isinstance(row.get(c), float) or row.get(c) is None
                              else f"{row[c]:>12}" for c in COLUMNS))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # $OUT: the device tool brings back only what is written there
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT") or
                                                  os.path.join(ROOT, "bench_out"),
                                                  "gpu_check.json"))
    p.add_argument("--iters", type=int, default=10, help="timed calls per rank")
    p.add_argument("--baseline-iters", type=int, default=3)
    p.add_argument("--budget", type=float, default=570.0, help="seconds for all steps")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-sanitizer", action="store_true")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--small-case", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timing", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--baseline", metavar="PATH", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.small_case:
        return run_small_case()
    if args.timing:
        return run_timing(args.timing, args.iters)
    if args.baseline:
        return run_baseline(args.baseline, args.baseline_iters)

    import torch
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    start = time.monotonic()
    left = lambda: args.budget - (time.monotonic() - start)  # noqa: E731
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    me = [sys.executable, os.path.abspath(__file__)]
    # ranks as threads: see moe_comm/cuda/local.py
    eager = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    lazy = {"CUDA_MODULE_LOADING": "LAZY"}
    log = {}
    if not args.skip_tests:
        _step("tests", [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                        "tests/test_cuda_compile.py", "tests/test_cuda_launch_args.py",
                        "tests/test_cuda_gpu.py", "tests/test_ibgda_gpu.py"],
              min(240, left() - 200), eager, log)
    timing_path, base_path = args.json + ".timing", args.json + ".baseline"
    _step("timing", me + ["--timing", timing_path, "--iters", str(args.iters)],
          min(180, left() - 120), eager, log)
    if not args.skip_baseline:
        _step("baseline", me + ["--baseline", base_path, "--baseline-iters",
                                str(args.baseline_iters)], min(150, left() - 60), lazy, log)
    tool = _sanitizer()
    if args.skip_sanitizer:
        pass
    elif tool is None:
        log["sanitizer"] = "compute-sanitizer not found"
        print("[sanitizer] compute-sanitizer not found: skipped", flush=True)
    else:
        for kind in ("memcheck", "racecheck"):
            if left() < 30:
                log[kind] = "skipped: out of time"
                print(f"[{kind}] skipped: out of time", flush=True)
                continue
            _step(kind, [tool, "--tool", kind, "--target-processes", "all",
                         "--error-exitcode", "99", "--print-limit", "30"] + me +
                  ["--small-case"], left() - 5, lazy, log)

    rows, meta = [], {}
    if os.path.exists(timing_path):
        with open(timing_path) as f:
            t = json.load(f)
        rows, meta = t["rows"], t["meta"]
    if os.path.exists(base_path):
        with open(base_path) as f:
            b = json.load(f)
        for row in rows:
            for brow in b["rows"]:
                if (brow["mode"], brow["dtype"]) == (row["mode"], row["dtype"]):
                    row.update(baseline_dispatch_us=brow["baseline_dispatch_us"],
                               baseline_combine_us=brow["baseline_combine_us"])
        meta.update(b["meta"])
    print(_table(rows))
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), rows=rows,
                  meta=meta, steps=log, seconds=round(time.monotonic() - start, 1))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json} ({result['seconds']} s)")
    failed = [k for k, v in log.items() if isinstance(v, dict) and v["rc"] != 0]
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
