// ll_combine.cu: low-latency combine, send and receive halves. Specialised with MOE_HIDDEN
// (0 = read at run time). Payload is bf16 both ways.
#include "low_latency.cuh"

static_assert(kHidden % 128 == 0, "specialised hidden sizes are multiples of 128");

// grid: (num_local, SPLIT), block: a multiple of 32 threads, >= num_ranks
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_COMBINE_SEND, 1)
moe_ll_combine_send(const u64* bases, i64 rank, i64 num_ranks, i64 timeout_ns,
                    i32* err_host, i32* err_dev, i64 op, i64 combine_off,
                    i64 max_tokens, const u16* x, i64 hidden, i64 num_local,
                    i64 rows_cap, const i64* recv_ranges,
                    const i64* return_base, i64 done_off, i64 done_stride,
                    i64 seq, i32* counter, i32* active) {
    const LLGroup g{bases, rank, num_ranks, timeout_ns, Active{active}};
    const LLBuffer lb{0, 0, 0, (u64)combine_off, 0, 0, max_tokens};
    ll_combine_send_body(g, ErrorSink{err_host, err_dev, (i32)op}, lb, x, hidden, num_local,
                         rows_cap, recv_ranges, return_base, (u64)done_off, (u64)done_stride,
                         (u32)seq, counter);
}

// grid: any (>= 1), block: a multiple of 32 threads, >= topk. Runs after moe_ll_wait has seen
// every rank's DONE.
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_COMBINE_RECV, 1)
moe_ll_combine_recv(const u64* bases, i64 rank, i64 num_ranks, i64 timeout_ns,
                    i32* err_host, i32* err_dev, i64 op, i64 combine_off,
                    i64 hidden, i64 num_tokens, i64 topk, i64 rows_cap,
                    const i64* topk_idx, const float* topk_w,
                    const i32* send_index, i64 free_off, i64 seq, u16* out,
                    i32* counter, i64 num_local, i32* active) {
    const LLGroup g{bases, rank, num_ranks, timeout_ns, Active{active}};
    const LLBuffer lb{0, 0, 0, (u64)combine_off, 0, 0, 0};
    ll_combine_recv_body(g, ErrorSink{err_host, err_dev, (i32)op}, lb, hidden, num_tokens, topk,
                         rows_cap, topk_idx, topk_w, send_index, (u64)free_off, (u32)seq, out,
                         counter, num_local);
}
