// common.cuh: integer types, lane helpers, dtype conversions and the warp copy used by every
// moe_comm kernel.
//
// No CUDA or C++ standard header is included anywhere in csrc/kernels: NVRTC compiles these
// files with only this folder on the include path, so the same sources build on a CPU-only CI
// machine (no toolkit headers needed) and on the GPU machine. Conversions are inline PTX
// (cvt.*), which is also what cuda_bf16.h / cuda_fp8.h would emit on sm_90 and sm_100.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// Generated from Python (moe_comm/jit/device_header.py), found on the include path every build
// adds: the wire-format constants of moe_comm/wire.py (kPage, kSignalStride, kFenceOffset, ...)
// and every kernel's parameter list as MOE_ARGS_<kernel> (moe_comm/jit/kernel_args.py).
#include "moe_generated.cuh"

#define MOE_DEVICE __device__ __forceinline__

// Kernels are declared `name(MOE_ARGS_name)`. Their parameters are all 8 bytes wide (pointers,
// i64 scalars): the Python launcher passes every argument as one numpy 64-bit scalar.
#define MOE_KERNEL extern "C" __global__

constexpr int kWarpSize = 32;
constexpr u32 kFullMask = 0xffffffffu;

MOE_DEVICE int lane_id() { return threadIdx.x & (kWarpSize - 1); }
MOE_DEVICE int warp_id() { return threadIdx.x / kWarpSize; }
MOE_DEVICE int warps_per_block() { return blockDim.x / kWarpSize; }

template <typename T>
MOE_DEVICE T min_of(T a, T b) { return a < b ? a : b; }
template <typename T>
MOE_DEVICE T max_of(T a, T b) { return a > b ? a : b; }

MOE_DEVICE u64 round_up(u64 n, u64 m) { return (n + m - 1) / m * m; }

// ---- dtype conversions (round to nearest even, like torch's casts) --------------------------
MOE_DEVICE float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
#ifdef MOE_EMU  // the CPU kernel emulator (csrc/emu): the same conversions in C++
MOE_DEVICE u16 f32_to_bf16(float f) { return emu::f32_to_bf16_rn(f); }
MOE_DEVICE float f16_to_f32(u16 h) { return emu::f16_to_f32(h); }
MOE_DEVICE u16 f32_to_f16(float f) { return emu::f32_to_f16_rn(f); }
MOE_DEVICE u16 f32x2_to_e4m3x2(float lo, float hi) {
    return (u16)(emu::f32_to_e4m3_satfinite(lo) | (emu::f32_to_e4m3_satfinite(hi) << 8));
}
#else
MOE_DEVICE u16 f32_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
MOE_DEVICE float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
MOE_DEVICE u16 f32_to_f16(float f) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
// Two floats -> two e4m3 bytes, `lo` in the low byte (element order in memory). satfinite
// clamps to +-448 like the clamp in moe_comm/quant.py (inputs are clamped already anyway).
MOE_DEVICE u16 f32x2_to_e4m3x2(float lo, float hi) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
#endif

// Element types of combine inputs/outputs: storage type + float conversion.
struct Bf16 {
    typedef u16 Storage;
    static MOE_DEVICE float to_f32(Storage v) { return bf16_to_f32(v); }
    static MOE_DEVICE Storage from_f32(float f) { return f32_to_bf16(f); }
};
struct F16 {
    typedef u16 Storage;
    static MOE_DEVICE float to_f32(Storage v) { return f16_to_f32(v); }
    static MOE_DEVICE Storage from_f32(float f) { return f32_to_f16(f); }
};
struct F32 {
    typedef float Storage;
    static MOE_DEVICE float to_f32(Storage v) { return v; }
    static MOE_DEVICE Storage from_f32(float f) { return f; }
};

// ---- vector accesses ---------------------------------------------------------------------
// A misaligned vector access faults on a GPU and the CUDA context is lost with it, so every
// 8- and 16-byte access goes through these, after the caller checked `aligned` (or knows it:
// its own buffer's layout); under the emulator they check again and fail the launch instead.
MOE_DEVICE bool aligned(const void* p, u64 bytes) { return ((u64)p & (bytes - 1)) == 0; }
#ifdef MOE_EMU
MOE_DEVICE void emu_check_aligned(const void* p, u64 bytes) {
    if (!aligned(p, bytes)) emu::fail("misaligned vector access (a GPU faults here)");
}
MOE_DEVICE uint4 ld16(const void* p) {
    emu_check_aligned(p, 16);
    uint4 v;
    memcpy(&v, p, 16);
    return v;
}
MOE_DEVICE void st16(void* p, uint4 v) {
    emu_check_aligned(p, 16);
    memcpy(p, &v, 16);
}
MOE_DEVICE uint2 ld8(const void* p) {
    emu_check_aligned(p, 8);
    uint2 v;
    memcpy(&v, p, 8);
    return v;
}
#else
MOE_DEVICE uint4 ld16(const void* p) { return *(const uint4*)p; }
MOE_DEVICE void st16(void* p, uint4 v) { *(uint4*)p = v; }
MOE_DEVICE uint2 ld8(const void* p) { return *(const uint2*)p; }
#endif

// ---- warp reductions ---------------------------------------------------------------------
MOE_DEVICE float warp_max(float v) {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
    return v;
}
MOE_DEVICE float warp_min(float v) {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o /= 2) v = fminf(v, __shfl_xor_sync(kFullMask, v, o));
    return v;
}

// ---- warp copy ---------------------------------------------------------------------------
// Copies `bytes` from `src` to `dst` with the 32 lanes of one warp: 16-byte accesses when both
// addresses and the size allow (every row of a bf16/fp8 hidden size that is a multiple of 16
// bytes does), else 4-byte, else 1-byte. Four loads are issued before their stores so each lane
// keeps several requests in flight (the copy is latency bound over NVLink otherwise).
// `src` must not change while the kernel runs (it may be read through the read-only path).
MOE_DEVICE void warp_copy(void* dst, const void* src, u64 bytes) {
    const int lane = lane_id();
    const u64 bits = (u64)dst | (u64)src | bytes;
    if ((bits & 15) == 0) {
        uint4* d = (uint4*)dst;
        const uint4* s = (const uint4*)src;
        const u64 n = bytes / 16;
        u64 i = lane;
        for (; i + 3 * kWarpSize < n; i += 4 * kWarpSize) {
            const uint4 v0 = ld16(s + i), v1 = ld16(s + i + kWarpSize),
                        v2 = ld16(s + i + 2 * kWarpSize), v3 = ld16(s + i + 3 * kWarpSize);
            st16(d + i, v0);
            st16(d + i + kWarpSize, v1);
            st16(d + i + 2 * kWarpSize, v2);
            st16(d + i + 3 * kWarpSize, v3);
        }
        for (; i < n; i += kWarpSize) st16(d + i, ld16(s + i));
    } else if ((bits & 3) == 0) {
        u32* d = (u32*)dst;
        const u32* s = (const u32*)src;
        for (u64 i = lane; i < bytes / 4; i += kWarpSize) d[i] = s[i];
    } else {
        u8* d = (u8*)dst;
        const u8* s = (const u8*)src;
        for (u64 i = lane; i < bytes; i += kWarpSize) d[i] = s[i];
    }
}

// Fill `bytes` at `dst` with the byte `value` (padding rows), one warp.
MOE_DEVICE void warp_fill(void* dst, u8 value, u64 bytes) {
    const int lane = lane_id();
    const u32 word = value * 0x01010101u;
    if ((((u64)dst | bytes) & 3) == 0) {
        u32* d = (u32*)dst;
        for (u64 i = lane; i < bytes / 4; i += kWarpSize) d[i] = word;
    } else {
        u8* d = (u8*)dst;
        for (u64 i = lane; i < bytes; i += kWarpSize) d[i] = value;
    }
}

// Index of the lowest set bit of a non-zero mask (what __ffs(mask) - 1 gives).
MOE_DEVICE int lowest_bit(u32 mask) { return __popc((mask & (0u - mask)) - 1u); }

// ---- segments ------------------------------------------------------------------------------
// Rows grouped by rank into consecutive segments, segment s ending (exclusive) at ends[s]
// (non-decreasing): the segment holding row i, the first s with i < ends[s] (n - 1 if none).
// A binary search: a scan from rank 0 costs O(R) a row in groups of hundreds of ranks.
MOE_DEVICE int segment_of(const i64* ends, int n, i64 i) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (i < ends[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

// ---- block-wide exclusive scan of per-thread flags (0/1) ------------------------------------
// Returns the number of set flags in threads below this one; *total gets the block's count.
// `warp_counts` is shared scratch of at least 32 ints. All threads of the block must call it.
MOE_DEVICE int block_scan_flags(bool flag, int* warp_counts, int* total) {
    const int lane = lane_id(), warp = warp_id(), nwarps = warps_per_block();
    const u32 ballot = __ballot_sync(kFullMask, flag);
    const int in_warp = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < nwarps; ++w) {
        const int c = warp_counts[w];
        before += w < warp ? c : 0;
        sum += c;
    }
    __syncthreads();  // warp_counts may be rewritten by the next call
    *total = sum;
    return before + in_warp;
}
