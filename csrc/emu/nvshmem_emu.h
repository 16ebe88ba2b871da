// nvshmem_emu.h: the few NVSHMEM device calls of csrc/ibgda/transport_nvshmem.cuh, on the CPU
// kernel emulator (cuda_emu.h), so the IBGDA build of the mode kernels (mirror staging,
// symmetric addressing, put/quiet/signal ordering) runs against the reference in CI, where
// there is neither a GPU nor NVSHMEM. Included instead of <nvshmem.h> when MOE_EMU is set.
//
// The model (nvshmem_emu.cpp): PEs are the ranks of a group the host registered as one
// symmetric heap (moe_comm/jit/emulator.py register_symmetric): `sym + offset` on PE p is
// offset bytes into p's buffer, and each PE has a local range of "NIC-registered" memory
// (its buffer and mirrors) that a put's source must lie in.
//  * A put is non-blocking, as on a NIC: it is queued on the issuing PE (the PE whose buffer
//    holds `dest`) and its source is read only when that PE's next quiet applies it. So a put
//    no quiet of its own PE covers never arrives, and a source rewritten before the quiet
//    delivers the new bytes: both fail the reference checks.
//  * The warp-collective put checks that all 32 lanes call it with the same arguments.
//  * nvshmem_quiet takes effect at the calling thread's next signal_op (which names the PE);
//    the kernels only ever quiet right before a signal (moe_ibgda::signal).
//  * A signal writes its word with a release store; get and test are acquire loads.
// What it does not model: delivery order between puts of one quiet (applied in issue order),
// the NIC's relaxed PCIe writes, queue-pair errors of a dead PE, timing.
#pragma once
#include <stddef.h>
#include <stdint.h>

#define NVSHMEM_SIGNAL_SET 0
#define NVSHMEM_SIGNAL_ADD 5
#define NVSHMEM_CMP_EQ 0

namespace emu {
// Address of `sym` (in some registered PE's buffer) in PE `pe`'s buffer; null after recording
// a launch error when `sym` lies in no registered heap or `pe` is out of range.
void* nvshmem_translate(const void* sym, int pe);
// Queue a put of `bytes` from `src` to `sym` on PE `pe` (checked: heap, registered source).
void nvshmem_queue_put(void* sym, const void* src, size_t bytes, int pe);
void nvshmem_quiet_pending();                 // the next signal_op of this thread quiets first
void nvshmem_signal(uint64_t* sym, uint64_t value, bool add, int pe);  // (quiet +) signal
}  // namespace emu

static inline void nvshmemx_putmem_nbi_warp(void* dest, const void* source, size_t bytes,
                                            int pe) {
    // the call is warp-collective: every lane must bring the same arguments
    const uint64_t key = (uint64_t)dest ^ ((uint64_t)source << 1) ^ ((uint64_t)bytes << 17) ^
                         ((uint64_t)(unsigned)pe << 47);
    uint64_t all[32];
    emu::warp_exchange(0xffffffffu, key, all);
    for (int l = 1; l < 32; ++l)
        if (all[l] != all[0]) emu::fail("emulated NVSHMEM: nvshmemx_putmem_nbi_warp called "
                                        "with different arguments by the lanes of a warp");
    if ((threadIdx.x & 31) == 0) emu::nvshmem_queue_put(dest, source, bytes, pe);
    __syncwarp();
}

static inline void nvshmem_quiet() { emu::nvshmem_quiet_pending(); }

static inline void nvshmemx_signal_op(uint64_t* sig_addr, uint64_t signal, int sig_op, int pe) {
    emu::nvshmem_signal(sig_addr, signal, sig_op == NVSHMEM_SIGNAL_ADD, pe);
}

static inline void nvshmemx_putmem_signal_nbi_warp(void* dest, const void* source, size_t bytes,
                                                   uint64_t* sig_addr, uint64_t signal,
                                                   int sig_op, int pe) {
    nvshmemx_putmem_nbi_warp(dest, source, bytes, pe);
    if ((threadIdx.x & 31) == 0) {
        emu::nvshmem_quiet_pending();  // NVSHMEM delivers the signal after the data
        emu::nvshmem_signal(sig_addr, signal, sig_op == NVSHMEM_SIGNAL_ADD, pe);
    }
    __syncwarp();
}

static inline unsigned long long nvshmem_ulonglong_g(const unsigned long long* source, int pe) {
    const unsigned long long* p =
        (const unsigned long long*)emu::nvshmem_translate(source, pe);
    emu::spin_point();  // callers poll with it
    return p ? __atomic_load_n(p, __ATOMIC_ACQUIRE) : 0;
}

static inline int nvshmem_ulonglong_test(unsigned long long* ivar, int cmp,
                                         unsigned long long value) {
    (void)cmp;  // only NVSHMEM_CMP_EQ is used
    return __atomic_load_n(ivar, __ATOMIC_ACQUIRE) == value;
}
