// transport.cuh: how bytes and signals reach another rank's buffer.
//
// Every write a kernel makes into another rank's memory goes through `Transport`, never
// through a raw pointer, so a transport for ranks that are not reachable by pointer can be
// slotted in without touching the mode kernels:
//
//   row = t.row_for_write(rank, offset)            // where to build a message for `rank`
//   ... write the message into `row` ...
//   t.commit_row_warp(rank, offset, row, bytes)    // make it travel (no-op for peer stores)
//   t.put_warp(rank, offset, src, bytes)           // copy existing bytes (= the three above)
//   t.signal(rank, offset, tagged_word)            // release-ordered signal word
//   t.read_signal(rank, offset)                    // acquire load of a word in rank's memory
//
// `bases[r]` (moe_comm/cuda/comm.py) says how rank r is reached:
//   * a pointer: a peer mapped into this process (CUDA IPC or nvshmem_ptr on a GPU, /dev/shm
//     on the kernel emulator): the row *is* the peer's memory, commit does nothing, a signal
//     is one st.release.sys;
//   * a pointer with its low bit set: a network rank (another host). The pointer (bit
//     cleared) is this process's *mirror* of that rank's buffer, same layout: a message is
//     built (or copied) there at the offset it must land at, then the remote transport moves
//     those bytes to the same offset of the rank's buffer. Which transport is a build choice:
//       - default build: the host proxy. Commit pushes a put command into the GPU->CPU ring at
//         bases[-1] (proxy_ring.cuh; moe_comm/cuda/kernel_proxy.py runs the proxy thread);
//       - -DMOE_WITH_NVSHMEM (nvcc -rdc + libnvshmem_device, moe_comm/jit/nvcc.py): IBGDA,
//         the GPU posts the RDMA write itself from the mirror, which lies in the NVSHMEM
//         symmetric heap (so the NIC can read it); bases[-1] is this rank's own symmetric
//         buffer, whose address names the destination on every PE
//         (csrc/ibgda/transport_nvshmem.cuh, csrc/ibgda/README.md);
//   * 0: unreachable: kErrNoTransport is recorded and the write dropped.
// The mirror also makes every source NIC-registered (IBGDA) or host-readable (proxy): bytes a
// kernel puts from the caller's tensors are copied into the mirror first.
#pragma once
#include "sync.cuh"
#ifdef MOE_WITH_NVSHMEM
#include "../ibgda/transport_nvshmem.cuh"
#else
#include "proxy_ring.cuh"
#endif

struct Transport {
    const u64* bases;  // [num_ranks] how each rank is reached (above); bases[-1]: see above
    ErrorSink err;

    MOE_DEVICE bool by_pointer(int rank) const {
        const u64 b = bases[rank];
        return b != 0 && (b & 1) == 0;
    }
    MOE_DEVICE bool by_network(int rank) const { return (bases[rank] & 1) != 0 && bases[-1]; }
    MOE_DEVICE u8* peer(int rank, u64 offset) const { return (u8*)bases[rank] + offset; }
    MOE_DEVICE u8* mirror(int rank, u64 offset) const {
        return (u8*)(bases[rank] & ~1ull) + offset;
    }

    // Where to write a message of `rank` that must land at `offset` of its buffer: the peer's
    // memory, or the mirror for a network rank; null (reported) for an unreachable rank.
    // Called by whole warps, like the commit that follows.
    MOE_DEVICE u8* row_for_write(int rank, u64 offset) const {
        if (by_pointer(rank)) return peer(rank, offset);
        if (by_network(rank)) return mirror(rank, offset);
        if (lane_id() == 0) err.report(kErrNoTransport, 0, rank, 2);
        return nullptr;
    }

    MOE_DEVICE void commit_row_warp(int rank, u64 offset, const u8* row, u64 bytes) const {
        if (by_pointer(rank) || !row) return;  // stores went to the peer / nothing was built
        remote_put_warp(rank, offset, row, bytes);
    }

    MOE_DEVICE void put_warp(int rank, u64 offset, const void* src, u64 bytes) const {
        if (by_pointer(rank))
            warp_copy(peer(rank, offset), src, bytes);
        else
            remote_put_warp(rank, offset, (const u8*)src, bytes);
    }

    MOE_DEVICE void signal(int rank, u64 offset, u64 word) const {
        if (by_pointer(rank))
            st_release_sys((u64*)peer(rank, offset), word);
        else
            remote_signal(rank, offset, word);
    }

    MOE_DEVICE u64 read_signal(int rank, u64 offset) const {
        if (by_pointer(rank)) return ld_acquire_sys((const u64*)peer(rank, offset));
#ifdef MOE_WITH_NVSHMEM
        if (by_network(rank))  // one RDMA read: every wait of the kernels is on local words
            return moe_ibgda::read_remote(bases[-1], rank, offset);
#endif
        err.report(kErrNoTransport, 0, rank, 1);  // no remote read path: "nothing yet"
        return 0;
    }

    // One look at a tagged word in this rank's own memory that a peer signals: its value if it
    // carries `epoch`, else -1. NVSHMEM build: NVSHMEM's consistency step runs before the
    // value is trusted (RDMA writes of the payload may reach memory relaxed-ordered).
    // `failure_marks`: a kFailedValue of a later epoch counts too. Its sender has failed and,
    // waiting for nobody, may have run through later operations whose marks overwrote this
    // one's. Not one of an earlier epoch: a signature mismatch, the one error that clears,
    // can leave marks of the rounds that followed it in slots the next call reads.
    MOE_DEVICE i64 poll_local(const u64* p, u32 epoch, bool failure_marks = false) const {
        const u64 w = ld_acquire_sys(p);
        if (tag_epoch(w) != epoch &&
            !(failure_marks && tag_value(w) == kFailedValue && later_epoch(tag_epoch(w), epoch)))
            return -1;
#ifdef MOE_WITH_NVSHMEM
        if (!moe_ibgda::consistent(p, w)) return -1;
#endif
        return (i64)tag_value(w);
    }

    // Wait for a tagged word in this rank's own memory that `rank` signals (the push model:
    // every wait is on local memory). Returns the value, or -1 after the deadline (reported).
    MOE_DEVICE i64 wait_local(const u64* p, u32 epoch, u64 timeout_ns, int rank,
                              bool failure_marks = false) const {
        const u64 deadline = globaltimer_ns() + timeout_ns;
        for (;;) {
            const i64 v = poll_local(p, epoch, failure_marks);
            if (v >= 0) return v;
            if (globaltimer_ns() > deadline) {
                err.report(kErrTimeout, epoch, rank, 0);
                return -1;
            }
        }
    }

    // Remote hooks: the only place a network transport plugs in. A whole warp: the bytes are
    // staged in the mirror (unless they were built there), every lane's stores are made
    // visible system-wide, then one put moves them (proxy command, or RDMA write).
    MOE_DEVICE void remote_put_warp(int rank, u64 offset, const u8* src, u64 bytes) const {
        if (!by_network(rank)) {
            if (lane_id() == 0) err.report(kErrNoTransport, 0, rank, 0);
            return;
        }
        u8* row = mirror(rank, offset);
        if (src != row) warp_copy(row, src, bytes);
        __threadfence_system();
        __syncwarp();
        if (bytes == 0) return;
#ifdef MOE_WITH_NVSHMEM
        moe_ibgda::put_warp(bases[-1], rank, offset, row, bytes);
#else
        if (lane_id() == 0)
            ProxyRing{(u64*)bases[-1]}.push(err, kProxyOpPut, rank, offset, bytes);
        __syncwarp();
#endif
    }
    // One thread, after the writes it announces (ordered by the caller, see sync.cuh).
    MOE_DEVICE void remote_signal(int rank, u64 offset, u64 word) const {
        if (!by_network(rank)) {
            err.report(kErrNoTransport, 0, rank, 0);
            return;
        }
        __threadfence_system();
#ifdef MOE_WITH_NVSHMEM
        moe_ibgda::signal(bases[-1], rank, offset, word);
#else
        ProxyRing{(u64*)bases[-1]}.push(err, kProxyOpSignal, rank, offset, word);
#endif
    }
};

// Deadline-bounded wait for a tagged word in another rank's memory (flow control: "has that
// rank finished reading the buffer I am about to overwrite"). Waits that run side by side do
// not give up early when one of them reports: each silent rank gets named.
MOE_DEVICE bool wait_peer_tag(const Transport& t, int rank, u64 offset, u32 epoch,
                              u64 timeout_ns) {
    const u64 deadline = globaltimer_ns() + timeout_ns;
    for (;;) {
        if (tag_epoch(t.read_signal(rank, offset)) == epoch) return true;
        if (globaltimer_ns() > deadline) {
            t.err.report(kErrTimeout, epoch, rank, 1);
            return false;
        }
#ifdef MOE_WITH_NVSHMEM
        if (!t.by_pointer(rank)) __nanosleep(moe_ibgda::kRemotePollNs);  // one RDMA read a poll
#endif
    }
}

// ---- rank masking -----------------------------------------------------------------------------
// Which ranks take part (moe_comm/cuda/comm.py): null while nothing can be masked (a group
// that is not elastic and was never given a mask: every check below is skipped), else word 1
// of an int32 [1 + R] device tensor. words[r] is 1 while rank r takes part (the Buffer's
// active_ranks, Mooncake's convention); words[-1] says what a missed deadline does: 1
// (elastic) masks the rank, 0 reports it (CommTimeoutError) as in a group without masking.
// Kernels send nothing to and await nothing from a rank at 0; every kernel of a call reads the
// same words, so a rank masked by one wait is skipped by all later kernels.
struct Active {
    i32* words;
    MOE_DEVICE bool on(int r) const { return !words || ld_volatile_i32(words + r) != 0; }
    MOE_DEVICE bool elastic() const { return words && ld_volatile_i32(words - 1) != 0; }
    MOE_DEVICE void drop(int r) const {
        if (words) st_volatile_i32(words + r, 0);
    }
};

// ---- call signatures (moe_comm/signature.py) ---------------------------------------------------
// What every rank must pass alike for one call: eight values (wire.NORMAL_CALL_FIELDS or
// LL_CALL_FIELDS), one tagged word each, in a CALL / LL_CALL header row per source (kCallWords
// of them, moe_generated.cuh). Kernels take them as the i64 arguments call0..call7
// (moe_comm/jit/kernel_args.py). FENCE (kFenceOffset) is set by the survivors that masked a rank.
struct CallRow {
    u32 v[kCallWords];
};
#define MOE_CALL_ROW                                                                        \
    CallRow {                                                                               \
        { (u32)call0, (u32)call1, (u32)call2, (u32)call3, (u32)call4, (u32)call5, (u32)call6, \
          (u32)call7 }                                                                      \
    }


// for a masked rank. Past the deadline: elastic, the rank is masked and -1 returned; else
// Transport::wait_local reports it (the host raises CommTimeoutError). A word carrying
// kFailedValue (its sender's call failed, sync.cuh) ends the wait at once the same way:
// elastic masks the rank, else kErrPeerFailed is reported. `failure_marks` = false for words
// whose every value is data (the agreement's mask bits).
MOE_DEVICE i64 wait_from(const Transport& t, const Active& live, const u64* p, u32 epoch,
                         i64 timeout_ns, int rank, bool failure_marks = true);

// This rank's signature into `rank`'s row at `row_off` (one thread; kFailedValue words once
// this rank has failed, so the reader fails at once).
MOE_DEVICE void send_call_row(const Transport& t, int rank, u64 row_off, u32 epoch,
                              const CallRow& call, bool failed) {
    for (int w = 0; w < kCallWords; ++w)
        t.signal(rank, row_off + 8 * (u64)w, tag(epoch, failed ? kFailedValue : call.v[w]));
}

// Wait for `rank`'s signature at `theirs` (this rank's memory) and compare it with `call`:
// true if they agree; false when a field differs (reported: kErrMismatch, detail = the field)
// or the rank is silent, failed or masked (reported or masked by wait_from).
MOE_DEVICE bool same_call(const Transport& t, const Active& live, const u64* theirs, u32 epoch,
                          i64 timeout_ns, int rank, const CallRow& call) {
    for (int w = 0; w < kCallWords; ++w) {
        const i64 v = wait_from(t, live, theirs + w, epoch, timeout_ns, rank);
        if (v < 0) return false;
        if ((u32)v != call.v[w]) {
            t.err.report(kErrMismatch, epoch, rank, w);
            return false;
        }
    }
    return true;
}

MOE_DEVICE i64 wait_from(const Transport& t, const Active& live, const u64* p, u32 epoch,
                         i64 timeout_ns, int rank, bool failure_marks) {
    if (!live.on(rank)) return -1;
    i64 v = -1;
    if (!live.elastic()) {
        v = t.wait_local(p, epoch, timeout_ns, rank, failure_marks);
    } else {
        const u64 deadline = globaltimer_ns() + (u64)timeout_ns;
        while (v < 0) {
            if (!live.on(rank)) return -1;
            v = t.poll_local(p, epoch, failure_marks);
            if (v < 0 && globaltimer_ns() > deadline) {
                live.drop(rank);
                return -1;
            }
        }
    }
    if (failure_marks && v == (i64)kFailedValue) {
        if (live.elastic())
            live.drop(rank);
        else
            t.err.report(kErrPeerFailed, epoch, rank, 0);
        return -1;
    }
    return v;
}
