// ll_dispatch_recv.cu: low-latency dispatch, receive half (the hook). Specialised with
// MOE_HIDDEN (0 = run time), MOE_FP8 (messages carry e4m3 + f32 scales) and MOE_UE8M0 (scales
// handed out as packed UE8M0 bytes, four per int32).
#include "low_latency.cuh"

#ifndef MOE_FP8
#error "MOE_FP8 must be defined (0 or 1)"
#endif
#ifndef MOE_UE8M0
#define MOE_UE8M0 0
#endif
static_assert(MOE_FP8 || !MOE_UE8M0, "UE8M0 scales need fp8");
static_assert(kHidden % 128 == 0, "specialised hidden sizes are multiples of 128");

// ---- dispatch call check ----------------------------------------------------------------
// grid 1, one thread per source s: s's signature of call `seq` in LL_CALL[buf][s] (call_off =
// LL_CALL[buf][0]) equals this rank's, else kErrMismatch (every rank sees every signature, so
// all fail this call; the receive kernel then reads nothing and frees the buffer).
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_CHECK_CALL, 1)
moe_ll_check_call(const u64* bases, i64 rank, i64 num_ranks, i64 timeout_ns, i32* err_host,
                  i32* err_dev, i64 op, i64 call_off, i64 seq, i32* active, MOE_CALL_ARGS) {
    const LLGroup g{bases, rank, num_ranks, timeout_ns, Active{active}};
    const Transport t{bases, ErrorSink{err_host, err_dev, (i32)op}};
    const int s = threadIdx.x;
    if (t.err.aborted() || s >= g.num_ranks) return;
    same_call(t, g.live, (const u64*)g.own((u64)call_off + (u64)s * kCallWords * 8), (u32)seq,
              g.timeout_ns, s, MOE_CALL_ROW);
}

// grid: (num_local, SPLIT), block: a multiple of 32 threads, >= num_ranks. Runs after
// moe_ll_wait has seen every source's count row.
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_DISPATCH_RECV, 1)
moe_ll_dispatch_recv(const u64* bases, i64 rank, i64 num_ranks, i64 timeout_ns,
                     i32* err_host, i32* err_dev, i64 op, i64 payload_off,
                     i64 meta_off, i64 counts_off, i64 count_row_words,
                     i64 stride, i64 max_tokens, i64 hidden, i64 num_local,
                     i64 free_off, i64 seq, u8* recv_x, void* recv_scales,
                     i32* recv_count, i32* stats, i64* recv_meta,
                     i64* recv_ranges, i64* return_base, i32* counter,
                     i32* active) {
    const LLGroup g{bases, rank, num_ranks, timeout_ns, Active{active}};
    const LLBuffer lb{(u64)payload_off, (u64)meta_off, (u64)counts_off, 0, count_row_words,
                      stride, max_tokens};
    ll_dispatch_recv_body<MOE_FP8 != 0, MOE_UE8M0 != 0>(
        g, ErrorSink{err_host, err_dev, (i32)op}, lb, hidden, num_local, (u64)free_off,
        (u32)seq, recv_x, recv_scales, recv_count, stats, recv_meta, recv_ranges, return_base,
        counter);
}
