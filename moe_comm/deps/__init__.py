"""Optional dependencies, each imported in exactly one module of this package, on first use.

Importing moe_comm needs only torch and numpy. The CUDA stack is optional (CPU machines run
the host backend and the kernel emulator), and so is NVSHMEM (IBGDA); these accessors are the
only places that import them, so every other module keeps its imports at the top.

- ``cuda_bindings``  the CUDA driver and NVRTC bindings (``cuda.bindings``), result checking
- ``cuda_core``      cuda.core: compiling, loading and launching kernels
- ``nvshmem``        nvshmem4py (``nvshmem.core``, ``nvshmem.bindings``)
- ``pathfinder``     cuda.pathfinder: where NVIDIA wheels put their headers
"""
