// cuda_emu.h: just enough of CUDA C++ for the kernels of csrc/kernels to compile as host C++
// and run on CPU threads (the kernel emulator, moe_comm/jit/emulator.py). Force-included
// (g++ -include) ahead of a kernel source built with -DMOE_EMU.
//
// Why: the CUDA backend's kernels and its Python driver can then be checked against the
// reference on any machine, in CI, before a GPU ever runs them. What it models:
//
//  * a block is one OS thread; its CUDA threads are fibers (ucontext) switched cooperatively
//    at __syncthreads, warp collectives and every spin on memory (ld_acquire_sys, volatile
//    loads, __nanosleep), so a thread spinning on a peer never starves the one that would
//    signal it. All blocks of a launch run at once, so blocks may wait on each other and on
//    other ranks' kernels (ranks are Python threads, each launch a blocking call that
//    releases the GIL).
//  * __shared__ is thread_local (one OS thread per block); blockIdx/threadIdx/... are read
//    from the running fiber.
//  * warp collectives take the named lanes' values and block until all of them arrive; a
//    collective or barrier that can never complete (a lane exited, divergent __syncthreads)
//    is reported as an error instead of hanging.
//  * ordering: release/acquire/seq_cst atomics of the host; GPU memory is host memory.
//
// What it does not model: warp-synchronous execution without __syncwarp (fibers of a warp
// interleave only at the points above, so such code may pass here and fail on a GPU), the
// weaker ordering of GPU memory (x86 is TSO), timing.
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct dim3 {
    unsigned x, y, z;
};
struct uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

#define __global__
#define __device__
#define __forceinline__ inline __attribute__((always_inline))
#define __shared__ static thread_local
#define __restrict__ __restrict
// Launch bounds: the Python launcher checks the block against them (moe_comm/jit/emulator.py).
#define __launch_bounds__(...)

// The runtime (csrc/emu/runtime.cpp). Calls are opaque to the compiler; the "memory" clobber
// in the wrappers below also stops it from keeping shared (thread_local) values in registers
// across a barrier, which another fiber of the block may have changed.
namespace emu {
dim3 thread_idx();
dim3 block_idx();
dim3 block_dim();
dim3 grid_dim();
void sync_block();
int sync_block_count(int predicate);
// All lanes of `mask` deposit `value`; every lane gets the 32 deposited values in `out`.
void warp_exchange(unsigned mask, uint64_t value, uint64_t* out);
void spin_point();  // a thread is polling memory: let the other fibers of its block run
void fail(const char* msg);  // the launch returns this error (first one of a block wins)
// Tests: MOE_EMU_STOP_AT_OP=<phase id> stops this process (SIGSTOP) the first time block 0 of
// a kernel of that phase (moe_comm/cuda/comm.py OPS) has passed its fence check, before its
// stores: a late writer, which a peer resumes (SIGCONT) once the survivors have masked it.
void stop_point(int op);
uint64_t now_ns();
}  // namespace emu

#define EMU_CLOBBER() asm volatile("" ::: "memory")
#define threadIdx (emu::thread_idx())
#define blockIdx (emu::block_idx())
#define blockDim (emu::block_dim())
#define gridDim (emu::grid_dim())

static inline void __syncthreads() {
    EMU_CLOBBER();
    emu::sync_block();
    EMU_CLOBBER();
}
static inline int __syncthreads_count(int predicate) {
    EMU_CLOBBER();
    const int n = emu::sync_block_count(predicate);
    EMU_CLOBBER();
    return n;
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    uint64_t all[32];
    EMU_CLOBBER();
    emu::warp_exchange(mask, 0, all);
    EMU_CLOBBER();
}
static inline unsigned __ballot_sync(unsigned mask, int predicate) {
    uint64_t all[32];
    EMU_CLOBBER();
    emu::warp_exchange(mask, predicate != 0, all);
    EMU_CLOBBER();
    unsigned bits = 0;
    for (int i = 0; i < 32; ++i)
        if ((mask >> i & 1u) && all[i]) bits |= 1u << i;
    return bits;
}
static inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
    uint64_t all[32];
    uint32_t bits;
    memcpy(&bits, &v, 4);
    EMU_CLOBBER();
    emu::warp_exchange(mask, bits, all);
    EMU_CLOBBER();
    const uint32_t got = (uint32_t)all[(emu::thread_idx().x & 31u) ^ (unsigned)lane_mask];
    float r;
    memcpy(&r, &got, 4);
    return r;
}
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline float __uint_as_float(unsigned v) {
    float f;
    memcpy(&f, &v, 4);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned v;
    memcpy(&v, &f, 4);
    return v;
}
static inline float __fdiv_rn(float a, float b) { return a / b; }  // IEEE without -ffast-math
static inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __nanosleep(unsigned) { emu::spin_point(); }
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline int atomicCAS(int* p, int compare, int v) {
    __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;  // the old value, as on a GPU
}
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}

// ---- what the kernels' inline PTX does (common.cuh, sync.cuh under MOE_EMU) -----------------
namespace emu {
inline uint16_t f32_to_bf16_rn(float f) {  // cvt.rn.bf16.f32
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float f16_to_f32(uint16_t h) {  // cvt.f32.f16
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}
inline uint16_t f32_to_f16_rn(float f) {  // cvt.rn.f16.f32
    const _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}
// cvt.rn.satfinite.e4m3x2.f32 for one value: e4m3fn (bias 7, no infinities, 0x7f = NaN),
// round to nearest even, finite values beyond +-448 saturate to +-448.
inline uint8_t f32_to_e4m3_satfinite(float f) {
    if (f != f) return 0x7f;
    const uint8_t sign = signbit(f) ? 0x80 : 0;
    float a = fabsf(f);
    if (a >= 448.0f) return sign | 0x7e;
    uint8_t code;
    if (a < 0.015625f) {  // below the smallest normal 2^-6: multiples of 2^-9
        code = (uint8_t)nearbyintf(a * 512.0f);  // 8 -> 0x08, the smallest normal: right
    } else {
        int e;
        const float m = frexpf(a, &e);  // a = m * 2^e, m in [0.5, 1)
        int q = (int)nearbyintf((m * 2.0f - 1.0f) * 8.0f);
        int exp = e - 1;
        if (q == 8) {
            q = 0;
            ++exp;
        }
        code = (uint8_t)(((exp + 7) << 3) | q);
        if (code > 0x7e) code = 0x7e;
    }
    return sign | code;
}
// (unsigned long long: the kernels' u64, which is not uint64_t's unsigned long on x86-64)
inline void st_release(unsigned long long* p, unsigned long long v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
inline unsigned long long ld_acquire(const unsigned long long* p) {
    spin_point();
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
inline int ld_volatile(const int* p) {
    spin_point();
    return __atomic_load_n(p, __ATOMIC_RELAXED);
}
inline unsigned long long ld_volatile(const unsigned long long* p) {
    spin_point();
    return __atomic_load_n(p, __ATOMIC_RELAXED);
}
}  // namespace emu
