// logfmt.cuh: LogFMT (moe_comm/logfmt.py) on the device, for low-latency combine with
// use_logfmt=True. The same bytes as the Python encoder (logfmt.decode reads them): per row of
// H channels, H/128 block headers {float32 low, float32 top} (log2|x| range kept), then the
// blocks' ten-bit codes (sign << 9 | level, level 0 = zero, 1..kLogfmtLevels spread evenly
// over [low, top] in the log domain), four codes in five bytes, little-endian.
//
// Encoding: one warp per block of 128 channels, each lane four consecutive channels (so a
// lane's four codes are exactly one 5-byte group); the block's range is a warp max / min of
// log2|x|. Codes may differ from the Python encoder by one level where log2f and torch's log2
// differ in the last bit at a rounding boundary; ranges and decoding are the same formulas.
#pragma once
#include "common.cuh"

constexpr int kLogfmtGroups = kLogfmtBlock / 4;             // 5-byte groups of a block: a warp
constexpr int kLogfmtStageWords = kLogfmtCodeBytes / 4;     // a block's codes as u32 words
static_assert(kLogfmtGroups == kWarpSize, "LogFMT: one lane per four channels of a block");
static_assert(kLogfmtCodeBytes == kLogfmtGroups * 5, "LogFMT: four 10-bit codes in 5 bytes");

MOE_DEVICE u64 logfmt_row_bytes(i64 hidden) {
    return (u64)(hidden / kLogfmtBlock) * (kLogfmtHeaderBytes + kLogfmtCodeBytes);
}

MOE_DEVICE float neg_inf() { return __uint_as_float(0xff800000u); }
MOE_DEVICE float pos_inf() { return __uint_as_float(0x7f800000u); }

// The level step of a block's range (logfmt.py: span / (LEVELS - 1), 1 for an empty span).
MOE_DEVICE float logfmt_step(float low, float top) {
    return top > low ? __fdiv_rn(top - low, (float)(kLogfmtLevels - 1)) : 1.0f;
}

// One warp, one block: `v` = this lane's four channels. Returns the lane's 40-bit group (its
// four codes, channel 4*lane + j at bits 10j); *low / *top get the block's range (every lane).
MOE_DEVICE u64 logfmt_encode_group(const float v[4], float* low, float* top) {
    float logs[4];
    float hi = neg_inf();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        logs[j] = v[j] != 0.0f ? log2f(fabsf(v[j])) : neg_inf();
        hi = fmaxf(hi, logs[j]);
    }
    hi = warp_max(hi);
    bool kept[4];
    float lo = pos_inf();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        // values more than 2^-LOG_RANGE below the block's largest go as zero (logfmt.py)
        kept[j] = v[j] != 0.0f && logs[j] >= hi - (float)kLogfmtLogRange;
        if (kept[j]) lo = fminf(lo, logs[j]);
    }
    lo = warp_min(lo);
    if (hi == neg_inf()) lo = hi = 0.0f;  // an all-zero block: range (0, 0), every code 0
    const float step = logfmt_step(lo, hi);
    u64 group = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 code = 0;
        if (kept[j]) {
            const float q = rintf(__fdiv_rn(logs[j] - lo, step));  // half to even, as torch
            code = (u32)fminf(fmaxf(q, 0.0f), (float)(kLogfmtLevels - 1)) + 1;
            if (v[j] < 0.0f) code |= 1u << 9;
        }
        group |= (u64)code << (10 * j);
    }
    *low = lo;
    *top = hi;
    return group;
}

// One warp: encode bf16 `x_row` [hidden] into `row` (logfmt_row_bytes(hidden) bytes, 4-byte
// aligned: a peer's combine row or a network rank's mirror). The codes are staged per block
// in `stage` (this warp's kLogfmtStageWords words of shared memory) and stored as u32 words,
// so a peer's memory gets 4-byte stores over NVLink instead of five byte stores per lane.
MOE_DEVICE void logfmt_encode_row_warp(u8* row, const u16* x_row, i64 hidden, u32* stage) {
    const int lane = lane_id();
    const i64 blocks = hidden / kLogfmtBlock;
    u8* codes = row + blocks * kLogfmtHeaderBytes;
    for (i64 b = 0; b < blocks; ++b) {
        const u16* src = x_row + b * kLogfmtBlock + lane * 4;
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = bf16_to_f32(src[j]);
        float low, top;
        const u64 group = logfmt_encode_group(v, &low, &top);
        u8* staged = (u8*)stage + lane * 5;
#pragma unroll
        for (int k = 0; k < 5; ++k) staged[k] = (u8)(group >> (8 * k));
        if (lane == 0) {
            float* range = (float*)(row + b * kLogfmtHeaderBytes);
            range[0] = low;
            range[1] = top;
        }
        __syncwarp();
        u32* out = (u32*)(codes + b * kLogfmtCodeBytes);
        for (int w = lane; w < kLogfmtStageWords; w += kWarpSize) out[w] = stage[w];
        __syncwarp();  // `stage` is rewritten for the next block
    }
}

// Decode channels 4g .. 4g+3 of an encoded row (logfmt.decode's formulas) into `out`.
MOE_DEVICE void logfmt_decode_group(const u8* row, i64 hidden, i64 g, float out[4]) {
    const i64 b = g / kLogfmtGroups;
    const float* range = (const float*)(row + b * kLogfmtHeaderBytes);
    const float low = range[0], top = range[1];
    const float step = logfmt_step(low, top);
    const u8* p = row + (hidden / kLogfmtBlock) * kLogfmtHeaderBytes + g * 5;
    u64 group = 0;
#pragma unroll
    for (int k = 0; k < 5; ++k) group |= (u64)p[k] << (8 * k);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 code = (u32)(group >> (10 * j)) & 0x3ffu;
        const u32 level = code & (u32)kLogfmtLevels;
        const float mag = level ? exp2f(low + (float)(level - 1) * step) : 0.0f;
        out[j] = (code >> 9) ? -mag : mag;
    }
}
