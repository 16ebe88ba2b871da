"""Settings every test module shares.

The suite's Buffers carry CPU tensors (the host backend, or the CUDA backend's kernels in the
CPU emulator). A Buffer built without ``device=`` serves the current CUDA device wherever CUDA
is available (DeepEP's rule, moe_comm/backend.py ``pick_device``), so on a GPU machine these
tests would build GPU Buffers for CPU tensors: ``MOE_COMM_DEVICE=cpu`` keeps them on the CPU
(inherited by the rank processes). The GPU tests name their device explicitly.
"""
import os

os.environ.setdefault("MOE_COMM_DEVICE", "cpu")
