// elastic.cuh: the survivors of an elastic group leave a call with the same mask; the CUDA
// twin of HostComm.agree (moe_comm/host/comm.py).
//
// Each rank masks on its own deadlines, so two survivors can disagree: rank A timed out on a
// rank that died just after writing its notify row to B. One round of mask words settles it
// (moe_comm/cuda/elastic.py runs it after a dispatch's notify and at the end of every call):
//
//   push   this rank's view (a bit per active rank, 32 bits in the value field of each tagged
//          word) into MASK[parity][me] of every rank that was active when the call began, so
//          a rank that is only late still learns that it was dropped;
//   wait   for the MASK row of every rank still active in this rank's view, for a deadline
//          plus a grace (`timeout_ns`, set by the host): a healthy peer may arrive a whole
//          deadline after this rank, having timed out on a rank whose signals reached this
//          one; a rank silent here is masked as well;
//   AND    the views heard: a rank stays active only if every survivor still has it.
//
// If this rank's own bit is cleared it reports kErrMasked (the host raises RankMaskedError) and
// later kernels stop at entry. With `matrix` (a dispatch's R x R count matrix after notify) the
// rows and columns of masked ranks are zeroed, so every survivor computes the same row offsets.
//
// MASK rows alternate by parity of the round number `seq`: a rank reaches round k + 2 only
// after round k + 1 heard every survivor, which each sends after finishing round k, so a row is
// never overwritten while its reader still waits for it (the same argument as NOTIFY's).
#pragma once
#include "transport.cuh"

constexpr int kMaskBits = 32;  // wire.MASK_BITS
constexpr int kMaxMaskWords = kMaxErrorRanks / kMaskBits;

// grid 1, blockDim >= num_ranks (<= kMaxErrorRanks). active: the group's words (elastic);
// call_active: a copy of them taken when the call began; mask_off: byte offset of
// MASK[seq's parity][0]; row_stride: bytes between two ranks' MASK rows.
MOE_DEVICE void agree_body(const u64* bases, int rank, int num_ranks, i64 timeout_ns,
                           const ErrorSink err, i32* active, const i32* call_active,
                           u64 mask_off, u64 row_stride, int mask_words, u32 seq, i32* matrix) {
    __shared__ u32 mine[kMaxMaskWords];                 // this rank's view before the round
    __shared__ u32 heard[kMaxErrorRanks][kMaxMaskWords];  // each rank's view (all ones: not heard)
    __shared__ bool silent[kMaxErrorRanks];
    __shared__ bool keep[kMaxErrorRanks];
    __shared__ bool aborted;
    const Transport t{bases, err};
    const Active live{active};
    const int p = threadIdx.x;
    if (p == 0) aborted = err.aborted();  // one reading: every thread leaves, or none
    if (p < kMaxMaskWords) mine[p] = 0;
    __syncthreads();
    if (p == 0)
        for (int r = 0; r < num_ranks; ++r)
            if (live.on(r) && !(aborted && r == rank)) mine[r / kMaskBits] |= 1u << (r % kMaskBits);
    __syncthreads();
    if (aborted) {
        // This rank failed (its own error stands): it tells every rank of the call that it is
        // out - its own bit cleared - so they mask it now instead of at their deadline, and
        // waits for nothing.
        if (p < num_ranks && p != rank && call_active[p])
            for (int w = 0; w < mask_words; ++w)
                t.signal(p, mask_off + (u64)rank * row_stride + 8 * (u64)w, tag(seq, mine[w]));
        return;
    }
    if (p < num_ranks) {
        silent[p] = false;
        for (int w = 0; w < kMaxMaskWords; ++w) heard[p][w] = ~0u;
        const bool was_on = (mine[p / kMaskBits] >> (p % kMaskBits)) & 1u;
        if (p != rank && call_active[p])
            for (int w = 0; w < mask_words; ++w)
                t.signal(p, mask_off + (u64)rank * row_stride + 8 * (u64)w, tag(seq, mine[w]));
        if (p != rank && was_on) {
            const u64* row = (const u64*)((u8*)bases[rank] + mask_off + (u64)p * row_stride);
            for (int w = 0; w < mask_words; ++w) {
                // every value of a mask word is data: no failure mark
                const i64 v = wait_from(t, live, row + w, seq, timeout_ns, p, false);
                if (v < 0) {  // silent in this round (now masked), or masked meanwhile
                    silent[p] = true;
                    break;
                }
                heard[p][w] = (u32)v;
            }
        }
    }
    __syncthreads();
    if (p < num_ranks) {
        const int w = p / kMaskBits;
        const u32 bit = 1u << (p % kMaskBits);
        bool k = (mine[w] & bit) && !silent[p];
        for (int q = 0; q < num_ranks; ++q)
            if (!silent[q]) k = k && (heard[q][w] & bit) != 0;
        keep[p] = k;
        if (!k) live.drop(p);
    }
    __syncthreads();
    if (p == 0 && !keep[rank]) err.report(kErrMasked, seq, rank, 0);
    for (int i = p; matrix && i < num_ranks * num_ranks; i += blockDim.x)
        if (!keep[i / num_ranks] || !keep[i % num_ranks]) matrix[i] = 0;
}
