"""moe_comm/testing/local_cuda.py, the harness of ranks as threads (the GPU tests and
bench/gpu_check.py run through it): what it reports when a rank meets its deadline, and the
settings that ranks sharing one GPU need, kept the same in the three places that make them."""
import importlib.util
import os
import re
import sys
import threading
import types

import pytest
import torch

import cuda_cases as C
from moe_comm.errors import CommTimeoutError
from moe_comm.testing.local_cuda import SHARED_GPU_ENV, run_local

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _comms(n):
    return [types.SimpleNamespace(rank=r, device=torch.device("cpu"), check=lambda: None)
            for r in range(n)]


def held_in_a_host_call(entered, release):
    """Stands for a host call that waits for the device (a cudaMalloc beside a spinning
    kernel, on the first GPU run): the name the report must show."""
    entered.set()
    release.wait(30)


def test_a_rank_at_its_deadline_reports_where_its_peers_are_held():
    entered, release = threading.Event(), threading.Event()

    def body(comm):
        if comm.rank == 1:
            held_in_a_host_call(entered, release)
            return "late"
        assert entered.wait(30)
        try:
            raise CommTimeoutError("dispatch/notify", [1], 10.0)
        finally:           # rank 0's stacks are taken in run_local's handler, before this
            threading.Timer(0.5, release.set).start()

    with pytest.raises(CommTimeoutError) as info:
        run_local(body, _comms(2), timeout=60)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "(rank 0 of 2)" in note
    assert "-- rank 1 was still at:" in note
    assert "held_in_a_host_call" in note and "release.wait(30)" in note


def test_other_errors_carry_no_stacks():
    def body(comm):
        if comm.rank == 0:
            raise ValueError("bad argument")
        return comm.rank

    with pytest.raises(ValueError) as info:
        run_local(body, _comms(2), timeout=60)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "(rank 0 of 2)" in note and "was still at" not in note


def test_the_shared_gpu_settings_agree_everywhere():
    """tests/conftest.py sets them before torch is imported and bench/gpu_check.py passes them
    to its steps; neither may import moe_comm for them, so each holds a copy."""
    conftest = open(os.path.join(ROOT, "tests", "conftest.py")).read()
    found = dict(re.findall(r'os\.environ\.setdefault\("(\w+)", "([^"]+)"\)', conftest))
    assert {k: found.get(k) for k in SHARED_GPU_ENV} == SHARED_GPU_ENV
    spec = importlib.util.spec_from_file_location(
        "gpu_check_env", os.path.join(ROOT, "bench", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_check          # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    assert gpu_check.EAGER == SHARED_GPU_ENV


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 32])
def test_the_gpu_tests_cases_fit_their_buffers_at_every_rank_count(n):
    """The first GPU run lost its 16-rank LL case to a count above the buffer's tokens: every
    case the GPU tests build is checked here at every rank count they run."""
    for case in C.ll_cases(n):
        assert len(case["tokens"]) == n and max(case["tokens"]) <= case["max_tokens"], case
    for case in C.normal_cases(n):
        assert len(case["tokens"]) == n and case["topk"] <= case["experts"], case
        assert not case["worst"] or case["worst"] >= sum(case["tokens"]), case
