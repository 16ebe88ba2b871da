// layout.cuh: where each token goes (moe_comm/layout.py's dispatch_layout, plus the send
// positions normal dispatch needs).
//
// Experts are owned contiguously: rank d owns experts [d * L, (d + 1) * L), L = E / R.
// Outputs (any may be null):
//   per_rank   int32 [R]     tokens sent to rank d (once per token however many experts there)
//   per_expert int32 [E]     (token, slot) pairs routed to expert e
//   in_rank    bool  [T, R]  token t goes to rank d
//   send_pos   int32 [T, R]  t's index among this rank's tokens for d (-1 if not sent): the row
//                            offset of t inside the block this rank writes at d, which keeps
//                            the receive order "by source rank, then token index".
// Grid: R blocks (one per destination rank: a block-wide scan over tokens in order), then
// ceil(E / kExpertsPerBlock) blocks for per_expert (shared-memory histograms).
#pragma once
#include "common.cuh"

// kExpertsPerBlock: moe_generated.cuh (jit/variants.py EXPERTS_PER_LAYOUT_BLOCK)

__device__ void layout_body(const i64* topk_idx, i64 num_tokens, i64 topk, i64 num_experts,
                            int R, i32* per_rank, i32* per_expert, u8* in_rank, i32* send_pos) {
    __shared__ int warp_counts[32];
    __shared__ int hist[kExpertsPerBlock];
    const i64 num_local = num_experts / R;
    if ((int)blockIdx.x < R) {
        const int d = blockIdx.x;
        const i64 lo = d * num_local, hi = lo + num_local;
        int running = 0;
        // Every thread runs the same number of iterations: block_scan_flags has barriers.
        for (i64 base = 0; base < num_tokens; base += blockDim.x) {
            const i64 t = base + threadIdx.x;
            bool flag = false;
            if (t < num_tokens) {
                for (i64 k = 0; k < topk; ++k) {
                    const i64 e = topk_idx[t * topk + k];
                    flag |= e >= lo && e < hi;  // -1 (unused slot) is never in range
                }
            }
            int total;
            const int pos = block_scan_flags(flag, warp_counts, &total);
            if (t < num_tokens) {
                if (in_rank) in_rank[t * R + d] = flag ? 1 : 0;
                if (send_pos) send_pos[t * R + d] = flag ? running + pos : -1;
            }
            running += total;
        }
        if (per_rank && threadIdx.x == 0) per_rank[d] = running;
        return;
    }
    if (!per_expert) return;
    const i64 e0 = (i64)(blockIdx.x - R) * kExpertsPerBlock;
    const int n = (int)min_of<i64>(kExpertsPerBlock, num_experts - e0);
    for (int i = threadIdx.x; i < n; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (i64 i = threadIdx.x; i < num_tokens * topk; i += blockDim.x) {
        const i64 e = topk_idx[i];
        if (e >= e0 && e < e0 + n) atomicAdd(&hist[e - e0], 1);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) per_expert[e0 + i] = hist[i];
}
