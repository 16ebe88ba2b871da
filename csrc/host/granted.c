/* The payload phase of a granted normal dispatch or combine in one C call (moe_comm/host/
 * granted.py): exchange.send_when_granted over every destination, then the wait for every
 * source's DONE word and eager flag, as normal.py's _exchange runs them in Python.
 *
 * Why: in a 4-rank 1024 x 7168 dispatch on 2 cores, a fifth of each rank's CPU went to the
 * Python around the copies (the grant waits, a DONE per destination, the slab views of each
 * destination's rows, the waits for the sources), and the ranks share the cores, so every
 * rank's Python slows every other rank's copies (docs/PERF.md, session 21).
 *
 * Same words at the same places as the Python protocol (exchange.py): the receiver's grant
 * [page, pages] in this rank's GRANT slot, rows only into a region that holds the slab this
 * rank computed (else DONE_REFUSED and nothing written), nothing to a receiver whose
 * signature differs from this rank's (DONE_REFUSED), DONE_NOTHING to a receiver that could
 * not allocate, DONE_WRITTEN after the rows. A rank here pairs with a rank on the
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
    GX_GRANT_OUT,                 /* int64 [R]: this rank's grant for rank s, in s's header */
    GX_WORDS
};

/* One destination of a call, int64 words: its rank, the rows of its whole region (the slab
 * it grants), where this rank's rows start in it, which rows this rank sends it (a dispatch:
 * the address of its token ids; a combine: its first row of x) and how many; and GD_STATE,
 * which the call writes: GS_PENDING until the destination's grant came, then what this rank
 * did with it. */
enum { GD_RANK, GD_ROWS, GD_ROW0, GD_IDS, GD_N, GD_STATE, GD_WORDS };
enum { GS_PENDING = 0, GS_WRITTEN = 1, GS_FAILED = 2, GS_SHORT = 3, GS_DIFFER = 4 };

/* What the calls return besides SMALL_OK / SMALL_AGAIN (small.py's codes): */
enum { GRANTED_LATE_GRANTS = 6, GRANTED_LATE_DONE = 7, GRANTED_BAD_ID = 8,
       GRANTED_UNWRITTEN = 9 };

#define GX_PTR(gx, i) ((const int64_t *)(intptr_t)(gx)[i])

/* One call's payload phase: its words and rows. */
typedef struct {
    const int64_t *cx, *gx;
    int64_t epoch, *dests, nd;
    const int64_t *call_in;          /* every rank's signature words here (or NULL: none) */
    const int64_t *call_row;         /* this rank's signature, which each must equal */
    int combine;                     /* rows of x in received order, else a dispatch's */
    const uint8_t *x;
    int64_t x_stride, T, row_bytes;
    const int64_t *topk_idx;         /* a dispatch's [T, K], or NULL */
    const float *topk_w;             /* [T, K] (a combine: [received rows, K]), or NULL */
    int64_t K, num_local;
} granted_call;

/* Whether destination d's grant came (both words carry the epoch), and, where signatures are
 * checked, its signature (posted before its grant, HostComm.post_call). */
static inline int granted(const granted_call *c, int64_t d) {
    const int64_t *w = (const int64_t *)(intptr_t)GX_PTR(c->gx, GX_GRANT_IN)[d];
    if ((__atomic_load_n(&w[0], __ATOMIC_RELAXED) >> 32) != c->epoch ||
        (__atomic_load_n(&w[1], __ATOMIC_RELAXED) >> 32) != c->epoch)
        return 0;
    if (!c->call_in) return 1;
    const int64_t *call = (const int64_t *)(intptr_t)c->call_in[d];
    for (int64_t i = 0; i < c->cx[CX_CALL_WORDS]; i++)
        if ((__atomic_load_n(&call[i], __ATOMIC_RELAXED) >> 32) != c->epoch) return 0;
    return 1;
}

/* How many pending destinations' grants came; how many are pending. */
static int64_t count_granted(const granted_call *c) {
    int64_t n = 0;
    for (int64_t j = 0; j < c->nd; j++)
        n += c->dests[j * GD_WORDS + GD_STATE] == GS_PENDING &&
             granted(c, c->dests[j * GD_WORDS + GD_RANK]);
    return n;
}

static int64_t count_pending(const granted_call *c) {
    int64_t n = 0;
    for (int64_t j = 0; j < c->nd; j++) n += c->dests[j * GD_WORDS + GD_STATE] == GS_PENDING;
    return n;
}

/* One DONE word `value` into destination d's header for this rank, its doorbell rung. */
static void granted_done(const granted_call *c, int64_t d, int64_t value) {
    publish((int64_t *)(intptr_t)GX_PTR(c->gx, GX_DONE_OUT)[d], CX_PTR(c->cx, CX_BELLS)[d],
            c->epoch, &value, 1);
}

/* Whether rank d's signature words (here, complete) differ from this rank's. */
static int call_differs(const granted_call *c, int64_t d) {
    if (!c->call_in) return 0;
    const int64_t *call = (const int64_t *)(intptr_t)c->call_in[d];
    for (int64_t i = 0; i < c->cx[CX_CALL_WORDS]; i++)
        if ((call[i] & 0xFFFFFFFFll) != c->call_row[i]) return 1;
    return 0;
}

/* A combine's rows for one owner (normal.combine's put_back): rows [src0, src0 + n) of x,
 * and their weights, as rows row0.. of the owner's slab at `region`; none to this rank itself
 * (its sum reads them from x). */
static void combine_rows(const granted_call *c, uint8_t *region, const int64_t *offs,
                         const int64_t *dest) {
    const int64_t n = dest[GD_N], src0 = dest[GD_IDS], row0 = dest[GD_ROW0];
    if (dest[GD_RANK] == c->cx[CX_ME] || !n) return;
    copy_run(region + offs[0] + row0 * c->row_bytes, c->x + src0 * c->x_stride,
             (size_t)(n * c->row_bytes), n * c->row_bytes >= STREAM_MIN_BYTES);
    if (c->K && c->topk_w)
        memcpy(region + offs[3] + row0 * c->K * 4, c->topk_w + src0 * c->K,
               (size_t)(n * c->K * 4));
}

/* The pending destinations whose grant came, at once: each grant's verdict (send_when_granted's
 * verdict: GRANT_FAILED, a signature that differs, or fewer pages than this rank's slab of
 * GD_ROWS rows needs, gets its DONE at once and nothing written), then the rows of all the
 * others (a dispatch: in one pass over x, moe_put_rows_multi), then their DONE words. Returns
 * -1 (nothing written) for a dispatch's token id outside [0, T), else 0. */
static int granted_batch(const granted_call *c) {
    const int64_t *cx = c->cx, *gx = c->gx, nd = c->nd;
    int64_t put[nd * PUT_WORDS + 1], taken[nd + 1], nput = 0, stream = 0;
    for (int64_t j = 0; j < nd; j++) {
        int64_t *dest = c->dests + j * GD_WORDS;
        const int64_t d = dest[GD_RANK];
        if (dest[GD_STATE] != GS_PENDING || !granted(c, d)) continue;
        __atomic_thread_fence(__ATOMIC_ACQUIRE);   /* the grant (and signature) read below */
        const int64_t *w = (const int64_t *)(intptr_t)GX_PTR(gx, GX_GRANT_IN)[d];
        const int64_t page = w[0] & 0xFFFFFFFFll, pages = w[1] & 0xFFFFFFFFll;
        int64_t offs[4];
        const int64_t need = slab_layout(dest[GD_ROWS], c->row_bytes, 0, c->K, cx[CX_ALIGN],
                                         cx[CX_PAGE], offs);
        /* (rows beyond the slab: a plan this call cannot have, refused all the same) */
        const int state = page == gx[GX_GRANT_FAILED] ? GS_FAILED : call_differs(c, d) ?
                          GS_DIFFER : need > pages * cx[CX_PAGE] ||
                          dest[GD_ROW0] + dest[GD_N] > dest[GD_ROWS] ? GS_SHORT : GS_WRITTEN;
        if (state != GS_WRITTEN) {
            dest[GD_STATE] = state;
            granted_done(c, d, state == GS_FAILED ? gx[GX_DONE_NOTHING] : gx[GX_DONE_REFUSED]);
            continue;
        }
        uint8_t *region = (uint8_t *)(intptr_t)GX_PTR(gx, GX_HEAP)[d] + page * cx[CX_PAGE];
        taken[nput] = j;
        if (c->combine) {
            combine_rows(c, region, offs, dest);
            stream |= dest[GD_N] * c->row_bytes >= STREAM_MIN_BYTES;
            nput++;
            continue;
        }
        const int64_t row0 = dest[GD_ROW0];
        int64_t *p = put + nput++ * PUT_WORDS;
        p[PUT_IDS] = dest[GD_IDS];
        p[PUT_N] = dest[GD_N];
        p[PUT_LO] = d * c->num_local;
        p[PUT_X] = (int64_t)(intptr_t)(region + offs[0] + row0 * c->row_bytes);
        p[PUT_SCALES] = 0;
        p[PUT_IDX] = (int64_t)(intptr_t)(region + offs[2] + row0 * c->K * 8);
        p[PUT_W] = (int64_t)(intptr_t)(region + offs[3] + row0 * c->K * 4);
    }
    if (c->combine) {
        if (stream) stream_done();
    } else if (nput && moe_put_rows_multi(c->x, c->x_stride, c->T, c->row_bytes, NULL, 0, 0,
                                          c->topk_idx, c->topk_w, c->K, c->num_local, put,
                                          nput)) {
        return -1;
    }
    for (int64_t i = 0; i < nput; i++) {
        int64_t *dest = c->dests + taken[i] * GD_WORDS;
        dest[GD_STATE] = GS_WRITTEN;
        granted_done(c, dest[GD_RANK], cx[CX_DONE_WRITTEN]);
    }
    return 0;
}

/* Sleep on this rank's doorbell for at most ns (and not past `until`) unless a pending
 * destination's grant came meanwhile (small_wait's second look). */
static void granted_sleep(const granted_call *c, int64_t ns, int64_t until) {
    const int64_t left = until - now_ns(), bell = c->cx[CX_BELL];
    if (left <= 0) return;
    __atomic_store_n(bell_at(bell), 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (count_granted(c)) __atomic_store_n(bell_at(bell), 0, __ATOMIC_RELAXED);
    else sleep_on(bell, ns < left ? ns : left);
}

/* The payload phase of call c, this rank's grant pushed already: waits up to gather_ns for
 * every destination's grant (a dispatch then writes to all of them in one pass over x:
 * send_when_granted's GATHER_S), then writes to each destination whose grant came, in
 * batches, and tells it; then waits for the DONE word of every source s with src[s] = 1 and
 * the eager flag (2 words, at eager parity ep) of those with src[s] = 2.
 * Returns SMALL_OK, SMALL_AGAIN (a wait's slice ended first: call again with resume = 1 to
 * go on, nothing is written twice), GRANTED_LATE_GRANTS (the deadline passed, or this rank's
 * FENCE word was set, with destinations still GS_PENDING: nothing written to those),
 * GRANTED_LATE_DONE (the same while waiting for the sources) or GRANTED_BAD_ID. */
static int64_t granted_phase(const granted_call *c, int64_t ep, int64_t deadline_ns,
                             int64_t resume, const int64_t *src, int64_t gather_ns) {
    const int64_t *cx = c->cx, R = cx[CX_R], *fence = CX_PTR(cx, CX_FENCE);
    /* a granted call moves megabytes: its waits last as long as a peer's copies, so they
     * yield only briefly, then sleep on the doorbell, which the peer's DONE or grant rings
     * (backoff's crowded steps, whatever the cores: a rank spinning through a peer's copy
     * took 10-15% longer 2-rank combines, calls alternating with the Python waits) */
    const int crowded = 1;
    const int64_t start = now_ns(), slice_end = start + WAIT_SLICE_NS;
    const int64_t until = slice_end < deadline_ns ? slice_end : deadline_ns;
    int64_t pending = count_pending(c), spins = 0;
    if (!resume && pending > 1 && gather_ns > 0) {
        const int64_t gather_end = start + gather_ns < until ? start + gather_ns : until;
        while (count_granted(c) < pending && now_ns() < gather_end &&
               !__atomic_load_n(fence, __ATOMIC_RELAXED)) {
            const int64_t ns = backoff(spins++, crowded);
            if (ns) granted_sleep(c, ns, gather_end);
        }
        spins = 0;
    }
    while (pending) {
        if (count_granted(c)) {
            if (__atomic_load_n(fence, __ATOMIC_RELAXED)) break;    /* masked: writes nothing */
            if (granted_batch(c) < 0) return GRANTED_BAD_ID;
            pending = count_pending(c);
            spins = 0;
            continue;
        }
        if (__atomic_load_n(fence, __ATOMIC_RELAXED) || now_ns() > until) break;
        const int64_t ns = backoff(spins++, crowded);
        if (ns) granted_sleep(c, ns, until);
    }
    const int more = until < deadline_ns && !__atomic_load_n(fence, __ATOMIC_RELAXED);
    if (pending) return more ? SMALL_AGAIN : GRANTED_LATE_GRANTS;
    int64_t words[R], nwords[R];
    for (int64_t s = 0; s < R; s++) {
        words[s] = src[s] == 2 ? CX_PTR(cx, CX_IN_FLAG + ep)[s] : GX_PTR(c->gx, GX_DONE_IN)[s];
        nwords[s] = src[s] == 2 ? 2 : 1;
    }
    const int64_t missing = small_wait(R, words, nwords, src, NULL, c->epoch, until, fence,
                                       cx[CX_BELL], crowded, (uint8_t *)(intptr_t)cx[CX_READY]);
    if (missing) return more ? SMALL_AGAIN : GRANTED_LATE_DONE;
    return SMALL_OK;
}

/* A dispatch's payload phase (granted_phase): dests [nd][GD_WORDS] (GD_IDS: token ids), x
 * [T, row_bytes] rows x_stride bytes apart, topk_idx / topk_w [T, K] or NULL (top-k ids made
 * local to each destination's num_local experts); with call_row (a cached dispatch), every
 * destination's signature at call parity cp is compared with it before writing there. */
int64_t moe_granted_dispatch(const int64_t *cx, const int64_t *gx, int64_t ep, int64_t cp,
                             int64_t epoch, int64_t deadline_ns, int64_t resume, int64_t *dests,
                             int64_t nd, const int64_t *src, const uint8_t *x, int64_t x_stride,
                             int64_t T, int64_t row_bytes, const int64_t *topk_idx,
                             const float *topk_w, int64_t K, int64_t num_local,
                             const int64_t *call_row, int64_t gather_ns) {
    const granted_call c = {cx, gx, epoch, dests, nd, call_row ? CX_PTR(cx, CX_CALL_IN + cp) :
                            NULL, call_row, 0, x, x_stride, T, row_bytes, topk_idx, topk_w, K,
                            num_local};
    return granted_phase(&c, ep, deadline_ns, resume, src, gather_ns);
}

/* A combine's payload phase (granted_phase): dests [nd][GD_WORDS] (GD_IDS: the first of the
 * owner's rows in x), x [rows, row_bytes] contiguous, topk_w [rows, K] or NULL; every owner's
 * signature at call parity cp compared with call_row before writing there. */
int64_t moe_granted_combine(const int64_t *cx, const int64_t *gx, int64_t ep, int64_t cp,
                            int64_t epoch, int64_t deadline_ns, int64_t resume, int64_t *dests,
                            int64_t nd, const int64_t *src, const uint8_t *x, int64_t row_bytes,
                            const float *topk_w, int64_t K, const int64_t *call_row) {
    const granted_call c = {cx, gx, epoch, dests, nd, CX_PTR(cx, CX_CALL_IN + cp), call_row, 1,
                            x, row_bytes, 0, row_bytes, NULL, topk_w, K, 0};
    return granted_phase(&c, ep, deadline_ns, resume, src, 0);
}

/* The rest of a fresh dispatch begun in direct.py, once its count matrix [R, R] came, that
 * moves in one round with no source's rows in an eager slot of this rank (granted.py
 * fresh_dispatch): this rank's grant [page, pages] to every source (as exchange.grant
 * pushes it), its destinations beyond an eager slot of slot_rows rows into dests [R][GD_WORDS]
 * (*nd of them, in normal.py's rotation order: the peers after this rank, then itself; the
 * pairs within a slot went with the counts) and its sources into src [R] (1: a DONE word to
 * wait for), then moe_granted_dispatch's payload phase (ids / first [R + 1]: the token ids
 * by destination). With resume (after SMALL_AGAIN) only the phase goes on. Returns what the
 * phase returns, or GRANTED_UNWRITTEN where it ended but a destination's rows were not written
 * (its grant failed, was short) or a source's DONE does not say its rows were (settle raises
 * what went wrong). As Python steps, these took ~250 us of each rank's CPU a call in a 4-rank
 * 1024 x 7168 dispatch on 2 cores (docs/PERF.md, session 26). */
int64_t moe_granted_fresh(const int64_t *cx, const int64_t *gx, int64_t ep, int64_t epoch,
                          int64_t deadline_ns, int64_t resume, const int64_t *matrix,
                          int64_t slot_rows, int64_t page, int64_t pages, int64_t *dests,
                          int64_t *nd, int64_t *src, const int64_t *ids, const int64_t *first,
                          const uint8_t *x, int64_t x_stride, int64_t T, int64_t row_bytes,
                          const int64_t *topk_idx, const float *topk_w, int64_t K,
                          int64_t num_local, int64_t gather_ns) {
    const int64_t me = cx[CX_ME], R = cx[CX_R];
    if (!resume) {
        const int64_t grant[2] = {page, pages};
        for (int64_t s = 0; s < R; s++) {
            src[s] = matrix[s * R + me] > 0;
            if (src[s])
                publish((int64_t *)(intptr_t)GX_PTR(gx, GX_GRANT_OUT)[s],
                        CX_PTR(cx, CX_BELLS)[s], epoch, grant, 2);
        }
        *nd = 0;
        for (int64_t i = 0; i < R; i++) {
            const int64_t d = CX_PTR(cx, CX_ROTATION)[i], n = matrix[me * R + d];
            if (n <= slot_rows) continue;
            int64_t rows = 0, row0 = 0;             /* d's region; where this rank's start */
            for (int64_t s = 0; s < R; s++) {
                rows += matrix[s * R + d];
                row0 += s < me ? matrix[s * R + d] : 0;
            }
            int64_t *t = dests + (*nd)++ * GD_WORDS;
            t[GD_RANK] = d, t[GD_ROWS] = rows, t[GD_ROW0] = row0;
            t[GD_IDS] = (int64_t)(intptr_t)(ids + first[d]), t[GD_N] = n;
            t[GD_STATE] = GS_PENDING;
        }
    }
    const granted_call c = {cx, gx, epoch, dests, *nd, NULL, NULL, 0, x, x_stride, T,
                            row_bytes, topk_idx, topk_w, K, num_local};
    const int64_t rc = granted_phase(&c, ep, deadline_ns, resume, src, gather_ns);
    if (rc != SMALL_OK) return rc;
    for (int64_t j = 0; j < *nd; j++)
        if (dests[j * GD_WORDS + GD_STATE] != GS_WRITTEN) return GRANTED_UNWRITTEN;
    const int64_t *done_in = GX_PTR(gx, GX_DONE_IN);
    for (int64_t s = 0; s < R; s++)      /* (the phase's acquire fence ordered these reads) */
        if (src[s] && (*(const int64_t *)(intptr_t)done_in[s] & 0xFFFFFFFFll) !=
                      cx[CX_DONE_WRITTEN])
            return GRANTED_UNWRITTEN;
    return SMALL_OK;
}
