// intranode.cu: the normal-mode kernels (and the layout kernel) for a group of MOE_NUM_RANKS
// ranks whose buffers are mapped into each other through CUDA IPC. Compiled once per group
// size by moe_comm/jit/nvrtc.py (NVRTC, -DMOE_NUM_RANKS=R); every kernel takes only 8-byte
// arguments (pointers and int64), in the order moe_comm/cuda/normal.py passes them.
#include "elastic.cuh"
#include "layout.cuh"
#include "normal.cuh"

#ifndef MOE_NUM_RANKS
#error "MOE_NUM_RANKS must be defined (1..8)"
#endif
constexpr int R = MOE_NUM_RANKS;
static_assert(R >= 1 && R <= 8, "intranode groups have 1..8 ranks");

#define MOE_GROUP_ARGS \
    const u64 *bases, i64 rank, i64 data_off, i64 capacity, i64 timeout_ns, i32 *active
#define MOE_ERROR_ARGS i32 *err_host, i32 *err_dev, i64 op
#define MOE_GROUP Group{bases, rank, (u64)data_off, (u64)capacity, timeout_ns, Active{active}}
#define MOE_ERRORS ErrorSink{err_host, err_dev, (i32)op}

// grid: R + (per_expert ? ceil(E / kExpertsPerBlock) : 0) blocks
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LAYOUT, 1)
moe_layout(const i64* topk_idx, i64 num_tokens, i64 topk, i64 num_experts, i32* per_rank,
           i32* per_expert, u8* in_rank, i32* send_pos) {
    layout_body<R>(topk_idx, num_tokens, topk, num_experts, per_rank, per_expert, in_rank,
                   send_pos);
}

// grid 1, block 32
// call0..7: the call's signature (wire.NORMAL_CALL_FIELDS), call_off: CALL[parity][0]
MOE_KERNEL void __launch_bounds__(MOE_THREADS_NOTIFY, 1)
moe_notify(MOE_GROUP_ARGS, MOE_ERROR_ARGS, i64 notify_off, i64 row_words, i64 epoch,
           const i32* counts, i32* matrix, i64 call_off, MOE_CALL_ARGS) {
    notify_body<R>(MOE_GROUP, MOE_ERRORS, (u64)notify_off, row_words, (u32)epoch, counts, matrix,
                   (u64)call_off, MOE_CALL_ROW);
}

// grid 1, block 32
MOE_KERNEL void __launch_bounds__(MOE_THREADS_WAIT_DONE, 1)
moe_wait_done(MOE_GROUP_ARGS, MOE_ERROR_ARGS, i64 done_off, i64 done_stride, i64 epoch) {
    wait_done_body<R>(MOE_GROUP, MOE_ERRORS, (u64)done_off, (u64)done_stride, (u32)epoch);
}

MOE_KERNEL void __launch_bounds__(MOE_THREADS_DISPATCH_SEND, 1)
moe_dispatch_send(MOE_GROUP_ARGS, MOE_ERROR_ARGS, const u8* x, i64 num_tokens, i64 row_bytes,
                  const float* scales, i64 scale_cols, const i64* topk_idx, const float* topk_w,
                  i64 topk, i64 num_local, const i32* send_pos, const i32* matrix, i64 worst,
                  i64 done_off, i64 done_stride, i64 epoch, i32* counter) {
    dispatch_send_body<R>(MOE_GROUP, MOE_ERRORS, x, num_tokens, row_bytes, scales, scale_cols,
                          topk_idx, topk_w, topk, num_local, send_pos, matrix, worst,
                          (u64)done_off, (u64)done_stride, (u32)epoch, counter);
}

MOE_KERNEL void __launch_bounds__(MOE_THREADS_DISPATCH_COPY_OUT, 1)
moe_dispatch_copy_out(MOE_GROUP_ARGS, i64 row_bytes, i64 scale_cols, i64 topk, const i32* matrix,
                      i64 worst, i64 rows_out, u8* recv_x, float* recv_scales, i64* recv_idx,
                      float* recv_w, i32* expert_counts, i64 num_local) {
    dispatch_copy_out_body<R>(MOE_GROUP, row_bytes, scale_cols, topk, matrix, worst, rows_out,
                              recv_x, recv_scales, recv_idx, recv_w, expert_counts, num_local);
}

MOE_KERNEL void __launch_bounds__(MOE_THREADS_COMBINE_SEND, 1)
moe_combine_send(MOE_GROUP_ARGS, MOE_ERROR_ARGS, const u8* x, i64 row_bytes, const float* topk_w,
                 i64 topk, const i32* matrix, i64 done_off, i64 done_stride, i64 epoch,
                 i32* counter) {
    combine_send_body<R>(MOE_GROUP, MOE_ERRORS, x, row_bytes, topk_w, topk, matrix,
                         (u64)done_off, (u64)done_stride, (u32)epoch, counter);
}

#define MOE_REDUCE_KERNEL(NAME, ELEM, THREADS)                                               \
    MOE_KERNEL void __launch_bounds__(THREADS, 1)                                              \
        NAME(MOE_GROUP_ARGS, i64 hidden, i64 topk, const i32* matrix, const i32* send_pos,  \
             i64 num_tokens, const float* bias0, const float* bias1, ELEM::Storage* out,    \
             float* w_out) {                                                                \
        combine_reduce_body<R, ELEM>(MOE_GROUP, hidden, topk, matrix, send_pos, num_tokens, \
                                     bias0, bias1, out, w_out);                             \
    }
MOE_REDUCE_KERNEL(moe_combine_reduce_bf16, Bf16, MOE_THREADS_COMBINE_REDUCE_BF16)
MOE_REDUCE_KERNEL(moe_combine_reduce_f16, F16, MOE_THREADS_COMBINE_REDUCE_F16)
MOE_REDUCE_KERNEL(moe_combine_reduce_f32, F32, MOE_THREADS_COMBINE_REDUCE_F32)

// grid 1, block 64 (kMaxErrorRanks): elastic mode's mask agreement (elastic.cuh); the LL calls
// use it too (it does not depend on R)
MOE_KERNEL void __launch_bounds__(MOE_THREADS_AGREE, 1)
moe_agree(const u64* bases, i64 rank, i64 num_ranks, i64 timeout_ns, MOE_ERROR_ARGS, i32* active,
          i32* told, i64 mask_off, i64 decided_off, i64 fence_off, i64 row_stride,
          i64 mask_words, i64 seq, i64 tag0, i64 max_rounds, i32* matrix) {
    agree_body(bases, (int)rank, (int)num_ranks, timeout_ns, MOE_ERRORS, active, told,
               (u64)mask_off, (u64)decided_off, (u64)fence_off, (u64)row_stride, (int)mask_words,
               (u32)seq, (u32)tag0, (int)max_rounds, matrix);
}
