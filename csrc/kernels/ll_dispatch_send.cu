// ll_dispatch_send.cu: low-latency dispatch, send half. Specialised by moe_comm/jit/variants.py
// with MOE_HIDDEN (0 = read at run time), MOE_FP8 (cast to e4m3 + per-128 scales in the
// kernel) and MOE_ROUND_SCALE (power-of-two scales).
#include "low_latency.cuh"

#ifndef MOE_FP8
#error "MOE_FP8 must be defined (0 or 1)"
#endif
#ifndef MOE_ROUND_SCALE
#define MOE_ROUND_SCALE 0
#endif
static_assert(MOE_FP8 || !MOE_ROUND_SCALE, "round_scale needs fp8");
static_assert(kHidden % 128 == 0, "specialised hidden sizes are multiples of 128");

// grid: up to E blocks, block <= 1024 threads (a multiple of 32)
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_DISPATCH_SEND, 1)
moe_ll_dispatch_send(const u64* bases, i64 rank, i64 num_ranks, i64 timeout_ns,
                     i32* err_host, i32* err_dev, i64 op, i64 payload_off,
                     i64 meta_off, i64 counts_off, i64 count_row_words,
                     i64 stride, i64 max_tokens, const u16* x, i64 num_tokens,
                     i64 hidden, const i64* topk_idx, i64 topk, i64 num_experts,
                     i32* send_index, i64 seq, i32* active, i64 call_off,
                     MOE_CALL_ARGS) {
    const LLGroup g{bases, rank, num_ranks, timeout_ns, Active{active}};
    const LLBuffer lb{(u64)payload_off, (u64)meta_off, (u64)counts_off, 0, count_row_words,
                      stride, max_tokens};
    ll_dispatch_send_body<MOE_FP8 != 0, MOE_ROUND_SCALE != 0>(
        g, ErrorSink{err_host, err_dev, (i32)op}, lb, x, num_tokens, hidden, topk_idx, topk,
        num_experts, send_index, (u32)seq, (u64)call_off, MOE_CALL_ROW);
}
