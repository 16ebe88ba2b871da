#!/usr/bin/env python3
"""bench_all_to_all: moe_comm dispatch/combine against torch.distributed all_to_all_single
doing the same exchange, and against the machine's copy bandwidth, all in one run.

    python bench/bench_all_to_all.py                     # 4 local CPU ranks, both modes
    python bench/bench_all_to_all.py --mode normal --ranks 2,4 --tokens 256,1024 --json out.json
    python bench/bench_all_to_all.py --tokens 64,256,1024 --dtype bfloat16,fp8 --plot out.png

Every shape option takes a comma list; the run sweeps the cross product (per mode; a
combination a mode cannot run, such as low-latency float32, is skipped with a note). Rows go
to stdout as a table, then one summary line per mode: geometric means over its cases of the
speed-up over the baseline and of dispatch's share of copy bandwidth, with the best and worst
case when there are several. A progress line (case i/n, elapsed) goes to stderr when it is a
terminal.

Normal mode's baseline is all_to_all_single doing the same exchange (permute, exchange counts,
exchange payloads, unpermute). Low-latency mode's baseline is the plain padded exchange a
fixed-shape all_to_all needs without a count exchange: every rank sends each destination
max_tokens x min(top-k, experts per rank) message slots, as pplx-kernels compares.

GB/s follow DeepEP's convention: real payload bytes a rank receives in dispatch (and sends
back in combine) divided by the call's time. ``copy_gbps`` is what one process copies per
second while all ranks copy at once: a copy-based exchange cannot beat it. Times are the
median over iterations of the slowest rank, each iteration started after a barrier.

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
from call_timing import copy_gbps, timed_across_ranks  # noqa: E402
from hosts import measure as measure_link  # noqa: E402
from moe_comm.testing.processes import run_ranks  # noqa: E402
from moe_comm.wire import LL_MAX_TOPK  # noqa: E402
# COLUMNS also as this script's own name: tests/test_bench_cli.py reads bench.COLUMNS
from result_table import CASE_COLUMNS, COLUMNS, case_columns, header_line, row_line  # noqa: E402
from routed_inputs import per_block_fp8, random_routed_inputs, token_bytes  # noqa: E402

MODES = ("normal", "ll")
DTYPES = ("bfloat16", "float32", "fp8")
DEFAULT_TOKENS = {"normal": [1024], "ll": [128]}
DEFAULT_DTYPE = {"normal": ["bfloat16"], "ll": ["fp8"]}
BASELINE = {"normal": "all_to_all_single", "ll": "the padded all_to_all_single exchange"}
CASE_TIMEOUT_S = 600


class _RankEnv:
    """Where one rank's tensors live and what its baseline runs over. ``host``: CPU tensors,
    baseline on the default (gloo) group. ``cuda``: GPU ``LOCAL_RANK`` (else the rank), baseline
    on an NCCL group of every rank; the Buffer gets the default group either way."""

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

    def timed(self, fn, iters):
        return timed_across_ranks(fn, iters, self.device)


def _inputs(case, rank, device):
    x, idx, w = random_routed_inputs(case["tokens"], case["hidden"], case["experts"],
                                     case["topk"], seed=1234 + rank)
    if case["dtype"] == "fp8":
        x = tuple(t.to(device) for t in per_block_fp8(x))
    else:
        x = x.to(getattr(torch, case["dtype"])).to(device)
    return x, idx.to(device), w.to(device)


def _baseline(x, idx, w, is_token_in_rank, num_tokens_per_rank, env):
    """normal_exchange on the rank's group; its dispatch also cuts the received x out of the
    byte rows, as moe_comm's dispatch hands x back as a tensor of its own."""
    exchange, combine = normal_exchange(x, idx, w, is_token_in_rank, num_tokens_per_rank,
                                        env.a2a)
    data = x[0] if isinstance(x, tuple) else x
    width = data.shape[1] * data.element_size()

    def dispatch():
        return exchange()[:, :width].contiguous().view(data.dtype)

    return dispatch, combine


def _ll_baseline(x, idx, w, num_experts, max_tokens, use_fp8, env):
    """PaddedExchange, with the receiver laying the messages out per local expert (as
    moe_comm's low-latency dispatch returns them) and the expert outputs packed back into
    their slots."""
    R = dist.get_world_size()
    dev = x.device
    padded = PaddedExchange(idx, w, num_experts, R, max_tokens, env.a2a)
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
        for e in range(num_local):
            rows = (le == e).nonzero().flatten()
            out[e, :rows.numel()] = flat[rows]
        state["recv_meta"] = recv_meta

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
        t, h, n, e), low_latency_mode=True, timeout_s=120)
    x, idx, w = random_routed_inputs(t, h, e, case["topk"], seed=99 + rank)
    x, idx, w = x.bfloat16().to(env.device), idx.to(env.device), w.to(env.device)
    state = {}

    def dispatch():
        state["out"] = buf.low_latency_dispatch(x, idx, t, e, use_fp8=fp8)

    t_dispatch = env.timed(dispatch, iters)
    recv_x, recv_count, handle, _, _ = state["out"]
    y = torch.randn(e // n, n * t, h).bfloat16().to(env.device)
    t_combine = env.timed(lambda: buf.low_latency_combine(y, idx, w, handle), iters)
    msgs = int(recv_count.sum())
    recv_bytes = msgs * token_bytes(h, fp8)
    combine_bytes = msgs * 2 * h
    buf.destroy()
    return _row(n, case, iters, env, t_dispatch, t_combine,
                _ll_baseline(x, idx, w, e, t, fp8, env), y, recv_bytes, combine_bytes)


def _row(n, case, iters, env, t_dispatch, t_combine, baseline, y, recv_bytes, combine_bytes):
    """Time the baseline and the copy bandwidth in the same run, then build the table row
    (bytes averaged over ranks, times of the slowest rank)."""
    b_dispatch, b_combine = baseline
    t_b_dispatch = env.timed(b_dispatch, iters)
    t_b_combine = env.timed(lambda: b_combine(y), iters)
    copy = copy_gbps(max(recv_bytes, 1 << 20), env.device, lambda fn: env.timed(fn, iters))
    stats = [None] * n
    dist.all_gather_object(stats, (recv_bytes, combine_bytes, copy))
    mean = lambda i: sum(s[i] for s in stats) / n  # noqa: E731
    return dict(case_columns(case), dispatch_us=t_dispatch * 1e6, combine_us=t_combine * 1e6,
                dispatch_gbps=mean(0) / t_dispatch / 1e9, combine_gbps=mean(1) / t_combine / 1e9,
                baseline_dispatch_us=t_b_dispatch * 1e6, baseline_combine_us=t_b_combine * 1e6,
                copy_gbps=mean(2))


def _run_normal(rank, n, case, iters, env):
    e = case["experts"]
    buf = moe_comm.Buffer(None, case["nvl_bytes"], timeout_s=120)
    x, idx, w = _inputs(case, rank, env.device)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, e)
    state = {}

    def dispatch():
        state["out"] = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                    num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)

    t_dispatch = env.timed(dispatch, iters)
    recv_x, _, recv_w, _, handle, _ = state["out"]
    y = (recv_x[0].float() if isinstance(recv_x, tuple) else recv_x.float()).bfloat16()
    t_combine = env.timed(lambda: buf.combine(y, handle), iters)
    recv_bytes = sum(t.numel() * t.element_size()
                     for t in (recv_x if isinstance(recv_x, tuple) else (recv_x,)))
    combine_bytes = y.numel() * y.element_size()
    del state["out"], recv_x, recv_w
    buf.destroy()
    return _row(n, case, iters, env, t_dispatch, t_combine,
                _baseline(x, idx, w, itr, ntr, env), y, recv_bytes, combine_bytes)


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
                dtypes=None):
    """The cross product per mode, in table order. ``tokens``/``dtypes`` None: each mode's
    default (normal 1024 tokens bf16, ll 128 tokens fp8). Returns every combination, runnable
    or not (see case_problem)."""
    cases = []
    for mode in modes:
        for n, t, h, k, e, dt in itertools.product(
                ranks, tokens or DEFAULT_TOKENS[mode], hidden, topk, experts,
                dtypes or DEFAULT_DTYPE[mode]):
            case = dict(mode=mode, ranks=n, tokens=t, hidden=h, topk=k, experts=e, dtype=dt)
            if mode == "normal":
                elem = 1 if dt == "fp8" else 4 if dt == "float32" else 2
                case["nvl_bytes"] = moe_comm.Buffer.get_normal_buffer_size_hint(
                    t, h, n, k, elem_size=elem, fp8=dt == "fp8", keep_alive=2)
            cases.append(case)
    return cases


def case_label(case, keys=("ranks", "tokens", "hidden", "topk", "experts", "dtype")):
    return " ".join(f"{k}={case[k]}" for k in keys)


def run_cases(cases, iters, backend="host", *, launcher=run_ranks, on_row=None,
              progress=None):
    """Run ``cases`` (dicts from build_cases) one after another and return their rows, in
    order. ``launcher(fn, n, *args, timeout=...)`` runs ``fn(rank, n, *args)`` on ``n`` ranks
    joined by a default process group and returns the per-rank results; the default,
    moe_comm.testing.processes.run_ranks, forks local processes. A runner over several machines passes
    its own. ``on_row(row)`` sees each row as soon as it is done; ``progress``: a Progress."""
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


def format_header():
    return header_line(TABLE_WIDTH)


def format_row(row):
    return row_line(row, TABLE_WIDTH)


def _geomean(values):
    if min(values) <= 0:
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _pct(v):
    return f"{v:.0%}" if v >= 0.1 else f"{v * 100:.2g}%"


def _varying(rows, keys=("ranks", "tokens", "hidden", "topk", "experts", "dtype")):
    return [k for k in keys if len({r[k] for r in rows}) > 1]


def summarize(rows):
    """One line per mode: speed-ups over the baseline and dispatch's share of copy bandwidth
    (geometric means over the mode's cases; best and worst case when there are several)."""
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        ratios = {
            "dispatch": [r["baseline_dispatch_us"] / r["dispatch_us"] for r in rs],
            "combine": [r["baseline_combine_us"] / r["combine_us"] for r in rs],
            "copy": [r["dispatch_gbps"] / r["copy_gbps"] for r in rs]}
        g = {k: _geomean(v) for k, v in ratios.items()}
        head = (f"dispatch {g['dispatch']:.1f}x / combine {g['combine']:.1f}x speed-up over "
                f"{BASELINE[mode]}; dispatch at {_pct(g['copy'])} of copy bandwidth")
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


def _check_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("bench_all_to_all: --plot needs matplotlib, which is not installed. "
                         f"Install it with: {sys.executable} -m pip install matplotlib") from None


def plot(rows, path):
    """PNG at ``path``: for each mode and op (dispatch, combine) a column of two panels, time
    per call and GB/s against tokens per rank, moe_comm solid, baseline dashed, copy
    bandwidth dotted; one colour per combination of the other swept options."""
    _check_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, op) for m in dict.fromkeys(r["mode"] for r in rows)
              for op in ("dispatch", "combine")]
    fig, axes = plt.subplots(2, len(panels), figsize=(4.6 * len(panels), 8), squeeze=False)
    for j, (mode, op) in enumerate(panels):
        rs = [r for r in rows if r["mode"] == mode]
        keys = _varying(rs, ("ranks", "hidden", "topk", "experts", "dtype"))
        groups = {}
        for r in rs:
            groups.setdefault(tuple(r[k] for k in keys), []).append(r)
        t_ax, bw_ax = axes[0][j], axes[1][j]
        for gi, (key, grs) in enumerate(groups.items()):
            grs.sort(key=lambda r: r["tokens"])
            x = [r["tokens"] for r in grs]
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
            bw_ax.plot(x, [r["copy_gbps"] for r in grs], ":", color=c, label=f"copy{tag}")
        tokens = sorted({r["tokens"] for r in rs})
        for ax in (t_ax, bw_ax):
            if len(tokens) > 1 and tokens[-1] >= 4 * tokens[0]:
                ax.set_xscale("log", base=2)
            ax.set_xticks(tokens, [str(t) for t in tokens])
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
            ax.set_xlabel("tokens per rank")
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
               "dispatch's share of copy bandwidth, with the best and worst case); a progress "
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
                        "talk through the host proxy over TCP, the baseline's gloo over the "
                        "same links (default: 1)")
    p.add_argument("--iters", type=int, default=10,
                   help="back-to-back calls per timed repeat (default: 10)")
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
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


def _hosts_launcher(p, hosts, backend, cases):
    """A run_cases launcher placing ranks on ``hosts`` network namespaces (moe_comm.testing.netns),
    ranks / hosts on each; ranks on different hosts go through the host proxy over TCP."""
    from moe_comm.testing import netns
    why = netns.available()
    if why is not None:
        p.error(f"--hosts needs network namespaces: {why}")
    if backend != "host":
        p.error("--hosts runs the host backend (CPU tensors) only")
    bad = sorted({c["ranks"] for c in cases if c["ranks"] % hosts})
    if bad:
        p.error(f"--ranks {bad} cannot be spread evenly over {hosts} hosts")

    def launch(fn, n, *args, timeout):
        return netns.run_on_hosts(fn, hosts, n // hosts, *args, timeout=timeout,
                                  env={"MOE_COMM_TRANSPORT": "tcp"})
    return launch


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
    cases = build_cases(args.mode, args.ranks, args.tokens, args.hidden, args.topk,
                        args.experts, args.dtype)
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
    if args.hosts > 1:
        launcher = _hosts_launcher(p, args.hosts, backend, runnable)
    progress = Progress(len(runnable), enabled=not args.quiet)
    progress.print(format_header())
    try:
        rows = run_cases(runnable, args.iters, backend, progress=progress, launcher=launcher,
                         on_row=lambda row: progress.print(format_row(row)))
    finally:
        progress.close()
    for line in summarize(rows):
        print(line)
    if args.hosts > 1:
        # the link itself, same run: a plain socket stream vs the proxy's puts
        link = measure_link(total_mb=128, repeat=3)
        print(f"summary link between 2 hosts: raw TCP {link['raw_tcp_GBps']:.2f} GB/s, "
              f"proxy put {link['proxy_tcp_GBps']:.2f} GB/s ({link['ratio']:.0%} of raw)")
        for row in rows:
            row.update(hosts=args.hosts, raw_tcp_gbps=link["raw_tcp_GBps"],
                       proxy_tcp_gbps=link["proxy_tcp_GBps"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return rows


if __name__ == "__main__":
    main()
