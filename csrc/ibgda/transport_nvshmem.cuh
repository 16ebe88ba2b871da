// transport_nvshmem.cuh: the remote branch of `Transport` (csrc/kernels/transport.cuh) on
// NVSHMEM's device API, so GPU threads post RDMA writes and signals themselves (IBGDA: the
// NIC's send queues live in GPU memory and a warp rings the doorbell; with IBGDA off, the
// same calls go through NVSHMEM's CPU proxy).
//
// Compiled only when the kernels are built with -DMOE_WITH_NVSHMEM, by nvcc with -rdc=true
// and device-linked against libnvshmem_device.a (moe_comm/ibgda/build.py). NVRTC cannot build
// it (NVSHMEM's signal entry points mangle differently under NVRTC, and the headers compile
// IBGDA out there): see shared/TOOLING.md.
//
// How a kernel reaches rank r (the `bases[r]` word the host hands the kernels):
//
//   bases[r] == 0             no transport: the write is dropped, kErrNoTransport reported
//   bases[r] & kRemoteTag     network peer: rank r is NVSHMEM PE r; its buffer is the same
//                             symmetric allocation as ours, so the destination of `offset` is
//                             the *symmetric* address (bases[r] & ~kRemoteTag) + offset, put
//                             with nvshmem to PE r (RDMA write posted by this warp)
//   otherwise                 a pointer this GPU can store to (our own buffer, a CUDA IPC
//                             mapping, or nvshmem_ptr() of an NVLink/P2P peer): plain stores
//
// Buffers live in the NVSHMEM symmetric heap (nvshmem_malloc through nvshmem4py), so the
// symmetric address is our own buffer's address and is the same word for every network peer.
// PE numbers are the group's ranks: moe_comm.ibgda.init_nvshmem initialises NVSHMEM over
// exactly the EP group, PE i = group rank i. The host builds the words with
// moe_comm.ibgda.bases.encode_bases.
//
// Memory ordering (the contract of sync.cuh, carried over the network):
//  * put: nvshmemx_putmem_nbi_warp, the 32 lanes of one warp cooperate (one WQE chain, no
//    wait). The source must be NIC-registered memory: the symmetric heap or a buffer
//    registered with nvshmemx_buffer_register (nvshmem4py register_external_tensor); an
//    unregistered source is an assert in NVSHMEM. Non-blocking: the source must not change
//    until a later quiet, which `signal` performs.
//  * signal: nvshmem_quiet, then nvshmemx_signal_op(SET). The kernels call it from one thread
//    after `__threadfence_system(); __syncthreads();` (or after last_block_arrives), so every
//    put of the block (or grid) has been posted before it. In NVSHMEM's IBGDA implementation
//    quiet (and fence) drain every QP of this PE, not only the calling thread's, so it covers
//    those puts: once it returns they are delivered at the target and their sources are free
//    (quiet is completion, fence only ordering; quiet also makes the kernel's end a safe point
//    for the caller to overwrite the inputs). The signal then lands after the payload.
//  * wait: only ever on *local* words that the peer pushed. The word is polled with
//    ld.acquire.sys under a %globaltimer deadline (NVSHMEM's wait_until has none); when the
//    awaited epoch shows, nvshmem_ulonglong_test on the observed value runs NVSHMEM's
//    target-side consistency step (NIC writes reach GPU memory over PCIe, possibly relaxed
//    ordered: NVSHMEM issues a flush before the payload may be read). A silent rank is
//    reported through the kernels' ErrorSink and the wait returns -1; nothing traps or hangs.
//  * remote read (read_signal of a network peer): RDMA has no cheap remote load. It is served
//    by nvshmem_ulonglong_g (one blocking RDMA read per poll, with a back-off between polls) so
//    the kernels stay correct, but every wait should be on local memory: see README.md
//    "What the kernels must change".
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../kernels/sync.cuh"

namespace moe_ibgda {

// Low bit of a bases[] word: "network peer, the rest is our symmetric address". Buffers are
// at least 8-byte aligned (nvshmem_malloc aligns far more), so the bit is free.
constexpr u64 kRemoteTag = 1;
// Pause between two remote polls (read_signal of a network peer): one RDMA read per poll.
constexpr unsigned kRemotePollNs = 2000;

MOE_DEVICE bool is_remote(u64 base_word) { return (base_word & kRemoteTag) != 0; }
MOE_DEVICE bool is_pointer(u64 base_word) { return base_word != 0 && !is_remote(base_word); }

MOE_DEVICE void* symmetric(u64 base_word, u64 offset) {
    return (void*)((base_word & ~kRemoteTag) + offset);
}

// Warp-cooperative put of `bytes` from local registered memory to `offset` of PE `pe`'s
// buffer. All 32 lanes call with the same arguments.
MOE_DEVICE void put_warp(u64 base_word, int pe, u64 offset, const void* src, u64 bytes) {
    if (bytes == 0) return;
    nvshmemx_putmem_nbi_warp(symmetric(base_word, offset), src, (size_t)bytes, pe);
}

// Release-ordered signal from one thread: everything this PE posted before (payload puts of
// any warp that met this thread at a barrier first) is delivered before the word lands.
MOE_DEVICE void signal(u64 base_word, int pe, u64 offset, u64 word) {
    nvshmem_quiet();
    nvshmemx_signal_op((uint64_t*)symmetric(base_word, offset), (uint64_t)word,
                       NVSHMEM_SIGNAL_SET, pe);
}

// Payload and signal in one call, warp-cooperative: NVSHMEM delivers the signal after the
// data. For a single message whose arrival is announced on its own (one row, one count).
MOE_DEVICE void put_signal_warp(u64 base_word, int pe, u64 offset, const void* src, u64 bytes,
                                u64 signal_offset, u64 word) {
    nvshmemx_putmem_signal_nbi_warp(symmetric(base_word, offset), src, (size_t)bytes,
                                    (uint64_t*)symmetric(base_word, signal_offset),
                                    (uint64_t)word, NVSHMEM_SIGNAL_SET, pe);
}

// Acquire read of a word in a network peer's buffer (a blocking RDMA read). Fallback only.
MOE_DEVICE u64 read_remote(u64 base_word, int pe, u64 offset) {
    return nvshmem_ulonglong_g((const unsigned long long*)symmetric(base_word, offset), pe);
}

// Completion of every put/signal this PE posted so far (sources reusable, data delivered).
MOE_DEVICE void quiet() { nvshmem_quiet(); }

// Deadline-bounded wait for the tagged word at local address `p` (written by a peer's signal)
// to carry `epoch`. Returns its value, or -1 after `timeout_ns` with `rank` reported silent.
// Same contract as sync.cuh's wait_tag, plus NVSHMEM's consistency step on success.
MOE_DEVICE i64 wait_local_tag(const u64* p, u32 epoch, u64 timeout_ns, const ErrorSink& err,
                              int rank) {
    const u64 deadline = globaltimer_ns() + timeout_ns;
    for (;;) {
        const u64 w = ld_acquire_sys(p);
        // test() re-reads the word; it only differs if a newer epoch landed in between, which
        // an exact-epoch wait must not accept either: poll on.
        if (tag_epoch(w) == epoch &&
            nvshmem_ulonglong_test((unsigned long long*)p, NVSHMEM_CMP_EQ, w))
            return (i64)tag_value(w);
        if (globaltimer_ns() > deadline) {
            err.report(kErrTimeout, epoch, rank, 0);
            return -1;
        }
    }
}

// Deadline-bounded wait for the tagged word at `offset` of network peer `pe` (fallback for
// pull-style flow control; see read_remote). Returns whether it showed `epoch` in time.
MOE_DEVICE bool wait_remote_tag(u64 base_word, int pe, u64 offset, u32 epoch, u64 timeout_ns,
                                const ErrorSink& err) {
    const u64 deadline = globaltimer_ns() + timeout_ns;
    for (;;) {
        if (tag_epoch(read_remote(base_word, pe, offset)) == epoch) return true;
        if (globaltimer_ns() > deadline) {
            err.report(kErrTimeout, epoch, pe, 1);
            return false;
        }
        __nanosleep(kRemotePollNs);
    }
}

}  // namespace moe_ibgda
