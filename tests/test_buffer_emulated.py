"""The Buffer API on the CUDA backend, without a GPU: MOE_COMM_CPU_BACKEND=emulator makes a
CPU Buffer drive the CUDA backend (moe_comm/backend.py CudaBackend, moe_comm/cuda/*.py) with
its kernels in the CPU kernel emulator, ranks as real processes mapping each other's buffers
(/dev/shm standing in for CUDA IPC). The cases and rank bodies are the host backend's Buffer
tests (test_normal_mode.py, test_low_latency.py), so both backends answer the same calls the
same way: layout, dispatch with and without a cached handle, num_worst_tokens, expert
alignment, bias, combine; LL with hooks, FP8/UE8M0, zero-copy and out= combine, stats."""
from __future__ import annotations

import pytest

import cuda_cases
import test_low_latency as LL
import test_cuda_gpu as GPU
import test_normal_mode as NM
from checks import check_ll, check_normal
from moe_comm.jit import emulator
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not emulator.available(),
                                reason="the kernel emulator needs a C++ compiler (g++)")


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    monkeypatch.setenv("MOE_COMM_CPU_BACKEND", "emulator")   # inherited by the forked ranks


def _uses_cuda_backend(rank, n):
    import moe_comm
    buf = moe_comm.Buffer(None, 1 << 20)
    kind = type(buf._be).__name__
    buf.destroy()
    return kind


@pytest.mark.parametrize("n", [2, 3])
def test_normal_mode_through_buffer(n):
    assert run_ranks(_uses_cuda_backend, n, timeout=60) == ["CudaBackend"] * n
    cases = NM._cases(n)[::3]
    cuda_cases.preload("cpu", n)
    check_normal(n, cases, run_ranks(NM._run_cases, n, cases, timeout=300))


@pytest.mark.parametrize("n", [2, 4])
def test_low_latency_through_buffer(n):
    cases = LL._cases(n)
    cuda_cases.preload("cpu", n, {c["hidden"] for c in cases}, ll=True)
    check_ll(n, cases, run_ranks(LL._run, n, cases, timeout=300), cuda_cases.kernel_quantize)


def test_low_latency_hooks_through_buffer():
    cuda_cases.preload("cpu", 2, {256}, ll=True)
    for errors, ok, _ in run_ranks(LL._hooks, 2, timeout=120):
        assert ok
        assert "two low-latency dispatch calls are already in flight" in errors[0]
        assert "has not received yet" in errors[1]
        assert "already ran" in errors[2]


def test_gpu_buffer_round_on_the_emulator():
    """The Buffer-level rank body of the GPU checks (tests/test_cuda_gpu.py: a gloo-group
    Buffer, two hosts through the kernel proxy) and its reference checks, run here so the
    first GPU run does not find a mistake in the test itself."""
    n = len(GPU.BUF_CASE["tokens"])
    cuda_cases.preload("cpu", n, {GPU.BUF_CASE["hidden"]}, ll=True)
    GPU._check_buffer_rounds(run_ranks(GPU._buffer_round, n, "cpu", "cpu", timeout=300))
