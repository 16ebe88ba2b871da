"""Whether each compiled kernel fits the block it is launched with.

A kernel that asks more of an SM than one block of its size can have does not launch
(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES), and a kernel that spills registers runs slowly. Neither
shows on the CPU kernel emulator, so both are checked from the compiled code:

* in CI, from the cubins (:func:`problems`, moe_comm/jit/elf.py reads them): registers x
  block size within the register file, static shared memory under the limit that needs no
  opt-in, no stack frame beyond :data:`MAX_STACK_BYTES` (spills), and the launch bound the
  kernel was compiled with equal to the block the launch sites use (variants.THREADS);
* on a GPU, when a kernel is loaded (:func:`check_loaded`): the driver's
  ``max_threads_per_block`` for the kernel must cover the block it will be launched with, so
  a kernel that cannot launch fails at load with its name instead of at its first launch.
"""
from __future__ import annotations

from . import elf
from .variants import THREADS

REGISTERS_PER_BLOCK = 65536    # register file one block can use (sm_90 and sm_100)
MAX_REGISTERS_PER_THREAD = 255
REGISTER_GRANULE = 8           # a warp's registers are allocated 256 at a time: 8 per thread
STATIC_SHARED_BYTES = 48 << 10  # more needs dynamic shared memory and an opt-in attribute
MAX_STACK_BYTES = 0            # no kernel needs local memory: a stack frame means spills


class KernelResourceError(RuntimeError):
    """A kernel cannot be launched with the block size the library uses."""


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def problems(cubin: bytes, label: str, kernels, threads_of=THREADS) -> list:
    """What is wrong with ``kernels`` (names) of ``cubin`` (the program ``label``), as
    sentences; empty when every one fits the block it is launched with (``threads_of``)."""
    found = elf.kernel_resources(cubin)
    out = []
    for name in kernels:
        res = found.get(name)
        threads = threads_of[name]
        if res is None:
            out.append(f"{label}: kernel {name} is not in the cubin")
            continue
        regs = _round_up(res.registers, REGISTER_GRANULE)
        if res.registers > MAX_REGISTERS_PER_THREAD or regs * threads > REGISTERS_PER_BLOCK:
            out.append(f"{label}: {name} uses {res.registers} registers per thread; at "
                       f"{threads} threads a block needs {regs * threads} > "
                       f"{REGISTERS_PER_BLOCK} (the launch would fail)")
        if res.shared_bytes > STATIC_SHARED_BYTES:
            out.append(f"{label}: {name} has {res.shared_bytes} bytes of static shared memory "
                       f"> {STATIC_SHARED_BYTES}")
        if res.stack_bytes > MAX_STACK_BYTES:
            out.append(f"{label}: {name} has a {res.stack_bytes}-byte stack frame per thread "
                       f"(register spills or a local array; at most {MAX_STACK_BYTES})")
        if res.max_threads != threads:
            out.append(f"{label}: {name} was compiled for blocks of {res.max_threads or 'any'} "
                       f"threads (__launch_bounds__) but is launched with {threads}")
    return out


def _attribute(kernel, name: str) -> int:
    value = getattr(kernel.attributes, name)
    return int(value() if callable(value) else value)      # a method before cuda.core 0.4


def check_loaded(kernel, name: str) -> None:
    """Raise :class:`KernelResourceError` if the loaded ``kernel`` (cuda.core) cannot run
    blocks of ``THREADS[name]`` threads on this GPU (GPU only)."""
    can = _attribute(kernel, "max_threads_per_block")
    if can < THREADS[name]:
        raise KernelResourceError(
            f"kernel {name} can run at most {can} threads per block on this GPU "
            f"({_attribute(kernel, 'num_regs')} registers per thread, "
            f"{_attribute(kernel, 'local_size_bytes')} bytes of local memory) but is launched "
            f"with {THREADS[name]} (moe_comm/jit/variants.py THREADS)")
