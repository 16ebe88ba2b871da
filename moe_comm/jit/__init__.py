"""Building and launching the kernels of csrc/: no GPU needed to build, none to emulate.

- ``variants``   every kernel variant (source + specialisation macros) and which a call needs
- ``kernel_args``  every kernel's parameter list (names, C types), and packing arguments by name
- ``device_header``  the generated header of csrc/ (wire constants, MOE_ARGS_<kernel> lists)
- ``cache``      the on-disk kernel cache: where it is, keys over the sources, atomic writes
- ``nvrtc``      NVRTC compile to cubin (cuda.core), and loading a variant's kernels on a
                 device (a GPU's, or the emulator's for a CPU device)
- ``nvcc``       nvcc -rdc builds linked against NVSHMEM's device library (the IBGDA kernels)
- ``toolchain``  where nvcc and the NVSHMEM wheel's headers and libraries are
- ``emulator``   the CPU kernel emulator: kernels built with g++ against csrc/emu, run now
- ``launch``     launching a kernel on torch's current stream (or in the emulator)
- ``elf``, ``resources``  reading a cubin: registers, shared memory, undefined symbols, and
                 the check that every kernel can launch at its block size
"""
from .variants import Variant, all_variants

__all__ = ["Variant", "all_variants"]
