"""IBGDA: GPU threads post RDMA writes and signals themselves through NVSHMEM's device API
(device side in csrc/ibgda; design and limits in csrc/ibgda/README.md). This package is the
host side.

- ``bases``     the ``bases`` words that tell kernels how each rank is reached (pure)
- ``path``      whether a CUDA group takes IBGDA, the host proxy or plain IPC, and its
                buffers in the NVSHMEM symmetric heap (real, or the emulator's)
- ``runtime``   init_nvshmem over a torch.distributed group, symmetric buffers, cubin loading
                with library_init, finalize (GPU)

The nvcc build of the IBGDA kernels is in moe_comm/jit/nvcc.py, the two-rank selftest in
moe_comm/testing/ibgda_selftest.py. Importing the package needs neither a GPU, nor NVSHMEM,
nor cuda.core.
"""
from ..jit.toolchain import NvshmemNotFoundError, nvshmem_install
from .bases import NETWORK_TAG, decode_base, encode_bases, network_ranks
from .runtime import (CommBuffers, NvshmemContext, NvshmemUnavailableError, NvshmemVersionError,
                      cuda_device_count, exchange_unique_id, init_nvshmem, rdma_devices)

__all__ = ["NETWORK_TAG", "decode_base", "encode_bases", "network_ranks", "CommBuffers",
           "NvshmemNotFoundError", "nvshmem_install", "NvshmemContext",
           "NvshmemUnavailableError", "NvshmemVersionError", "cuda_device_count",
           "exchange_unique_id", "init_nvshmem", "rdma_devices"]
