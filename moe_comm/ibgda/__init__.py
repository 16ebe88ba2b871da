"""IBGDA transport: GPU threads post RDMA writes and signals themselves through NVSHMEM's
device API (csrc/ibgda; design and limits in csrc/ibgda/README.md).

Modules, one job each:

- ``bases``     the ``bases`` words that tell kernels how each rank is reached (pure)
- ``locate``    the NVSHMEM wheel's headers/libs/version and nvcc (no GPU)
- ``build``     nvcc -rdc + device link against libnvshmem_device.a -> cubin, disk cache (no GPU;
                the link check reads the cubin with moe_comm/cuda/elf.py)
- ``runtime``   init_nvshmem over a torch.distributed group, symmetric buffers, cubin loading
                with library_init, finalize (GPU)
- ``selftest``  two-rank put/signal round trip, ping-pong latency, timeout (GPU + RDMA NIC)

Importing the package needs neither a GPU, nor NVSHMEM, nor cuda.core.
"""
from .bases import NETWORK_TAG, decode_base, encode_bases, network_ranks
from .build import (IbgdaBuildError, Program, build_cubin, kernel_program,
                    selftest_program)
from .locate import NvshmemNotFoundError, nvshmem_install
from .runtime import (CommBuffers, NvshmemContext, NvshmemUnavailableError, NvshmemVersionError,
                      cuda_device_count, exchange_unique_id, init_nvshmem, rdma_devices)

__all__ = ["NETWORK_TAG", "decode_base", "encode_bases", "network_ranks", "IbgdaBuildError",
           "Program", "build_cubin", "kernel_program", "selftest_program", "CommBuffers",
           "NvshmemNotFoundError", "nvshmem_install", "NvshmemContext",
           "NvshmemUnavailableError", "NvshmemVersionError", "cuda_device_count",
           "exchange_unique_id", "init_nvshmem", "rdma_devices"]
