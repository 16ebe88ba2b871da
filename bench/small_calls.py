"""Per-call time of small calls on local CPU ranks: a normal-mode fresh dispatch, combine
and cached dispatch, or (--mode ll) a low-latency fp8 dispatch and combine, each run back to
back many times (wall time per call, and the CPU time of each rank per call), without
baselines. The benchmark (bench_all_to_all.py) times repeats between barriers beside MPI;
this loop is the steadier view of what one call costs.

    python bench/small_calls.py --ranks 2 --tokens 64 --hidden 1024 --calls 500
    python bench/small_calls.py --mode ll --ranks 4 --tokens 128 --hidden 7168 --calls 100
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.testing.processes import run_ranks
from routed_inputs import random_routed_inputs


def _per_call(fn, calls):
    """(wall us, CPU us of this rank) per call of ``calls`` back-to-back calls of ``fn``."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    return ((time.perf_counter() - wall) / calls * 1e6,
            (time.thread_time() - cpu) / calls * 1e6)


def _ll_ops(buf, x, idx, w, experts):
    """A low-latency fp8 dispatch and a combine of its result's shape."""
    tokens = x.shape[0]
    state = {"out": buf.low_latency_dispatch(x, idx, tokens, experts)}

    def dispatch():
        state["out"] = buf.low_latency_dispatch(x, idx, tokens, experts)
    y = torch.randn(state["out"][0][0].shape).bfloat16()
    return {"ll dispatch": dispatch,
            "ll combine": lambda: buf.low_latency_combine(y, idx, w, state["out"][2])}


def _rank(rank, n, mode, tokens, hidden, experts, topk, calls, elastic):
    x, idx, w = random_routed_inputs(tokens, hidden, experts, topk, seed=1234 + rank)
    x = x.bfloat16()
    if mode == "ll":
        buf = moe_comm.Buffer(None, 1 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
            tokens, hidden, n, experts), low_latency_mode=True, timeout_s=60, elastic=elastic)
        return _timed(buf, _ll_ops(buf, x, idx, w, experts), calls)
    buf = moe_comm.Buffer(None, 64 << 20, timeout_s=60, elastic=elastic)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)

    def dispatch():
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    out = dispatch()
    y, handle = out[0], out[4]
    ops = {"dispatch": dispatch, "combine": lambda: buf.combine(y, handle),
           "cached dispatch": lambda: buf.dispatch(x, handle=handle)}
    return _timed(buf, ops, calls)


def _timed(buf, ops, calls):
    for fn in ops.values():          # warm up (both buffers of the calls that alternate)
        fn()
        fn()
    result = {name: _per_call(fn, calls) for name, fn in ops.items()}
    buf.destroy()
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["normal", "ll"], default="normal")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--elastic", action="store_true", help="an elastic Buffer (shrink mode)")
    a = p.parse_args(argv)
    results = run_ranks(_rank, a.ranks, a.mode, a.tokens, a.hidden, a.experts, a.topk, a.calls,
                        a.elastic, timeout=600)
    print(f"{a.ranks} ranks, {a.tokens} tokens of H={a.hidden} "
          f"{'bf16' if a.mode == 'normal' else 'fp8, low-latency'}, top-{a.topk} of "
          f"{a.experts} experts, {a.calls} calls back to back (us per call):")
    for name in results[0]:
        wall = max(r[name][0] for r in results)
        cpu = sum(r[name][1] for r in results) / len(results)
        print(f"  {name:16s} wall {wall:8.1f}   CPU per rank {cpu:8.1f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
