// fp8.cuh: BF16 -> FP8 (e4m3) with one float32 scale per 128 channels, as moe_comm/quant.py:
//   scale = max(amax(|x| over 128 channels), 1e-4) / 448
//   round_scale: scale rounded up to a power of two
//   data  = clamp(x / scale, -448, 448) cast to e4m3 (round to nearest even)
// and UE8M0 packing of power-of-two scales (byte = log2(scale) + 127, four per int32, channel
// block 4g+i in byte i of word g).
#pragma once
#include "common.cuh"

constexpr int kFp8Block = 128;
constexpr float kFp8Max = 448.0f;
constexpr float kMinAmax = 1e-4f;

// Smallest power of two >= s, for a positive normal float (exact, unlike exp2(ceil(log2))).
MOE_DEVICE float ceil_pow2(float s) {
    return __uint_as_float((__float_as_uint(s) + 0x007fffffu) & 0xff800000u);
}

// One warp quantises one 128-channel block: lane l owns channels 4l..4l+3. `src` points at the
// block's 128 bf16 values (any 2-byte alignment: the caller's x may be a view; 8-byte loads
// where it allows), `dst` at its 128 output bytes (4-byte aligned: a message row).
// Returns the block's scale (the same value in every lane).
template <bool kRoundScale>
MOE_DEVICE float quantize_block_e4m3(const u16* src, u8* dst) {
    const int lane = lane_id();
    const u16* mine = src + lane * 4;
    u16 v[4];
    if (aligned(src, 8)) {
        const uint2 raw = ld8(mine);
        v[0] = (u16)(raw.x & 0xffff), v[1] = (u16)(raw.x >> 16);
        v[2] = (u16)(raw.y & 0xffff), v[3] = (u16)(raw.y >> 16);
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = mine[j];
    }
    float f[4] = {bf16_to_f32(v[0]), bf16_to_f32(v[1]), bf16_to_f32(v[2]), bf16_to_f32(v[3])};
    float amax = fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3])));
    amax = warp_max(amax);
    // IEEE division (NVRTC's default -prec-div=true), so scales match torch's bit for bit.
    float scale = fmaxf(amax, kMinAmax) / kFp8Max;
    if (kRoundScale) scale = ceil_pow2(scale);
    float q[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = fminf(fmaxf(__fdiv_rn(f[j], scale), -kFp8Max), kFp8Max);
    const u32 packed = (u32)f32x2_to_e4m3x2(q[0], q[1]) | ((u32)f32x2_to_e4m3x2(q[2], q[3]) << 16);
    *(u32*)(dst + lane * 4) = packed;
    return scale;
}

// UE8M0 byte of a power-of-two scale: its biased exponent (= log2(scale) + 127).
MOE_DEVICE u32 ue8m0_byte(float pow2_scale) { return (__float_as_uint(pow2_scale) >> 23) & 0xffu; }
