"""Settings every test module shares.

The suite's Buffers carry CPU tensors (the host backend, or the CUDA backend's kernels in the
CPU emulator). A Buffer built without ``device=`` serves the current CUDA device wherever CUDA
is available (DeepEP's rule, moe_comm/backend.py ``pick_device``), so on a GPU machine these
tests would build GPU Buffers for CPU tensors: ``MOE_COMM_DEVICE=cpu`` keeps them on the CPU
(inherited by the rank processes). The GPU tests name their device explicitly.

The GPU tests run ranks as threads sharing one GPU; what that needs of CUDA and torch
(moe_comm/testing/local_cuda.py says why) is set here, before anything imports torch: torch
picks its allocator backend when it is imported, and CUDA reads the other two when it starts.
On a machine without a GPU they change nothing.
"""
import json
import os
import sys

os.environ.setdefault("MOE_COMM_DEVICE", "cpu")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")

# MOE_COMM_FAILURE_PREFIX (bench/gpu_check.py sets it): each failure is also written at once,
# as that prefix and a JSON line, so a run killed at its deadline keeps the failures it had
# (pytest prints their tracebacks only at the end). The first GPU run lost them that way.
FAILURE_PREFIX = os.environ.get("MOE_COMM_FAILURE_PREFIX")


def pytest_runtest_logreport(report):
    if FAILURE_PREFIX and report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = report.longreprtext
        # the head holds the error and its traceback, the tail the notes (a timeout's peer
        # stacks, moe_comm/testing/local_cuda.py): keep both ends of a long one
        if len(text) > 12000:
            text = text[:6000] + "\n[...]\n" + text[-6000:]
        line = json.dumps(dict(kind="test_failure", test=report.nodeid, when=report.when,
                               message=crash.message if crash else "", error=text))
        # one write: another thread's output cannot land inside the line
        sys.stdout.write("\n" + FAILURE_PREFIX + line + "\n")   # its own line, also after -v
        sys.stdout.flush()
