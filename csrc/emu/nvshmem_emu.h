// nvshmem_emu.h: the few NVSHMEM device calls of csrc/ibgda/transport_nvshmem.cuh, on the CPU
// kernel emulator (cuda_emu.h), so the IBGDA build of the mode kernels (mirror staging,
// symmetric addressing, put/quiet/signal ordering) runs against the reference in CI, where
// there is neither a GPU nor NVSHMEM. Included instead of <nvshmem.h> when MOE_EMU is set.
//
// The model (nvshmem_emu.cpp): PEs are the ranks of a group whose buffers the host registered
// as one symmetric heap (moe_comm/cuda/emulator.py register_symmetric); `sym + offset` on PE
// p is offset bytes into p's buffer. Puts are non-blocking as on a NIC: a put is queued and
// its source read only at the next quiet (of any thread), so a source overwritten before its
// quiet, or a put that no quiet covers, delivers wrong or missing bytes. A signal writes its
// word after a quiet, with a release store; get and test are acquire loads.
//
// What it does not model: delivery order between puts (all are applied at the quiet in issue
// order), the NIC's relaxed PCIe writes, and registration: any address may be a source.
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
void nvshmem_queue_put(void* dst, const void* src, size_t bytes);
void nvshmem_quiet_all();  // apply every queued put, in issue order
}  // namespace emu

static inline void nvshmemx_putmem_nbi_warp(void* dest, const void* source, size_t bytes,
                                            int pe) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
        void* dst = emu::nvshmem_translate(dest, pe);
        if (dst) emu::nvshmem_queue_put(dst, source, bytes);
    }
    __syncwarp();
}

static inline void nvshmem_quiet() { emu::nvshmem_quiet_all(); }

static inline void nvshmemx_signal_op(uint64_t* sig_addr, uint64_t signal, int sig_op, int pe) {
    uint64_t* word = (uint64_t*)emu::nvshmem_translate(sig_addr, pe);
    if (!word) return;
    if (sig_op == NVSHMEM_SIGNAL_ADD)
        __atomic_fetch_add(word, signal, __ATOMIC_RELEASE);
    else
        __atomic_store_n(word, signal, __ATOMIC_RELEASE);
}

static inline void nvshmemx_putmem_signal_nbi_warp(void* dest, const void* source, size_t bytes,
                                                   uint64_t* sig_addr, uint64_t signal,
                                                   int sig_op, int pe) {
    nvshmemx_putmem_nbi_warp(dest, source, bytes, pe);
    if ((threadIdx.x & 31) == 0) {
        emu::nvshmem_quiet_all();  // NVSHMEM delivers the signal after the data
        nvshmemx_signal_op(sig_addr, signal, sig_op, pe);
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
