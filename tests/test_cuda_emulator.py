"""The CUDA backend - csrc/kernels and moe_comm/cuda/*.py - on the CPU kernel emulator
(moe_comm/jit/emulator.py), checked against moe_comm.reference with the GPU tests' cases
(tests/cuda_cases.py). Runs wherever a C++17 compiler is; the GPU remains the judge of what
the emulator does not model (csrc/emu/cuda_emu.h: warp-synchronous code, weak ordering).

The 8-, 12- and 40-rank groups run a subset of the cases to keep the suite fast; every kind of
case still runs on 2-4 ranks."""
from __future__ import annotations

import pytest
import torch

import cuda_cases as C
import cuda_fault_cases as F

pytestmark = pytest.mark.skipif(
    not __import__("moe_comm.jit.emulator", fromlist=["available"]).available(),
    reason="the kernel emulator needs a C++ compiler (g++)")

CPU = torch.device("cpu")


def _subset(cases, step):
    return cases[::step]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_normal_dispatch_combine_match_reference(n):
    cases = C.normal_cases(n)
    C.check_normal_group(n, CPU, cases if n <= 4 else _subset(cases, 4))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_low_latency_matches_reference(n):
    cases = C.ll_cases(n)
    C.check_ll_group(n, CPU, cases if n <= 4 else _subset(cases, 2))


# A group above 8 ranks: the same programs as every other size (the rank count is a kernel
# argument). 12 ranks are 12 rank threads on CI's 2 cores, so small cases only: every other
# normal case of hidden 128 (fp32 random / holes / one rank, fp16 with num_worst_tokens and
# bias) and the two smallest LL cases (bf16 128, fp8 256): about 30 s + 10 s.
ABOVE_EIGHT = 12


def test_normal_group_above_eight_ranks_matches_reference():
    n = ABOVE_EIGHT
    C.check_normal_group(n, CPU, _subset([c for c in C.normal_cases(n) if c["hidden"] == 128], 2))


def test_low_latency_group_above_eight_ranks_matches_reference():
    C.check_ll_group(ABOVE_EIGHT, CPU, C.ll_cases(ABOVE_EIGHT)[:2])


# More ranks than a warp has lanes: the one-thread-per-rank waits span several warps and
# dispatch send's destination search takes two ballots. 40 rank threads, so a few tokens a
# rank: fp32 random and fp16 with num_worst_tokens (hidden 128), LL bf16 128; about 50 s.
BEYOND_A_WARP = 40


def test_group_beyond_a_warp_of_ranks_matches_reference():
    n = BEYOND_A_WARP
    normal = [c for c in C.normal_cases(n) if c["hidden"] == 128]
    C.check_normal_group(n, CPU, [dict(normal[0], tokens=[4 + r % 3 for r in range(n)]),
                                  dict(normal[-1], tokens=[3 + r % 2 for r in range(n)],
                                       worst=5 * n)])
    ll = C.ll_cases(n)[0]
    C.check_ll_group(n, CPU, [dict(ll, tokens=[min(t, 4) for t in ll["tokens"]])])


@pytest.mark.parametrize("seed", [1, 2])
def test_shuffled_schedules(seed, monkeypatch):
    """The same checks with the block's threads run in a different random order every pass
    (csrc/emu/runtime.cpp): results must not depend on which thread happens to go first."""
    monkeypatch.setenv("MOE_EMU_SCHEDULE_SEED", str(seed))
    C.check_normal_group(3, CPU, _subset(C.normal_cases(3), 3))
    C.check_ll_group(3, CPU, _subset(C.ll_cases(3), 2))


@pytest.mark.parametrize("n", [2, 4])
def test_low_latency_two_in_flight_and_long_runs(n):
    C.check_ll_in_flight(n, CPU)


@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_silent_rank_is_named_not_hung(mode):
    C.check_silent_rank(mode, CPU)


@pytest.mark.parametrize("silent", ["start", "mid_notify", "after_agree"])
def test_elastic_normal_mode_masks_a_silent_rank(silent):
    C.check_elastic_normal(CPU, silent=silent)


def test_elastic_low_latency_masks_a_silent_rank():
    C.check_elastic_ll(CPU)


# ---- error paths and caller tensors (tests/cuda_fault_cases.py) ------------------------------
def test_overflow_fails_every_rank_and_resets_the_block_counters():
    F.check_overflow_fails_every_rank(CPU)


@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_failed_rank_fails_its_peers_at_once(mode, elastic):
    F.check_failed_rank_fails_peers_at_once(CPU, mode, elastic)


def test_low_latency_overflow_on_one_rank_fails_its_peer_at_once():
    F.check_ll_overflow_fails_the_peer_at_once(CPU)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_low_latency_x_and_out_at_any_offset(fp8):
    F.check_ll_views_at_any_offset(CPU, fp8)


def test_ranks_that_disagree_about_a_call_all_raise_and_go_on():
    F.check_mismatch_raises_everywhere_and_the_next_call_works(CPU)


STUCK = r"""
extern "C" __global__ void stuck(unsigned long long* out) {
    // lanes 0-15 wait at the block barrier, lanes 16-31 at a full-mask warp barrier: on a GPU
    // this hangs; the emulator must say so instead
    if (threadIdx.x < 16) __syncthreads(); else __syncwarp();
    out[threadIdx.x] = 1;
}
extern "C" __global__ void racy(unsigned long long* out) {
    __shared__ unsigned long long v;        // zero in a fresh block thread
    if (threadIdx.x == 0) v = 7;
    if (threadIdx.x == 1) out[blockIdx.x] = v;   // no __syncwarp between: a race
}
extern "C" __global__ void fine(unsigned long long* out) {
    __shared__ unsigned long long sum;
    if (threadIdx.x == 0) sum = 0;
    __syncthreads();
    atomicAdd((unsigned*)&sum, 1u + __popc(__ballot_sync(0xffffffffu, threadIdx.x & 1)));
    __syncthreads();
    out[threadIdx.x + 32 * blockIdx.x] = sum;
}
"""


def test_stuck_barrier_is_an_error_not_a_hang(tmp_path):
    from moe_comm.jit import emulator
    src = tmp_path / "stuck.cu"
    src.write_text(STUCK)
    k = emulator.load_library(emulator.build_source(src), ("stuck", "fine"))
    out = torch.zeros(64, dtype=torch.int64)
    emulator.launch_emu(k["fine"], 2, 32, [out.data_ptr()])
    assert out.tolist() == [32 * 17] * 64          # every lane: 1 + popcount of 16 odd lanes
    with pytest.raises(emulator.EmulatorError, match="can never complete"):
        emulator.launch_emu(k["stuck"], 1, 32, [out.data_ptr()])


def test_shuffled_schedule_exposes_a_warp_race(tmp_path, monkeypatch):
    """In thread order lane 0 always writes before lane 1 reads; shuffled, some blocks read
    first - the kind of bug a GPU shows only sometimes."""
    from moe_comm.jit import emulator
    src = tmp_path / "stuck.cu"
    src.write_text(STUCK)
    k = emulator.load_library(emulator.build_source(src), ("racy",))["racy"]
    out = torch.zeros(16, dtype=torch.int64)
    emulator.launch_emu(k, 16, 32, [out.data_ptr()])
    assert out.tolist() == [7] * 16
    monkeypatch.setenv("MOE_EMU_SCHEDULE_SEED", "3")
    emulator.launch_emu(k, 16, 32, [out.data_ptr()])
    assert 0 in out.tolist() and 7 in out.tolist()


# ---- the IBGDA build (MOE_WITH_NVSHMEM) on the emulated NVSHMEM --------------------------------
# Ranks on other emulated hosts are network ranks: messages are built or staged in the sender's
# mirror and put from there by NVSHMEM calls (csrc/emu/nvshmem_emu.h applies a put only at the
# next quiet, reading its source then), so a put no signal's quiet covers, a mirror row reused
# too early or a wrong symmetric offset shows up as wrong or missing rows. `hosts` = n: every
# peer over the network; fewer: a mixed group (peers on the same host by pointer).
@pytest.mark.parametrize("n,hosts", [(3, 3), (4, 2)])
def test_ibgda_build_matches_reference(n, hosts):
    C.check_normal_group(n, CPU, _subset(C.normal_cases(n), 4), network=hosts)
    C.check_ll_group(n, CPU, _subset(C.ll_cases(n), 4), network=hosts)


@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_ibgda_build_names_a_silent_rank(mode):
    C.check_silent_rank(mode, CPU, network=2)


def test_ibgda_build_elastic_masks_a_silent_rank():
    C.check_elastic_normal(CPU, silent="mid_notify", network=2)
