// ll.cu: the low-latency kernels' entries over the bodies of low_latency.cuh. One program per
// variant of moe_comm/jit/variants.py, specialised with MOE_HIDDEN (0 = read at run time) and,
// for the dispatch halves, MOE_FP8 (e4m3 messages + f32 scales) with MOE_ROUND_SCALE
// (send: power-of-two scales) or MOE_UE8M0 (receive: scales handed out as packed UE8M0 bytes,
// four per int32).
//
// A variant compiles only the kernels it lists: it defines MOE_THREADS_<KERNEL> (the launch
// bound) for exactly those, so each entry below is guarded by its own bound. The dispatch
// send, dispatch receive and combine programs stay separate compiles (as small as before);
// moe_ll_wait is in all three.
#include "low_latency.cuh"

static_assert(kHidden % 128 == 0, "specialised hidden sizes are multiples of 128");
#if defined(MOE_THREADS_LL_DISPATCH_SEND) || defined(MOE_THREADS_LL_DISPATCH_RECV)
#ifndef MOE_FP8
#error "the LL dispatch kernels need MOE_FP8 (0 or 1)"
#endif
#endif
#ifndef MOE_ROUND_SCALE
#define MOE_ROUND_SCALE 0
#endif
#ifndef MOE_UE8M0
#define MOE_UE8M0 0
#endif

// The kernels that wait on (or check) every rank side by side keep one thread per rank (each
// wait has its own deadline); the others loop over ranks.
#ifdef MOE_THREADS_LL_WAIT
static_assert(MOE_THREADS_LL_WAIT >= kMaxRanks, "moe_ll_wait: one thread per rank");
#endif
#ifdef MOE_THREADS_LL_CHECK_CALL
static_assert(MOE_THREADS_LL_CHECK_CALL >= kMaxRanks, "moe_ll_check_call: one thread per rank");
#endif

#define MOE_LL_GROUP LLGroup{bases, rank, num_ranks, timeout_ns, Active{active}}
#define MOE_ERRORS ErrorSink{err_host, err_dev, (i32)op}

// ---- wait ----------------------------------------------------------------------------------
// wait_cost (int64 [R] or null): the receive halves' *_wait_recv_cost_stats. Thread s adds
// the nanoseconds (%globaltimer) from its start until s's words arrived (or its wait ended:
// deadline, failure mark, masked meanwhile); a source masked before it starts is not awaited
// and adds nothing, as on the host backend (host/ll.py _timed_wait). One writer per element.
MOE_DEVICE void add_wait_cost(i64* wait_cost, int s, bool awaited, u64 started) {
    if (wait_cost && awaited) wait_cost[s] += (i64)(globaltimer_ns() - started);
}

// grid 1, one thread per rank s (blockDim >= kMaxRanks): the `words` words at offset + s *
// src_stride of this rank's buffer (s's count row, DONE slot or FREE slot) all carry `epoch`.
// Timeouts name s. wait_cost: see add_wait_cost.
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_WAIT, 1)
moe_ll_wait(MOE_ARGS_moe_ll_wait) {
    const LLGroup g = MOE_LL_GROUP;
    const ErrorSink err = MOE_ERRORS;
    const Transport t{bases, err};
    const int s = threadIdx.x;
    if (err.aborted() || s >= g.num_ranks) return;
    const u64 started = globaltimer_ns();
    const bool awaited = g.live.on(s);
    const u64* row = (const u64*)g.own((u64)offset + s * (u64)src_stride);
    for (i64 j = 0; j < words; ++j)
        if (wait_from(t, g.live, row + j, (u32)epoch, g.timeout_ns, s) < 0) break;
    add_wait_cost(wait_cost, s, awaited, started);
}

// ---- dispatch send -------------------------------------------------------------------------
#ifdef MOE_THREADS_LL_DISPATCH_SEND
static_assert(MOE_FP8 || !MOE_ROUND_SCALE, "round_scale needs fp8");

// grid: up to E blocks, block <= 1024 threads (a multiple of 32)
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_DISPATCH_SEND, 1)
moe_ll_dispatch_send(MOE_ARGS_moe_ll_dispatch_send) {
    const LLBuffer lb{(u64)payload_off, (u64)meta_off, (u64)counts_off, 0, count_row_words,
                      stride, max_tokens};
    ll_dispatch_send_body<MOE_FP8 != 0>(
        MOE_LL_GROUP, MOE_ERRORS, lb, x, staged, staged_stride, num_tokens, hidden, topk_idx,
        topk, num_experts, send_index, (u32)seq, (u64)call_off, MOE_CALL_ROW,
        ReturnRows{holds, shift_used, runs}, rows_cap);
}
#endif

#ifdef MOE_THREADS_LL_QUANTIZE
static_assert(MOE_FP8, "moe_ll_quantize is the fp8 dispatch's");
// grid: T blocks (token b), block: a multiple of 32 threads, one warp per 128-channel block:
// staged[b] = token b's fp8 message (low_latency.cuh ll_quantize_row), before the send.
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_QUANTIZE, 1)
moe_ll_quantize(MOE_ARGS_moe_ll_quantize) {
    const i64 h = hidden_size(hidden);
    for (i64 tok = blockIdx.x; tok < num_tokens; tok += gridDim.x)
        ll_quantize_row<MOE_ROUND_SCALE != 0>(x + tok * h, staged + tok * staged_stride, h);
}
#endif

// ---- dispatch receive (the hook) -----------------------------------------------------------
#ifdef MOE_THREADS_LL_CHECK_CALL
// grid 1, one thread per source s: s's signature of call `seq` in LL_CALL[buf][s] (call_off =
// LL_CALL[buf][0]) equals this rank's, else kErrMismatch (every rank sees every signature, so
// all fail this call; the receive kernel then reads nothing and frees the buffer).
// wait_cost: as moe_ll_wait's (a source's signature goes before its messages, so a late
// source is mostly waited for here; the count wait after it adds the rest).
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_CHECK_CALL, 1)
moe_ll_check_call(MOE_ARGS_moe_ll_check_call) {
    const LLGroup g = MOE_LL_GROUP;
    const Transport t{bases, MOE_ERRORS};
    const int s = threadIdx.x;
    if (t.err.aborted() || s >= g.num_ranks) return;
    const u64 started = globaltimer_ns();
    const bool awaited = g.live.on(s);
    same_call(t, g.live, (const u64*)g.own((u64)call_off + (u64)s * kCallWords * 8), (u32)seq,
              g.timeout_ns, s, MOE_CALL_ROW);
    add_wait_cost(wait_cost, s, awaited, started);
}
#endif

#ifdef MOE_THREADS_LL_DISPATCH_RECV
static_assert(MOE_FP8 || !MOE_UE8M0, "UE8M0 scales need fp8");

// grid: (num_local, SPLIT), block: a multiple of 32 threads. Runs after
// moe_ll_wait has seen every source's count row.
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_DISPATCH_RECV, 1)
moe_ll_dispatch_recv(MOE_ARGS_moe_ll_dispatch_recv) {
    const LLBuffer lb{(u64)payload_off, (u64)meta_off, (u64)counts_off, 0, count_row_words,
                      stride, max_tokens};
    ll_dispatch_recv_body<MOE_FP8 != 0, MOE_UE8M0 != 0>(
        MOE_LL_GROUP, MOE_ERRORS, lb, hidden, num_local, (u64)free_off, (u32)seq, recv_x,
        recv_scales, recv_count, stats, recv_meta, recv_ranges, return_base, counter);
}
#endif

// ---- combine (bf16 rows, or LogFMT-encoded with logfmt = 1) --------------------------------
#ifdef MOE_THREADS_LL_COMBINE_SEND
// grid: (num_local, SPLIT), block: a multiple of 32 threads
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_COMBINE_SEND, 1)
moe_ll_combine_send(MOE_ARGS_moe_ll_combine_send) {
    const LLBuffer lb{0, 0, 0, (u64)combine_off, 0, 0, max_tokens};
    ll_combine_send_body(MOE_LL_GROUP, MOE_ERRORS, lb, x, hidden, num_local, rows_cap,
                         recv_ranges, return_base, (u64)done_off, (u64)done_stride, (u32)seq,
                         counter, logfmt != 0);
}
#endif

#ifdef MOE_THREADS_LL_COMBINE_RECV
// grid: any (>= 1), block: a multiple of 32 threads, >= topk. Runs after moe_ll_wait has seen
// every rank's DONE.
MOE_KERNEL void __launch_bounds__(MOE_THREADS_LL_COMBINE_RECV, 1)
moe_ll_combine_recv(MOE_ARGS_moe_ll_combine_recv) {
    const LLBuffer lb{0, 0, 0, (u64)combine_off, 0, 0, 0};
    ll_combine_recv_body(MOE_LL_GROUP, MOE_ERRORS, lb, hidden, num_tokens, topk, rows_cap,
                         topk_idx, topk_w, send_index, (u64)free_off, (u32)seq, out, counter,
                         num_local, ReturnRows{holds, nullptr, (i32*)runs}, (u64)done_off,
                         logfmt != 0, logfmt_seen);
}
#endif
