"""CUDA backend: kernels of csrc/kernels compiled at run time with NVRTC (cuda.core) and
launched on torch's current stream; peers of one node reached through CUDA IPC mappings.

Modules, one job each:

- ``variants``  every kernel variant (source + specialisation macros) and which a call needs
- ``compiler``  NVRTC compile to cubin, disk cache keyed on sha256(sources, arch, macros),
                kernel loading (GPU only)
- ``launcher``  cuda.core ``launch`` on torch's current stream, 8-byte argument conversion
- ``comm``      ``CudaComm``: the buffers of a group (IPC or in-process), epochs, error word
- ``normal``    normal-mode dispatch/combine (same signature as moe_comm/host/normal.py)
- ``ll``        low-latency dispatch/combine halves (same signature as moe_comm/host/ll.py)
- ``local``     run a group's ranks as threads of one process (tests, benchmark)

Importing this package needs neither a GPU nor cuda.core; ``compiler.compile_cubin`` needs
cuda.core + the NVRTC wheel but no driver.
"""
from .variants import Variant, all_variants

__all__ = ["Variant", "all_variants"]
