// normal.cuh: normal (high-throughput) mode between the ranks of a group, the CUDA twin of
// moe_comm/host/normal.py. Same semantics and output order. R = number of ranks is a run-time
// argument (Group::num_ranks: one program for every group size); per-rank tables live in
// shared memory, sized by the compile-time bound kMaxRanks (moe_generated.cuh), and the loops
// over destinations visit only a token's destinations (dispatch send, combine reduce), so a
// group of hundreds of ranks costs a token what its few destinations cost.
//
// One operation (dispatch or combine, epoch e) is a sequence of kernels on the caller's stream:
//
//   notify      1 block: write my row of R counts, tagged e, into NOTIFY[e's parity][me] of
//               every rank; wait for every rank's row in my header. Gives the R x R count
//               matrix m[s][d] (dispatch) and doubles as the flow-control barrier of every
//               operation (combine and cached dispatch send zeros): a rank writes its row
//               only after the previous kernels on its stream, which read its data region,
//               have finished, so no peer overwrites a region still being read.
//   send        grid: rows written straight into each destination's data region (Transport),
//               then the last block to finish signals DONE[me] = e in every rank.
//   wait_done   1 block: wait for DONE[s] = e from every rank s.
//   copy_out /  grid: dispatch copies the received region into the output tensors (rows past
//   reduce      the real count padded for num_worst_tokens); combine sums rows per token in fp32.
//
// The data region of every rank starts at `data_off` of its buffer; an operation's slab starts
// `floors[d]` bytes into it (0 until an elastic group drops a rank that may still be writing:
// see `Group`) and holds one wire.SlabLayout (moe_comm/wire.py describes its sub-arrays;
// `Slab` below computes their offsets with kSlabAlign and kPage from moe_generated.cuh).
// Dispatch: rows ordered by source rank then source token index; source s owns rows
// [sum_{s'<s} m[s'][d], ...). Combine staging at the token owner: rows ordered by expert rank
// d then token, d's rows start at sum_{d'<d} m[me][d'].
//
// Streaming (a call whose regions do not fit the data region; moe_comm/cuda/normal.py Rounds):
// the send kernels take `chunk` > 0 and `first`: each launch is one round and moves only the
// rows [first, first + chunk) of every region, into a slab of `chunk` rows at row - first;
// dispatch copy-out writes them to the outputs from row `first`, combine_stage to a local
// staging tensor that the reduce reads instead of the slab. Each round has its own epoch and
// each round after the first starts with a notify: the same barrier as between operations.
//
// Why two parities for NOTIFY and one slot for DONE: see docs/ARCHITECTURE.md ("Why the slots
// are safe without resets"); the per-operation notify barrier gives the same guarantees here.
#pragma once
#include "transport.cuh"

// wire.SlabLayout on the device.
struct Slab {
    u64 x, scales, idx, w, nbytes;

    static MOE_DEVICE Slab make(u64 rows, u64 row_bytes, u64 scale_cols, u64 topk) {
        Slab s;
        s.x = 0;
        s.scales = round_up(s.x + rows * row_bytes, kSlabAlign);
        s.idx = round_up(s.scales + rows * scale_cols * 4, kSlabAlign);
        s.w = round_up(s.idx + rows * topk * 8, kSlabAlign);
        s.nbytes = round_up(s.w + rows * topk * 4, kPage);
        return s;
    }
};

// Common kernel arguments of one rank's view of the group.
struct Group {
    const u64* bases;  // [R] every rank's buffer base in this process
    i64 rank;
    i64 num_ranks;     // R, 1..kMaxRanks (moe_comm/jit/variants.py check_num_ranks)
    u64 data_off;      // byte offset of the data region in every buffer
    u64 capacity;      // bytes of the data region
    i64 timeout_ns;
    Active live;       // elastic mode's active ranks (transport.cuh)
    // Elastic groups: i64 [2R + 1] (moe_comm/cuda/comm.py ``floors``), else null (all 0).
    // floors[d]: where rank d's slabs start in its data region. A rank dropped mid-operation
    // may be stopped between its fence check and its stores (a late writer): the agreement
    // that drops it asks (floors[2R] = 1) for every floors[d] to move past the slab the
    // operation used at d, which the next operation's notify does (`settle_floors`), so no
    // later operation reads there (elastic.cuh). floors[R + d]: where the slab of the
    // operation in flight ends at d (written by the send kernels). The same on every
    // survivor: computed from the agreed decision and the count matrix.
    i64* floors;

    MOE_DEVICE u8* own(u64 offset) const { return (u8*)bases[rank] + offset; }
    MOE_DEVICE const u64* fence() const { return (const u64*)own(kFenceOffset); }
    MOE_DEVICE u64 floor(int d) const { return floors ? (u64)floors[d] : 0; }
    // Byte offset of rank d's slab in its buffer, and whether `nbytes` of slab fit there.
    MOE_DEVICE u64 slab_at(int d) const { return data_off + floor(d); }
    MOE_DEVICE bool fits(int d, u64 nbytes) const { return floor(d) + nbytes <= capacity; }
    // The send kernels (block 0, the thread of d) note where this operation's slab at d ends.
    MOE_DEVICE void note_end(int d, u64 nbytes) const {
        if (floors && blockIdx.x == 0) floors[num_ranks + d] = (i64)(floor(d) + nbytes);
    }
    // Notify, first thing of every operation (all threads of its one block, >= R): a move the
    // last agreement asked for takes effect. Not earlier: the operation that agreed still
    // reads its own slab (copy-out, reduce) where its floors put it.
    MOE_DEVICE void settle_floors() const {
        __shared__ bool move;
        const int d = threadIdx.x;
        if (!floors) return;
        if (d == 0) move = floors[2 * num_ranks] != 0;
        __syncthreads();
        if (move && d < num_ranks) floors[d] = (i64)round_up((u64)floors[num_ranks + d], kPage);
        __syncthreads();
        if (move && d == 0) floors[2 * num_ranks] = 0;
    }
};

// ---- notify ------------------------------------------------------------------------------
// One block, thread p for rank p (blockDim >= kMaxRanks: side by side, each wait has its own
// deadline). Thread p writes this rank's call signature and then its row of counts into rank
// p, then checks rank p's signature here against its own (a difference is reported as
// kErrMismatch: every rank sees every signature, so all fail the call together, before any
// payload moves) and reads rank p's row of counts.
// counts: int32 [R] or null (zeros: a pure barrier). matrix: int32 [R, R] out, or null.
// host_counts: int32 [num_hosts] (a hierarchical dispatch, relay.cuh; num_hosts 0 otherwise):
// the row carries them after the R counts, read into host_matrix int32 [R, num_hosts]. The
// CUDA backend's relayed dispatch sends its token count per host, then its token count (the
// rounds of a call in token rounds, moe_comm/cuda/rounds.py): num_hosts = H + 1 <= R + 1.
// A rank that has failed still writes its row, of kFailedValue words, and waits for nothing:
// its peers fail at once instead of waiting for it until their deadline. A fresh dispatch's
// matrix is zeros then, so its copy-out moves nothing; calls with a handle keep the handle's
// matrix, and their copy-out/reduce (which take no error word) read only inside the region:
// their outputs are meaningless, and the call raises. (Its row may land in a NOTIFY slot a
// peer still waits on for an older epoch: that peer meets its deadline, as before.)
// Rank p's row of the count matrices, zeroed (rank p failed, disagreed or is silent).
MOE_DEVICE void zero_notify_row(i32* matrix, i32* host_matrix, int p, int R, i64 num_hosts) {
    for (int e = 0; matrix && e < R; ++e) matrix[p * R + e] = 0;
    for (int h = 0; host_matrix && h < num_hosts; ++h) host_matrix[p * num_hosts + h] = 0;
}

__device__ void notify_body(const Group g, const ErrorSink err, u64 notify_off, i64 row_words,
                            u32 epoch, const i32* counts, i32* matrix, u64 call_off,
                            const CallRow call, const i32* host_counts, i64 num_hosts,
                            i32* host_matrix) {
    const Transport t{g.bases, err};
    const int p = threadIdx.x, R = (int)g.num_ranks;  // blockDim >= kMaxRanks (intranode.cu)
    g.settle_floors();
    const bool failed = block_failed(err, g.fence());
    if (p >= R) return;
    // Each word carries its own tag, so a reader never needs an extra "row complete" flag.
    if (g.live.on(p)) {
        send_call_row(t, p, call_off + (u64)g.rank * kCallWords * 8, epoch, call, failed);
        for (int d = 0; d < R; ++d) {
            const u32 c = failed ? kFailedValue : counts ? (u32)counts[d] : 0u;
            t.signal(p, notify_off + (u64)(g.rank * row_words + d) * 8, tag(epoch, c));
        }
        // a hierarchical dispatch (relay.cuh): the row goes on with this rank's token count
        // per host and its token count (row_words >= 2R + 1 leaves room for up to R + 1)
        for (int h = 0; h < num_hosts; ++h) {
            const u32 c = failed ? kFailedValue : (u32)host_counts[h];
            t.signal(p, notify_off + (u64)(g.rank * row_words + R + h) * 8, tag(epoch, c));
        }
    }
    if (failed) {
        zero_notify_row(matrix, host_matrix, p, R, num_hosts);
        return;
    }
    const u64* theirs = (const u64*)g.own(call_off + (u64)(p * kCallWords) * 8);
    if (!same_call(t, g.live, theirs, epoch, g.timeout_ns, p, call)) {
        zero_notify_row(matrix, host_matrix, p, R, num_hosts);
        return;
    }
    const u64* row = (const u64*)g.own(notify_off + (u64)(p * row_words) * 8);
    for (int d = 0; d < R + num_hosts; ++d) {
        const i64 v = wait_from(t, g.live, row + d, epoch, g.timeout_ns, p);
        if (v < 0) {  // rank p is silent (reported) or masked: it sends nothing
            zero_notify_row(matrix, host_matrix, p, R, num_hosts);
            return;
        }
        if (d < R && matrix) matrix[p * R + d] = (i32)v;
        if (d >= R) host_matrix[p * num_hosts + d - R] = (i32)v;
    }
}

// ---- wait_done ---------------------------------------------------------------------------
__device__ void wait_done_body(const Group g, const ErrorSink err, u64 done_off, u64 done_stride,
                               u32 epoch) {
    const Transport t{g.bases, err};
    const int s = threadIdx.x;  // blockDim >= kMaxRanks (intranode.cu)
    if (err.aborted() || s >= g.num_ranks) return;
    wait_from(t, g.live, (const u64*)g.own(done_off + s * done_stride), epoch, g.timeout_ns, s);
}

// Signal DONE[me] = epoch in every rank (run by the last block of a send kernel); the value is
// kFailedValue if this rank has failed (its rows may be missing).
MOE_DEVICE void signal_done_all(const Transport& t, const Group& g, u64 done_off,
                                u64 done_stride, u32 epoch) {
    const u32 value = t.err.signal_value(1);
    for (int d = threadIdx.x; d < g.num_ranks; d += blockDim.x)
        if (g.live.on(d)) t.signal(d, done_off + g.rank * done_stride, tag(epoch, value));
}

// ---- dispatch send -----------------------------------------------------------------------
// The first rank d >= from that a token goes to (pos: its row of send_pos), or R. The warp
// reads 32 positions at once, so a token's few destinations among hundreds of ranks cost a
// few reads, not one per rank. All lanes of the warp call it and get the same d.
MOE_DEVICE int next_destination(const i32* pos, int from, int R) {
    for (int d0 = from; d0 < R; d0 += kWarpSize) {
        const int d = d0 + lane_id();
        const u32 found = __ballot_sync(kFullMask, d < R && pos[d] >= 0);
        if (found) return d0 + lowest_bit(found);
    }
    return R;
}

// x: [T, row_bytes] bytes; scales f32 [T, S] or null; topk_idx i64 [T, K] / topk_w f32 [T, K]
// or null (cached dispatch sends neither); send_pos i32 [T, R] from the layout; matrix i32
// [R, R] from notify. worst > 0 (num_worst_tokens): every destination's receive region has
// exactly `worst` rows, so no host ever needs the matrix; rows past it are dropped and
// reported.
// chunk == 0: the slab holds d's whole receive region (the single copy). chunk > 0 (a streamed
// call, moe_comm/cuda/normal.py): the slab holds `chunk` rows and this launch (one round)
// writes only the region's rows [first, first + chunk), at slab row (row - first); the
// receiver copies them out before the next round's notify lets any sender write again.
__device__ void dispatch_send_body(const Group g, const ErrorSink err, const u8* x,
                                   i64 num_tokens, i64 row_bytes, const float* scales,
                                   i64 scale_cols, const i64* topk_idx, const float* topk_w,
                                   i64 topk, i64 num_local, const i32* send_pos,
                                   const i32* matrix, i64 worst, i64 chunk, i64 first,
                                   u64 done_off, u64 done_stride, u32 epoch, i32* counter) {
    __shared__ i64 row0[kMaxRanks];     // slab row of this rank's first row at destination d
                                        // (negative while this round's window starts later)
    __shared__ u64 limit[kMaxRanks];    // rows of d's slab this round (writes at or past it
                                        // would overflow the slab or the region)
    __shared__ Slab slab[kMaxRanks];
    __shared__ int last;
    const Transport t{g.bases, err};
    const int R = (int)g.num_ranks;
    // A failed rank (an error of an earlier kernel) writes no rows but still arrives and
    // signals DONE, carrying kFailedValue: its peers fail at once.
    const bool failed = block_failed(err, g.fence());
    for (int d = threadIdx.x; !failed && d < R; d += blockDim.x) {
        const bool live = g.live.on(d);  // a masked destination gets nothing (limit 0)
        u64 before = 0, rows = 0;
        for (int s = 0; s < R; ++s) {
            const u64 c = (u64)matrix[s * R + d];
            before += s < g.rank ? c : 0;
            rows += c;
        }
        const u64 region_rows = worst > 0 ? (u64)worst : rows;
        const u64 slab_rows = chunk > 0 ? (u64)chunk : region_rows;
        // rows of the region in this round's window (all of it without streaming)
        const u64 window = (u64)first < region_rows ? min_of<u64>(slab_rows, region_rows - first)
                                                    : 0;
        row0[d] = (i64)before - first;
        slab[d] = Slab::make(slab_rows, row_bytes, scale_cols, topk);
        g.note_end(d, slab[d].nbytes);
        limit[d] = live && g.fits(d, slab[d].nbytes) ? window : 0;
        if (live && (!g.fits(d, slab[d].nbytes) || rows > region_rows))
            err.report(kErrOverflow, epoch, d, (i32)rows);
    }
    __syncthreads();
    const int lane = lane_id();
    const i64 warp0 = (i64)blockIdx.x * warps_per_block() + warp_id();
    const i64 nwarps = (i64)gridDim.x * warps_per_block();
    for (i64 tok = warp0; !failed && tok < num_tokens; tok += nwarps) {
        // Only the ranks the token goes to (next_destination). Not unrolled, and nothing but d
        // carried from one pass to the next: each pass copies a whole row, and more of this
        // body's state would not fit the 128 registers a 512-thread block allows (spills).
        const i32* token_pos = send_pos + tok * R;
#pragma unroll 1
        for (int d = next_destination(token_pos, 0, R); d < R;
             d = next_destination(token_pos, d + 1, R)) {
            const i64 at = row0[d] + token_pos[d];
            // another round's row, or an overflow (reported above)
            if (at < 0 || (u64)at >= limit[d]) continue;
            const u64 row = (u64)at;
            const Slab& s = slab[d];
            const u64 base = g.slab_at(d);
            t.put_warp(d, base + s.x + row * row_bytes, x + tok * row_bytes, row_bytes);
            if (scales)
                t.put_warp(d, base + s.scales + row * scale_cols * 4, scales + tok * scale_cols,
                           scale_cols * 4);
            if (topk > 0) {
                // Top-k ids as seen by d: local ids, -1 where the expert lives elsewhere; the
                // weights are zeroed there so summing them back in combine restores the input.
                i64* ids = (i64*)t.row_for_write(d, base + s.idx + row * topk * 8);
                float* ws = (float*)t.row_for_write(d, base + s.w + row * topk * 4);
                if (!ids || !ws) continue;  // unreachable rank (reported): nowhere to build
                for (i64 k = lane; k < topk; k += kWarpSize) {
                    const i64 e = topk_idx[tok * topk + k];
                    const i64 local = e - d * num_local;
                    const bool mine = e >= 0 && local >= 0 && local < num_local;
                    ids[k] = mine ? local : -1;
                    ws[k] = mine && topk_w ? topk_w[tok * topk + k] : 0.0f;
                }
                __syncwarp();
                t.commit_row_warp(d, base + s.idx + row * topk * 8, (const u8*)ids, topk * 8);
                t.commit_row_warp(d, base + s.w + row * topk * 4, (const u8*)ws, topk * 4);
            }
        }
    }
    if (last_block_arrives(counter, &last)) signal_done_all(t, g, done_off, done_stride, epoch);
}

// ---- dispatch copy-out -------------------------------------------------------------------
// Copies this rank's received slab into the output tensors: rows_out rows (the real count, or
// num_worst_tokens with padding: x 0, scales 0, ids -1, weights 0). expert_counts int32
// [num_local] (zeroed by the host) or null: rows per local expert, for the aligned count list.
// Nothing here trusts the received bytes or the matrix to be sane (an elastic group whose
// survivors disagreed on the mask has senders that used other offsets): reads stay inside the
// data region and counts inside expert_counts.
// chunk > 0 (one round of a streamed call, see dispatch send): the slab holds `chunk` rows,
// the region's rows [first, first + rows_out); the outputs point at output row `first`.
__device__ void dispatch_copy_out_body(const Group g, i64 row_bytes, i64 scale_cols, i64 topk,
                                       const i32* matrix, i64 worst, i64 chunk, i64 first,
                                       i64 rows_out, u8* recv_x,
                                       float* recv_scales, i64* recv_idx, float* recv_w,
                                       i32* expert_counts, i64 num_local) {
    __shared__ i64 received;
    __shared__ Slab slab;
    __shared__ i64 src_end[kMaxRanks];  // rows of sources 0..s end at src_end[s]
    __shared__ bool live[kMaxRanks];    // elastic: rows of a source masked after notify: padding
    const int R = (int)g.num_ranks;
    for (int s = threadIdx.x; s < R; s += blockDim.x) live[s] = g.live.on(s);
    if (threadIdx.x == 0) {
        i64 n = 0;
        for (int s = 0; s < R; ++s) {
            n += matrix[s * R + g.rank];
            src_end[s] = n;
        }
        const u64 slab_rows = chunk > 0 ? (u64)chunk : worst > 0 ? (u64)worst : (u64)n;
        slab = Slab::make(slab_rows, row_bytes, scale_cols, topk);
        // a slab past the region was refused by every sender (overflow): nothing arrived
        received = g.fits(g.rank, slab.nbytes) ? min_of<i64>(n - first, rows_out) : 0;
    }
    __syncthreads();
    const u8* region = g.own(g.slab_at(g.rank));
    const int lane = lane_id();
    const i64 warp0 = (i64)blockIdx.x * warps_per_block() + warp_id();
    const i64 nwarps = (i64)gridDim.x * warps_per_block();
    for (i64 r = warp0; r < rows_out; r += nwarps) {
        if (r < received && live[segment_of(src_end, R, first + r)]) {
            warp_copy(recv_x + r * row_bytes, region + slab.x + r * row_bytes, row_bytes);
            if (recv_scales)
                warp_copy(recv_scales + r * scale_cols, region + slab.scales + r * scale_cols * 4,
                          scale_cols * 4);
            if (topk > 0) {
                const i64* ids = (const i64*)(region + slab.idx) + r * topk;
                const float* ws = (const float*)(region + slab.w) + r * topk;
                for (i64 k = lane; k < topk; k += kWarpSize) {
                    const i64 e = ids[k];
                    recv_idx[r * topk + k] = e;
                    recv_w[r * topk + k] = ws[k];
                    if (expert_counts && e >= 0 && e < num_local) atomicAdd(expert_counts + e, 1);
                }
            }
        } else {
            warp_fill(recv_x + r * row_bytes, 0, row_bytes);
            if (recv_scales) warp_fill(recv_scales + r * scale_cols, 0, scale_cols * 4);
            for (i64 k = lane; k < topk; k += kWarpSize) {
                recv_idx[r * topk + k] = -1;
                recv_w[r * topk + k] = 0.0f;
            }
        }
    }
}

// ---- combine send ------------------------------------------------------------------------
// x: [>= N, row_bytes] this rank's expert outputs in received order (N = sum_s m[s][me], the
// real count even when x has num_worst_tokens rows); topk_w f32 [>= N, K] or null. Each row
// goes back to its source rank's staging slab. chunk > 0 (one round of a streamed call): the
// staging slab holds `chunk` rows, and only the staging rows [first, first + chunk) move, to
// slab row (row - first); the owner copies them to a local tensor before the next round.
__device__ void combine_send_body(const Group g, const ErrorSink err, const u8* x, i64 row_bytes,
                                  const float* topk_w, i64 topk, const i32* matrix, i64 chunk,
                                  i64 first, u64 done_off, u64 done_stride, u32 epoch,
                                  i32* counter) {
    __shared__ i64 src_start[kMaxRanks + 1];  // my rows from source s: [src_start[s], ...)
    __shared__ i64 row0[kMaxRanks];           // where my rows start in s's staging slab
                                              // (negative while this round's window starts later)
    __shared__ bool fits[kMaxRanks];
    __shared__ Slab slab[kMaxRanks];
    __shared__ int last;
    const Transport t{g.bases, err};
    const int R = (int)g.num_ranks;
    const bool failed = block_failed(err, g.fence());  // then: no rows, but arrive, signal
    if (threadIdx.x == 0) {
        src_start[0] = 0;
        for (int s = 0; s < R; ++s) src_start[s + 1] = src_start[s] + matrix[s * R + g.rank];
    }
    for (int s = threadIdx.x; s < R; s += blockDim.x) {
        u64 before = 0, rows = 0;
        for (int d = 0; d < R; ++d) {
            const u64 c = (u64)matrix[s * R + d];
            before += d < g.rank ? c : 0;
            rows += c;
        }
        row0[s] = (i64)before - first;
        slab[s] = Slab::make(chunk > 0 ? (u64)chunk : rows, row_bytes, 0, topk);
        g.note_end(s, slab[s].nbytes);
        fits[s] = g.fits(s, slab[s].nbytes);
        if (!fits[s]) err.report(kErrOverflow, epoch, s, (i32)rows);
        fits[s] = fits[s] && g.live.on(s);  // a masked token owner gets nothing back
    }
    __syncthreads();
    const i64 total = failed ? 0 : src_start[R];
    const i64 warp0 = (i64)blockIdx.x * warps_per_block() + warp_id();
    const i64 nwarps = (i64)gridDim.x * warps_per_block();
    for (i64 i = warp0; i < total; i += nwarps) {
        const int s = segment_of(src_start + 1, R, i);
        if (!fits[s]) continue;
        const i64 at = row0[s] + (i - src_start[s]);
        if (chunk > 0 && (at < 0 || at >= chunk)) continue;  // another round's row
        const u64 row = (u64)at;
        const Slab& sl = slab[s];
        t.put_warp(s, g.slab_at(s) + sl.x + row * row_bytes, x + i * row_bytes, row_bytes);
        if (topk_w)
            t.put_warp(s, g.slab_at(s) + sl.w + row * topk * 4, topk_w + i * topk, topk * 4);
    }
    if (last_block_arrives(counter, &last)) signal_done_all(t, g, done_off, done_stride, epoch);
}

// ---- combine reduce ----------------------------------------------------------------------
// The staging rows token `tok` sums, in rank order, into rows[0..n); returns n. Rank d's row
// counts if the token went to d, d's segment holds it (a failed call's matrix may not match
// send_pos) and d is live (elastic: rows of a rank masked during the call never came).
// Compacted once per token so the channel loops run over the token's few rows, not over every
// rank of the group. All threads of the block call it (block scans, in chunks of blockDim).
MOE_DEVICE int token_rows(const Group& g, const i32* send_pos, i64 tok, const u64* seg_start,
                          const i64* seg_rows, u64* rows, int* warp_counts) {
    const int R = (int)g.num_ranks;
    int n = 0;
    for (int d0 = 0; d0 < R; d0 += blockDim.x) {  // the same passes in every thread
        const int d = d0 + threadIdx.x;
        const i32 p = d < R ? send_pos[tok * R + d] : -1;
        const bool use = p >= 0 && p < seg_rows[d] && g.live.on(d);
        int total;
        const int at = block_scan_flags(use, warp_counts, &total);
        if (use) rows[n + at] = seg_start[d] + (u64)p;
        n += total;
    }
    __syncthreads();  // rows complete before any thread reads them
    return n;
}

// out[t] = sum over ranks d that t was sent to of staging row (d, send_pos[t][d]), in fp32 and
// in rank order (like moe_comm/host/reduce.py), plus up to two fp32 biases [T, H]; written in
// Elem. w_out f32 [T, K] or null: the returned top-k weights summed the same way.
// One block per token (grid-stride); 16-byte vectors when the row size and `out` allow.
// Like the copy-out, nothing here trusts the matrix to match send_pos (a failed call's is
// zeros): a row past d's segment, or a segment past the region, is not read.
// staged: null (the rows are in this rank's slab), or a streamed call's local copy of them,
// laid out as the same Slab (combine_stage): the same rows, read in the same order.
template <typename Elem>
__device__ void combine_reduce_body(const Group g, i64 hidden, i64 topk, const i32* matrix,
                                    const i32* send_pos, i64 num_tokens, const float* bias0,
                                    const float* bias1, typename Elem::Storage* out,
                                    float* w_out, const u8* staged) {
    typedef typename Elem::Storage S;
    constexpr int V = 16 / sizeof(S);  // elements per 16-byte vector
    __shared__ u64 seg_start[kMaxRanks];
    __shared__ i64 seg_rows[kMaxRanks];
    __shared__ Slab slab;
    __shared__ u64 rows[kMaxRanks];  // the current token's staging rows (token_rows)
    __shared__ int warp_counts[32];
    const int R = (int)g.num_ranks;
    const u64 row_bytes = hidden * sizeof(S);
    if (threadIdx.x == 0) {
        u64 at = 0;
        for (int d = 0; d < R; ++d) {
            seg_start[d] = at;
            seg_rows[d] = matrix[g.rank * R + d];
            at += (u64)max_of<i64>(seg_rows[d], 0);
        }
        slab = Slab::make(at, row_bytes, 0, topk);
        if (!staged && !g.fits(g.rank, slab.nbytes))  // refused by every sender (overflow)
            for (int d = 0; d < R; ++d) seg_rows[d] = 0;
    }
    __syncthreads();  // slab and segments ready
    const u8* region = staged ? staged : g.own(g.slab_at(g.rank));
    const bool vec = (row_bytes % 16) == 0 && aligned(out, 16);
    for (i64 tok = blockIdx.x; tok < num_tokens; tok += gridDim.x) {
        const int n = token_rows(g, send_pos, tok, seg_start, seg_rows, rows, warp_counts);
        S* dst = out + tok * hidden;
        if (vec) {
            for (i64 c = threadIdx.x; c < hidden / V; c += blockDim.x) {
                float acc[V];
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] = 0.0f;
                for (int i = 0; i < n; ++i) {
                    const uint4 raw = ld16(region + slab.x + rows[i] * row_bytes + c * 16);
                    const S* v = (const S*)&raw;
#pragma unroll
                    for (int j = 0; j < V; ++j) acc[j] += Elem::to_f32(v[j]);
                }
                const float* biases[2] = {bias0, bias1};
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    if (!biases[b]) continue;
                    const float* bp = biases[b] + tok * hidden + c * V;
#pragma unroll
                    for (int j = 0; j < V; ++j) acc[j] += bp[j];
                }
                uint4 packed;
                S* o = (S*)&packed;
#pragma unroll
                for (int j = 0; j < V; ++j) o[j] = Elem::from_f32(acc[j]);
                st16(dst + c * V, packed);
            }
        } else {
            for (i64 c = threadIdx.x; c < hidden; c += blockDim.x) {
                float acc = 0.0f;
                for (int i = 0; i < n; ++i)
                    acc += Elem::to_f32(((const S*)(region + slab.x + rows[i] * row_bytes))[c]);
                if (bias0) acc += bias0[tok * hidden + c];
                if (bias1) acc += bias1[tok * hidden + c];
                dst[c] = Elem::from_f32(acc);
            }
        }
        if (w_out) {
            for (i64 k = threadIdx.x; k < topk; k += blockDim.x) {
                float acc = 0.0f;
                for (int i = 0; i < n; ++i)
                    acc += ((const float*)(region + slab.w))[rows[i] * topk + k];
                w_out[tok * topk + k] = acc;
            }
        }
    }
}

// ---- combine stage (streamed calls) ------------------------------------------------------
// One round of a streamed combine: the `rows` staging rows that arrived in this rank's slab
// (`chunk` rows of layout, holding staging rows [first, first + rows)) copied into `staged`, a
// local tensor laid out as the Slab of all `total` staging rows, which the reduce then reads:
// every row is reduced once, in the order the single copy reduces it, so a streamed combine
// returns the single copy's bits.
__device__ void combine_stage_body(const Group g, i64 row_bytes, i64 topk, i64 chunk, i64 first,
                                   i64 rows, i64 total, u8* staged) {
    const Slab win = Slab::make((u64)chunk, row_bytes, 0, topk);
    const Slab all = Slab::make((u64)total, row_bytes, 0, topk);
    if (!g.fits(g.rank, win.nbytes)) return;  // refused by every sender (overflow, reported)
    const u8* region = g.own(g.slab_at(g.rank));
    const i64 warp0 = (i64)blockIdx.x * warps_per_block() + warp_id();
    const i64 nwarps = (i64)gridDim.x * warps_per_block();
    for (i64 r = warp0; r < rows; r += nwarps) {
        warp_copy(staged + all.x + (first + r) * row_bytes, region + win.x + r * row_bytes,
                  row_bytes);
        if (topk > 0)
            warp_copy(staged + all.w + (first + r) * topk * 4, region + win.w + r * topk * 4,
                      topk * 4);
    }
}
