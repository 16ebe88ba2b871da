"""Ranks on separate hosts: two network namespaces joined by veth links (moe_comm.testing.netns), two
ranks in each. Ranks of one host share memory; across hosts the host backend goes through the
host proxy over TCP (moe_comm.transport). Normal and low-latency dispatch/combine are checked
against the reference exactly as on one host, and a host whose ranks are killed is reported
(or, in elastic mode, masked) within the deadline.

Every test runs on both backends: the host backend, and the CUDA backend (its kernels in the
CPU kernel emulator), whose kernels reach the other host through their command ring and the
kernel proxy thread (csrc/kernels/proxy_ring.cuh, moe_comm/cuda/kernel_proxy.py) on the same TCP
transport.
"""
from __future__ import annotations

import io
import os
import signal
import time

import pytest
import torch

import moe_comm
from moe_comm.testing import netns
from moe_comm.jit import emulator
from moe_comm.quant import quantize_fp8
from checks import check_ll, check_normal
from test_low_latency import _cases as ll_cases
from test_low_latency import _run as ll_run
from test_normal_mode import _cases as normal_cases
from test_normal_mode import _run_cases as normal_run

HOSTS, PER_HOST = 2, 2
N = HOSTS * PER_HOST

WHY_NOT = netns.available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")
TCP = {"MOE_COMM_TRANSPORT": "tcp"}


@pytest.fixture(params=["host", "cuda_emulated"])
def env(request):
    """The ranks' environment: MOE_COMM_CPU_BACKEND=emulator makes their CPU Buffers drive
    the CUDA backend."""
    if request.param == "host":
        return TCP
    if not emulator.available():
        pytest.skip("the kernel emulator needs a C++ compiler (g++)")
    import cuda_cases
    hiddens = {c["hidden"] for c in ll_cases(N)[:4]} | {128}
    cuda_cases.preload("cpu", N, hiddens, ll=True)   # built before any rank's deadline runs
    return {**TCP, "MOE_COMM_CPU_BACKEND": "emulator"}


def _path(rank, n):
    """Which backend this rank's Buffer drives, and which ranks it reaches by proxy."""
    buf = moe_comm.Buffer(None, 1 << 20)
    proxy = getattr(buf._comm, "proxy", None)
    proxied = sorted(proxy.mirrors) if proxy is not None else \
        sorted(buf._comm.remote_ranks) if hasattr(buf._comm, "remote_ranks") else None
    kind = type(buf._be).__name__
    # DeepEP's num_tokens_per_rdma_rank: tokens that go to each host at least once
    idx = torch.tensor([[0, 1], [0, 4 * PER_HOST], [4 * PER_HOST + 1, -1], [-1, -1]])
    per_host = buf.get_dispatch_layout(idx, 4 * n)[1]
    buf.destroy()
    return kind, proxied, per_host.tolist()


def _both_modes(rank, n, normal, ll):
    blob = io.BytesIO()           # torch.save: fp8 and shared-memory tensors round-trip
    torch.save((_path(rank, n), normal_run(rank, n, normal), ll_run(rank, n, ll)), blob)
    return blob.getvalue()


def test_dispatch_combine_across_hosts_match_reference(env):
    normal = normal_cases(N)[::3]
    ll = ll_cases(N)[:4]
    blobs = netns.run_on_hosts(_both_modes, HOSTS, PER_HOST, normal, ll, timeout=300, env=env)
    results = [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]
    kind = "CudaBackend" if "MOE_COMM_CPU_BACKEND" in env else "HostBackend"
    for r, (path, _, _) in enumerate(results):        # the other host's ranks, by proxy
        other = [p for p in range(N) if p // PER_HOST != r // PER_HOST]
        assert path == (kind, other, [2, 2]), (r, path)
    check_normal(N, normal, [r[1] for r in results])
    check_ll(N, ll, [r[2] for r in results], quantize_fp8)


def _killed_host(rank, n, elastic):
    buf = moe_comm.Buffer(None, 16 << 20, timeout_s=2.0, elastic=elastic)
    torch.manual_seed(rank)
    x = torch.randn(16, 128).bfloat16()
    idx = torch.stack([torch.randperm(4 * n)[:2] for _ in range(16)])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4 * n)
    if rank // PER_HOST == 1:                   # the whole second host goes away
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert)
        outcome = buf.active_ranks.tolist()
    except moe_comm.CommTimeoutError as e:
        outcome = sorted(e.silent_ranks)
    return outcome, time.monotonic() - t0


@pytest.mark.parametrize("elastic", [False, True])
def test_a_dead_host_is_reported_within_the_deadline(env, elastic):
    dead = {PER_HOST, PER_HOST + 1}
    with netns.Hosts(HOSTS) as hosts:
        results = hosts.run(_killed_host, PER_HOST, elastic, expect_exit={1}, timeout=60,
                            env=env)
    for r in range(PER_HOST):
        outcome, elapsed = results[r]
        assert outcome == ([1, 1, 0, 0] if elastic else sorted(dead)), (r, outcome)
        assert elapsed < 2.0 + 3.0, (r, elapsed)
