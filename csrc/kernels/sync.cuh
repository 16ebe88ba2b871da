// sync.cuh: memory ordering between GPUs, tagged signal words, deadline-bounded waits and the
// error word the host turns into moe_comm.CommTimeoutError.
//
// Memory model (PTX ISA "Memory Consistency Model"), as used by every kernel:
//
//  * A writer makes its payload visible before the signal that announces it. The payload is
//    written with ordinary stores (to a peer's memory through a CUDA IPC mapping, i.e. over
//    NVLink/PCIe); then
//      - the threads that wrote it meet at a barrier (__syncthreads): bar.sync orders each
//        thread's earlier writes before the later operations of every thread of the block
//        (CTA scope), so one thread - the publisher - now follows all of them in causality
//        order. Across blocks, each block's publisher increments a block counter after a
//        fence (see `last_block_arrives`);
//      - the publisher executes `fence.sc.sys` (__threadfence_system) and stores the signal
//        word with `st.release.sys`.
//    Fence and release at system scope are cumulative: every write that precedes them in
//    causality order (the publisher's own, and those of the threads it met at the barrier) is
//    visible to any thread of any GPU that observes the signal with an acquire load. One fence
//    by the publisher is enough; a fence by every writing thread would order nothing more and
//    costs a system-scope round trip per thread.
//  * A reader polls the signal word with `ld.acquire.sys`; once it sees the awaited epoch, its
//    later loads (in this thread, and in threads that synchronise with it through a barrier or
//    a later kernel on the same stream) see the payload.
//  * Scope is `.sys`, not `.gpu`: writers and readers are on different devices (or different
//    processes sharing one device through IPC mappings); `.gpu` would only order accesses as
//    observed from the writer's own GPU.
//  * A release also orders the writer's earlier *loads*: a rank that publishes "my region is
//    free" (notify rows, LL *_FREE words) with a release store has finished reading the region
//    before any peer that acquires the word can overwrite it.
//
// Signal words are tagged (moe_comm/wire.py): `(epoch << kValueBits) | value`, epoch >= 1. A reader
// waits until the epoch field equals the epoch of the current operation, so slots are never
// reset and a word left by an older operation can never be mistaken for a new one.
//
// Deadlines: every spin reads %globaltimer (nanoseconds, the same clock on every SM) and gives
// up when the operation's deadline passes. The silent rank is written to the error word in
// pinned host memory (the host reads it without a device sync and raises CommTimeoutError
// naming it) and to a device copy that later kernels check at entry, so a failed operation
// does not make every following kernel wait out its own timeout too. No kernel traps.
#pragma once
#include "common.cuh"

// ---- ordered accesses --------------------------------------------------------------------
#ifdef MOE_EMU  // the CPU kernel emulator (csrc/emu): host atomics, and loads yield
MOE_DEVICE u64 globaltimer_ns() { return emu::now_ns(); }
MOE_DEVICE void st_release_sys(u64* p, u64 v) { emu::st_release(p, v); }
MOE_DEVICE u64 ld_acquire_sys(const u64* p) { return emu::ld_acquire(p); }
MOE_DEVICE void st_volatile_i32(i32* p, i32 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
MOE_DEVICE i32 ld_volatile_i32(const i32* p) { return emu::ld_volatile(p); }
MOE_DEVICE u64 ld_volatile_u64(const u64* p) { return emu::ld_volatile(p); }
#else
MOE_DEVICE u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

MOE_DEVICE void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

MOE_DEVICE u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

MOE_DEVICE void st_volatile_i32(i32* p, i32 v) { *(volatile i32*)p = v; }
MOE_DEVICE i32 ld_volatile_i32(const i32* p) { return *(const volatile i32*)p; }
MOE_DEVICE u64 ld_volatile_u64(const u64* p) { return *(const volatile u64*)p; }
#endif

// ---- tagged words (wire.tag / tag_epoch / tag_value) --------------------------------------
// kValueBits (moe_generated.cuh) is 32: the value is the low u32, the epoch the high one.
static_assert(kValueBits == 32, "tagged words split into two u32 halves");
MOE_DEVICE u64 tag(u32 epoch, u32 value) { return ((u64)epoch << kValueBits) | (u64)value; }
MOE_DEVICE u32 tag_epoch(u64 word) { return (u32)(word >> kValueBits); }
MOE_DEVICE u32 tag_value(u64 word) { return (u32)word; }
// Whether epoch `e` comes after `than` (epochs run 1..kMaxEpoch and wrap to 1): within half
// the cycle ahead of it. Not a word that is no tag at all (0, or the all-ones of an int64 -1
// that an LL buffer of another layout left where a count word now lies).
MOE_DEVICE bool later_epoch(u32 e, u32 than) {
    if (e == 0 || e > kMaxEpoch) return false;
    const u64 ahead = ((u64)e + kMaxEpoch - (u64)than) % kMaxEpoch;
    return ahead != 0 && ahead < kMaxEpoch / 2;
}

// ---- errors ------------------------------------------------------------------------------
// The codes kErr*, the error word's layout (kErrorHeader ints, then one per rank up to
// kMaxErrorRanks) and kFailedValue - the value a tagged signal word carries when its sender's
// call failed, so the receiver fails at once instead of at its deadline (`wait_from`,
// transport.cuh) - come from moe_comm/wire.py through moe_generated.cuh.

struct ErrorSink {
    i32* host;  // pinned, mapped host memory (same address on host and device under UVA)
    i32* dev;   // device copy of the code: cheap to test at kernel entry
    i32 op;     // which phase is running (moe_comm/cuda/comm.py OPS)

    // The first error wins the header (later ones are mostly its consequences: a peer that
    // failed because this rank did); reports of the same code add their rank. Ranks and
    // details first, the code last (after a system fence): a host that sees the code sees the
    // rest.
    MOE_DEVICE void report(i32 code, u32 epoch, int rank, i32 detail) const {
        const i32 first = atomicCAS(dev, 0, code);
        if (first != 0 && first != code) return;
        if (rank >= 0 && rank < kMaxErrorRanks) st_volatile_i32(host + kErrorHeader + rank, 1);
        if (first != 0) return;
        st_volatile_i32(host + 1, op);
        st_volatile_i32(host + 2, (i32)epoch);
        st_volatile_i32(host + 3, detail);
        __threadfence_system();
        st_volatile_i32(host + 0, code);
    }
    MOE_DEVICE bool aborted() const { return ld_volatile_i32(dev) != 0; }
    // What a signal announcing `value` carries: kFailedValue once this rank has failed - but
    // not for a call signature mismatch, which every rank sees at once and which leaves the
    // group in step: its signals stay plain, so the calls after it go on.
    MOE_DEVICE u32 signal_value(u32 value) const {
        const i32 code = ld_volatile_i32(dev);
        return code != 0 && code != kErrMismatch ? kFailedValue : value;
    }
};

// Whether an earlier error stops this block: read once, by thread 0, and shared, so every
// thread of the block takes the same path (a per-thread read lets some threads leave while
// others wait at a barrier, and leaves a block out of `last_block_arrives`). A failed block
// skips its work but still arrives and signals, so the counter is reset and peers learn of the
// failure at once. Every thread of the block calls it.
// `fence` (this rank's FENCE header word, wire.FENCE_WORD; kernels that write payload pass
// it): the survivors of an elastic group masked this rank, which reports kErrMasked and
// writes no payload (a late writer stops; its failure marks land only in its own signal
// slots, which the survivors no longer read).
MOE_DEVICE bool block_failed(const ErrorSink& err, const u64* fence = nullptr) {
    __shared__ bool failed;
    __syncthreads();  // an earlier call's readers are done with `failed`
    if (threadIdx.x == 0) {
        failed = err.aborted();
        if (!failed && fence && ld_volatile_u64(fence) != 0) {
            err.report(kErrMasked, 0, -1, 0);
            failed = true;
        }
#ifdef MOE_EMU  // tests: a late writer, stopped between this check and its stores
        if (!failed && fence) emu::stop_point(err.op);
#endif
    }
    __syncthreads();
    return failed;
}

// Spin until the word at `p` carries `epoch`; returns its value, or -1 after `timeout_ns`
// (reporting `rank` as silent). The acquire load orders everything the thread reads after.
MOE_DEVICE i64 wait_tag(const u64* p, u32 epoch, u64 timeout_ns, const ErrorSink& err,
                        int rank) {
    const u64 deadline = globaltimer_ns() + timeout_ns;
    for (;;) {
        const u64 w = ld_acquire_sys(p);
        if (tag_epoch(w) == epoch) return (i64)tag_value(w);
        if (globaltimer_ns() > deadline) {
            err.report(kErrTimeout, epoch, rank, 0);
            return -1;
        }
    }
}

// Cross-block completion: every thread of every block calls this after its last write of
// the kernel's payload (a failed block too: see `block_failed`). Returns true in exactly one
// block, the last to arrive, which may then publish signals covering all blocks' writes. The
// barrier puts the block's writes before thread 0's fence.sc.sys (see the memory model above),
// and its atomic (a release pattern with the fence) carries them to the last block, whose
// thread 0 reads the count and fences again (an acquire pattern) before the barrier that lets
// its threads store the signals. The last block resets the counter, so the next kernel on the
// stream (which starts only after this one ends) finds it at 0.
MOE_DEVICE bool last_block_arrives(i32* counter, int* shared_flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        const i32 blocks = (i32)(gridDim.x * gridDim.y * gridDim.z);  // 2-D grids too
        const i32 prev = atomicAdd(counter, 1);
        *shared_flag = prev == blocks - 1;
        if (*shared_flag) {
            *counter = 0;
            __threadfence_system();
        }
    }
    __syncthreads();
    return *shared_flag != 0;
}
