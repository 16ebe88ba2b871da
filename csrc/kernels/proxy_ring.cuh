// proxy_ring.cuh: the GPU -> CPU command ring of the host proxy (the fallback for ranks on
// other hosts when there is no IBGDA; moe_comm/cuda/kernel_proxy.py drains it).
//
// A kernel cannot open a socket, so for a rank on another host it writes the message into a
// local *mirror* of that rank's buffer (same layout, host memory the proxy can read) and pushes
// a fixed-size command; a proxy thread of the same process takes commands in slot order and
// hands them to the host transport (moe_comm/transport: TCP or verbs), which writes the bytes
// into the remote rank's buffer and stores signal words after the data they announce.
//
// Layout (host memory, mapped into the GPU's address space; words are u64):
//   [0] head   address of the slot counter (device memory: only GPU threads add to it)
//   [1] depth  number of slots
//   [2] timeout_ns  how long a producer waits for a free slot before reporting (longer than
//                   any one blocking step of the transport, so only a stopped proxy trips it)
//   [8] tail   slots the proxy has finished (written by the CPU, release)
//   [16 + 4 * i] slot i: {seq, op << 32 | rank, offset, bytes or signal word}
// A producer reserves index n with an atomic add, waits until n - tail < depth (a credit),
// fills slot n % depth and release-stores seq = n + 1; the proxy waits for seq == n + 1 before
// taking slot n, so commands run in reservation order whatever order producers finish in.
//
// Ordering: the bytes of a put are written (by a whole warp) before the put's slot is published:
// each lane fences (fence.sc.sys), the warp meets, lane 0 publishes with a release store, and
// the proxy reads the mirror after an acquire of seq. A signal is reserved after every put it
// announces (kernels signal after their writes: barrier + fence, see sync.cuh), so it lies in
// a later slot and the transport sends it after them on the same ordered channel.
//
// Mirror reuse: the proxy copies a put's bytes when it takes the command, before it takes any
// later slot, and a kernel rewrites a mirror row only after the remote rank answered a signal
// sent after that put (notify rows, FREE words): the earlier bytes were copied by then.
#pragma once
#include "sync.cuh"

// kProxyOp*, kProxyHead/Depth/Timeout/Tail (header word indices) and the header and slot sizes
// come from moe_comm/wire.py through moe_generated.cuh.

struct ProxyRing {
    u64* words;  // the ring in host memory (null: no proxy in this group)

    // Reserve a slot and publish one command; false (reported) if no slot frees up in time.
    // Once the ring is known to be stuck (kErrProxy) nothing waits on it again: a failed
    // rank's kernels still signal, and each push would otherwise wait the whole timeout.
    MOE_DEVICE bool push(const ErrorSink& err, u64 op, int rank, u64 offset, u64 arg) const {
        if (ld_volatile_i32(err.dev) == kErrProxy) return false;
        u64* head = (u64*)ld_volatile_u64(words + kProxyHead);
        const u64 depth = ld_volatile_u64(words + kProxyDepth);
        const u64 n = atomicAdd((unsigned long long*)head, 1ull);
        const u64 deadline = globaltimer_ns() + ld_volatile_u64(words + kProxyTimeout);
        while (n - ld_acquire_sys(words + kProxyTail) >= depth) {
            // The proxy thread stopped taking commands (its slot n stays unpublished, so the
            // ring is stuck for good): not a peer's fault, the host raises CudaCommError.
            if (globaltimer_ns() > deadline || ld_volatile_i32(err.dev) == kErrProxy) {
                err.report(kErrProxy, 0, rank, 0);
                return false;
            }
            __nanosleep(256);  // every poll crosses PCIe
        }
        u64* slot = words + kProxyHeaderWords + (n % depth) * kProxySlotWords;
        slot[1] = op << 32 | (u64)rank;
        slot[2] = offset;
        slot[3] = arg;
        st_release_sys(slot, n + 1);
        return true;
    }
};
