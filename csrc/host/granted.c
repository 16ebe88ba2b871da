/* The payload phase of a granted normal dispatch in one C call (moe_comm/host/granted.py):
 * exchange.send_when_granted over every destination, then the wait for every source's DONE
 * word and eager flag, as normal.py's _exchange runs them in Python.
 *
 * Why: in a 4-rank 1024 x 7168 dispatch on 2 cores, a fifth of each rank's CPU went to the
 * Python around the copies (the grant waits, a DONE per destination, the slab views of each
 * destination's rows, the waits for the sources), and the ranks share the cores, so every
 * rank's Python slows every other rank's copies (docs/PERF.md, session 21).
 *
 * Same words at the same places as the Python protocol (exchange.py): the receiver's grant
 * [page, pages] in this rank's GRANT slot, rows only into a region that holds the slab this
 * rank computed (else DONE_REFUSED and nothing written), DONE_NOTHING to a receiver that
 * could not allocate, DONE_WRITTEN after the rows. A rank here pairs with a rank on the
 * Python path. This file is built as part of host_ops.c and included at its end (it uses the
 * waits, doorbells and row copies there).
 *
 * `gx`: the addresses a Buffer's granted dispatches use (granted.py's Addresses, built once),
 * int64 words in this order: */
enum {
    GX_GRANT_FAILED, GX_DONE_NOTHING, GX_DONE_REFUSED,
    GX_GRANT_IN,                  /* int64 [R]: rank d's grant for this rank, in its header */
    GX_DONE_OUT,                  /* int64 [R]: this rank's DONE word in rank d's header */
    GX_DONE_IN,                   /* int64 [R]: rank s's DONE word in this rank's header */
    GX_HEAP,                      /* int64 [R]: rank d's heap */
    GX_WORDS
};

/* One destination of a call, int64 words: its rank, the rows of its whole region (the slab
 * it grants), where this rank's rows start in it, this rank's token ids for it (address,
 * count); and GD_STATE, which the call writes: GS_PENDING until the destination's grant
 * came, then what this rank did with it. */
enum { GD_RANK, GD_ROWS, GD_ROW0, GD_IDS, GD_N, GD_STATE, GD_WORDS };
enum { GS_PENDING = 0, GS_WRITTEN = 1, GS_FAILED = 2, GS_SHORT = 3 };

/* What moe_granted_dispatch returns besides SMALL_OK / SMALL_AGAIN (small.py's codes): */
enum { GRANTED_LATE_GRANTS = 6, GRANTED_LATE_DONE = 7, GRANTED_BAD_ID = 8 };

#define GX_PTR(gx, i) ((const int64_t *)(intptr_t)(gx)[i])

/* Whether destination d's two grant words both carry `epoch`. */
static inline int granted(const int64_t *gx, int64_t d, int64_t epoch) {
    const int64_t *w = (const int64_t *)(intptr_t)GX_PTR(gx, GX_GRANT_IN)[d];
    return (__atomic_load_n(&w[0], __ATOMIC_RELAXED) >> 32) == epoch &&
           (__atomic_load_n(&w[1], __ATOMIC_RELAXED) >> 32) == epoch;
}

/* Pending destinations whose grant came (all of them with `all`: 1 when every one came). */
static int64_t count_granted(const int64_t *gx, int64_t *dests, int64_t nd, int64_t epoch) {
    int64_t n = 0;
    for (int64_t j = 0; j < nd; j++)
        n += dests[j * GD_WORDS + GD_STATE] == GS_PENDING &&
             granted(gx, dests[j * GD_WORDS + GD_RANK], epoch);
    return n;
}

static int64_t count_pending(const int64_t *dests, int64_t nd) {
    int64_t n = 0;
    for (int64_t j = 0; j < nd; j++) n += dests[j * GD_WORDS + GD_STATE] == GS_PENDING;
    return n;
}

/* One DONE word `value` into destination d's header for this rank, its doorbell rung. */
static void granted_done(const int64_t *cx, const int64_t *gx, int64_t d, int64_t epoch,
                         int64_t value) {
    publish((int64_t *)(intptr_t)GX_PTR(gx, GX_DONE_OUT)[d], CX_PTR(cx, CX_BELLS)[d], epoch,
            &value, 1);
}

/* The pending destinations whose grant came, at once: each grant's verdict (send_when_granted's
 * verdict: GRANT_FAILED, or fewer pages than this rank's slab of GD_ROWS rows needs, gets its
 * DONE at once and nothing written), then the rows of all the others in one pass over x
 * (moe_put_rows_multi), then their DONE words. Returns the destinations taken, or -1 (nothing
 * written) for a token id outside [0, T). */
static int64_t granted_batch(const int64_t *cx, const int64_t *gx, int64_t *dests, int64_t nd,
                             int64_t epoch, const uint8_t *x, int64_t x_stride, int64_t T,
                             int64_t row_bytes, const int64_t *topk_idx, const float *topk_w,
                             int64_t K, int64_t num_local) {
    int64_t put[nd * PUT_WORDS + 1], taken[nd + 1], nput = 0, ntaken = 0;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (int64_t j = 0; j < nd; j++) {
        int64_t *dest = dests + j * GD_WORDS;
        const int64_t d = dest[GD_RANK];
        if (dest[GD_STATE] != GS_PENDING || !granted(gx, d, epoch)) continue;
        ntaken++;
        const int64_t *w = (const int64_t *)(intptr_t)GX_PTR(gx, GX_GRANT_IN)[d];
        const int64_t page = w[0] & 0xFFFFFFFFll, pages = w[1] & 0xFFFFFFFFll;
        int64_t offs[4];
        const int64_t need = slab_layout(dest[GD_ROWS], row_bytes, 0, K, cx[CX_ALIGN],
                                         cx[CX_PAGE], offs);
        if (page == gx[GX_GRANT_FAILED] || need > pages * cx[CX_PAGE]) {
            dest[GD_STATE] = page == gx[GX_GRANT_FAILED] ? GS_FAILED : GS_SHORT;
            granted_done(cx, gx, d, epoch, page == gx[GX_GRANT_FAILED] ? gx[GX_DONE_NOTHING]
                                                                      : gx[GX_DONE_REFUSED]);
            continue;
        }
        uint8_t *region = (uint8_t *)(intptr_t)GX_PTR(gx, GX_HEAP)[d] + page * cx[CX_PAGE];
        const int64_t row0 = dest[GD_ROW0];
        int64_t *p = put + nput * PUT_WORDS;
        p[PUT_IDS] = dest[GD_IDS];
        p[PUT_N] = dest[GD_N];
        p[PUT_LO] = d * num_local;
        p[PUT_X] = (int64_t)(intptr_t)(region + offs[0] + row0 * row_bytes);
        p[PUT_SCALES] = 0;
        p[PUT_IDX] = (int64_t)(intptr_t)(region + offs[2] + row0 * K * 8);
        p[PUT_W] = (int64_t)(intptr_t)(region + offs[3] + row0 * K * 4);
        taken[nput++] = j;
    }
    if (nput && moe_put_rows_multi(x, x_stride, T, row_bytes, NULL, 0, 0, topk_idx, topk_w, K,
                                   num_local, put, nput))
        return -1;
    for (int64_t i = 0; i < nput; i++) {
        dests[taken[i] * GD_WORDS + GD_STATE] = GS_WRITTEN;
        granted_done(cx, gx, dests[taken[i] * GD_WORDS + GD_RANK], epoch, cx[CX_DONE_WRITTEN]);
    }
    return ntaken;
}

/* Sleep on this rank's doorbell for at most ns (and not past `until`) unless a pending
 * destination's grant came meanwhile (small_wait's second look). */
static void granted_sleep(const int64_t *cx, const int64_t *gx, int64_t *dests, int64_t nd,
                          int64_t epoch, int64_t ns, int64_t until) {
    const int64_t left = until - now_ns();
    if (left <= 0) return;
    const int64_t bell = cx[CX_BELL];
    __atomic_store_n(bell_at(bell), 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (count_granted(gx, dests, nd, epoch)) __atomic_store_n(bell_at(bell), 0, __ATOMIC_RELAXED);
    else sleep_on(bell, ns < left ? ns : left);
}

/* The payload phase of a granted dispatch at `epoch`, this rank's grant pushed already:
 * waits up to gather_ns for every destination's grant (one pass over x then writes to all of
 * them: send_when_granted's GATHER_S), then writes to each destination whose grant came (in
 * batches, each a pass over x) and tells it, then waits for the DONE word of every source s
 * with src[s] = 1 and the eager flag (2 words, at eager parity ep) of those with src[s] = 2.
 * dests [nd][GD_WORDS]; x [T, row_bytes] rows x_stride apart, topk_idx / topk_w [T, K]
 * (top-k ids made local to each destination's num_local experts).
 * Returns SMALL_OK, SMALL_AGAIN (a wait's slice ended first: call again with resume = 1 to
 * go on, nothing is written twice), GRANTED_LATE_GRANTS (the deadline passed, or this rank's
 * FENCE word was set, with destinations still GS_PENDING: nothing written to those),
 * GRANTED_LATE_DONE (the same while waiting for the sources) or GRANTED_BAD_ID. */
int64_t moe_granted_dispatch(const int64_t *cx, const int64_t *gx, int64_t ep, int64_t epoch,
                             int64_t deadline_ns, int64_t resume, int64_t *dests, int64_t nd,
                             const int64_t *src, const uint8_t *x, int64_t x_stride, int64_t T,
                             int64_t row_bytes, const int64_t *topk_idx, const float *topk_w,
                             int64_t K, int64_t num_local, int64_t gather_ns) {
    const int64_t R = cx[CX_R], *fence = CX_PTR(cx, CX_FENCE);
    const int crowded = (int)cx[CX_CROWDED];
    const int64_t start = now_ns(), slice_end = start + WAIT_SLICE_NS;
    const int64_t until = slice_end < deadline_ns ? slice_end : deadline_ns;
    int64_t pending = count_pending(dests, nd), spins = 0;
    if (!resume && pending > 1) {       /* gather: one pass over x for every destination */
        const int64_t gather_end = start + gather_ns < until ? start + gather_ns : until;
        while (count_granted(gx, dests, nd, epoch) < pending && now_ns() < gather_end &&
               !__atomic_load_n(fence, __ATOMIC_RELAXED)) {
            const int64_t ns = backoff(spins++, crowded);
            if (ns) granted_sleep(cx, gx, dests, nd, epoch, ns, gather_end);
        }
        spins = 0;
    }
    while (pending) {
        if (count_granted(gx, dests, nd, epoch)) {
            if (__atomic_load_n(fence, __ATOMIC_RELAXED)) break;    /* masked: writes nothing */
            if (granted_batch(cx, gx, dests, nd, epoch, x, x_stride, T, row_bytes, topk_idx,
                              topk_w, K, num_local) < 0)
                return GRANTED_BAD_ID;
            pending = count_pending(dests, nd);
            spins = 0;
            continue;
        }
        if (__atomic_load_n(fence, __ATOMIC_RELAXED) || now_ns() > until) break;
        const int64_t ns = backoff(spins++, crowded);
        if (ns) granted_sleep(cx, gx, dests, nd, epoch, ns, until);
    }
    const int more = until < deadline_ns && !__atomic_load_n(fence, __ATOMIC_RELAXED);
    if (pending) return more ? SMALL_AGAIN : GRANTED_LATE_GRANTS;
    int64_t words[R], nwords[R];
    for (int64_t s = 0; s < R; s++) {
        words[s] = src[s] == 2 ? CX_PTR(cx, CX_IN_FLAG + ep)[s] : GX_PTR(gx, GX_DONE_IN)[s];
        nwords[s] = src[s] == 2 ? 2 : 1;
    }
    const int64_t missing = small_wait(R, words, nwords, src, NULL, epoch, until, fence,
                                       cx[CX_BELL], crowded, (uint8_t *)(intptr_t)cx[CX_READY]);
    if (missing) return more ? SMALL_AGAIN : GRANTED_LATE_DONE;
    return SMALL_OK;
}
