// elastic.cuh: the survivors of an elastic group leave a call with the same mask; the CUDA
// twin of HostComm.agree (moe_comm/host/comm.py), the same protocol step for step.
//
// Each rank masks on its own deadlines, so two survivors can disagree: rank A timed out on a
// rank that died just after writing its notify row to B. moe_comm/cuda/elastic.py runs an
// agreement after a dispatch's notify and at the end of every call: flooding rounds with an
// early decision (docs/ARCHITECTURE.md "Agreement" says why it converges):
//
//   round r  push this rank's estimate (its view ANDed with every estimate heard so far) into
//            MASK[r % 2][me] of every rank the previous agreement kept (`told`: a rank masked
//            since then, only late perhaps, still learns it was dropped); wait, one deadline
//            plus a grace, for the round-r estimate of every rank it still listens to, or for
//            a decision of this agreement from one of them; AND the estimates in, drop the silent ranks
//            (they are no longer listened to).
//   decide   a round in which nobody it listens to was silent decides its estimate; a rank
//            that reads a peer's decision takes it. Either way it writes the decision into
//            DECIDED[seq % 2][me] of every rank of the call, FENCE into the header of every
//            rank the decision drops, and leaves.
//
// Each round either decides or loses a rank it listened to, so `max_rounds` (num_ranks + 1)
// bounds it. If this rank's own bit is cleared it reports kErrMasked (the host raises
// RankMaskedError) and later kernels stop at entry. With `matrix` (a dispatch's R x R count
// matrix after notify) the rows and columns of masked ranks are zeroed, so every survivor
// computes the same row offsets. With `floors` (normal.cuh Group; the agreement at the end of
// a normal operation) a decision that drops a rank the previous agreement kept has every
// rank's floor moved past the slab this operation used there (by the next notify): the
// dropped rank may be stopped between its fence check and its stores into those slabs, and
// no later operation reads them. Every survivor takes the same decision and knows every
// slab, so all move alike.
//
// Rows alternate by parity (rounds for MASK, agreements for DECIDED) and carry the round's own
// tag (wire.agree_round_tag): a rank writes round r + 2 only after it heard round r + 1 from
// everyone it listens to, which each wrote after reading its round r row; a rank still waiting
// for a round's row of a peer that has decided finds the peer's decision instead.
#pragma once
#include "transport.cuh"

// Words of a MASK row for the largest group (kMaskBits ranks a word: moe_generated.cuh). Rows
// of a smaller group have mask_words of them; `got` below is kept in registers, unrolled.
constexpr int kMaxMaskWords = (kMaxRanks + kMaskBits - 1) / kMaskBits;
static_assert(kMaxErrorRanks >= kMaxRanks, "the error word flags every rank of a group");

// grid 1, blockDim >= num_ranks (<= kMaxRanks). active: the group's words (elastic);
// told: the ranks the previous agreement kept (updated here to this one's decision);
// mask_off: byte offset of MASK[0][0];
// decided_off: of DECIDED[seq % 2][0]; fence_off: of FENCE; row_stride: bytes between two
// ranks' rows; tag0: the tag of round 1 (later rounds count on from it).
MOE_DEVICE void agree_body(const u64* bases, int rank, int num_ranks, i64 timeout_ns,
                           const ErrorSink err, i32* active, i32* told,
                           u64 mask_off, u64 decided_off, u64 fence_off, u64 row_stride,
                           int mask_words, u32 seq, u32 tag0, int max_rounds, i32* matrix,
                           i64* floors) {
    __shared__ u32 estimate[kMaxMaskWords];
    __shared__ u32 decision[kMaxMaskWords];
    __shared__ u32 row_of[kMaxRanks][kMaxMaskWords];  // what each rank wrote this round
    __shared__ bool listen[kMaxRanks];
    __shared__ bool heard[kMaxRanks];
    __shared__ bool keep[kMaxRanks];
    __shared__ volatile int decided_by;  // a rank whose decision was read, or -1
    __shared__ volatile int pending;     // ranks listened to whose row this round has not come
    __shared__ bool aborted, finished;
    __shared__ bool late;  // a rank the previous agreement kept is dropped: it may still write
    const Transport t{bases, err};
    const Active live{active};
    const int p = threadIdx.x;
    const bool tell = p < num_ranks && p != rank && told[p];
    const u64 round_rows = (u64)num_ranks * row_stride;  // one parity of MASK
    if (p == 0) {
        aborted = err.aborted();  // one reading: every thread leaves, or none
        decided_by = -1;
        finished = false;
    }
    if (p < kMaxMaskWords) estimate[p] = 0;
    __syncthreads();
    if (p == 0)
        for (int r = 0; r < num_ranks; ++r)
            if (live.on(r) && !(aborted && r == rank))
                estimate[r / kMaskBits] |= 1u << (r % kMaskBits);
    if (p < num_ranks) listen[p] = p != rank && live.on(p);
    __syncthreads();
    if (aborted) {
        // This rank failed (its own error stands): its round-1 estimate without itself tells
        // every rank of the call that it is out, so they drop it in that round instead of at
        // their deadline; then it leaves, as a rank that died after round 1.
        if (tell)
            for (int w = 0; w < mask_words; ++w)
                t.signal(p, mask_off + round_rows + (u64)rank * row_stride + 8 * (u64)w,
                         tag(tag0, estimate[w]));
        return;
    }
    for (int rnd = 1; rnd <= max_rounds; ++rnd) {
        const u32 row_tag = (u32)(((u64)tag0 - 1 + (u64)(rnd - 1)) % kMaxEpoch + 1);
        const u64 parity_off = mask_off + (u64)(rnd % 2) * round_rows;
        if (tell)
            for (int w = 0; w < mask_words; ++w)
                t.signal(p, parity_off + (u64)rank * row_stride + 8 * (u64)w,
                         tag(row_tag, estimate[w]));
        if (p < num_ranks) heard[p] = false;
        if (p == 0) {
            pending = 0;
            for (int q = 0; q < num_ranks; ++q) pending += listen[q];
        }
        __syncthreads();
        if (p < num_ranks && listen[p]) {
            // Poll p's decision of this agreement until the round ends (p may decide after
            // its round-r row was heard, while this rank still waits for a silent one), and
            // p's round-r row until heard.
            const u64* row = (const u64*)((u8*)bases[rank] + parity_off + (u64)p * row_stride);
            const u64* dec = (const u64*)((u8*)bases[rank] + decided_off + (u64)p * row_stride);
            const u64 deadline = globaltimer_ns() + (u64)timeout_ns;
            while (decided_by < 0 && pending > 0) {
                // every word each time, fully unrolled: `got` stays in registers
                u32 got[kMaxMaskWords];
                bool complete = true;
#pragma unroll
                for (int w = 0; w < kMaxMaskWords; ++w) {
                    got[w] = 0;
                    if (w < mask_words) {
                        const i64 v = t.poll_local(dec + w, seq);
                        complete = complete && v >= 0;
                        got[w] = (u32)v;
                    }
                }
                if (complete) {
                    if (atomicCAS((int*)&decided_by, -1, p) == -1) {
#pragma unroll
                        for (int w = 0; w < kMaxMaskWords; ++w)
                            if (w < mask_words) decision[w] = got[w];
                    }
                    break;
                }
                if (!heard[p]) {
                    int w = 0;
                    for (; w < mask_words; ++w) {
                        const i64 v = t.poll_local(row + w, row_tag);
                        if (v < 0) break;
                        row_of[p][w] = (u32)v;
                    }
                    if (w == mask_words) {
                        heard[p] = true;
                        atomicAdd((int*)&pending, -1);
                    }
                }
                if (globaltimer_ns() > deadline) break;  // silent in this round, if not heard
            }
        }
        __syncthreads();
        if (p == 0) {
            if (decided_by >= 0) {
                finished = true;  // `decision` holds it
            } else {
                bool silent = false;
                for (int q = 0; q < num_ranks; ++q) {
                    if (!listen[q]) continue;
                    if (heard[q]) {
                        for (int w = 0; w < mask_words; ++w) estimate[w] &= row_of[q][w];
                    } else {
                        silent = true;
                        listen[q] = false;
                        estimate[q / kMaskBits] &= ~(1u << (q % kMaskBits));
                    }
                }
                if (!silent) {
                    for (int w = 0; w < mask_words; ++w) decision[w] = estimate[w];
                    finished = true;
                }
            }
        }
        __syncthreads();
        if (finished) break;
    }
    if (p == 0 && !finished)  // everyone it listened to went silent: alone
        for (int w = 0; w < mask_words; ++w) decision[w] = estimate[w];
    __syncthreads();
    if (p < num_ranks) keep[p] = (decision[p / kMaskBits] >> (p % kMaskBits)) & 1u;
    __syncthreads();
    if (p == 0) {
        late = false;
        for (int q = 0; q < num_ranks; ++q) late = late || (told[q] && !keep[q]);
    }
    __syncthreads();
    if (floors && late && p == 0) floors[2 * num_ranks] = 1;
    if (tell) {
        for (int w = 0; w < mask_words; ++w)
            t.signal(p, decided_off + (u64)rank * row_stride + 8 * (u64)w, tag(seq, decision[w]));
        if (!keep[p]) t.signal(p, fence_off, tag(seq, (u32)rank + 1));  // a late rank stops
    }
    if (p < num_ranks && !keep[p]) live.drop(p);
    if (p < num_ranks) told[p] = keep[p];
    if (p == 0 && !keep[rank]) err.report(kErrMasked, seq, rank, 0);
    for (int i = p; matrix && i < num_ranks * num_ranks; i += blockDim.x)
        if (!keep[i / num_ranks] || !keep[i % num_ranks]) matrix[i] = 0;
}
