"""IBGDA on hardware: two ranks (spawned processes) initialise NVSHMEM over a gloo group,
allocate a symmetric buffer, load the selftest cubin (nvcc + libnvshmem_device, library_init)
and drive the kernels' Transport: put + signal, a ping-pong, the remote-read fallback and a
deadline that must expire with the silent rank named (moe_comm/testing/ibgda_selftest.py).

* ``test_round_trip_over_the_nic`` needs a CUDA GPU **and** an RDMA NIC (IB or RoCE,
  ConnectX-class for IBGDA): ``NVSHMEM_DISABLE_P2P=1`` sends even same-node traffic through the
  NIC, ``NVSHMEM_IB_ENABLE_IBGDA=1`` makes the GPU post it. No machine of this project has a NIC
  (CI: no GPU; the lent GPU machines: no NIC), so it skips everywhere here.
* ``test_round_trip_over_p2p`` needs only a GPU: the same kernels with the peer reached by
  pointer (nvshmem_ptr), which checks init, the symmetric heap, library_init and the wait
  path. With one GPU both PEs share it (NVSHMEM "limited MPG" without MPS).

Both skip, with the reason, without a GPU, nvshmem4py or the NVSHMEM wheel.
"""
from __future__ import annotations

import pytest

from moe_comm.ibgda import runtime


def _missing_gpu_stack():
    return runtime.missing_stack()


def _run(force_network: bool):
    from cuda_cases import outer_timeout      # capped by MOE_COMM_TEST_TIMEOUT_S
    from moe_comm.testing import ibgda_selftest as selftest
    reports = selftest.run(force_network=force_network, iters=200,
                           timeout_s=outer_timeout(300))
    for r in reports:
        print({k: v for k, v in r.items() if k != "env"})
    problems = selftest.check(reports, expect_network=force_network)
    assert not problems, "\n".join(problems)
    return reports


def test_round_trip_over_the_nic():
    why = _missing_gpu_stack()
    if why is None and not runtime.rdma_devices():
        why = ("no RDMA NIC (/sys/class/infiniband is empty): IBGDA needs an IB/RoCE NIC; no "
               "machine of this project has one")
    if why:
        pytest.skip(why)
    reports = _run(force_network=True)
    print(f"IBGDA ping-pong: {reports[0]['pingpong_us_per_round_trip']:.2f} us per round "
          f"trip ({reports[0]['device']})")


def test_round_trip_over_p2p():
    why = _missing_gpu_stack()
    if why:
        pytest.skip(why)
    _run(force_network=False)
