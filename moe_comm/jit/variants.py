"""Every kernel variant the CUDA backend can request, and which one a call needs.

A variant is one NVRTC program: a source file of ``csrc/kernels`` compiled with a set of
``-D`` specialisation macros (plus each kernel's block size, :data:`THREADS`); it holds one or
more ``extern "C"`` kernels. The host picks the
variant from the call's shape, so the device code stays free of run-time branching on those
parameters:

=====================  ==========================================  ========================
source                 macros                                      kernels
=====================  ==========================================  ========================
intranode.cu           (none: one program for every group size)    layout, notify, wait,
                                                                   normal dispatch/combine,
                                                                   elastic mask agreement
ll.cu                  MOE_HIDDEN, MOE_FP8, MOE_ROUND_SCALE         LL dispatch send, wait
ll.cu                  MOE_HIDDEN, MOE_FP8, MOE_UE8M0               LL dispatch receive, call
                                                                   check, wait
ll.cu                  MOE_HIDDEN                                  LL combine send/receive,
                                                                   wait
=====================  ==========================================  ========================

The rank count is a run-time argument of every kernel (``num_ranks``): a group of any size
up to :data:`MAX_RANKS` runs the same programs. What the device code sizes by rank (shared
per-rank tables, the elastic mask words, the error word's rank flags) is bounded by
``kMaxRanks`` = MAX_RANKS (moe_generated.cuh), and the kernels that keep one thread per rank
(the signal waits, the agreement) are launched with at least MAX_RANKS threads.

ll.cu holds every low-latency entry but compiles only those of the kernels a variant lists
(each entry is guarded by its ``MOE_THREADS_<KERNEL>`` bound, which :func:`thread_defines`
defines for exactly those kernels), so the three LL programs stay as small as three files were.

``MOE_HIDDEN`` is the hidden size for the sizes models use (:data:`SPECIALISED_HIDDEN`, the
128-channel loops unroll), and ``0`` for every other hidden size (read at run time). So the set
of variants is finite and :func:`all_variants` lists all of it: CI compiles each one.
"""
from __future__ import annotations

from dataclasses import dataclass

EXPERTS_PER_LAYOUT_BLOCK = 1024      # experts per block of the layout kernel's histograms
# Ranks of one CUDA group at most (on one host or across hosts). A compile-time bound, not a
# variant: per-rank shared tables are sized by it (256 of them fit the 48 KiB of static shared
# memory a block may have: the largest, dispatch send's, takes about 15 KiB).
MAX_RANKS = 256
SPECIALISED_HIDDEN = (1024, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
GENERIC_HIDDEN = 0

INTRANODE_KERNELS = ("moe_layout", "moe_notify", "moe_wait_done", "moe_dispatch_send",
                     "moe_dispatch_copy_out", "moe_combine_send", "moe_combine_stage",
                     "moe_combine_reduce_bf16",
                     "moe_combine_reduce_f16", "moe_combine_reduce_f32", "moe_agree",
                     "moe_relay_stage", "moe_relay_forward", "moe_relay_ranges",
                     "moe_relay_reduce_bf16", "moe_relay_reduce_f16", "moe_relay_reduce_f32")

# Threads per block of every kernel: the one definition of a kernel's block size. The launch
# sites (cuda/normal.py, ll.py, elastic.py, testing/ibgda_selftest.py) launch with THREADS[name],
# and every build (NVRTC, the nvcc/NVSHMEM build, the emulator) compiles the kernel with
# __launch_bounds__(MOE_THREADS_<NAME>) of the same number (:func:`thread_defines`), so the
# compiler keeps each kernel within the registers a block that size can have (65,536 per
# block on sm_90/sm_100: at most 128 per thread at 512 threads). tests/test_kernel_resources.py
# reads what each compiled kernel uses back from the cubins.
THREADS = {
    # normal mode and layout (intranode.cu): one warp per token / row
    "moe_layout": 512, "moe_dispatch_send": 512, "moe_dispatch_copy_out": 512,
    "moe_combine_send": 512, "moe_combine_stage": 512,
    # fp32 reduce: one block per token, 16-byte vectors across the block
    "moe_combine_reduce_bf16": 256, "moe_combine_reduce_f16": 256,
    "moe_combine_reduce_f32": 256,
    # hierarchical normal mode (relay.cuh): one warp per row; the relay's sum one block a row;
    # the forward at 256 threads: at 512 (128 registers a thread) the NVSHMEM build spills
    "moe_relay_stage": 512, "moe_relay_forward": 256, "moe_relay_ranges": 512,
    "moe_relay_reduce_bf16": 256, "moe_relay_reduce_f16": 256, "moe_relay_reduce_f32": 256,
    # signal waits: one thread per rank (each wait has its own deadline, side by side: a
    # thread serving several ranks would wait out one deadline per silent rank in turn)
    "moe_notify": MAX_RANKS, "moe_wait_done": MAX_RANKS, "moe_ll_wait": MAX_RANKS,
    # call signature check of a low-latency dispatch: one thread per source
    "moe_ll_check_call": MAX_RANKS,
    # elastic mask agreement: one thread per rank
    "moe_agree": MAX_RANKS,
    # low latency: one block per expert, one warp per (token, slot) in send; the fp8 cast
    # before it one block per token, one warp per 128-channel block
    "moe_ll_quantize": 256, "moe_ll_dispatch_send": 512, "moe_ll_dispatch_recv": 256,
    "moe_ll_combine_send": 256, "moe_ll_combine_recv": 256,
    # csrc/ibgda/selftest.cu: one warp
    "moe_ibgda_test_send": 32, "moe_ibgda_test_wait": 32, "moe_ibgda_test_wait_remote": 32,
    "moe_ibgda_test_pingpong": 32,
}


def threads_macro(kernel: str) -> str:
    """``moe_dispatch_send`` -> ``MOE_THREADS_DISPATCH_SEND`` (the kernel's launch bound)."""
    return "MOE_THREADS_" + kernel.removeprefix("moe_").upper()


def thread_defines(kernels) -> tuple:
    """The ``(macro, threads)`` pairs a program holding ``kernels`` is compiled with."""
    return tuple(sorted((threads_macro(k), THREADS[k]) for k in kernels))


@dataclass(frozen=True)
class Variant:
    """One program: ``source`` compiled with ``defines`` (sorted ``(name, value)`` pairs)."""

    source: str
    defines: tuple
    kernels: tuple

    @property
    def label(self) -> str:
        macros = ",".join(f"{k[4:].lower()}={v}" for k, v in self.defines
                          if not k.startswith("MOE_THREADS_"))
        return f"{self.source}[{macros}]"


def _variant(source, kernels, **defines) -> Variant:
    shape = tuple((f"MOE_{k.upper()}", int(v)) for k, v in defines.items())
    return Variant(source, tuple(sorted(shape + thread_defines(kernels))), tuple(kernels))


def hidden_key(hidden: int) -> int:
    """The MOE_HIDDEN a call with ``hidden`` channels uses."""
    return hidden if hidden in SPECIALISED_HIDDEN else GENERIC_HIDDEN


def check_num_ranks(num_ranks: int) -> None:
    """Raise ValueError unless a CUDA group of ``num_ranks`` ranks can run (1..MAX_RANKS)."""
    if not 1 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"the CUDA backend runs groups of 1..{MAX_RANKS} ranks, got "
                         f"{num_ranks}")


def intranode() -> Variant:
    """The normal-mode program (every group size: the rank count is a kernel argument)."""
    return _variant("intranode.cu", INTRANODE_KERNELS)


def ll_dispatch_send(hidden: int, use_fp8: bool, round_scale: bool) -> Variant:
    kernels = ("moe_ll_quantize",) if use_fp8 else ()
    return _variant("ll.cu", kernels + ("moe_ll_dispatch_send", "moe_ll_wait"),
                    hidden=hidden_key(hidden), fp8=use_fp8, round_scale=use_fp8 and round_scale)


def ll_dispatch_recv(hidden: int, use_fp8: bool, use_ue8m0: bool) -> Variant:
    return _variant("ll.cu", ("moe_ll_dispatch_recv", "moe_ll_check_call", "moe_ll_wait"),
                    hidden=hidden_key(hidden), fp8=use_fp8, ue8m0=use_fp8 and use_ue8m0)


def ll_combine(hidden: int) -> Variant:
    return _variant("ll.cu", ("moe_ll_combine_send", "moe_ll_combine_recv", "moe_ll_wait"),
                    hidden=hidden_key(hidden))


def all_variants() -> list:
    """Every variant any call can request: 1 intranode + 10 hidden keys x 7 LL programs (none
    depends on the group size)."""
    out = [intranode()]
    for hidden in (GENERIC_HIDDEN,) + SPECIALISED_HIDDEN:
        for fp8, round_scale in ((False, False), (True, False), (True, True)):
            out.append(ll_dispatch_send(hidden, fp8, round_scale))
        for fp8, ue8m0 in ((False, False), (True, False), (True, True)):
            out.append(ll_dispatch_recv(hidden, fp8, ue8m0))
        out.append(ll_combine(hidden))
    return out
