#!/usr/bin/env python3
"""bench_all_to_all: moe_comm dispatch/combine against torch.distributed all_to_all_single
doing the same exchange, and against the machine's copy bandwidth, all in one run.

    python bench/bench_all_to_all.py                     # 4 local CPU ranks, both modes
    python bench/bench_all_to_all.py --mode normal --ranks 2,4 --tokens 256,1024 --json out.json

Normal mode's baseline is all_to_all_single doing the same exchange (permute, exchange counts,
exchange payloads, unpermute). Low-latency mode's baseline is the plain padded exchange a
fixed-shape all_to_all needs without a count exchange: every rank sends each destination
max_tokens x min(top-k, experts per rank) message slots, as pplx-kernels compares.

GB/s follow DeepEP's convention: real payload bytes a rank receives in dispatch (and sends
back in combine) divided by the call's time. ``copy_gbps`` is what one process copies per
second while all ranks copy at once: a copy-based exchange cannot beat it. Times are the
median over iterations of the slowest rank, each iteration started after a barrier.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import moe_comm  # noqa: E402
from moe_comm.launch import run_ranks  # noqa: E402

COLUMNS = ("mode", "ranks", "tokens", "hidden", "topk", "experts", "dtype", "dispatch_us",
           "combine_us", "dispatch_gbps", "combine_gbps", "baseline_dispatch_us",
           "baseline_combine_us", "copy_gbps")


def _timed(fn, iters, repeats=3):
    """Seconds per call of ``fn()`` run ``iters`` times back to back on every rank between
    barriers: the slowest rank's time, median over ``repeats``. Back-to-back calls measure what
    ranks sharing the cores sustain together (per-call timing would let them take turns)."""
    fn()
    per_call = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per_call.append((time.perf_counter() - t0) / iters)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, per_call)
    return statistics.median(max(col) for col in zip(*everyone))


def _inputs(case, rank):
    gen = torch.Generator().manual_seed(1234 + rank)
    t, h, e, k = case["tokens"], case["hidden"], case["experts"], case["topk"]
    x = torch.randn(t, h, generator=gen)
    scores = torch.rand(t, e, generator=gen)
    idx = scores.topk(k, dim=1).indices
    w = torch.rand(t, k, generator=gen)
    if case["dtype"] == "fp8":
        blocks = x.view(t, h // 128, 128)
        s = blocks.abs().amax(-1).clamp(min=1e-4) / 448.0
        x = ((blocks / s.unsqueeze(-1)).view(t, h).to(torch.float8_e4m3fn), s)
    else:
        x = x.to(getattr(torch, case["dtype"]))
    return x, idx, w


def _baseline(x, idx, w, is_token_in_rank, num_tokens_per_rank):
    """The same exchange with all_to_all_single: permute, exchange counts, exchange payloads
    (x, scales, top-k packed into one byte row), unpermute."""
    R = dist.get_world_size()
    data, scales = x if isinstance(x, tuple) else (x, None)
    parts = [data.view(torch.uint8)] + ([scales.view(torch.uint8)] if scales is not None
                                        else []) + [idx.view(torch.uint8), w.view(torch.uint8)]
    rows = torch.cat(parts, 1)
    send_ids = torch.cat([is_token_in_rank[:, d].nonzero().flatten() for d in range(R)])
    state = {}

    def dispatch():
        send = rows.index_select(0, send_ids)
        send_counts = num_tokens_per_rank.long()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        recv = torch.empty(int(recv_counts.sum()), rows.shape[1], dtype=torch.uint8)
        dist.all_to_all_single(recv, send, recv_counts.tolist(), send_counts.tolist())
        n = data.shape[1] * data.element_size()
        state.update(recv_x=recv[:, :n].contiguous().view(data.dtype),
                     recv_counts=recv_counts, send_counts=send_counts)

    def combine(y):
        recv = torch.empty(int(state["send_counts"].sum()), y.shape[1], dtype=y.dtype)
        dist.all_to_all_single(recv.view(torch.uint8), y.view(torch.uint8),
                               state["send_counts"].tolist(), state["recv_counts"].tolist())
        out = torch.zeros(data.shape[0], y.shape[1], dtype=torch.float32)
        out.index_add_(0, send_ids, recv.float())
        return out.to(y.dtype)

    return dispatch, combine


def _copy_gbps(nbytes, iters):
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / _timed(lambda: dst.copy_(src), iters) / 1e9


def _ll_baseline(x, idx, w, num_experts, max_tokens, use_fp8):
    """Padded exchange: fixed [R, slots] message arrays through all_to_all_single."""
    R = dist.get_world_size()
    num_local = num_experts // R
    slots = max_tokens * min(idx.shape[1], num_local)
    valid = idx >= 0
    tok, k = valid.nonzero(as_tuple=True)
    expert = idx[tok, k]
    order = torch.sort(expert, stable=True).indices
    tok, k, expert = tok[order], k[order], expert[order]
    dst = expert // num_local
    pos = torch.arange(tok.numel()) - torch.searchsorted(dst, dst)     # slot within dst
    state = {}

    def dispatch():
        if use_fp8:
            data, scales = moe_comm.quant.quantize_fp8(x)
            msgs = torch.cat([data.view(torch.uint8), scales.view(torch.uint8)], 1)
        else:
            msgs = x.view(torch.uint8)
        send = torch.zeros(R, slots, msgs.shape[1], dtype=torch.uint8)
        meta = torch.full((R, slots, 2), -1, dtype=torch.int64)
        send[dst, pos] = msgs[tok]
        meta[dst, pos, 0] = expert % num_local
        meta[dst, pos, 1] = tok
        recv, rmeta = torch.empty_like(send), torch.empty_like(meta)
        dist.all_to_all_single(recv, send)
        dist.all_to_all_single(rmeta, meta)
        le = rmeta[..., 0].flatten()
        flat = recv.view(R * slots, -1)
        out = torch.empty(num_local, R * max_tokens, msgs.shape[1], dtype=torch.uint8)
        for e in range(num_local):
            rows = (le == e).nonzero().flatten()
            out[e, :rows.numel()] = flat[rows]
        state["rmeta"] = rmeta

    def combine(y):
        # expert outputs go back in the slots they came in, padded the same way
        le = state["rmeta"][..., 0]
        back = torch.zeros(R, slots, y.shape[-1], dtype=torch.bfloat16)
        for e in range(num_local):
            rows = (le.flatten() == e).nonzero().flatten()
            back.view(R * slots, -1)[rows] = y[e, :rows.numel()]
        recv = torch.empty_like(back)
        dist.all_to_all_single(recv, back)
        out = torch.zeros(x.shape[0], y.shape[-1])
        out.index_add_(0, tok, recv[dst, pos].float() * w[tok, k, None])
        return out.bfloat16()

    return dispatch, combine


def _run_ll(rank, n, case, iters):
    e, t, h = case["experts"], case["tokens"], case["hidden"]
    fp8 = case["dtype"] == "fp8"
    buf = moe_comm.Buffer(None, 1 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        t, h, n, e), low_latency_mode=True, timeout_s=120)
    gen = torch.Generator().manual_seed(99 + rank)
    x = torch.randn(t, h, generator=gen).bfloat16()
    idx = torch.rand(t, e, generator=gen).topk(case["topk"], dim=1).indices
    w = torch.rand(t, case["topk"], generator=gen)
    state = {}

    def dispatch():
        state["out"] = buf.low_latency_dispatch(x, idx, t, e, use_fp8=fp8)

    t_dispatch = _timed(dispatch, iters)
    recv_x, recv_count, handle, _, _ = state["out"]
    y = torch.randn(e // n, n * t, h).bfloat16()
    t_combine = _timed(lambda: buf.low_latency_combine(y, idx, w, handle), iters)
    msgs = int(recv_count.sum())
    recv_bytes = msgs * (h + h // 128 * 4 if fp8 else 2 * h)
    combine_bytes = msgs * 2 * h
    buf.destroy()
    return _row("ll", n, case, iters, t_dispatch, t_combine, _ll_baseline(x, idx, w, e, t, fp8),
                y, recv_bytes, combine_bytes)


def _row(mode, n, case, iters, t_dispatch, t_combine, baseline, y, recv_bytes, combine_bytes):
    """Time the baseline and the copy bandwidth in the same run, then build the table row
    (bytes averaged over ranks, times of the slowest rank)."""
    b_dispatch, b_combine = baseline
    t_b_dispatch = _timed(b_dispatch, iters)
    t_b_combine = _timed(lambda: b_combine(y), iters)
    copy = _copy_gbps(max(recv_bytes, 1 << 20), iters)
    stats = [None] * n
    dist.all_gather_object(stats, (recv_bytes, combine_bytes, copy))
    mean = lambda i: sum(s[i] for s in stats) / n  # noqa: E731
    return dict(mode=mode, ranks=n, tokens=case["tokens"], hidden=case["hidden"],
                topk=case["topk"], experts=case["experts"], dtype=case["dtype"],
                dispatch_us=t_dispatch * 1e6, combine_us=t_combine * 1e6,
                dispatch_gbps=mean(0) / t_dispatch / 1e9, combine_gbps=mean(1) / t_combine / 1e9,
                baseline_dispatch_us=t_b_dispatch * 1e6, baseline_combine_us=t_b_combine * 1e6,
                copy_gbps=mean(2))


def _run_normal(rank, n, case, iters):
    e = case["experts"]
    buf = moe_comm.Buffer(None, case["nvl_bytes"], timeout_s=120)
    x, idx, w = _inputs(case, rank)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, e)
    state = {}

    def dispatch():
        state["out"] = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                    num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)

    t_dispatch = _timed(dispatch, iters)
    recv_x, _, recv_w, _, handle, _ = state["out"]
    y = (recv_x[0].float() if isinstance(recv_x, tuple) else recv_x.float()).bfloat16()
    t_combine = _timed(lambda: buf.combine(y, handle), iters)
    recv_bytes = sum(t.numel() * t.element_size()
                     for t in (recv_x if isinstance(recv_x, tuple) else (recv_x,)))
    combine_bytes = y.numel() * y.element_size()
    del state["out"], recv_x, recv_w
    buf.destroy()
    return _row("normal", n, case, iters, t_dispatch, t_combine,
                _baseline(x, idx, w, itr, ntr), y, recv_bytes, combine_bytes)


def _ints(s):
    return [int(v) for v in s.split(",")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="both", choices=["normal", "ll", "both"])
    p.add_argument("--ranks", type=_ints, default=[4], help="comma list, e.g. 2,4")
    p.add_argument("--tokens", type=_ints, default=None,
                   help="tokens per rank, comma list (default: normal 1024, ll 128)")
    p.add_argument("--hidden", type=_ints, default=[7168])
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "fp8"],
                   help="dispatch dtype (default: normal bfloat16, ll fp8; ll combine is bf16)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = p.parse_args(argv)

    rows = []
    print(" ".join(f"{c:>10}" for c in COLUMNS))
    modes = ["normal", "ll"] if args.mode == "both" else [args.mode]
    for mode in modes:
        dtype = args.dtype or ("fp8" if mode == "ll" else "bfloat16")
        if mode == "ll" and dtype == "float32":
            p.error("low-latency mode dispatches bfloat16 or fp8")
        for n in args.ranks:
            for t in args.tokens or ([128] if mode == "ll" else [1024]):
                for h in args.hidden:
                    case = dict(tokens=t, hidden=h, topk=args.topk, experts=args.experts,
                                dtype=dtype)
                    if mode == "normal":
                        elem = 1 if dtype == "fp8" else 4 if dtype == "float32" else 2
                        case["nvl_bytes"] = moe_comm.Buffer.get_normal_buffer_size_hint(
                            t, h, n, args.topk, elem_size=elem, fp8=dtype == "fp8",
                            keep_alive=2)
                    fn = _run_normal if mode == "normal" else _run_ll
                    row = run_ranks(fn, n, case, args.iters, timeout=600)[0]
                    rows.append(row)
                    print(" ".join(f"{row[c]:>10.1f}" if isinstance(row[c], float) else
                                   f"{row[c]:>10}" for c in COLUMNS), flush=True)
    for row in rows:
        print(f"summary {row['mode']} ranks={row['ranks']} tokens={row['tokens']}: dispatch "
              f"{row['baseline_dispatch_us'] / row['dispatch_us']:.1f}x / combine "
              f"{row['baseline_combine_us'] / row['combine_us']:.1f}x faster than "
              f"all_to_all_single; dispatch at {row['dispatch_gbps'] / row['copy_gbps']:.0%} "
              "of copy bandwidth")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
