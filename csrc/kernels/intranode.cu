// intranode.cu: the normal-mode kernels (and the layout kernel) for a group of any size up to
// kMaxRanks, whose buffers are reached through Transport (transport.cuh: peers mapped by CUDA
// IPC, others through the host proxy or IBGDA). One program for every group size (the rank
// count is the kernels' `num_ranks` argument), compiled by moe_comm/jit/nvrtc.py. Each
// kernel's parameters are MOE_ARGS_<kernel> (moe_comm/jit/kernel_args.py, through
// moe_generated.cuh).
#include "elastic.cuh"
#include "layout.cuh"
#include "normal.cuh"
#include "relay.cuh"

// The kernels that wait on every rank side by side keep one thread per rank (each wait has
// its own deadline); the others loop over ranks.
static_assert(MOE_THREADS_NOTIFY >= kMaxRanks && MOE_THREADS_WAIT_DONE >= kMaxRanks &&
                  MOE_THREADS_AGREE >= kMaxRanks,
              "one thread per rank: variants.THREADS must cover MAX_RANKS");

// The structs the bodies take, built from the parameters every kernel of a group shares
// (kernel_args.GROUP and ERRORS).
#define MOE_GROUP                                                                            \
    Group {                                                                                  \
        bases, rank, num_ranks, (u64)data_off, (u64)capacity, timeout_ns, Active{active}, floors \
    }
#define MOE_ERRORS ErrorSink{err_host, err_dev, (i32)op}

// grid: R + (per_expert ? ceil(E / kExpertsPerBlock) : 0) blocks
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LAYOUT, 1)
moe_layout(MOE_ARGS_moe_layout) {
    layout_body(topk_idx, num_tokens, topk, num_experts, (int)num_ranks, per_rank, per_expert,
                in_rank, send_pos);
}

// grid 1, block >= R
// call0..7: the call's signature (wire.NORMAL_CALL_FIELDS), call_off: CALL[parity][0]
MOE_KERNEL void __launch_bounds__(MOE_THREADS_NOTIFY, 1)
moe_notify(MOE_ARGS_moe_notify) {
    notify_body(MOE_GROUP, MOE_ERRORS, (u64)notify_off, row_words, (u32)epoch, counts, matrix,
                (u64)call_off, MOE_CALL_ROW, host_counts, num_hosts, host_matrix);
}

// grid 1, block >= R
MOE_KERNEL void __launch_bounds__(MOE_THREADS_WAIT_DONE, 1)
moe_wait_done(MOE_ARGS_moe_wait_done) {
    wait_done_body(MOE_GROUP, MOE_ERRORS, (u64)done_off, (u64)done_stride, (u32)epoch);
}

MOE_KERNEL void __launch_bounds__(MOE_THREADS_DISPATCH_SEND, 1)
moe_dispatch_send(MOE_ARGS_moe_dispatch_send) {
    dispatch_send_body(MOE_GROUP, MOE_ERRORS, x, num_tokens, row_bytes, scales, scale_cols,
                       topk_idx, topk_w, topk, num_local, send_pos, matrix, worst, chunk, first,
                       (u64)done_off, (u64)done_stride, (u32)epoch, counter);
}

MOE_KERNEL void __launch_bounds__(MOE_THREADS_DISPATCH_COPY_OUT, 1)
moe_dispatch_copy_out(MOE_ARGS_moe_dispatch_copy_out) {
    dispatch_copy_out_body(MOE_GROUP, row_bytes, scale_cols, topk, matrix, worst, chunk, first,
                           rows_out, recv_x, recv_scales, recv_idx, recv_w, expert_counts,
                           num_local);
}

MOE_KERNEL void __launch_bounds__(MOE_THREADS_COMBINE_SEND, 1)
moe_combine_send(MOE_ARGS_moe_combine_send) {
    combine_send_body(MOE_GROUP, MOE_ERRORS, x, row_bytes, topk_w, topk, matrix, chunk, first,
                      (u64)done_off, (u64)done_stride, (u32)epoch, counter);
}

// streamed combine: one round's staging rows into the local tensor the reduce reads
MOE_KERNEL void __launch_bounds__(MOE_THREADS_COMBINE_STAGE, 1)
moe_combine_stage(MOE_ARGS_moe_combine_stage) {
    combine_stage_body(MOE_GROUP, row_bytes, topk, chunk, first, rows, total, staged);
}

// One reduce kernel per element type; MOE_ARGS_<NAME> declares `out` as ELEM::Storage*
// (kernel_args._REDUCE), and a mismatch fails to compile.
#define MOE_REDUCE_KERNEL(NAME, ELEM, THREADS)                                              \
    MOE_KERNEL void __launch_bounds__(THREADS, 1) NAME(MOE_ARGS_##NAME) {                  \
        combine_reduce_body<ELEM>(MOE_GROUP, hidden, topk, matrix, send_pos, num_tokens,    \
                                  bias0, bias1, out, w_out, staged);                        \
    }
MOE_REDUCE_KERNEL(moe_combine_reduce_bf16, Bf16, MOE_THREADS_COMBINE_REDUCE_BF16)
MOE_REDUCE_KERNEL(moe_combine_reduce_f16, F16, MOE_THREADS_COMBINE_REDUCE_F16)
MOE_REDUCE_KERNEL(moe_combine_reduce_f32, F32, MOE_THREADS_COMBINE_REDUCE_F32)

// ---- hierarchical normal mode (relay.cuh, moe_comm/cuda/relay.py) ----
MOE_KERNEL void __launch_bounds__(MOE_THREADS_RELAY_STAGE, 1)
moe_relay_stage(MOE_ARGS_moe_relay_stage) {
    relay_stage_body(MOE_GROUP, MOE_ERRORS, x, num_tokens, row_bytes, scales, scale_cols,
                     topk_idx, topk_w, topk, send_pos, host_pos, num_hosts, relay_of, ranks_on,
                     mask_cols, stage_off, stage_rows, stage_row0, done_to, (u64)done_off,
                     (u64)done_stride, (u32)epoch, counter);
}

// grid: one block per job at most
MOE_KERNEL void __launch_bounds__(MOE_THREADS_RELAY_FORWARD, 1)
moe_relay_forward(MOE_ARGS_moe_relay_forward) {
    relay_forward_body(MOE_GROUP, MOE_ERRORS, row_bytes, scale_cols, topk, num_local, mask_cols,
                       stage_off, stage_rows, jobs, num_jobs, out_rows, relay_pos, num_here,
                       done_to, (u64)done_off, (u64)done_stride, (u32)epoch, counter);
}

MOE_KERNEL void __launch_bounds__(MOE_THREADS_RELAY_RANGES, 1)
moe_relay_ranges(MOE_ARGS_moe_relay_ranges) {
    relay_ranges_body(MOE_GROUP, MOE_ERRORS, x, row_bytes, topk_w, topk, jobs, ends, num_jobs,
                      done_to, (u64)done_off, (u64)done_stride, (u32)epoch, counter);
}

#define MOE_RELAY_REDUCE_KERNEL(NAME, ELEM, THREADS)                                        \
    MOE_KERNEL void __launch_bounds__(THREADS, 1) NAME(MOE_ARGS_##NAME) {                  \
        relay_reduce_body<ELEM>(MOE_GROUP, MOE_ERRORS, hidden, topk, gather_off, gather_rows, \
                                jobs, ends, num_jobs, relay_pos, num_here, done_to,         \
                                (u64)done_off, (u64)done_stride, (u32)epoch, counter);      \
    }
MOE_RELAY_REDUCE_KERNEL(moe_relay_reduce_bf16, Bf16, MOE_THREADS_RELAY_REDUCE_BF16)
MOE_RELAY_REDUCE_KERNEL(moe_relay_reduce_f16, F16, MOE_THREADS_RELAY_REDUCE_F16)
MOE_RELAY_REDUCE_KERNEL(moe_relay_reduce_f32, F32, MOE_THREADS_RELAY_REDUCE_F32)

// grid 1, block >= R: elastic mode's mask agreement (elastic.cuh); the LL calls use it too
MOE_KERNEL void __launch_bounds__(MOE_THREADS_AGREE, 1)
moe_agree(MOE_ARGS_moe_agree) {
    agree_body(bases, (int)rank, (int)num_ranks, timeout_ns, MOE_ERRORS, active, told,
               (u64)mask_off, (u64)decided_off, (u64)fence_off, (u64)row_stride, (int)mask_words,
               (u32)seq, (u32)tag0, (int)max_rounds, matrix, floors);
}
