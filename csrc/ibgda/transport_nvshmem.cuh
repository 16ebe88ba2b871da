// transport_nvshmem.cuh: the remote branch of `Transport` (csrc/kernels/transport.cuh) on
// NVSHMEM's device API, so GPU threads post RDMA writes and signals themselves (IBGDA: the
// NIC's send queues live in GPU memory and a warp rings the doorbell; with IBGDA off, the
// same calls go through NVSHMEM's CPU proxy).
//
// Compiled only when the kernels are built with -DMOE_WITH_NVSHMEM, by nvcc with -rdc=true
// and device-linked against libnvshmem_device.a (moe_comm/jit/nvcc.py). NVRTC cannot build
// it (NVSHMEM's signal entry points mangle differently under NVRTC, and the headers compile
// IBGDA out there): see shared/TOOLING.md.
//
// How a kernel reaches a network rank r (transport.cuh has the whole `bases[]` encoding):
// bases[r] = mirror | 1, where `mirror` is this rank's copy of r's buffer layout, and
// bases[-1] = `sym`, this rank's own buffer. Both lie in the NVSHMEM symmetric heap
// (nvshmem_malloc through nvshmem4py; moe_comm/ibgda/runtime.py comm_buffers): the mirror so
// the NIC may read from it, the own buffer because NVSHMEM names a destination by the
// *symmetric* address, so `sym + offset` on PE r is `offset` of r's buffer. Kernels build or
// copy a message in the mirror at the offset it must land at and put it from there. PE numbers
// are the group's ranks: moe_comm.ibgda.init_nvshmem initialises NVSHMEM over exactly the EP
// group, PE i = group rank i.
//
// Memory ordering (the contract of sync.cuh, carried over the network):
//  * put: nvshmemx_putmem_nbi_warp, the 32 lanes of one warp cooperate (one WQE chain, no
//    wait). The source must be NIC-registered memory: the symmetric heap or a buffer
//    registered with nvshmemx_buffer_register (nvshmem4py register_external_tensor); an
//    unregistered source is an assert in NVSHMEM. Non-blocking: the source must not change
//    until a later quiet, which `signal` performs.
//  * signal: nvshmem_quiet, then nvshmemx_signal_op(SET). The kernels call it from one thread
//    after `__syncthreads()` (or after last_block_arrives), so every put of the block (or
//    grid) has been posted before it. In NVSHMEM's IBGDA implementation
//    quiet (and fence) drain every QP of this PE, not only the calling thread's, so it covers
//    those puts: once it returns they are delivered at the target and their sources are free
//    (quiet is completion, fence only ordering; quiet also makes the kernel's end a safe point
//    for the caller to overwrite the inputs). The signal then lands after the payload.
//  * wait: only ever on *local* words that the peer pushed (Transport::poll_local/wait_local
//    in transport.cuh). The word is polled with ld.acquire.sys under a %globaltimer deadline
//    (NVSHMEM's wait_until has none); when the awaited epoch shows, `consistent` below runs
//    NVSHMEM's target-side consistency step (NIC writes reach GPU memory over PCIe, possibly
//    relaxed ordered: NVSHMEM flushes before the payload may be read). A silent rank is
//    reported through the kernels' ErrorSink (or masked, elastic).
//  * liveness: the kernels' waits all have deadlines, but nvshmem_quiet has none, and it
//    drains every queue of this PE. A peer that is slow or gone but whose queue pair is still
//    healthy costs nothing here (puts complete at the NIC); a queue pair in error (a dead
//    peer's NIC, a cut link) is NVSHMEM's to handle, and it may stall or assert in the quiet.
//    So elastic masking on this path covers late and silent ranks, not a failing NIC path.
//    Cost: one full drain per signal; ordering each signal behind its own destination's
//    payload (put_signal, or a per-destination fence) would avoid it.
//  * remote read (read_signal of a network peer): RDMA has no cheap remote load. It is served
//    by nvshmem_ulonglong_g (one blocking RDMA read per poll, with a back-off between polls);
//    no mode kernel reads a peer's memory (flow control is pushed, csrc/ibgda/README.md).
//  * mirror reuse: a put's source (a mirror row) is rewritten only by a later call, after this
//    rank signalled that destination at least once more, and every signal starts with a quiet
//    that completes all earlier puts.
#pragma once
#ifdef MOE_EMU
#include "nvshmem_emu.h"  // csrc/emu: the device API on the CPU kernel emulator
#else
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

#include "../kernels/sync.cuh"

namespace moe_ibgda {

// Pause between two remote polls (read_signal of a network peer): one RDMA read per poll.
constexpr unsigned kRemotePollNs = 2000;

MOE_DEVICE void* symmetric(u64 sym, u64 offset) { return (void*)(sym + offset); }

// Warp-cooperative put of `bytes` from local registered memory (the mirror) to `offset` of PE
// `pe`'s buffer. All 32 lanes call with the same arguments.
MOE_DEVICE void put_warp(u64 sym, int pe, u64 offset, const void* src, u64 bytes) {
    if (bytes == 0) return;
    nvshmemx_putmem_nbi_warp(symmetric(sym, offset), src, (size_t)bytes, pe);
}

// Release-ordered signal from one thread: everything this PE posted before (payload puts of
// any warp that met this thread at a barrier first) is delivered before the word lands.
MOE_DEVICE void signal(u64 sym, int pe, u64 offset, u64 word) {
    nvshmem_quiet();
    nvshmemx_signal_op((uint64_t*)symmetric(sym, offset), (uint64_t)word, NVSHMEM_SIGNAL_SET,
                       pe);
}

// Payload and signal in one call, warp-cooperative: NVSHMEM delivers the signal after the
// data. For a single message whose arrival is announced on its own (one row, one count).
MOE_DEVICE void put_signal_warp(u64 sym, int pe, u64 offset, const void* src, u64 bytes,
                                u64 signal_offset, u64 word) {
    nvshmemx_putmem_signal_nbi_warp(symmetric(sym, offset), src, (size_t)bytes,
                                    (uint64_t*)symmetric(sym, signal_offset), (uint64_t)word,
                                    NVSHMEM_SIGNAL_SET, pe);
}

// Acquire read of a word in a network peer's buffer (a blocking RDMA read). Fallback only.
MOE_DEVICE u64 read_remote(u64 sym, int pe, u64 offset) {
    return nvshmem_ulonglong_g((const unsigned long long*)symmetric(sym, offset), pe);
}

// Completion of every put/signal this PE posted so far (sources reusable, data delivered).
MOE_DEVICE void quiet() { nvshmem_quiet(); }

// NVSHMEM's target-side consistency step for a local word seen holding `seen` (a peer's
// signal): true once the payload it announces may be read. test() re-reads the word; it only
// differs if a newer epoch landed in between, which an exact-epoch wait must not accept
// either, so the caller polls on.
MOE_DEVICE bool consistent(const u64* p, u64 seen) {
    return nvshmem_ulonglong_test((unsigned long long*)p, NVSHMEM_CMP_EQ,
                                  (unsigned long long)seen) != 0;
}

}  // namespace moe_ibgda
