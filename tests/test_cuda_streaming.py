"""A batch larger than the buffer streams through it on the CUDA backend (normal mode), on the
CPU kernel emulator (moe_comm/jit/emulator.py); the checks are tests/cuda_stream_cases.py,
which tests/test_cuda_gpu.py runs on a GPU."""
from __future__ import annotations

import pytest
import torch

import cuda_stream_cases as S

pytestmark = pytest.mark.skipif(
    not __import__("moe_comm.jit.emulator", fromlist=["available"]).available(),
    reason="the kernel emulator needs a C++ compiler (g++)")

CPU = torch.device("cpu")


def test_a_batch_larger_than_the_buffer_streams_exactly():
    S.check_streams_exactly(2, CPU)


def test_three_ranks_stream_exactly():
    """fp8 on skewed routing, -1 slots with a rank of no tokens, one batch that fits: three
    rank threads take twice as long on the loaded 2-core machine, so not every case."""
    S.check_streams_exactly(3, CPU, S.stream_cases(3)[1:3] + S.stream_cases(3)[4:])


def test_a_row_larger_than_half_the_buffer_is_refused_on_every_rank():
    S.check_row_too_big_refused_everywhere(2, CPU)


@pytest.mark.parametrize("failing_round", [0, 1])
@pytest.mark.parametrize("lag_s", [0.0, 2.0])
def test_a_rank_failing_mid_stream_fails_its_peer_at_once(failing_round, lag_s):
    """lag_s: the peer reaches that round late, after the failed rank has run through the
    rounds after it (its failure marks of the round overwritten by later ones)."""
    S.check_failure_mid_stream_fails_peers_at_once(CPU, failing_round, lag_s)


def test_a_mismatch_mid_stream_leaves_the_buffer_usable():
    S.check_mismatch_mid_stream_leaves_the_buffer_usable(CPU)


def test_elastic_survivors_stream_without_a_silent_rank():
    S.check_elastic_survivors_stream(CPU)
