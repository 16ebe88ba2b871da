#!/usr/bin/env python3
"""host_loops: the host backend's per-byte loops, in C (csrc/host/host_ops.c) and in torch
(the code the C stands in for), one process, one thread, the same random data.

    python bench/host_loops.py            # H=7168: the fp8 cast, LL and normal combine sums

Prints one line per implementation (ms per call, median of 20) and a copy of the same rows
for scale. docs/PERF.md (session 11) has a run.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_comm.host import native, reduce  # noqa: E402
from moe_comm.quant import quantize_fp8  # noqa: E402

HIDDEN, TOKENS, TOPK, CALLS = 7168, 128, 8, 20


def ms_per_call(fn) -> float:
    fn()
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    msgs = torch.empty(TOKENS, HIDDEN + HIDDEN // 32, dtype=torch.uint8)
    n = TOKENS * TOPK                       # LL combine: one row per (token, slot)
    rows = torch.randn(n, HIDDEN, generator=g).bfloat16()
    tok = torch.randperm(n, generator=g) // TOPK
    w = torch.rand(n, generator=g)
    out = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
    # normal combine: two sources' rows for 1024 tokens, 900 each
    segs = [torch.randn(900, HIDDEN, generator=g).bfloat16() for _ in range(2)]
    ids = [torch.randperm(1024, generator=g)[:900].sort().values for _ in range(2)]
    if native.library() is None:
        print("no C library here (no compiler, or MOE_COMM_HOST_NATIVE=0): torch only")
    for flag, name in (("1", "C"), ("0", "torch")):
        os.environ[native.ENV] = flag
        if native.library() is None and flag == "1":
            continue
        cast = (lambda: native.quantize_fp8(x, False, msgs)) if flag == "1" else \
            (lambda: quantize_fp8(x))
        times = [ms_per_call(cast),
                 ms_per_call(lambda: reduce.weighted_sum_rows(rows, tok, w, out)),
                 ms_per_call(lambda: reduce.sum_rows_per_token(segs, ids, 1024, torch.bfloat16))]
        print(f"{name:>5}: fp8 cast {TOKENS}x{HIDDEN} {times[0]:.2f} ms; LL weighted sum "
              f"{n} rows {times[1]:.2f} ms; normal sum 2x900 rows -> 1024 tokens "
              f"{times[2]:.2f} ms")
    os.environ.pop(native.ENV)
    print(f" copy: {n}x{HIDDEN} bf16 rows {ms_per_call(rows.clone):.2f} ms")


if __name__ == "__main__":
    main()
