// transport.cuh: how bytes and signals reach another rank's buffer.
//
// Every write a kernel makes into another rank's memory goes through `Transport`, never
// through a raw pointer, so a transport for ranks that are not reachable by pointer can be
// slotted in without touching the mode kernels:
//
//   row = t.row_for_write(rank, offset, staging)   // where to build a message for `rank`
//   ... write the message into `row` ...
//   t.commit_row_warp(rank, offset, row, bytes)    // make it travel (no-op for peer stores)
//   t.put_warp(rank, offset, src, bytes)           // copy existing bytes (= the three above)
//   t.signal(rank, offset, tagged_word)            // release-ordered signal word
//   t.read_signal(rank, offset)                    // acquire load of a word in rank's memory
//
// `bases[r]` (moe_comm/cuda/comm.py) says how rank r is reached:
//   * a pointer: a peer of this node mapped into this process (CUDA IPC; /dev/shm on the
//     kernel emulator): the row *is* the peer's memory, commit does nothing, a signal is one
//     st.release.sys;
//   * a pointer with its low bit set, default build: a rank on another host, served by the
//     host proxy. The pointer (bit cleared) is this process's mirror of that rank's buffer: the
//     row is built there and commit pushes a put command into the proxy ring, whose address
//     is bases[-1] (proxy_ring.cuh; moe_comm/cuda/proxy.py runs the proxy thread);
//   * 0: unreachable: kErrNoTransport is recorded and the write dropped.
// Built with -DMOE_WITH_NVSHMEM (nvcc -rdc + libnvshmem_device, moe_comm/ibgda/build.py), a
// word with its low bit set names an NVSHMEM network peer instead (IBGDA: the GPU posts the
// RDMA writes itself; csrc/ibgda/transport_nvshmem.cuh, csrc/ibgda/README.md).
#pragma once
#include "sync.cuh"
#ifdef MOE_WITH_NVSHMEM
#include "../ibgda/transport_nvshmem.cuh"
#else
#include "proxy_ring.cuh"
#endif

struct Transport {
    const u64* bases;  // [num_ranks] how each rank is reached (above); bases[-1]: proxy ring
    ErrorSink err;

#ifdef MOE_WITH_NVSHMEM
    MOE_DEVICE bool by_pointer(int rank) const { return moe_ibgda::is_pointer(bases[rank]); }
#else
    MOE_DEVICE bool by_pointer(int rank) const {
        const u64 b = bases[rank];
        return b != 0 && (b & 1) == 0;
    }
    MOE_DEVICE bool by_proxy(int rank) const { return (bases[rank] & 1) != 0 && bases[-1]; }
    MOE_DEVICE u8* mirror(int rank, u64 offset) const {
        return (u8*)(bases[rank] & ~1ull) + offset;
    }
#endif
    MOE_DEVICE u8* peer(int rank, u64 offset) const { return (u8*)bases[rank] + offset; }

    // Where to write a message of `rank` that must land at `offset` of its buffer. `staging`
    // (a local slot the caller owns, may be null) is what a remote transport would return.
#ifdef MOE_WITH_NVSHMEM
    // A network rank needs a staging row in NIC-registered memory (the symmetric heap); a
    // caller that has none (staging == nullptr) gets nullptr and the error word says so
    // (detail 2), instead of a message silently missing at the receiver.
    MOE_DEVICE u8* row_for_write(int rank, u64 offset, u8* staging) const {
        if (by_pointer(rank)) return peer(rank, offset);
        if (!staging) err.report(kErrNoTransport, 0, rank, 2);
        return staging;
    }

    MOE_DEVICE void commit_row_warp(int rank, u64 offset, const u8* row, u64 bytes) const {
        if (by_pointer(rank) || !row) return;  // stores went to the peer / nothing was staged
        remote_put_warp(rank, offset, row, bytes);
    }
#else
    // A proxied rank's message is built in its mirror, at the offset it must land at.
    MOE_DEVICE u8* row_for_write(int rank, u64 offset, u8* staging) const {
        if (by_pointer(rank)) return peer(rank, offset);
        return by_proxy(rank) ? mirror(rank, offset) : staging;
    }

    MOE_DEVICE void commit_row_warp(int rank, u64 offset, const u8* row, u64 bytes) const {
        if (by_pointer(rank)) return;  // the stores went straight to the peer
        remote_put_warp(rank, offset, row, bytes);
    }
#endif

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
        if (moe_ibgda::is_remote(bases[rank]))  // one RDMA read: prefer pushed local words
            return moe_ibgda::read_remote(bases[rank], rank, offset);
#endif
        err.report(kErrNoTransport, 0, rank, 1);  // no remote read path: "nothing yet"
        return 0;
    }

    // Wait for a tagged word in this rank's own memory that `rank` signals (the push model:
    // every wait is on local memory). Returns the value, or -1 after the deadline (reported).
    MOE_DEVICE i64 wait_local(const u64* p, u32 epoch, u64 timeout_ns, int rank) const {
#ifdef MOE_WITH_NVSHMEM
        return moe_ibgda::wait_local_tag(p, epoch, timeout_ns, err, rank);
#else
        return wait_tag(p, epoch, timeout_ns, err, rank);
#endif
    }

    // Remote hooks: the only place a network transport plugs in.
#ifdef MOE_WITH_NVSHMEM
    MOE_DEVICE void remote_put_warp(int rank, u64 offset, const u8* src, u64 bytes) const {
        if (moe_ibgda::is_remote(bases[rank]))
            moe_ibgda::put_warp(bases[rank], rank, offset, src, bytes);
        else if (lane_id() == 0)
            err.report(kErrNoTransport, 0, rank, 0);
    }
    MOE_DEVICE void remote_signal(int rank, u64 offset, u64 word) const {
        if (moe_ibgda::is_remote(bases[rank]))
            moe_ibgda::signal(bases[rank], rank, offset, word);
        else
            err.report(kErrNoTransport, 0, rank, 0);
    }
#else
    // Whole warp: stage the bytes in the mirror (unless they were built there), then one
    // put command once every lane's stores are visible system-wide (proxy_ring.cuh).
    MOE_DEVICE void remote_put_warp(int rank, u64 offset, const u8* src, u64 bytes) const {
        if (!by_proxy(rank)) {
            if (lane_id() == 0) err.report(kErrNoTransport, 0, rank, 0);
            return;
        }
        u8* row = mirror(rank, offset);
        if (src != row) warp_copy(row, src, bytes);
        __threadfence_system();
        __syncwarp();
        if (lane_id() == 0 && bytes > 0)
            ProxyRing{(u64*)bases[-1]}.push(err, kProxyOpPut, rank, offset, bytes);
        __syncwarp();
    }
    // One thread, after the writes it announces (ordered by the caller, see sync.cuh).
    MOE_DEVICE void remote_signal(int rank, u64 offset, u64 word) const {
        if (!by_proxy(rank)) {
            err.report(kErrNoTransport, 0, rank, 0);
            return;
        }
        __threadfence_system();
        ProxyRing{(u64*)bases[-1]}.push(err, kProxyOpSignal, rank, offset, word);
    }
#endif
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

// Wait for `rank`'s tagged word at `p` in this rank's memory; returns its value, or -1 at once
// for a masked rank. Past the deadline: elastic, the rank is masked and -1 returned; else
// Transport::wait_local reports it (the host raises CommTimeoutError).
MOE_DEVICE i64 wait_from(const Transport& t, const Active& live, const u64* p, u32 epoch,
                         i64 timeout_ns, int rank) {
    if (!live.on(rank)) return -1;
    if (!live.elastic()) return t.wait_local(p, epoch, timeout_ns, rank);
    const u64 deadline = globaltimer_ns() + (u64)timeout_ns;
    for (;;) {
        if (!live.on(rank)) return -1;
        const u64 w = ld_acquire_sys(p);
        if (tag_epoch(w) == epoch) return (i64)tag_value(w);
        if (globaltimer_ns() > deadline) {
            live.drop(rank);
            return -1;
        }
    }
}
