// low_latency.cuh: low-latency mode, the CUDA twin of moe_comm/host/ll.py. Same wire layout
// (wire.LLLayout, offsets computed on the host and passed in) and the same output order.
//
// Only one-block `wait` kernels ever spin (one thread per rank); the data kernels that follow
// on the same stream start once the awaited words are there, so a large grid never occupies
// SMs while a peer (possibly a stream of the same GPU) still needs them to make progress.
// Stream order carries the acquire: the wait kernel's acquire loads happen before the next
// kernel's plain loads.
//
// dispatch call s (buffer b = s % 2), split so the caller can separate send and receive
// (return_recv_hook):
//   send  [s > 2: wait until every rank d has finished reading its buffer b of call s-2
//         (d pushed LL_DISPATCH_FREE[b][d] = s-2 into this rank's header): flow control of
//         the two buffers]
//         one block per global expert e (owned by rank d = e / L, local id le = e % L):
//         - count this rank's (token, slot) pairs routed to experts below e: where e's
//           messages start in this rank's message order (pairs sorted by expert, then token,
//           then slot) - the host backend's order;
//         - find the pairs routed to e in (token, slot) order with a block-wide scan (rows keep
//           the host order without atomics); one warp per pair writes the message straight
//           into d's block payload[le][me][row] (fp8 cast + per-128 scales in registers, or the
//           bf16 row) and meta[le][me][row] = token << 8 | slot, and records the pair's message
//           index locally (send_index[t][k], where combine finds its returned row);
//         - after a system fence and a barrier, release stores of the count word
//           counts[me][le] = (s << 32) | rows in d's region ("rows are there"); the block of
//           le = 0 also stores the row's base word counts[me][L] = where this rank's messages
//           to d start in its message order.
//   recv  wait for every source's count row (L counts + base), then one block per local
//         expert (x SPLIT blocks for bandwidth) packs the rows source by source into recv_x
//         [L, R*M, H] (and the scales, UE8M0-packed if asked), writes recv_count, the handle's
//         meta/ranges/return_base, adds to the stats; the last block to finish pushes
//         LL_DISPATCH_FREE[b][me] = s into every rank (release: after all its reads).
// combine call c (buffer b = c % 2):
//   send  [c > 2: wait for every owner's LL_COMBINE_FREE[b][owner] = c-2] (L x SPLIT) one warp
//         per received row writes it into the owner's combine rows at return_base[owner] +
//         (rows of lower local experts from that owner) + position: the owner's own message
//         order, so each owner's rows form one contiguous run. use_logfmt: the warp encodes
//         the row (logfmt.cuh) into the first logfmt_row_bytes(H) bytes of the same row slot.
//         The last block signals LL_COMBINE_DONE[b][me] = (c << 32) | rows [| kDoneLogfmt]
//         in every owner.
//   recv  wait for every rank's DONE; a DONE whose kDoneLogfmt bit differs from this rank's
//         use_logfmt fails the call on every rank (kErrMismatch, nothing summed); else
//         out[t] = sum_k w[t,k] * row[send_index[t][k]] in fp32 (k with id -1 skipped; LogFMT
//         rows decoded first), cast to bf16; the last block pushes LL_COMBINE_FREE[b][me] = c
//         into every rank.
//
// Every wait is on this rank's own memory (peers push their signals), so a transport that
// can only write to remote ranks (RDMA) serves the same protocol.
//
// MOE_HIDDEN > 0 makes the hidden size a compile-time constant (loops over 128-channel blocks
// unroll); 0 is the generic variant that reads it from the arguments.
#pragma once
#include "fp8.cuh"
#include "logfmt.cuh"
#include "transport.cuh"

#ifndef MOE_HIDDEN
#define MOE_HIDDEN 0
#endif
constexpr i64 kHidden = MOE_HIDDEN;
MOE_DEVICE i64 hidden_size(i64 runtime_hidden) { return kHidden > 0 ? kHidden : runtime_hidden; }


// One rank's view of the group for LL kernels. All offsets are bytes from a buffer's base.
struct LLGroup {
    const u64* bases;
    i64 rank;
    i64 num_ranks;
    i64 timeout_ns;
    Active live;  // elastic mode: masked ranks get nothing and are not awaited (transport.cuh)
    MOE_DEVICE u8* own(u64 offset) const { return (u8*)bases[rank] + offset; }
    MOE_DEVICE const u64* fence() const { return (const u64*)own(kFenceOffset); }
};

// Offsets of one LL buffer (wire.LLLayout.offset(buf, ...) + the LL region's offset).
struct LLBuffer {
    u64 payload, meta, counts, combine;  // byte offsets in every rank's buffer
    i64 count_row_words;                 // LLLayout.count_row_words
    i64 stride;                          // bytes of one message row
    i64 max_tokens;                      // M
};

// ---- return rows a late writer may still hit ------------------------------------------------
// The combine rows come back in the owner's message order, from the row its dispatch sent each
// expert rank in the base word of the count row, and every second call reuses them. A rank
// masked while stopped between its fence check and its combine stores (a late writer) still
// writes its rows of that call when it resumes. Elastic groups (moe_comm/cuda/comm.py
// ``ll_holds``; null otherwise) hold those rows back, in the owner's combine receive:
// holds[q], holds[R + q] = rows [lo, hi) of rank q's run, holds[2R + q] = byte offset of q's
// LL_COMBINE_DONE slot of that call here, holds[3R + q] = the word it held then. The hold ends
// when that word changes (q signalled that call, or a later one, after its stores: release).
// Each dispatch places its return rows at the first `shift` that avoids every hold.
struct ReturnRows {
    i64* holds;   // [4R] or null: nothing is held, rows start at 0
    i32* shift;   // this dispatch's shift (the handle's; -1 until a block has chosen it)
    i32* runs;    // [R, 2]: rows [lo, hi) of this dispatch's messages to each rank (handle's)

    MOE_DEVICE bool held(const LLGroup& g, int q) const {
        const i64 R = g.num_ranks;
        return holds[R + q] > holds[q] &&
               ld_acquire_sys((const u64*)g.own((u64)holds[2 * R + q])) == (u64)holds[3 * R + q];
    }
    MOE_DEVICE bool clear(const LLGroup& g, i64 at, i64 rows) const {
        for (int q = 0; q < g.num_ranks; ++q)
            if (held(g, q) && holds[q] < at + rows && at < holds[g.num_ranks + q]) return false;
        return true;
    }
    // One thread of every block: the first row of `rows` return rows that avoids every hold and
    // ends by `cap`; the first block to choose decides for all (the holds may end meanwhile).
    // None fits: reported (kErrOverflow), rows at 0.
    MOE_DEVICE i64 place(const LLGroup& g, const ErrorSink& err, i64 rows, i64 cap, u32 seq) const {
        if (!holds) return 0;
        i64 best = -1;
        for (int c = -1; c < g.num_ranks; ++c) {
            const i64 at = c < 0 ? 0 : holds[g.num_ranks + c];
            if ((c >= 0 && !held(g, c)) || at + rows > cap || (best >= 0 && at >= best)) continue;
            if (clear(g, at, rows)) best = at;
        }
        if (best < 0) {
            err.report(kErrOverflow, seq, (int)g.rank, (i32)rows);
            best = 0;
        }
        const i32 first = atomicCAS(shift, -1, (i32)best);
        return first < 0 ? best : first;
    }
    // Dispatch send, thread 0 of expert e's block: where this rank's messages to `dst` begin
    // (its first expert) or end (its last).
    MOE_DEVICE void note_run(int dst, i64 le, i64 num_local, i64 first, i64 end) const {
        if (!holds) return;
        if (le == 0) runs[2 * dst] = (i32)first;
        if (le == num_local - 1) runs[2 * dst + 1] = (i32)end;
    }
    // Combine receive, block 0, every thread: hold_late of each rank.
    MOE_DEVICE void hold_all_late(const LLGroup& g, u64 done_off, u32 seq) const {
        if (!holds || blockIdx.x != 0) return;
        for (int q = threadIdx.x; q < g.num_ranks; q += blockDim.x) hold_late(g, q, done_off, seq);
    }
    // Hold q's run back if q is masked and its rows of call `seq` have not all come (its DONE
    // did not), once per rank (a masked rank stays masked).
    MOE_DEVICE void hold_late(const LLGroup& g, int q, u64 done_off, u32 seq) const {
        const i64 R = g.num_ranks;
        if (g.live.on(q) || holds[R + q] > holds[q] || runs[2 * q + 1] <= runs[2 * q]) return;
        const u64 slot = done_off + (u64)q * kSignalStride;
        const u64 word = ld_acquire_sys((const u64*)g.own(slot));
        if (tag_epoch(word) == seq) return;  // its rows are all here
        holds[q] = runs[2 * q];
        holds[R + q] = runs[2 * q + 1];
        holds[2 * R + q] = (i64)slot;
        holds[3 * R + q] = (i64)word;
    }
};

// Push "this rank finished reading buffer b of call seq" into every rank's FREE[b][me] slot
// (`free_off` = FREE[b][0]); release: ordered after this rank's earlier reads. kFailedValue
// once this rank has failed (sync.cuh): the peer's next send fails at once.
MOE_DEVICE void ll_publish_free(const Transport& t, const LLGroup& g, u64 free_off, u32 seq) {
    const u32 value = t.err.signal_value(0);
    for (int p = 0; p < g.num_ranks; ++p)
        if (g.live.on(p)) t.signal(p, free_off + (u64)g.rank * kSignalStride, tag(seq, value));
}

// ---- dispatch send -----------------------------------------------------------------------
// fp8: each token is cast once, before the send (moe_ll_quantize, ll.cu): staged [T, stride]
// rows of H e4m3 bytes then H/128 f32 scales, the message's own layout, so a message is a copy
// of its token's staged row. (Casting in every message instead cast each token once per
// routed expert: 2.7x the bf16 dispatch time on the first GPU run, H100, 8 ranks, top-8.)
template <bool kRoundScale>
MOE_DEVICE void ll_quantize_row(const u16* x_row, u8* staged_row, i64 hidden) {
    float* scales = (float*)(staged_row + hidden);
    for (i64 blk = warp_id(); blk < hidden / kFp8Block; blk += warps_per_block()) {
        const float s = quantize_block_e4m3<kRoundScale>(x_row + blk * kFp8Block,
                                                         staged_row + blk * kFp8Block);
        if (lane_id() == 0) scales[blk] = s;
    }
}

// One message: the token's staged fp8 row (bytes + scales, with the padding both the staged
// rows and the message slots have up to 16 bytes, so the copy takes 16-byte accesses at
// every hidden size), or its bf16 row.
template <bool kFp8>
MOE_DEVICE void ll_write_message(const Transport& t, int dst, u64 offset, const u16* x_row,
                                 const u8* staged_row, i64 hidden) {
    if (kFp8)
        t.put_warp(dst, offset, staged_row, (hidden + hidden / kFp8Block * 4 + 15) / 16 * 16);
    else
        t.put_warp(dst, offset, x_row, hidden * 2);
}

// x bf16 [T, H]; staged (fp8) the cast rows above, staged_stride bytes apart; topk_idx i64
// [T, K]; send_index i32 [T, K] out (message index of each
// routed pair in this rank's message order; slots with id -1 are left untouched). Grid: any
// number of blocks, block b handles experts b, b + gridDim.x, ...; blockDim.x <= 1024 (the
// shared list holds one entry per thread).
// call_off: LL_CALL[buf][0]; the block of each owner's first expert writes this call's
// signature there (moe_ll_check_call checks it before the count rows are trusted).
template <bool kFp8>
__device__ void ll_dispatch_send_body(const LLGroup g, const ErrorSink err, const LLBuffer lb,
                                      const u16* x, const u8* staged, i64 staged_stride,
                                      i64 num_tokens, i64 hidden_rt,
                                      const i64* topk_idx, i64 topk, i64 num_experts,
                                      i32* send_index, u32 seq, u64 call_off,
                                      const CallRow call, const ReturnRows rr, i64 rows_cap) {
    __shared__ int warp_counts[32];
    __shared__ int selected[1024];
    __shared__ i64 shift;  // where this rank's return rows start (ReturnRows)
    const Transport t{g.bases, err};
    // A failed rank (an error of an earlier kernel) writes no messages but still signals its
    // count words, carrying kFailedValue: the receivers fail at once.
    const bool failed = block_failed(err, g.fence());
    const i64 hidden = hidden_size(hidden_rt);
    const i64 R = g.num_ranks, M = lb.max_tokens;
    const i64 num_local = num_experts / R;
    const i64 pairs = failed ? 0 : num_tokens * topk;
    if (threadIdx.x == 0) shift = rr.place(g, err, pairs, rows_cap, seq);
    __syncthreads();
    for (i64 e = blockIdx.x; e < num_experts; e += gridDim.x) {
        const int dst = (int)(e / num_local);
        const i64 le = e % num_local;
        // elastic: a masked owner gets no messages; its pairs get send_index -1 (combine
        // skips them). Read once per expert so the whole block agrees (a uniform branch: no
        // extra barrier when the group is not elastic).
        __shared__ bool owner_on;
        if (g.live.words) {
            if (threadIdx.x == 0) owner_on = g.live.on(dst);
            __syncthreads();
        }
        const bool live = !g.live.words || owner_on;
        if (le == 0 && live && threadIdx.x == 0)
            send_call_row(t, dst, call_off + (u64)g.rank * kCallWords * 8, seq, call, failed);
        // Messages to experts below e come first in this rank's message order.
        int lower = 0;
        for (i64 base = 0; base < pairs; base += blockDim.x) {
            const i64 i = base + threadIdx.x;
            const i64 id = i < pairs ? topk_idx[i] : -1;
            lower += __syncthreads_count(id >= 0 && id < e);
        }
        const u64 block = (u64)(le * R + g.rank) * M;  // first message of block [le][me]
        int running = 0;
        for (i64 base = 0; base < pairs; base += blockDim.x) {
            const i64 i = base + threadIdx.x;
            const bool match = i < pairs && topk_idx[i] == e;
            int total;
            const int pos = block_scan_flags(match, warp_counts, &total);
            if (match) selected[pos] = (int)(i - base);
            __syncthreads();
            for (int j = warp_id(); j < total; j += warps_per_block()) {
                const i64 pair = base + selected[j];
                const i64 row = running + j;
                if (!live) {
                    if (lane_id() == 0) send_index[pair] = -1;
                    continue;
                }
                if (row >= M) {  // a token listed the same expert twice: more rows than M
                    if (lane_id() == 0) {
                        err.report(kErrOverflow, seq, dst, (i32)row);
                        send_index[pair] = -1;  // combine skips it instead of reading garbage
                    }
                    continue;
                }
                const i64 tok = pair / topk, slot = pair % topk;
                ll_write_message<kFp8>(t, dst, lb.payload + (block + row) * lb.stride,
                                       x + tok * hidden, staged + tok * staged_stride, hidden);
                const u64 meta_off = lb.meta + (block + row) * 8;
                i64* meta = (i64*)t.row_for_write(dst, meta_off);
                if (lane_id() == 0) {
                    if (meta) *meta = (tok << 8) | slot;
                    send_index[pair] = (i32)(shift + lower + row);
                }
                __syncwarp();
                if (meta) t.commit_row_warp(dst, meta_off, (const u8*)meta, 8);
            }
            running += total;
            __syncthreads();  // `selected` is rewritten by the next chunk
        }
        // The count words go after the rows: the block meets, then its publisher fences and
        // release-stores them (sync.cuh). Each word carries the tag, so order among them is
        // free. kFailedValue instead once this rank has failed (this block's overflow too).
        __syncthreads();
        if (threadIdx.x == 0)
            rr.note_run(dst, le, num_local, live ? shift + lower : 0,
                        live ? shift + lower + running : 0);
        if (threadIdx.x == 0 && live) {
            __threadfence_system();
            const u64 row_off = lb.counts + (u64)(g.rank * lb.count_row_words) * 8;
            const u32 rows = t.err.signal_value((u32)min_of<i64>(running, M));
            t.signal(dst, row_off + (u64)le * 8, tag(seq, rows));
            if (le == 0)
                t.signal(dst, row_off + (u64)num_local * 8,
                         tag(seq, err.signal_value((u32)(shift + lower))));
        }
    }
}

// ---- dispatch recv -----------------------------------------------------------------------
// Grid (L, SPLIT). recv_x [L, R*M, H] (fp8 bytes or bf16), recv_scales f32 [L, R*M, H/128] or
// int32 [L, R*M, H/512] (UE8M0) or null, recv_count i32 [L], stats i32 [L] or null,
// recv_meta i64 [L, R*M] (-1 past the count), recv_ranges i64 [L, R, 2] (first row, rows),
// return_base i64 [R] (where each source's messages to this rank start in its message order).
template <bool kFp8, bool kUe8m0>
__device__ void ll_dispatch_recv_body(const LLGroup g, const ErrorSink err, const LLBuffer lb,
                                      i64 hidden_rt, i64 num_local, u64 free_off, u32 seq,
                                      u8* recv_x, void* recv_scales, i32* recv_count, i32* stats,
                                      i64* recv_meta, i64* recv_ranges, i64* return_base,
                                      i32* counter) {
    __shared__ i64 count[kMaxRanks];
    __shared__ i64 start[kMaxRanks + 1];
    __shared__ int last;
    const Transport t{g.bases, err};
    // failed (an earlier error): nothing is read or written, the last block still publishes
    // FREE (kFailedValue) so the peers' next send fails at once
    const bool failed = block_failed(err, g.fence());
    const i64 hidden = hidden_size(hidden_rt);
    const i64 R = g.num_ranks, M = lb.max_tokens;
    const i64 le = blockIdx.x;
    // the count rows arrived: the wait kernel before this one saw them
    for (int s = threadIdx.x; s < R; s += blockDim.x) {
        const u64* row = (const u64*)g.own(lb.counts + (u64)(s * lb.count_row_words) * 8);
        const bool live = !failed && g.live.on(s);  // elastic: a masked source sent nothing
        // Checked again, word by word: a source that failed after the wait kernel (its kernels
        // no longer wait for FREE) may have stored a later call's failure mark here.
        const u64 c = live ? ld_acquire_sys(row + le) : 0;
        const u64 b = live ? ld_acquire_sys(row + num_local) : 0;
        const bool ok = live && tag_epoch(c) == seq && tag_value(c) != kFailedValue &&
                        tag_epoch(b) == seq && tag_value(b) != kFailedValue;
        if (live && !ok) {
            if (g.live.elastic())
                g.live.drop(s);
            else
                err.report(kErrPeerFailed, seq, s, 0);
        }
        count[s] = ok ? min_of<i64>(tag_value(c), M) : 0;
        if (le == 0 && blockIdx.y == 0) return_base[s] = ok ? tag_value(b) : 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        start[0] = 0;
        for (int s = 0; s < R; ++s) start[s + 1] = start[s] + count[s];
    }
    __syncthreads();
    const i64 n = start[R];
    const i64 row_bytes = kFp8 ? hidden : hidden * 2;
    const i64 scale_cols = hidden / kFp8Block;
    const i64 part = blockIdx.y, parts = gridDim.y;
    for (i64 i = part * warps_per_block() + warp_id(); i < n; i += parts * warps_per_block()) {
        const int s = segment_of(start + 1, (int)R, i);
        const u64 msg = (u64)(le * R + s) * M + (u64)(i - start[s]);
        const u8* src = g.own(lb.payload + msg * lb.stride);
        const i64 out_row = le * R * M + i;
        warp_copy(recv_x + out_row * row_bytes, src, row_bytes);
        if (kFp8 && recv_scales) {
            const float* sc = (const float*)(src + hidden);
            if (kUe8m0) {
                i32* packed = (i32*)recv_scales + out_row * (scale_cols / 4);
                for (i64 w = lane_id(); w < scale_cols / 4; w += kWarpSize) {
                    const u32 b = ue8m0_byte(sc[4 * w]) | (ue8m0_byte(sc[4 * w + 1]) << 8) |
                                  (ue8m0_byte(sc[4 * w + 2]) << 16) |
                                  (ue8m0_byte(sc[4 * w + 3]) << 24);
                    packed[w] = (i32)b;
                }
            } else {
                warp_copy((float*)recv_scales + out_row * scale_cols, sc, scale_cols * 4);
            }
        }
        if (lane_id() == 0) recv_meta[out_row] = *(const i64*)g.own(lb.meta + msg * 8);
    }
    for (i64 i = n + part * blockDim.x + threadIdx.x; i < R * M; i += parts * blockDim.x)
        recv_meta[le * R * M + i] = -1;
    if (part == 0) {
        if (threadIdx.x == 0) {
            recv_count[le] = (i32)n;
            if (stats) stats[le] += (i32)n;
        }
        for (int s = threadIdx.x; s < R; s += blockDim.x) {
            recv_ranges[(le * R + s) * 2] = start[s];
            recv_ranges[(le * R + s) * 2 + 1] = count[s];
        }
    }
    // Release after the reads above: no sender of call s+2 overwrites rows still being read.
    if (last_block_arrives(counter, &last) && threadIdx.x == 0)
        ll_publish_free(t, g, free_off, seq);
}

// ---- combine send ------------------------------------------------------------------------
// One returned row into `dst`'s combine row slot at `offset`, by one warp: bf16 as it is, or
// LogFMT-encoded into the start of the slot. LogFMT rows keep the bf16 row slots (rather than
// packing each owner's run of encoded rows, as the host backend does): a row's place stays
// send_index * 2H bytes, so warps encode their rows independently, the receive kernel indexes
// rows exactly as for bf16, and every encoded row starts 256-byte aligned; only the bytes
// written and put (0.66x) shrink, which is what LogFMT is for. Built in place (the peer's
// memory, or the network rank's mirror), then committed (transport.cuh).
MOE_DEVICE void ll_return_row(const Transport& t, int dst, u64 offset, const u16* x_row,
                              i64 hidden, bool logfmt, u32* stage) {
    if (!logfmt) {
        t.put_warp(dst, offset, x_row, hidden * 2);
        return;
    }
    u8* row = t.row_for_write(dst, offset);
    if (!row) return;
    logfmt_encode_row_warp(row, x_row, hidden, stage);
    t.commit_row_warp(dst, offset, row, logfmt_row_bytes(hidden));
}

// Grid (L, SPLIT). x bf16 [L, R*M, H]: expert outputs in the layout dispatch returned;
// recv_ranges / return_base from the dispatch handle; rows_cap = rows of a combine region
// (M * wire.LL_MAX_TOPK); logfmt: encode the rows (hidden % 128 == 0, checked by the host).
__device__ void ll_combine_send_body(const LLGroup g, const ErrorSink err, const LLBuffer lb,
                                     const u16* x, i64 hidden_rt, i64 num_local, i64 rows_cap,
                                     const i64* recv_ranges, const i64* return_base,
                                     u64 done_off, u64 done_stride, u32 seq, i32* counter,
                                     bool logfmt) {
    __shared__ u32 stage[1024 / kWarpSize][kLogfmtStageWords];  // LogFMT codes, per warp
    __shared__ i64 start[kMaxRanks + 1];
    __shared__ i64 dest[kMaxRanks];  // owner row of this block's first row from each source
    __shared__ bool live[kMaxRanks];  // elastic: masked owners get nothing back
    __shared__ int last;
    const Transport t{g.bases, err};
    // failed (an earlier error): no rows, the last block still signals DONE (kFailedValue)
    const bool failed = block_failed(err, g.fence());
    const i64 hidden = hidden_size(hidden_rt);
    const i64 R = g.num_ranks, M = lb.max_tokens;
    const i64 le = blockIdx.x;
    for (int s = threadIdx.x; s < R; s += blockDim.x) {
        // The owner's messages to this rank are sorted by expert: rows of lower local experts
        // come first in its run.
        i64 before = 0;
        for (i64 l = 0; l < le; ++l) before += recv_ranges[(l * R + s) * 2 + 1];
        dest[s] = return_base[s] + before;
        live[s] = g.live.on(s);
    }
    if (threadIdx.x == 0) {
        start[0] = 0;
        for (int s = 0; s < R; ++s) start[s + 1] = start[s] + recv_ranges[(le * R + s) * 2 + 1];
    }
    __syncthreads();
    const i64 n = failed ? 0 : start[R];
    const i64 part = blockIdx.y, parts = gridDim.y;
    for (i64 i = part * warps_per_block() + warp_id(); i < n; i += parts * warps_per_block()) {
        const int s = segment_of(start + 1, (int)R, i);
        const i64 row = dest[s] + (i - start[s]);
        if (!live[s]) continue;
        if (row < 0 || row >= rows_cap) {
            if (lane_id() == 0) err.report(kErrOverflow, seq, s, (i32)row);
            continue;
        }
        ll_return_row(t, s, lb.combine + (u64)row * hidden * 2, x + (le * R * M + i) * hidden,
                      hidden, logfmt, stage[warp_id()]);
    }
    if (last_block_arrives(counter, &last)) {
        for (int s = threadIdx.x; s < R; s += blockDim.x) {
            i64 rows = 0;
            for (i64 l = 0; l < num_local; ++l) rows += recv_ranges[(l * R + s) * 2 + 1];
            const u32 value = err.signal_value((u32)rows | (logfmt ? kDoneLogfmt : 0u));
            if (g.live.on(s)) t.signal(s, done_off + g.rank * done_stride, tag(seq, value));
        }
    }
}

// ---- combine recv ------------------------------------------------------------------------
// Whether every source's DONE of call `seq` says what this rank's use_logfmt says (every
// thread of the block calls it; the DONE words are there: the wait kernel saw them). A source
// that differs: block 0 reports kErrMismatch naming it (every rank reads the same words, so
// every rank fails this call and raises CallMismatchError; plain signals, so the next call
// goes on) and records every source's flag in seen[R] (1 LogFMT, 0 bf16, -1 not heard) for
// the host's error. Masked sources and failure marks are not compared.
MOE_DEVICE bool ll_logfmt_agrees(const LLGroup& g, const ErrorSink& err, u64 done_off,
                                 u32 seq, bool logfmt, i32* seen) {
    int odd = 0;
    for (int s = threadIdx.x; s < g.num_ranks; s += blockDim.x) {
        const u64 w = g.live.on(s) ? ld_acquire_sys((const u64*)g.own(done_off + (u64)s *
                                                                      kSignalStride)) : 0;
        const bool heard = tag_epoch(w) == seq && tag_value(w) != kFailedValue;
        const bool theirs = (tag_value(w) & kDoneLogfmt) != 0;
        if (blockIdx.x == 0) seen[s] = heard ? (i32)theirs : -1;
        if (heard && theirs != logfmt) {
            ++odd;
            if (blockIdx.x == 0) err.report(kErrMismatch, seq, s, 0);
        }
    }
    return __syncthreads_count(odd) == 0;
}

// out[tok] (bf16, `hidden` channels) = sum of weight[k] * the rows row_of[k] >= 0 of `rows`
// (bf16 rows of 2H bytes), in fp32, by the block.
MOE_DEVICE void ll_sum_bf16_rows(const u16* rows, i64 hidden, i64 topk, const i64* row_of,
                                 const float* weight, u16* dst, bool vec) {
    if (vec) {
        for (i64 c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
            for (i64 k = 0; k < topk; ++k) {
                if (row_of[k] < 0) continue;
                const uint4 raw = ld16(rows + row_of[k] * hidden + c * 8);
                const u16* v = (const u16*)&raw;
                const float w = weight[k];
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[j] += w * bf16_to_f32(v[j]);
            }
            uint4 packed;
            u16* o = (u16*)&packed;
#pragma unroll
            for (int j = 0; j < 8; ++j) o[j] = f32_to_bf16(acc[j]);
            st16(dst + c * 8, packed);
        }
    } else {
        for (i64 c = threadIdx.x; c < hidden; c += blockDim.x) {
            float acc = 0.0f;
            for (i64 k = 0; k < topk; ++k)
                if (row_of[k] >= 0) acc += weight[k] * bf16_to_f32(rows[row_of[k] * hidden + c]);
            dst[c] = f32_to_bf16(acc);
        }
    }
}

// The same sum over LogFMT rows (each at the start of its 2H-byte row slot), decoded first;
// a thread takes one 5-byte group (four channels) at a time.
MOE_DEVICE void ll_sum_logfmt_rows(const u8* rows, i64 hidden, i64 topk, const i64* row_of,
                                   const float* weight, u16* dst) {
    for (i64 grp = threadIdx.x; grp < hidden / 4; grp += blockDim.x) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (i64 k = 0; k < topk; ++k) {
            if (row_of[k] < 0) continue;
            float v[4];
            logfmt_decode_group(rows + row_of[k] * hidden * 2, hidden, grp, v);
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[j] += weight[k] * v[j];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[grp * 4 + j] = f32_to_bf16(acc[j]);
    }
}

// Grid: any; block b handles tokens b, b + gridDim.x, ... topk_idx i64 [T, K], topk_w f32
// [T, K], send_index i32 [T, K] from this call's dispatch, out bf16 [T, H]; logfmt: this
// rank's use_logfmt (the rows are decoded), logfmt_seen i32 [R] (ll_logfmt_agrees).
__device__ void ll_combine_recv_body(const LLGroup g, const ErrorSink err, const LLBuffer lb,
                                     i64 hidden_rt, i64 num_tokens, i64 topk, i64 rows_cap,
                                     const i64* topk_idx, const float* topk_w,
                                     const i32* send_index, u64 free_off, u32 seq, u16* out,
                                     i32* counter, i64 num_local, const ReturnRows rr,
                                     u64 done_off, bool logfmt, i32* logfmt_seen) {
    __shared__ float weight[32];
    __shared__ i64 row_of[32];  // returned row of slot k, -1 = slot unused
    __shared__ int last;
    const Transport t{g.bases, err};
    // failed (an earlier error), or the ranks disagree about use_logfmt: nothing summed, the
    // last block still publishes FREE (both block-uniform: every block reads the same words)
    const bool failed = block_failed(err, g.fence()) ||
                        !ll_logfmt_agrees(g, err, done_off, seq, logfmt, logfmt_seen);
    const i64 hidden = hidden_size(hidden_rt);
    const u16* rows = (const u16*)g.own(lb.combine);
    // 16-byte stores need a 16-byte aligned `out` (the caller's tensor: a view may start
    // anywhere); the returned rows are 16-byte aligned whenever hidden % 8 == 0
    const bool vec = (hidden % 8) == 0 && aligned(out, 16);
    for (i64 tok = blockIdx.x; !failed && tok < num_tokens; tok += gridDim.x) {
        if (threadIdx.x < topk) {
            const i64 k = threadIdx.x;
            const i64 e = topk_idx[tok * topk + k];
            // elastic: the rows of an owner masked during the call never came
            const bool used = e >= 0 && g.live.on((int)(e / num_local));
            const i64 r = used ? (i64)send_index[tok * topk + k] : -1;
            row_of[k] = r >= 0 && r < rows_cap ? r : -1;
            weight[k] = used ? topk_w[tok * topk + k] : 0.0f;
        }
        __syncthreads();
        u16* dst = out + tok * hidden;
        if (logfmt)
            ll_sum_logfmt_rows((const u8*)rows, hidden, topk, row_of, weight, dst);
        else
            ll_sum_bf16_rows(rows, hidden, topk, row_of, weight, dst, vec);
        __syncthreads();  // `weight` / `row_of` are rewritten for the next token
    }
    rr.hold_all_late(g, done_off, seq);
    if (last_block_arrives(counter, &last) && threadIdx.x == 0)
        ll_publish_free(t, g, free_off, seq);
}
