// relay.cuh: hierarchical (relay) normal mode across hosts, the CUDA twin of
// moe_comm/host/relay.py; moe_comm/cuda/relay.py queues these kernels and computes every table
// they take from the count matrices (the same on every rank), so the kernels only move rows.
//
// The relay of sender s on host H is the rank of H with s's local index (mod H's rank count).
// A call runs in one extra epoch `e` besides its notify (and, dispatch, one more for the
// flat send of this rank's own rows to its host, whose DONE nobody awaits):
//
//   dispatch  stage    each token of this rank that goes to another host, once per such host,
//                      into its relay's staging slab there (after that relay's output slab);
//                      DONE = e to every relay of this rank.
//             (own)    moe_dispatch_send with only this host's ranks live: this rank's own
//                      rows to its host at the flat rows.
//             forward  once the senders it relays for are DONE (moe_wait_done with their
//                      ranks live), each staged row to each rank of this host in its mask, at
//                      the flat protocol's row (rows of lower sources, then the row's place
//                      among its source's rows for that rank: a scan of the mask column), so
//                      the outputs are the flat protocol's bit for bit; DONE = e to this host.
//                      The scan positions are kept (relay_pos) for the combine.
//   combine   ranges   each rank's returned rows, one contiguous range per source: to the
//                      owner's flat staging slab when it is on this host, else to the owner's
//                      relay here (its gather slab, after its own staging slab); DONE = e to
//                      this host.
//             relay    once this host is DONE: per relayed token the fp32 sum of its host's
//                      rows, cast to the payload dtype (DeepEP's scheme), written once across
//                      into the owner's flat staging slab at the row of the first rank of this
//                      host the token went to; DONE = e to the owners.
//             reduce   moe_combine_reduce with send_pos keeping, per other host, only that
//                      first rank: the owner sums its host's rows and one partial per host.
//
// Masked ranks and elastic groups: relays are picked among the active ranks (the host's
// tables); the stage kernel leaves masked ranks out of a token's mask, so a token counted for
// one goes nowhere. Every slab (staging, gather, the owner's) starts after the rank's floor
// (Group::slab_at), and the host notes where a relayed call's slabs end (floors[R + d]), so
// a rank dropped mid-call that resumes writes only where no later call reads.
//
// Memory ordering is normal.cuh's: payload stores (peer stores, or puts through the proxy
// ring, which keeps the order of its commands) precede the last block's fence and its DONE
// signals; every wait is moe_wait_done's, with the group deadline. The notify of the next
// call is the barrier that keeps senders out of a staging or gather slab its owner still reads.
#pragma once
#include "normal.cuh"

// A relay's staging slab (moe_comm/cuda/relay.py StageLayout): payload rows, then one
// metadata row per token - global top-k ids (8 bytes each), scales, top-k weights (4 bytes
// each), mask bytes, the row rounded to 8 bytes - so a staged token crosses as two puts, not
// five (each put costs a command and a frame on the wire). Sub-arrays kSlabAlign aligned,
// the whole a page multiple.
struct StageSlab {
    u64 x, meta, meta_bytes, scales, w, mask, nbytes;  // scales, w, mask: offsets in a meta row

    static MOE_DEVICE StageSlab make(u64 rows, u64 row_bytes, u64 scale_cols, u64 topk,
                                     u64 mask_cols) {
        StageSlab s;
        s.x = 0;
        s.meta = round_up(rows * row_bytes, kSlabAlign);
        s.scales = topk * 8;
        s.w = s.scales + scale_cols * 4;
        s.mask = s.w + topk * 4;
        s.meta_bytes = round_up(s.mask + mask_cols, 8);
        s.nbytes = round_up(s.meta + rows * s.meta_bytes, kPage);
        return s;
    }
};

// DONE[me] = epoch at every rank d with done_to[d] != 0 (the last block of a relay kernel).
MOE_DEVICE void signal_done_to(const Transport& t, const Group& g, const i32* done_to,
                               u64 done_off, u64 done_stride, u32 epoch) {
    const u32 value = t.err.signal_value(1);
    for (int d = threadIdx.x; d < g.num_ranks; d += blockDim.x)
        if (done_to[d]) t.signal(d, done_off + g.rank * done_stride, tag(epoch, value));
}

// ---- dispatch stage ----------------------------------------------------------------------
// host_pos i32 [T, H]: the token's row among this rank's tokens for host h (-1: not, and
// always -1 for this rank's own host). relay_of i32 [H]: this rank's relay on host h (-1: own
// host). ranks_on i32 [H, mask_cols]: host h's ranks by local index (-1 padding).
// stage_off/stage_rows/stage_row0 i64 [H]: where the relay's staging slab starts in its data
// region, its rows, and this rank's first row there. Ids and weights go as given (global ids;
// zero weights without topk_w); the relay converts them per destination.
__device__ void relay_stage_body(const Group g, const ErrorSink err, const u8* x,
                                 i64 num_tokens, i64 row_bytes, const float* scales,
                                 i64 scale_cols, const i64* topk_idx, const float* topk_w,
                                 i64 topk, const i32* send_pos, const i32* host_pos,
                                 i64 num_hosts, const i32* relay_of, const i32* ranks_on,
                                 i64 mask_cols, const i64* stage_off, const i64* stage_rows,
                                 const i64* stage_row0, const i32* done_to, u64 done_off,
                                 u64 done_stride, u32 epoch, i32* counter) {
    // per host (H <= R), in shared memory so the token loop carries little but the token and
    // the host (a 512-thread block has 128 registers a thread)
    __shared__ StageSlab slab[kMaxRanks];
    __shared__ u64 base[kMaxRanks];   // the staging slab's byte offset in the relay's buffer
    __shared__ i64 row0[kMaxRanks];   // this rank's first staging row there
    __shared__ int relay[kMaxRanks];  // the relay, -1: own host (or a slab past the region)
    __shared__ int last;
    const Transport t{g.bases, err};
    const int R = (int)g.num_ranks, H = (int)num_hosts;
    const bool failed = block_failed(err, g.fence());
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        slab[h] = StageSlab::make((u64)stage_rows[h], row_bytes, scale_cols, topk, mask_cols);
        // after the relay's floor (elastic groups: past slabs a late writer may still use)
        base[h] = relay_of[h] >= 0 ? g.slab_at(relay_of[h]) + (u64)stage_off[h] : g.data_off;
        row0[h] = stage_row0[h];
        // the host planned the slab inside the region: a guard, never a normal path
        const bool inside = relay_of[h] < 0 || g.fits(relay_of[h], (u64)stage_off[h] +
                                                                    slab[h].nbytes);
        relay[h] = inside ? relay_of[h] : -1;
        if (relay_of[h] >= 0 && !inside && blockIdx.x == 0)
            err.report(kErrOverflow, epoch, relay_of[h], (i32)stage_rows[h]);
    }
    __syncthreads();
    const int lane = lane_id();
    const i64 warp0 = (i64)blockIdx.x * warps_per_block() + warp_id();
    const i64 nwarps = (i64)gridDim.x * warps_per_block();
    for (i64 tok = warp0; !failed && tok < num_tokens; tok += nwarps) {
#pragma unroll 1
        for (int h = 0; h < H; ++h) {
            const i32 p = host_pos[tok * H + h];
            const int f = relay[h];
            if (p < 0 || f < 0) continue;
            const u64 row = (u64)(row0[h] + p);
            t.put_warp(f, base[h] + slab[h].x + row * row_bytes, x + tok * row_bytes, row_bytes);
            const u64 at = base[h] + slab[h].meta + row * slab[h].meta_bytes;
            u8* meta = t.row_for_write(f, at);
            if (meta) {
                for (i64 k = lane; k < topk; k += kWarpSize) {
                    ((i64*)meta)[k] = topk_idx[tok * topk + k];
                    ((float*)(meta + slab[h].w))[k] = topk_w ? topk_w[tok * topk + k] : 0.0f;
                }
                for (i64 c = lane; c < scale_cols; c += kWarpSize)
                    ((float*)(meta + slab[h].scales))[c] = scales[tok * scale_cols + c];
                for (i64 c = lane; c < mask_cols; c += kWarpSize) {
                    const i32 d = ranks_on[h * mask_cols + c];
                    // a masked rank gets nothing (the counts of the notify may still count
                    // it: such a token is staged with an empty mask, forwarded nowhere)
                    meta[slab[h].mask + c] =
                        d >= 0 && g.live.on(d) && send_pos[tok * R + d] >= 0 ? 1 : 0;
                }
            }
            __syncwarp();
            t.commit_row_warp(f, at, meta, slab[h].meta_bytes);
        }
    }
    if (last_block_arrives(counter, &last))
        signal_done_to(t, g, done_to, done_off, done_stride, epoch);
}

// ---- dispatch forward --------------------------------------------------------------------
// jobs i64 [J, 5], one per (relayed sender s, rank d of this host): (s's first staging row,
// its staged rows n, d, d's local index li, d's flat row0 for s = rows of lower sources).
// One block per job (grid-stride). out_rows i64 [R]: rows of each rank's output slab (its
// column sum). relay_pos i32 [stage_rows, L] out: a staged row's place among s's rows for the
// rank of local index li, -1 when it does not go there (the combine's relay reads it).
__device__ void relay_forward_body(const Group g, const ErrorSink err, i64 row_bytes,
                                   i64 scale_cols, i64 topk, i64 num_local, i64 mask_cols,
                                   i64 stage_off, i64 stage_rows, const i64* jobs,
                                   i64 num_jobs, const i64* out_rows, i32* relay_pos,
                                   i64 num_here, const i32* done_to, u64 done_off,
                                   u64 done_stride, u32 epoch, i32* counter) {
    __shared__ i32 pos[MOE_THREADS_RELAY_FORWARD];  // this chunk's rows' places, -1: not sent
    __shared__ int warp_counts[32];
    __shared__ int last;
    const Transport t{g.bases, err};
    const bool failed = block_failed(err, g.fence());
    const StageSlab st = StageSlab::make((u64)stage_rows, row_bytes, scale_cols, topk, mask_cols);
    const u8* region = g.own(g.slab_at((int)g.rank) + (u64)stage_off);
    const bool inside = g.fits((int)g.rank, (u64)stage_off + st.nbytes);
    const int lane = lane_id();
    for (i64 j = blockIdx.x; !failed && inside && j < num_jobs; j += gridDim.x) {
        const i64* job = jobs + j * 5;
        const i64 row0 = job[0], n = job[1], li = job[3], dst0 = job[4];
        const int d = (int)job[2];
        const Slab out = Slab::make((u64)out_rows[d], row_bytes, scale_cols, topk);
        const bool fits = g.fits(d, out.nbytes);
        const u64 base = g.slab_at(d);
        i64 running = 0;
        for (i64 c0 = 0; c0 < n; c0 += blockDim.x) {
            const i64 i = c0 + threadIdx.x;
            const bool bit = i < n && region[st.meta + (u64)(row0 + i) * st.meta_bytes + st.mask +
                                             li] != 0;
            int total;
            const int before = block_scan_flags(bit, warp_counts, &total);
            const i32 at = bit ? (i32)(running + before) : -1;
            pos[threadIdx.x] = at;
            if (i < n) relay_pos[(row0 + i) * num_here + li] = at;
            __syncthreads();
            const i64 chunk = min_of<i64>(blockDim.x, n - c0);
            for (i64 r = warp_id(); fits && r < chunk; r += warps_per_block()) {
                if (pos[r] < 0) continue;
                const u64 src = (u64)(row0 + c0 + r), row = (u64)(dst0 + pos[r]);
                const u8* meta = region + st.meta + src * st.meta_bytes;
                t.put_warp(d, base + out.x + row * row_bytes, region + st.x + src * row_bytes,
                           row_bytes);
                if (scale_cols)
                    t.put_warp(d, base + out.scales + row * scale_cols * 4, meta + st.scales,
                               scale_cols * 4);
                if (topk > 0) {
                    // ids as d sees them (local, -1 elsewhere), weights zeroed there: the
                    // flat send's rule (normal.cuh dispatch send)
                    const i64* ids_in = (const i64*)meta;
                    const float* ws_in = (const float*)(meta + st.w);
                    i64* ids = (i64*)t.row_for_write(d, base + out.idx + row * topk * 8);
                    float* ws = (float*)t.row_for_write(d, base + out.w + row * topk * 4);
                    if (!ids || !ws) continue;
                    for (i64 k = lane; k < topk; k += kWarpSize) {
                        const i64 e = ids_in[k];
                        const i64 local = e - (i64)d * num_local;
                        const bool mine = e >= 0 && local >= 0 && local < num_local;
                        ids[k] = mine ? local : -1;
                        ws[k] = mine ? ws_in[k] : 0.0f;
                    }
                    __syncwarp();
                    t.commit_row_warp(d, base + out.idx + row * topk * 8, (const u8*)ids,
                                      topk * 8);
                    t.commit_row_warp(d, base + out.w + row * topk * 4, (const u8*)ws,
                                      topk * 4);
                }
            }
            running += total;
            __syncthreads();  // pos is rewritten by the next chunk
        }
    }
    if (last_block_arrives(counter, &last))
        signal_done_to(t, g, done_to, done_off, done_stride, epoch);
}

// ---- combine ranges ----------------------------------------------------------------------
// jobs i64 [J, 6]: (first row of x, rows, destination rank, its first row there, byte offset
// of the destination slab in its data region, that slab's rows); ends i64 [J]: cumulative
// rows. Each row (payload and weights) goes to Slab(slab rows, row_bytes, 0, topk).
__device__ void relay_ranges_body(const Group g, const ErrorSink err, const u8* x,
                                  i64 row_bytes, const float* topk_w, i64 topk,
                                  const i64* jobs, const i64* ends, i64 num_jobs,
                                  const i32* done_to, u64 done_off, u64 done_stride, u32 epoch,
                                  i32* counter) {
    __shared__ int last;
    const Transport t{g.bases, err};
    const bool failed = block_failed(err, g.fence());
    const i64 total = failed || num_jobs == 0 ? 0 : ends[num_jobs - 1];
    const i64 warp0 = (i64)blockIdx.x * warps_per_block() + warp_id();
    const i64 nwarps = (i64)gridDim.x * warps_per_block();
    for (i64 i = warp0; i < total; i += nwarps) {
        const int j = segment_of(ends, (int)num_jobs, i);
        const i64* job = jobs + j * 6;
        const i64 k = i - (ends[j] - job[1]);  // place in the job's range
        const int d = (int)job[2];
        const Slab sl = Slab::make((u64)job[5], row_bytes, 0, topk);
        if (!g.fits(d, (u64)job[4] + sl.nbytes)) continue;  // planned inside: a guard
        const u64 base = g.slab_at(d) + (u64)job[4], row = (u64)(job[3] + k), src = job[0] + k;
        t.put_warp(d, base + sl.x + row * row_bytes, x + src * row_bytes, row_bytes);
        if (topk_w)
            t.put_warp(d, base + sl.w + row * topk * 4, topk_w + src * topk, topk * 4);
    }
    if (last_block_arrives(counter, &last))
        signal_done_to(t, g, done_to, done_off, done_stride, epoch);
}

// ---- combine relay -----------------------------------------------------------------------
// jobs i64 [J, 4 + 2L], one per relayed owner s: (s's first staging row, its staged rows,
// s, rows of s's flat staging slab, then per local index li: where (s, li)'s rows start in
// this rank's gather slab, and where li's rows start in s's flat staging slab); ends i64 [J]
// cumulative staged rows. One warp per staged token (no block barrier: a token's few rows are
// summed lane by lane across the row): the fp32 sum of the rows this host returned for it
// (relay_pos says which and where), in local-index order, cast to Elem, written into s's slab
// at the row of the first local rank the token went to; weights summed alike (float32).
template <typename Elem>
__device__ void relay_reduce_body(const Group g, const ErrorSink err, i64 hidden, i64 topk,
                                  i64 gather_off, i64 gather_rows, const i64* jobs,
                                  const i64* ends, i64 num_jobs, const i32* relay_pos,
                                  i64 num_here, const i32* done_to, u64 done_off,
                                  u64 done_stride, u32 epoch, i32* counter) {
    typedef typename Elem::Storage S;
    __shared__ int last;
    const Transport t{g.bases, err};
    const bool failed = block_failed(err, g.fence());
    const u64 row_bytes = (u64)hidden * sizeof(S);
    const Slab gs = Slab::make((u64)gather_rows, row_bytes, 0, topk);
    const u8* region = g.own(g.slab_at((int)g.rank) + (u64)gather_off);
    const bool inside = g.fits((int)g.rank, (u64)gather_off + gs.nbytes);
    const i64 total = failed || !inside || num_jobs == 0 ? 0 : ends[num_jobs - 1];
    const i64 stride = 4 + 2 * num_here;
    const int lane = lane_id();
    const i64 warp0 = (i64)blockIdx.x * warps_per_block() + warp_id();
    const i64 nwarps = (i64)gridDim.x * warps_per_block();
    for (i64 i = warp0; i < total; i += nwarps) {
        const int j = segment_of(ends, (int)num_jobs, i);
        const i64* job = jobs + j * stride;
        const i32* pos = relay_pos + (job[0] + (i - (ends[j] - job[1]))) * num_here;
        const int s = (int)job[2];
        const Slab back = Slab::make((u64)job[3], row_bytes, 0, topk);
        int first = 0;  // the first local rank the token went to (the same in every lane)
        while (first < num_here && pos[first] < 0) ++first;
        if (first == num_here || !g.fits(s, back.nbytes)) continue;
        const u64 dst_row = (u64)(job[4 + 2 * first + 1] + pos[first]);
        const u64 at = g.slab_at(s) + back.x + dst_row * row_bytes;
        S* out = (S*)t.row_for_write(s, at);
        if (out)
            for (i64 c = lane; c < hidden; c += kWarpSize) {
                float acc = 0.0f;
                for (int li = first; li < num_here; ++li)
                    if (pos[li] >= 0)
                        acc += Elem::to_f32(((const S*)(region + gs.x + (u64)(job[4 + 2 * li] +
                                                                            pos[li]) *
                                                                       row_bytes))[c]);
                out[c] = Elem::from_f32(acc);
            }
        __syncwarp();
        t.commit_row_warp(s, at, (const u8*)out, row_bytes);
        if (topk > 0) {
            const u64 w_at = g.slab_at(s) + back.w + dst_row * topk * 4;
            float* w_out = (float*)t.row_for_write(s, w_at);
            if (w_out)
                for (i64 k = lane; k < topk; k += kWarpSize) {
                    float acc = 0.0f;
                    for (int li = first; li < num_here; ++li)
                        if (pos[li] >= 0)
                            acc += ((const float*)(region + gs.w))[(job[4 + 2 * li] + pos[li]) *
                                                                   topk + k];
                    w_out[k] = acc;
                }
            __syncwarp();
            t.commit_row_warp(s, w_at, (const u8*)w_out, topk * 4);
        }
    }
    if (last_block_arrives(counter, &last))
        signal_done_to(t, g, done_to, done_off, done_stride, epoch);
}
