#!/usr/bin/env python3
"""bench_all_to_all: moe_comm dispatch/combine against torch.distributed all_to_all_single
doing the same exchange, against MPICH's Alltoallv doing it too (when mpi4py and the mpich
wheel are installed), and against the machine's copy bandwidth, all in one run.

    python bench/bench_all_to_all.py                     # 4 local CPU ranks, both modes
    python bench/bench_all_to_all.py --mode normal --ranks 2,4 --tokens 256,1024 --json out.json
    python bench/bench_all_to_all.py --tokens 64,256,1024 --dtype bfloat16,fp8 --plot out.png
    python bench/bench_all_to_all.py --hosts 2 --transport nixl   # 2 namespace hosts, NIXL

Every shape option takes a comma list; the run sweeps the cross product (per mode; a
combination a mode cannot run, such as low-latency float32, is skipped with a note). Rows go
to stdout as a table, then one summary line per mode: geometric means over its cases of the
speed-up over the baseline and of dispatch's and combine's share of copy bandwidth, with the
best and worst case when there are several. A progress line (case i/n, elapsed) goes to
stderr when it is a terminal.

Normal mode's baseline is all_to_all_single doing the same exchange (permute, exchange counts,
exchange payloads, unpermute). Low-latency mode's baseline is the plain padded exchange a
fixed-shape all_to_all needs without a count exchange: every rank sends each destination
max_tokens x min(top-k, experts per rank) message slots, as pplx-kernels compares.

MPI baseline (columns mpi_dispatch_us, mpi_combine_us): the same two exchanges with MPI as the
transport (MPI_Alltoall for counts and equal parts, MPI_Alltoallv for uneven ones; see
mpi_exchange.py). When mpi4py can be imported, the ranks are started by MPICH's
``mpiexec -n R`` instead of being forked (mpi_ranks.py), and each rank builds its gloo group
from MPI's rank and size, so moe_comm and both baselines run in the same processes on the same
data. Without mpi4py (or with --hosts) the MPI columns are None and a note says why.

GB/s follow DeepEP's convention: real payload bytes a rank receives in dispatch (and sends
back in combine) divided by the call's time. ``copy_gbps`` is what one process copies per
second while all ranks copy at once (on the CPU the faster of torch's copy and one with
non-temporal stores, as a large dispatch writes its rows): a copy-based exchange cannot beat
it. Times are the
median over repeats of the slowest rank (each repeat: --iters calls back to back after a
barrier, or as many more as fill 0.1 s where those would not: one late wake-up weighs less);
the JSON keeps min/median/max of every time and the calls a repeat made. copy_gbps is
measured several times in each case (before moe_comm's dispatch, between its dispatch and its
combine, after its combine, and after each baseline's calls) and reported as the median, its
samples and spread beside it. The machine's copy bandwidth swings within seconds (one run here:
5 to 56 GB/s), so the summary's shares of it pair moe_comm's calls with copies repeat by
repeat: each of its 5 repeats runs between two samples of the bar (one block each of the
copies), and its share is the median over the repeats of the call's GB/s over the mean of
the two samples around it (``dispatch_copy_share``, ``combine_copy_share``; each repeat's in
``paired``). ``dispatch_copy_gbps``, ``combine_copy_gbps`` keep the mean of the case's
samples before and after each column, the shares' bar of earlier runs. The JSON is
{"run": versions, machine and settings, "rows": [...]}.

Backends: ``host`` runs CPU tensors over the shared-memory backend (gloo for the baseline);
``cuda`` puts every tensor on the GPU (rank r on GPU r) and runs the baseline through an NCCL
group, so it needs one GPU per rank; ``auto`` picks cuda when torch sees a GPU.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

BENCH = os.path.dirname(os.path.abspath(__file__))
# the repository (moe_comm) and this folder (the modules shared with gpu_check.py): the tests
# load this file by its path, so its folder is not on sys.path on its own
sys.path[:0] = [os.path.dirname(BENCH), BENCH]
import moe_comm  # noqa: E402
from a2a_baseline import PaddedExchange, byte_rows, normal_exchange  # noqa: E402
from call_timing import (CopyBar, calls_to_time, copy_gbps, timed_across_ranks,  # noqa: E402
                         timed_spread, timed_with_copy_bar)
from hosts import measure as measure_link  # noqa: E402
from moe_comm.testing import netns  # noqa: E402
from moe_comm.testing.processes import run_ranks  # noqa: E402
from moe_comm.wire import LL_MAX_TOPK  # noqa: E402
from mpi_exchange import mpi_all_to_all_single  # noqa: E402
import mpi_ranks  # noqa: E402
# COLUMNS also as this script's own name: tests/test_bench_cli.py reads bench.COLUMNS
from result_table import (CASE_COLUMNS, COLUMNS, MPI_COLUMNS, WIRE_COLUMNS,  # noqa: E402
                          case_columns, header_line, row_line)
from routed_inputs import per_block_fp8, random_routed_inputs, token_bytes  # noqa: E402
from run_info import run_info  # noqa: E402

MODES = ("normal", "ll")
DTYPES = ("bfloat16", "float32", "fp8")
DEFAULT_TOKENS = {"normal": [1024], "ll": [128]}
DEFAULT_DTYPE = {"normal": ["bfloat16"], "ll": ["fp8"]}
BASELINE = {"normal": "all_to_all_single", "ll": "the padded all_to_all_single exchange"}
MPI_BASELINE = {"normal": "MPICH Alltoallv", "ll": "MPICH's padded Alltoall"}
REPEATS = 3                     # timed repeats per call; each is --iters calls back to back
PAIRED_REPEATS = 5              # moe_comm's calls: repeats, each between two copy bar samples
MIN_REPEAT_S = 0.1              # or more calls, where --iters would take less (calls_to_time)
CASE_TIMEOUT_S = 600


class _RankEnv:
    """Where one rank's tensors live and what its baselines run over, and what it measured.
    ``host``: CPU tensors, baseline on the default (gloo) group. ``cuda``: GPU ``LOCAL_RANK``
    (else the rank), baseline on an NCCL group of every rank; the Buffer gets the default group
    either way. ``mpi_a2a``: the same all_to_all over MPI_COMM_WORLD when mpiexec started this
    rank, else None. ``spread``: (min, median, max) seconds per call of every timed column;
    ``paired``: moe_comm's columns' repeats beside their copy samples (timed_beside_copy);
    ``copy_samples``: copy GB/s measured at several points of the case."""

    def __init__(self, rank, backend):
        self.backend = backend
        if backend == "cuda":
            local = int(os.environ.get("LOCAL_RANK", rank))
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
            self.group = dist.new_group(backend="nccl")   # collective: every rank creates it
        else:
            self.device = torch.device("cpu")
            self.group = None
        self.a2a = functools.partial(dist.all_to_all_single, group=self.group)
        comm = mpi_ranks.world()
        self.mpi_a2a = None if comm is None else mpi_all_to_all_single(comm)
        self.spread = {}
        self.calls = {}
        self.paired = {}
        self.copy_samples = []

    def timed(self, column, fn, iters):
        """Seconds per call of fn (the median over repeats), its spread kept for ``column``
        and the calls a repeat made (at least ``iters``: calls_to_time) in ``calls``."""
        fn()             # warm-up: both of a call's buffers (LL calls and eager slots
        fn()             # alternate between two; each one's outputs fault in on first use)
        calls = self.calls[column] = calls_to_time(fn, iters, self.device, MIN_REPEAT_S)
        self.spread[column] = timed_spread(fn, calls, self.device, REPEATS)
        return self.spread[column][1]

    def timed_beside_copy(self, column, fn, iters, bar):
        """As timed(), for moe_comm's own calls: after the same warm-up, PAIRED_REPEATS
        repeats (not REPEATS), each between two samples of ``bar`` (a CopyBar), and an untimed
        repeat before them (timed_with_copy_bar). ``paired[column]`` keeps (seconds per call,
        copy GB/s around it) per repeat, from which _row forms the call's share of the bar
        repeat by repeat."""
        fn()
        fn()
        calls = self.calls[column] = calls_to_time(fn, iters, self.device, MIN_REPEAT_S)
        pairs = self.paired[column] = timed_with_copy_bar(fn, calls, bar, PAIRED_REPEATS)
        times = [t for t, _ in pairs]
        self.spread[column] = min(times), statistics.median(times), max(times)
        return self.spread[column][1]

    def copy_bar(self, nbytes, iters):
        """A CopyBar of ``nbytes`` (at least 1 MiB) for timed_beside_copy."""
        return CopyBar(max(nbytes, 1 << 20), self.device, iters, MIN_REPEAT_S)

    def sample_copy(self, nbytes, iters):
        """One more copy bandwidth sample: copies of ``nbytes`` (at least 1 MiB), every rank
        at once. Several per case, as it swings with what the other processes do."""
        def time_call(fn):
            return timed_across_ranks(fn, calls_to_time(fn, iters, self.device, MIN_REPEAT_S),
                                      self.device, REPEATS)
        self.copy_samples.append(copy_gbps(max(nbytes, 1 << 20), self.device, time_call))


def _inputs(case, rank, device):
    x, idx, w = random_routed_inputs(case["tokens"], case["hidden"], case["experts"],
                                     case["topk"], seed=1234 + rank)
    if case["dtype"] == "fp8":
        x = tuple(t.to(device) for t in per_block_fp8(x))
    else:
        x = x.to(getattr(torch, case["dtype"])).to(device)
    return x, idx.to(device), w.to(device)


def _baseline(x, idx, w, is_token_in_rank, num_tokens_per_rank, a2a):
    """normal_exchange over ``a2a`` (the rank's group, or MPI); its dispatch also cuts the
    received x out of the byte rows, as moe_comm's dispatch hands x back as a tensor of its
    own."""
    exchange, combine = normal_exchange(x, idx, w, is_token_in_rank, num_tokens_per_rank, a2a)
    data = x[0] if isinstance(x, tuple) else x
    width = data.shape[1] * data.element_size()

    def dispatch():
        return exchange()[:, :width].contiguous().view(data.dtype)

    return dispatch, combine


def _ll_baseline(x, idx, w, num_experts, max_tokens, use_fp8, a2a):
    """PaddedExchange over ``a2a`` (the rank's group, or MPI), with the receiver laying the
    messages out per local expert (as moe_comm's low-latency dispatch returns them) and the
    expert outputs packed back into their slots. dispatch() returns (uint8 [local experts,
    ranks * max_tokens, bytes]: each expert's message rows first, int64 [local experts]: how
    many)."""
    R = dist.get_world_size()
    dev = x.device
    padded = PaddedExchange(idx, w, num_experts, R, max_tokens, a2a)
    num_local, slots = padded.num_local, padded.slots
    state = {}

    def dispatch():
        # fp8: cast the way the host backend casts (moe_comm.quant), scales beside the data
        msgs = byte_rows(*moe_comm.quant.quantize_fp8(x)) if use_fp8 else x.view(torch.uint8)
        recv, recv_meta = padded.dispatch(msgs)
        le = recv_meta[..., 0].flatten()
        flat = recv.view(R * slots, -1)
        out = torch.empty(num_local, R * max_tokens, msgs.shape[1], dtype=torch.uint8,
                          device=dev)
        counts = torch.empty(num_local, dtype=torch.int64)
        for e in range(num_local):
            rows = (le == e).nonzero().flatten()
            out[e, :rows.numel()] = flat[rows]
            counts[e] = rows.numel()
        state["recv_meta"] = recv_meta
        return out, counts

    def combine(y):
        # expert outputs go back in the slots they came in, padded the same way
        le = state["recv_meta"][..., 0]
        back = torch.zeros(R, slots, y.shape[-1], dtype=torch.bfloat16, device=dev)
        for e in range(num_local):
            rows = (le.flatten() == e).nonzero().flatten()
            back.view(R * slots, -1)[rows] = y[e, :rows.numel()]
        return padded.combine(back)

    return dispatch, combine


def _run_ll(rank, n, case, iters, env):
    e, t, h = case["experts"], case["tokens"], case["hidden"]
    fp8 = case["dtype"] == "fp8"
    buf = moe_comm.Buffer(None, 1 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        t, h, n, e), low_latency_mode=True, timeout_s=120, device=env.device)
    x, idx, w = random_routed_inputs(t, h, e, case["topk"], seed=99 + rank)
    x, idx, w = x.bfloat16().to(env.device), idx.to(env.device), w.to(env.device)
    state = {}

    def dispatch():
        state["out"] = buf.low_latency_dispatch(x, idx, t, e, use_fp8=fp8)

    dispatch()                        # (its result sizes the copy samples)
    msgs = int(state["out"][1].sum())
    recv_bytes = msgs * token_bytes(h, fp8)
    bar = env.copy_bar(recv_bytes, iters)
    env.sample_copy(recv_bytes, iters)                  # copy samples around each column
    env.timed_beside_copy("dispatch_us", dispatch, iters, bar)
    env.sample_copy(recv_bytes, iters)
    recv_x, recv_count, handle, _, _ = state["out"]
    y = torch.randn(e // n, n * t, h).bfloat16().to(env.device)
    env.timed_beside_copy("combine_us", lambda: buf.low_latency_combine(y, idx, w, handle),
                          iters, bar)
    combine_bytes = msgs * 2 * h
    env.sample_copy(recv_bytes, iters)
    buf.destroy()
    baselines = {prefix: _ll_baseline(x, idx, w, e, t, fp8, a2a)
                 for prefix, a2a in _baseline_transports(env)}
    return _row(n, case, iters, env, baselines, y, recv_bytes, combine_bytes)


def _baseline_transports(env):
    """(column prefix, all_to_all) of each baseline this rank can run: torch.distributed's,
    and MPI's when mpiexec started the ranks."""
    yield "baseline_", env.a2a
    if env.mpi_a2a is not None:
        yield "mpi_", env.mpi_a2a


def _wire_ratio(n, per_host, step, row_bytes, iters):
    """Bytes that crossed the host links during ``iters`` calls of ``step`` (a dispatch and
    its combine), read from the links' own counters, over the ideal: each token's payload
    (``row_bytes`` out and back) once per other host it visits (``per_host``: DeepEP's
    num_tokens_per_rdma_rank). Ranks are placed by host in blocks (netns.run_on_hosts); the
    first rank of each host reads its link."""
    rank, per = dist.get_rank(), n // len(per_host)
    first = rank % per == 0
    dist.barrier()
    before = netns.link_tx_bytes() if first else 0
    for _ in range(iters):
        step()
    dist.barrier()
    sent = netns.link_tx_bytes() - before if first else 0
    ideal = iters * row_bytes * sum(int(c) for h, c in enumerate(per_host) if h != rank // per)
    totals = [None] * n
    dist.all_gather_object(totals, (sent, ideal))
    return sum(t[0] for t in totals) / max(1, sum(t[1] for t in totals))


def _row(n, case, iters, env, baselines, y, recv_bytes, combine_bytes, wire_ratio=None):
    """Time the baselines (one copy bandwidth sample after each) in the same run, then build
    the table row (bytes averaged over ranks, times of the slowest rank, copy samples averaged
    over ranks). ``baselines``: {column prefix: (dispatch, combine)}."""
    for prefix, (b_dispatch, b_combine) in baselines.items():
        env.timed(prefix + "dispatch_us", b_dispatch, iters)
        env.timed(prefix + "combine_us", functools.partial(b_combine, y), iters)
        env.sample_copy(recv_bytes, iters)
    stats = [None] * n
    dist.all_gather_object(stats, (recv_bytes, combine_bytes, env.copy_samples))
    mean = lambda i: sum(s[i] for s in stats) / n  # noqa: E731
    copies = [sum(ss) / n for ss in zip(*(s[2] for s in stats))]
    us = {c: lo_med_hi[1] * 1e6 for c, lo_med_hi in env.spread.items()}
    # each repeat of moe_comm's calls against the copy samples just around it
    shares = {op: [mean(i) / sec / 1e9 / gbps for sec, gbps in env.paired[f"{op}_us"]]
              for i, op in enumerate(("dispatch", "combine"))}
    return dict(case_columns(case), dispatch_us=us["dispatch_us"], combine_us=us["combine_us"],
                dispatch_gbps=mean(0) / us["dispatch_us"] / 1e3,
                combine_gbps=mean(1) / us["combine_us"] / 1e3,
                baseline_dispatch_us=us["baseline_dispatch_us"],
                baseline_combine_us=us["baseline_combine_us"],
                copy_gbps=statistics.median(copies), wire_ratio=wire_ratio,
                # the samples taken just before and after each column (_run_normal, _run_ll)
                dispatch_copy_gbps=(copies[0] + copies[1]) / 2,
                combine_copy_gbps=(copies[1] + copies[2]) / 2,
                mpi_dispatch_us=us.get("mpi_dispatch_us"), mpi_combine_us=us.get("mpi_combine_us"),
                copy_gbps_samples=copies, copy_gbps_min=min(copies), copy_gbps_max=max(copies),
                dispatch_copy_share=statistics.median(shares["dispatch"]),
                combine_copy_share=statistics.median(shares["combine"]),
                paired={op: dict(shares=shares[op],
                                 us=[sec * 1e6 for sec, _ in env.paired[f"{op}_us"]],
                                 copy_gbps=[g for _, g in env.paired[f"{op}_us"]])
                        for op in shares},
                spread_us={c: dict(min=lo * 1e6, median=med * 1e6, max=hi * 1e6,
                                   calls=env.calls[c])
                           for c, (lo, med, hi) in env.spread.items()})


def _run_normal(rank, n, case, iters, env):
    e = case["experts"]
    buf = moe_comm.Buffer(None, case["nvl_bytes"], timeout_s=120, device=env.device)
    x, idx, w = _inputs(case, rank, env.device)
    ntr, per_host, nte, itr, _ = buf.get_dispatch_layout(idx, e)
    state = {}

    def dispatch():
        state["out"] = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                    num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)

    dispatch()                        # (its result sizes the copy samples)
    recv_x = state["out"][0]
    recv_bytes = sum(t.numel() * t.element_size()
                     for t in (recv_x if isinstance(recv_x, tuple) else (recv_x,)))
    bar = env.copy_bar(recv_bytes, iters)
    env.sample_copy(recv_bytes, iters)                  # copy samples around each column
    env.timed_beside_copy("dispatch_us", dispatch, iters, bar)
    env.sample_copy(recv_bytes, iters)
    recv_x, _, recv_w, _, handle, _ = state["out"]
    y = (recv_x[0].float() if isinstance(recv_x, tuple) else recv_x.float()).bfloat16()
    env.timed_beside_copy("combine_us", lambda: buf.combine(y, handle), iters, bar)
    combine_bytes = y.numel() * y.element_size()
    env.sample_copy(recv_bytes, iters)
    wire = None
    if per_host is not None:            # ranks on several hosts
        payload = x[0] if isinstance(x, tuple) else x
        wire = _wire_ratio(n, per_host, lambda: (dispatch(), buf.combine(y, state["out"][4])),
                           payload[0].numel() * payload.element_size() + y[0].numel() * 2,
                           iters)
    del state["out"], recv_x, recv_w
    buf.destroy()
    baselines = {prefix: _baseline(x, idx, w, itr, ntr, a2a)
                 for prefix, a2a in _baseline_transports(env)}
    return _row(n, case, iters, env, baselines, y, recv_bytes, combine_bytes, wire)


def run_rank(rank, n, case, iters, backend="host"):
    """One rank's part of one case; needs torch.distributed initialised (default group of
    ``n`` ranks, gloo). Every rank returns the same row."""
    env = _RankEnv(rank, backend)
    return (_run_normal if case["mode"] == "normal" else _run_ll)(rank, n, case, iters, env)


# ---- cases --------------------------------------------------------------------------------
def case_problem(case):
    """Why ``case`` cannot run (a sentence), or None."""
    mode, n, t, h, k, e, dt = (case[c] for c in CASE_COLUMNS)
    if min(n, t, h, k, e) < 1:
        return "ranks, tokens, hidden, topk and experts must be positive"
    if e % n:
        return f"{e} experts do not divide evenly over {n} ranks"
    if k > e:
        return f"top-{k} needs at least {k} experts, got {e}"
    if mode == "ll" and dt == "float32":
        return "low-latency mode dispatches bfloat16 or fp8"
    if mode == "ll" and k > LL_MAX_TOPK:
        return f"low-latency mode takes top-k <= {LL_MAX_TOPK}, got {k}"
    if (mode == "ll" or dt == "fp8") and h % 128:
        return f"hidden {h} must be a multiple of 128 (fp8 scales per 128 channels)"
    return None


def build_cases(modes, ranks, tokens=None, hidden=(7168,), topk=(8,), experts=(64,),
                dtypes=None, buffer_bytes=None):
    """The cross product per mode, in table order. ``tokens``/``dtypes`` None: each mode's
    default (normal 1024 tokens bf16, ll 128 tokens fp8). ``buffer_bytes``: normal mode's
    num_nvl_bytes (None: the size hint for one copy). Returns every combination, runnable or
    not (see case_problem)."""
    cases = []
    for mode in modes:
        for n, t, h, k, e, dt in itertools.product(
                ranks, tokens or DEFAULT_TOKENS[mode], hidden, topk, experts,
                dtypes or DEFAULT_DTYPE[mode]):
            case = dict(mode=mode, ranks=n, tokens=t, hidden=h, topk=k, experts=e, dtype=dt)
            if mode == "normal":
                elem = 1 if dt == "fp8" else 4 if dt == "float32" else 2
                hint = moe_comm.Buffer.get_normal_buffer_size_hint(
                    t, h, n, k, elem_size=elem, fp8=dt == "fp8", keep_alive=2)
                case["nvl_bytes"] = buffer_bytes or hint
            cases.append(case)
    return cases


def case_label(case, keys=("ranks", "tokens", "hidden", "topk", "experts", "dtype")):
    return " ".join(f"{k}={case[k]}" for k in keys)


def run_cases(cases, iters, backend="host", *, launcher=run_ranks, on_row=None,
              progress=None):
    """Run ``cases`` (dicts from build_cases) one after another and return their rows, in
    order. ``launcher(fn, n, *args, timeout=...)`` runs ``fn(rank, n, *args)`` on ``n`` ranks
    joined by a default process group and returns the per-rank results; the default,
    moe_comm.testing.processes.run_ranks, forks local processes. A runner over several
    machines passes its own. ``on_row(row)`` sees each row as soon as it is done;
    ``progress``: a Progress."""
    rows = []
    for i, case in enumerate(cases):
        if progress is not None:
            progress.start(i, "{mode} R={ranks} T={tokens} H={hidden} K={topk} E={experts} "
                              "{dtype}".format(**case))
        row = launcher(run_rank, case["ranks"], case, iters, backend, timeout=CASE_TIMEOUT_S)[0]
        row["backend"] = backend
        rows.append(row)
        if progress is not None:
            progress.finish(i)
        if on_row is not None:
            on_row(row)
    return rows


# ---- output -------------------------------------------------------------------------------
TABLE_WIDTH = 10


def table_columns(with_mpi, with_wire=False):
    """The table's columns: the MPI baseline's and the host links' last, and only when they
    were measured."""
    return COLUMNS + (MPI_COLUMNS if with_mpi else ()) + (WIRE_COLUMNS if with_wire else ())


def format_header(with_mpi=False, with_wire=False):
    return header_line(TABLE_WIDTH, table_columns(with_mpi, with_wire))


def format_row(row, with_mpi=False, with_wire=False):
    return row_line(row, TABLE_WIDTH, table_columns(with_mpi, with_wire))


def _geomean(values):
    if min(values) <= 0:
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _pct(v):
    return f"{v:.0%}" if v >= 0.1 else f"{v * 100:.2g}%"


def _varying(rows, keys=("ranks", "tokens", "hidden", "topk", "experts", "dtype")):
    return [k for k in keys if len({r[k] for r in rows}) > 1]


def _has_mpi(rows):
    return bool(rows) and all(r.get("mpi_dispatch_us") is not None for r in rows)


def _share(row, op):
    """``op``'s (dispatch, combine) share of the copy bandwidth in ``row``: the median over
    its repeats of each against the copy samples around it; in rows of older runs, its GB/s
    over the mean of the samples before and after its column."""
    if f"{op}_copy_share" in row:
        return row[f"{op}_copy_share"]
    return row[f"{op}_gbps"] / row.get(f"{op}_copy_gbps", row["copy_gbps"])


def summarize(rows):
    """One line per mode: speed-ups over the baseline (and over MPI when it ran) and
    dispatch's and combine's shares of the copy bandwidth measured beside them (geometric means
    over the mode's cases; best and worst case when there are several)."""
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        ratios = {
            "dispatch": [r["baseline_dispatch_us"] / r["dispatch_us"] for r in rs],
            "combine": [r["baseline_combine_us"] / r["combine_us"] for r in rs],
            "copy": [_share(r, "dispatch") for r in rs],
            "combine copy": [_share(r, "combine") for r in rs]}
        g = {k: _geomean(v) for k, v in ratios.items()}
        over_mpi = ""
        if _has_mpi(rs):
            g_mpi = {op: _geomean([r[f"mpi_{op}_us"] / r[f"{op}_us"] for r in rs])
                     for op in ("dispatch", "combine")}
            over_mpi = (f", {g_mpi['dispatch']:.1f}x / {g_mpi['combine']:.1f}x over "
                        f"{MPI_BASELINE[mode]}")
        head = (f"dispatch {g['dispatch']:.1f}x / combine {g['combine']:.1f}x speed-up over "
                f"{BASELINE[mode]}{over_mpi}; dispatch / combine at {_pct(g['copy'])} / "
                f"{_pct(g['combine copy'])} of copy bandwidth")
        wires = [r["wire_ratio"] for r in rs if r.get("wire_ratio") is not None]
        if wires:
            head += f"; host links carried {max(wires):.2f}x the ideal bytes (worst case)"
        if len(rs) == 1:
            lines.append(f"summary {mode} {case_label(rs[0], ('ranks', 'tokens'))}: {head}")
            continue
        keys = _varying(rs)
        parts = []
        for what, fmt in (("dispatch", "{:.1f}x".format), ("combine", "{:.1f}x".format),
                          ("copy", _pct)):
            v = ratios[what]
            hi, lo = max(range(len(rs)), key=v.__getitem__), min(range(len(rs)), key=v.__getitem__)
            name = "dispatch vs copy" if what == "copy" else what
            parts.append(f"{name} {fmt(v[hi])} ({case_label(rs[hi], keys) or hi + 1}) / "
                         f"{fmt(v[lo])} ({case_label(rs[lo], keys) or lo + 1})")
        lines.append(f"summary {mode}, geometric mean of {len(rs)} cases: {head}. "
                     f"Best / worst: " + ", ".join(parts))
    return lines


def copy_summary(rows):
    """The run's copy bandwidth over every sample of every case: (median, min, max, samples)."""
    samples = [g for r in rows for g in r.get("copy_gbps_samples", [r["copy_gbps"]])]
    return statistics.median(samples), min(samples), max(samples), len(samples)


def copy_line(rows):
    med, lo, hi, n = copy_summary(rows)
    return (f"summary copy bandwidth: median {med:.1f} GB/s over {n} samples "
            f"(min {lo:.1f}, max {hi:.1f})")


def _check_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("bench_all_to_all: --plot needs matplotlib, which is not installed. "
                         f"Install it with: {sys.executable} -m pip install matplotlib") from None


def plot(rows, path):
    """PNG at ``path``: for each mode and op (dispatch, combine) a column of two panels, time
    per call and GB/s against tokens per rank (against the rank count for a --ranks sweep at
    one token count), moe_comm solid, baseline dashed, MPI
    dash-dotted (when it ran), copy bandwidth dotted; one colour per combination of the other
    swept options."""
    _check_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a --ranks sweep at one token count is drawn against the rank count
    along = "ranks" if len({r["tokens"] for r in rows}) == 1 and \
        len({r["ranks"] for r in rows}) > 1 else "tokens"
    others = tuple(k for k in ("ranks", "tokens", "hidden", "topk", "experts", "dtype")
                   if k != along)
    panels = [(m, op) for m in dict.fromkeys(r["mode"] for r in rows)
              for op in ("dispatch", "combine")]
    fig, axes = plt.subplots(2, len(panels), figsize=(4.6 * len(panels), 8), squeeze=False)
    for j, (mode, op) in enumerate(panels):
        rs = [r for r in rows if r["mode"] == mode]
        keys = _varying(rs, others)
        groups = {}
        for r in rs:
            groups.setdefault(tuple(r[k] for k in keys), []).append(r)
        t_ax, bw_ax = axes[0][j], axes[1][j]
        for gi, (key, grs) in enumerate(groups.items()):
            grs.sort(key=lambda r: r[along])
            x = [r[along] for r in grs]
            tag = " ".join(f"{k}={v}" for k, v in zip(keys, key))
            tag = f" ({tag})" if tag else ""
            c = f"C{gi % 10}"
            ours = [r[f"{op}_us"] for r in grs]
            base = [r[f"baseline_{op}_us"] for r in grs]
            t_ax.plot(x, ours, "o-", color=c, label=f"moe_comm{tag}")
            t_ax.plot(x, base, "s--", color=c, label=f"baseline{tag}")
            gbps = [r[f"{op}_gbps"] for r in grs]
            bw_ax.plot(x, gbps, "o-", color=c, label=f"moe_comm{tag}")
            bw_ax.plot(x, [g * t / b for g, t, b in zip(gbps, ours, base)], "s--", color=c,
                       label=f"baseline{tag}")
            if _has_mpi(grs):
                mpi = [r[f"mpi_{op}_us"] for r in grs]
                t_ax.plot(x, mpi, "^-.", color=c, label=f"MPI{tag}")
                bw_ax.plot(x, [g * t / m for g, t, m in zip(gbps, ours, mpi)], "^-.", color=c,
                           label=f"MPI{tag}")
            bw_ax.plot(x, [r["copy_gbps"] for r in grs], ":", color=c, label=f"copy{tag}")
        ticks = sorted({r[along] for r in rs})
        for ax in (t_ax, bw_ax):
            if len(ticks) > 1 and ticks[-1] >= 4 * ticks[0]:
                ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
            ax.set_xlabel("tokens per rank" if along == "tokens" else "ranks")
        t_ax.set_yscale("log")
        bw_ax.set_yscale("log")
        t_ax.set_ylabel("time per call (µs)")
        bw_ax.set_ylabel("GB/s per rank")
        t_ax.set_title(f"{mode} {op} vs {BASELINE[mode]}", fontsize=9)
    backend = rows[0].get("backend", "host")
    fig.suptitle(f"bench_all_to_all ({backend} backend): moe_comm vs baseline")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- progress -----------------------------------------------------------------------------
# One lock around every progress write. run_ranks forks while the ticker thread may be
# writing; holding the lock across fork() means no child starts with stderr's buffer locked.
_DRAW_LOCK = threading.Lock()
os.register_at_fork(before=_DRAW_LOCK.acquire, after_in_parent=_DRAW_LOCK.release,
                    after_in_child=_DRAW_LOCK.release)


class Progress:
    """``[#####-----] case 3/8  0:42 elapsed  normal ranks=4 ...`` on one line of ``stream``,
    redrawn every ``interval`` s by a daemon thread. Does nothing unless ``enabled`` and
    ``stream`` is a terminal."""

    def __init__(self, total, stream=None, enabled=True, interval=0.5, width=20):
        self.stream = stream if stream is not None else sys.stderr
        self.on = bool(enabled) and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total, self.interval, self.width = total, interval, width
        self.done = 0
        self.current, self.label = 0, ""
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = None

    def _line(self):
        fill = self.width * self.done // max(self.total, 1)
        el = int(time.monotonic() - self.t0)
        line = (f"[{'#' * fill}{'-' * (self.width - fill)}] case {self.current}/{self.total}"
                f"  {el // 60}:{el % 60:02d} elapsed  {self.label}")
        return line[:max(shutil.get_terminal_size((100, 20)).columns - 1, 20)]

    def _draw(self):
        self.stream.write("\r" + self._line() + "\033[K")
        self.stream.flush()

    def _clear(self):
        self.stream.write("\r\033[K")
        self.stream.flush()

    def _tick(self):
        while not self._stop.wait(self.interval):
            with _DRAW_LOCK:
                self._draw()

    def start(self, index, label=""):
        if not self.on:
            return
        with _DRAW_LOCK:
            self.current, self.label = index + 1, label
            self._draw()
        if self._thread is None:
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()

    def finish(self, index):
        self.done = index + 1

    def print(self, text, file=None):
        """Print a line of output (stdout by default) without tearing the progress line."""
        file = file if file is not None else sys.stdout
        if not self.on:
            print(text, file=file, flush=True)
            return
        with _DRAW_LOCK:
            self._clear()
            print(text, file=file, flush=True)
            if self.current:
                self._draw()

    def close(self):
        if not self.on:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with _DRAW_LOCK:
            self._clear()


# ---- command line -------------------------------------------------------------------------
def _list(kind, choices=None):
    def parse(s):
        try:
            vals = [kind(v.strip()) for v in s.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__}s, "
                                             f"got {s!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError("empty list")
        if choices is not None:
            bad = [v for v in vals if v not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"invalid choice {bad[0]!r} (choose from "
                                                 f"{', '.join(choices)})")
        return list(dict.fromkeys(vals))
    return parse


def _modes(s):
    vals = _list(str, ("normal", "ll", "both"))(s)
    return list(dict.fromkeys(m for v in vals for m in (MODES if v == "both" else (v,))))


def resolve_backend(name, max_ranks=1):
    """``auto``/``host``/``cuda`` -> ``host`` or ``cuda``; ``auto`` takes cuda only with a GPU
    for each of ``max_ranks`` ranks. Raises ValueError for cuda without a GPU. Never
    initialises CUDA in this process (the ranks are forked from it)."""
    if name == "host":
        return "host"
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")   # keeps fork() safe
    have = torch.cuda.is_available()
    if name == "auto":
        if have and torch.cuda.device_count() < max_ranks:
            print(f"--backend auto: {max_ranks} ranks but {torch.cuda.device_count()} GPU(s) "
                  "(one per rank needed), running on the host backend", file=sys.stderr)
            return "host"
        return "cuda" if have else "host"
    if not have:
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "torch sees no GPU")
        raise ValueError(f"--backend cuda needs a CUDA GPU, but {why} (torch "
                         f"{torch.__version__}); use --backend host")
    return "cuda"


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Lists are comma separated (--ranks 2,4 --tokens 256,1024); the run sweeps their "
               "cross product for each mode, skipping with a note the combinations a mode "
               "cannot run. Output: the table on stdout, then one summary line per mode "
               "(geometric means over its cases of the speed-up over the baseline and of "
               "dispatch's and combine's share of copy bandwidth, with the best and worst case); "
               "a progress "
               "line (case i/n, elapsed) on stderr when it is a terminal.")
    p.add_argument("--mode", type=_modes, default=list(MODES), metavar="MODE[,MODE]",
                   help="normal, ll or both (default: both)")
    p.add_argument("--ranks", type=_list(int), default=[4], metavar="N[,N...]",
                   help="ranks (local processes; on cuda one GPU each) (default: 4)")
    p.add_argument("--tokens", type=_list(int), default=None, metavar="T[,T...]",
                   help="tokens per rank (default: normal 1024, ll 128)")
    p.add_argument("--hidden", type=_list(int), default=[7168], metavar="H[,H...]",
                   help="hidden size (default: 7168)")
    p.add_argument("--topk", type=_list(int), default=[8], metavar="K[,K...]",
                   help="experts per token (default: 8)")
    p.add_argument("--experts", type=_list(int), default=[64], metavar="E[,E...]",
                   help="experts in total, divided evenly over the ranks (default: 64)")
    p.add_argument("--dtype", type=_list(str, DTYPES), default=None, metavar="D[,D...]",
                   help=f"dispatch dtype: {', '.join(DTYPES)} (default: normal bfloat16, ll fp8;"
                        " ll combine is always bfloat16, ll has no float32)")
    p.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"],
                   help="host: CPU tensors over shared memory, gloo baseline; cuda: GPU "
                        "tensors, NCCL baseline, one GPU per rank; auto: cuda if torch sees "
                        "a GPU, else host (default: auto)")
    p.add_argument("--hosts", type=int, default=1,
                   help="spread the ranks over this many hosts: network namespaces on this "
                        "machine joined by veth links (needs root); ranks on different hosts "
                        "talk through the host proxy (--transport), the baseline's gloo "
                        "over the same links (default: 1)")
    p.add_argument("--transport", default="tcp", choices=["tcp", "nixl"],
                   help="with --hosts: the host proxy's engine between the hosts: tcp, or "
                        "nixl (NIXL's UCX backend over TCP on the veth links; needs "
                        "moe_comm[nixl]) (default: tcp)")
    p.add_argument("--buffer-mb", type=float, default=None, metavar="MB",
                   help="normal mode's buffer (num_nvl_bytes) in MiB (default: the size hint "
                        "for one copy of the batch); a smaller one streams the batch through "
                        "it, across hosts in token rounds of relayed calls")
    p.add_argument("--no-mpi", action="store_true",
                   help="leave out the MPI baseline even when mpi4py is installed: the ranks "
                        "are then forked, as without MPI")
    p.add_argument("--iters", type=int, default=10,
                   help="back-to-back calls per timed repeat, at least; more where they "
                        "would take less than 0.1 s (default: 10)")
    p.add_argument("--json", metavar="PATH",
                   help='write {"run": versions, machine, settings, "rows": [...]} as JSON')
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG of time and GB/s against tokens, moe_comm vs baseline, "
                        "one column per mode and op (needs matplotlib)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress line on stderr (it is off anyway when stderr is not a "
                        "terminal)")
    return p


def _prepare_output(path):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)


def _hosts_launcher(p, hosts, backend, cases, transport="tcp"):
    """A run_cases launcher placing ranks on ``hosts`` network namespaces (moe_comm.testing.netns),
    ranks / hosts on each; ranks on different hosts go through the host proxy's ``transport``
    engine."""
    from moe_comm.testing import netns
    why = netns.available()
    if why is not None:
        p.error(f"--hosts needs network namespaces: {why}")
    if backend != "host":
        p.error("--hosts runs the host backend (CPU tensors) only")
    bad = sorted({c["ranks"] for c in cases if c["ranks"] % hosts})
    if bad:
        p.error(f"--ranks {bad} cannot be spread evenly over {hosts} hosts")

    env = {"MOE_COMM_TRANSPORT": transport, **(netns.UCX_ENV if transport == "nixl" else {})}

    def launch(fn, n, *args, timeout):
        return netns.run_on_hosts(fn, hosts, n // hosts, *args, timeout=timeout, env=env)
    return launch


def _run_record(argv, args, backend, rows, launcher, no_mpi):
    """The JSON's "run": versions and machine (run_info), the settings, the copy bandwidth."""
    mpi_library = getattr(launcher, "library_version", None)
    info = run_info(None if no_mpi else mpi_ranks.versions(), mpi_library)
    med, lo, hi, n = copy_summary(rows)
    return dict(info, backend=backend, iters=args.iters, min_repeat_s=MIN_REPEAT_S,
                repeats=REPEATS, paired_repeats=PAIRED_REPEATS,
                buffer_mb=args.buffer_mb,
                argv=list(sys.argv[1:] if argv is None else argv),
                mpi_baselines=None if no_mpi else MPI_BASELINE, no_mpi_reason=no_mpi,
                copy_gbps=dict(median=med, min=lo, max=hi, samples=n))


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error("--iters must be at least 1")
    try:
        backend = resolve_backend(args.backend, max(args.ranks))
    except ValueError as e:
        p.error(str(e))
    if args.plot:
        _check_matplotlib()                     # fail before the sweep, not after it
    if args.buffer_mb is not None and args.buffer_mb <= 0:
        p.error("--buffer-mb must be positive")
    cases = build_cases(args.mode, args.ranks, args.tokens, args.hidden, args.topk,
                        args.experts, args.dtype,
                        None if args.buffer_mb is None else int(args.buffer_mb * (1 << 20)))
    runnable = [c for c in cases if case_problem(c) is None]
    skipped = [c for c in cases if case_problem(c) is not None]
    if not runnable:
        p.error("no case can run: " + "; ".join(
            f"{c['mode']} {case_label(c)}: {case_problem(c)}" for c in skipped[:3]))
    for c in skipped:
        print(f"skipping {c['mode']} {case_label(c)}: {case_problem(c)}",
              file=sys.stderr)
    if backend == "cuda":
        gpus = torch.cuda.device_count()
        most = max(c["ranks"] for c in runnable)
        if most > gpus:
            p.error(f"--backend cuda runs one rank per GPU (NCCL refuses two ranks on one "
                    f"GPU): {most} ranks asked for, {gpus} GPU(s) visible")
    for path in (args.json, args.plot):
        if path:
            _prepare_output(path)

    launcher = run_ranks
    no_mpi = "--no-mpi" if args.no_mpi else mpi_ranks.unavailable()
    if args.hosts > 1:
        launcher = _hosts_launcher(p, args.hosts, backend, runnable, args.transport)
        no_mpi = no_mpi or "--hosts runs its ranks in network namespaces, not under mpiexec"
    elif no_mpi is None:
        launcher = mpi_ranks.Launcher()
    if no_mpi is not None:
        print(f"note: no MPI baseline (mpi_dispatch_us, mpi_combine_us are None): {no_mpi}",
              file=sys.stderr)
    progress = Progress(len(runnable), enabled=not args.quiet)
    wire = args.hosts > 1
    progress.print(format_header(no_mpi is None, wire))
    try:
        rows = run_cases(runnable, args.iters, backend, progress=progress, launcher=launcher,
                         on_row=lambda row: progress.print(format_row(row, no_mpi is None,
                                                                      wire)))
    finally:
        progress.close()
    for line in summarize(rows):
        print(line)
    print(copy_line(rows))
    if args.hosts > 1:
        # the link itself, same run: a plain socket stream vs the proxy's puts
        engines = tuple(dict.fromkeys(("tcp", args.transport)))
        link = measure_link(total_mb=128, repeat=3, engines=engines)
        print(f"summary link between 2 hosts: raw TCP {link['raw_tcp_GBps']:.2f} GB/s, " +
              ", ".join(f"{e} engine put {link[f'proxy_{e}_GBps']:.2f} GB/s "
                        f"({link['ratio' if e == 'tcp' else f'{e}_ratio']:.0%} of raw)"
                        for e in engines))
        for row in rows:
            row.update(hosts=args.hosts, transport=args.transport,
                       raw_tcp_gbps=link["raw_tcp_GBps"],
                       **{f"proxy_{e}_gbps": link[f"proxy_{e}_GBps"] for e in engines})
    if args.json:
        with open(args.json, "w") as f:
            run = _run_record(argv, args, backend, rows, launcher, no_mpi)
            json.dump({"run": run, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return rows


if __name__ == "__main__":
    main()
