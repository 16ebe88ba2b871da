/* A normal combine too large for the eager slots, streamed through them in parts (moe_comm/
 * host/ring.py).
 *
 * Why: a granted combine moves each returned row through memory twice - the expert rank
 * writes it into the owner's region, the owner reads it back for its sum - and a region of
 * megabytes is out of the cache by then. Here each expert rank writes an owner's rows, in
 * order, a part at a time into its eager slot at the owner, which holds `parts` parts; the
 * owner sums the tokens whose rows have all come while those parts are still in the cache,
 * then hands the parts back. In a two-process model of a 2-rank 1024 x 7168 combine this took
 * 1.6 ms against 2.45 for the whole region; in the library 2.0-2.3 ms against 2.8-3.7
 * (docs/PERF.md, session 24).
 *
 * Every rank takes this path alike or none does: its decision depends on the count matrix
 * (the handle's, named in the call's signature), the rows' shape (in the signature) and the
 * Buffer's agreement at creation (HostComm.ring_combine). The owner sums nothing before every
 * rank's signature came. Where two differ it goes on all the same (every write and read stays
 * in this rank's own slots and outputs) to its deadline, then small.py raises
 * CallMismatchError: a peer may have taken another path and wait for words this rank never
 * sends, and the small calls' finish phases and the Python protocol's waits hold out to
 * their deadlines too, so all ranks raise near the same time and meet at the next call.
 * A pair whose rows fit the slot whole went eagerly (moe_small_combine_start); only the
 * others stream. Words, in the flag page of slot (ep, expert) at the owner, tagged
 * with the call's epoch like every signal: the parts the expert has written (RING_WRITTEN,
 * after the rows; the owner's doorbell rung) and the parts the owner has summed and handed
 * back (RING_TAKEN; the expert's doorbell rung). An expert writes part p into slot part
 * p % parts once the owner took part p - parts. Why the slot is free at the start of a call:
 * eager.py's argument (this call's parity last served two calls ago, every rank's signature
 * of the call between them seen by every rank before it ended), which holds here since the
 * owner reads its slots only within this call, and this call too ends only once every
 * rank's signature came.
 *
 * Built as part of host_ops.c and included at its end (it uses the small calls' context,
 * waits, doorbells and sums there). */

enum { RING_WRITTEN = 8, RING_TAKEN = 16 };       /* int64 words of a slot's flag page */

/* A part: its rows, then from the next multiple of RING_ALIGN bytes their weights (ring.py
 * parts_of sizes it). */
#define RING_ALIGN 64
static inline int64_t ring_weights_at(int64_t part_rows, int64_t row_bytes) {
    return round_up_i64(part_rows * row_bytes, RING_ALIGN);
}

/* What moe_ring_combine returns beyond small.py's codes: the deadline passed (or this rank
 * was fenced) while a peer's part or hand-back had not come (RS_SILENT names the peers);
 * token ids of the handle out of order or outside [0, T) (nothing summed past them). */
enum { RING_LATE = 9, RING_BAD_IDS = 10 };

/* The caller's state words, kept between the resumed runs of one call: the signatures
 * checked, the eager slots come, the tokens summed, two signatures differing (told to
 * small.py, at cx[CX_DIFFER], only at the deadline: it raises at once), then per rank the
 * parts this rank wrote to it (as expert), the rows of it summed and the parts handed back
 * to it (as owner), and at RING_LATE whether this rank was still waiting for it. */
enum { RS_CALLS, RS_FLAGS, RS_T, RS_DIFFER, RS_WORDS };
#define RS_SENT(s, R, d) ((s)[RS_WORDS + (d)])
#define RS_CURSOR(s, R, d) ((s)[RS_WORDS + (R) + (d)])
#define RS_TAKEN(s, R, d) ((s)[RS_WORDS + 2 * (R) + (d)])
#define RS_SILENT(s, R, d) ((s)[RS_WORDS + 3 * (R) + (d)])

typedef struct {
    const int64_t *cx;
    int64_t ep, cp, epoch, me, R;
    int64_t *state;
    const int64_t *count_in;          /* [R] rows rank d returns to this rank */
    const int64_t *count_out;         /* [R] rows this rank returns to owner o */
    const int64_t *ids, *first;       /* this rank's tokens sent to each rank (handle) */
    int in_dt, out_dt, num_bias, stream;
    int64_t hidden, row_bytes, K, T;
    const int64_t *bias_addr;
    uint8_t *out;
    float *out_w;
    int64_t *index;
    const int64_t *call_row;
    const uint8_t *x;                 /* this rank's rows in received order (by owner) */
    const float *topk_w;
    int64_t slot_rows, part_rows, part_bytes, parts;
    const int64_t *out_at;            /* [R] x's first row for each owner */
    const int64_t *eager_at;          /* [R][2] an eager slot's rows and weights (offsets) */
} ring_call;

/* The value of a tagged word of this call (its low 32 bits), or 0 if it is an older one. */
static inline int64_t ring_word(const int64_t *w, int64_t epoch) {
    const int64_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    return (v >> 32) == epoch ? (v & 0xFFFFFFFFll) : 0;
}

static inline int ring_streams(const ring_call *c, int64_t n) { return n > c->slot_rows; }

static inline int64_t ring_parts_of(const ring_call *c, int64_t n) {
    return (n + c->part_rows - 1) / c->part_rows;
}

/* As expert: the next part to each owner whose slot has room for it. Returns how many. */
static int64_t ring_send(const ring_call *c) {
    const int64_t *cx = c->cx, *rot = CX_PTR(cx, CX_ROTATION);
    int64_t sent = 0;
    for (int64_t j = 0; j < c->R; j++) {
        const int64_t o = rot[j], n = c->count_out[o];
        if (o == c->me || !ring_streams(c, n)) continue;
        const int64_t p = RS_SENT(c->state, c->R, o);
        if (p >= ring_parts_of(c, n)) continue;
        int64_t *flag = (int64_t *)(intptr_t)CX_PTR(cx, CX_OUT_FLAG + c->ep)[o];
        if (p - ring_word(flag + RING_TAKEN, c->epoch) >= c->parts) continue;
        const int64_t lo = p * c->part_rows;
        const int64_t m = n - lo < c->part_rows ? n - lo : c->part_rows;
        uint8_t *part = (uint8_t *)(intptr_t)CX_PTR(cx, CX_OUT_SLOT + c->ep)[o] +
                        (p % c->parts) * c->part_bytes;
        /* plain stores: the owner reads the part soon, from the cache */
        memcpy(part, c->x + (c->out_at[o] + lo) * c->row_bytes, (size_t)(m * c->row_bytes));
        if (c->K && c->topk_w)
            memcpy(part + ring_weights_at(c->part_rows, c->row_bytes),
                   c->topk_w + (c->out_at[o] + lo) * c->K, (size_t)(m * c->K * 4));
        const int64_t written = p + 1;
        RS_SENT(c->state, c->R, o) = written;
        publish(flag + RING_WRITTEN, CX_PTR(cx, CX_BELLS)[o], c->epoch, &written, 1);
        sent++;
    }
    return sent;
}

/* Whether every rank's signature came (then compared: RS_DIFFER set where one differs);
 * without blocking. */
static int ring_calls_came(const ring_call *c) {
    const int64_t *where = CX_PTR(c->cx, CX_CALL_IN + c->cp), nw = c->cx[CX_CALL_WORDS];
    for (int64_t s = 0; s < c->R; s++) {
        const int64_t *w = (const int64_t *)(intptr_t)where[s];
        for (int64_t i = 0; i < nw; i++)
            if ((__atomic_load_n(&w[i], __ATOMIC_RELAXED) >> 32) != c->epoch) return 0;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (int64_t s = 0; s < c->R; s++) {
        const int64_t *w = (const int64_t *)(intptr_t)where[s];
        for (int64_t i = 0; i < nw; i++)
            if ((w[i] & 0xFFFFFFFFll) != c->call_row[i]) c->state[RS_DIFFER] = 1;
    }
    return 1;
}

/* Whether every eager slot this rank reads came (1), not yet (0), or -(d + 1) for a rank d
 * whose slot holds another size than this rank expects. */
static int64_t ring_flags_came(const ring_call *c) {
    const int64_t *flag = CX_PTR(c->cx, CX_IN_FLAG + c->ep);
    for (int64_t d = 0; d < c->R; d++) {
        const int64_t n = c->count_in[d];
        if (!n || ring_streams(c, n)) continue;
        const int64_t *w = (const int64_t *)(intptr_t)flag[d];
        if ((__atomic_load_n(&w[0], __ATOMIC_RELAXED) >> 32) != c->epoch ||
            (__atomic_load_n(&w[1], __ATOMIC_RELAXED) >> 32) != c->epoch)
            return 0;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    int64_t offs[4];
    for (int64_t d = 0; d < c->R; d++) {
        const int64_t n = c->count_in[d];
        if (!n || ring_streams(c, n)) continue;
        const int64_t said = ((const int64_t *)(intptr_t)flag[d])[1] & 0xFFFFFFFFll;
        if (said != slab_layout(n, c->row_bytes, 0, c->K, c->cx[CX_ALIGN], c->cx[CX_PAGE], offs))
            return -(d + 1);
    }
    return 1;
}

/* Where row i of rank d's rows for this rank is, and its weights. */
static inline const uint8_t *ring_row(const ring_call *c, int64_t d, int64_t i,
                                      const float **w) {
    const int64_t n = c->count_in[d];
    if (d == c->me) {                 /* this rank's own rows stay in x */
        const int64_t at = c->out_at[d] + i;
        *w = c->topk_w ? c->topk_w + at * c->K : NULL;
        return c->x + at * c->row_bytes;
    }
    const uint8_t *slot = (const uint8_t *)(intptr_t)CX_PTR(c->cx, CX_IN_SLOT + c->ep)[d];
    if (!ring_streams(c, n)) {
        *w = (const float *)(slot + c->eager_at[2 * d + 1]) + i * c->K;
        return slot + c->eager_at[2 * d] + i * c->row_bytes;
    }
    const uint8_t *part = slot + ((i / c->part_rows) % c->parts) * c->part_bytes;
    const int64_t k = i % c->part_rows;
    *w = (const float *)(part + ring_weights_at(c->part_rows, c->row_bytes)) + k * c->K;
    return part + k * c->row_bytes;
}

/* As owner: the tokens [RS_T, t_end) whose rows have all come, summed (small_combine_recv's
 * sums, in rank order), and the parts they emptied handed back. Returns whether it summed,
 * or -1 for token ids not ascending within [0, T) (a handle that is not this call's). */
static int ring_sum(const ring_call *c) {
    const int64_t R = c->R, T = c->T, t0 = c->state[RS_T];
    int64_t *s = c->state;
    if (t0 >= T) return 0;
    int64_t t_end = T;
    for (int64_t d = 0; d < R; d++) {
        const int64_t n = c->count_in[d];
        if (d == c->me || !ring_streams(c, n)) continue;
        const int64_t *flag = (const int64_t *)(intptr_t)CX_PTR(c->cx, CX_IN_FLAG + c->ep)[d];
        const int64_t came = ring_word(flag + RING_WRITTEN, c->epoch) * c->part_rows;
        if (came < n && c->ids[c->first[d] + came] < t_end) t_end = c->ids[c->first[d] + came];
    }
    if (t_end <= t0) return 0;
    const int64_t L = t_end - t0;
    int64_t *tfirst = c->index, *addr = c->index + L + 1;
    for (int64_t t = 0; t <= L; t++) tfirst[t] = 0;
    for (int64_t d = 0; d < R; d++) {
        const int64_t *ids = c->ids + c->first[d], n = c->count_in[d];
        for (int64_t i = RS_CURSOR(s, R, d); i < n && ids[i] < t_end; i++) {
            if (ids[i] < t0 || (i && ids[i] <= ids[i - 1])) return -1;
            tfirst[ids[i] - t0 + 1]++;
        }
    }
    for (int64_t t = 0; t < L; t++) tfirst[t + 1] += tfirst[t];
    if (c->K) memset(c->out_w + t0 * c->K, 0, (size_t)(L * c->K * 4));
    for (int64_t d = 0; d < R; d++) {            /* rank order: each token's rows in it */
        const int64_t *ids = c->ids + c->first[d], n = c->count_in[d];
        int64_t i = RS_CURSOR(s, R, d);
        for (; i < n && ids[i] < t_end; i++) {
            const float *w;
            const int64_t t = ids[i];
            addr[tfirst[t - t0]++] = (int64_t)(intptr_t)ring_row(c, d, i, &w);
            if (c->K)
                for (int64_t k = 0; k < c->K; k++) c->out_w[t * c->K + k] += w[k];
        }
        RS_CURSOR(s, R, d) = i;
        if (t_end == T && i < n) return -1;      /* rows of tokens past T: never summed */
    }
    for (int64_t t = L; t > 0; t--) tfirst[t] = tfirst[t - 1];   /* cursors back to starts */
    tfirst[0] = 0;
    int64_t bias[c->num_bias + 1];    /* each bias from token t0 on */
    for (int k = 0; k < c->num_bias; k++)
        bias[k] = c->bias_addr[k] + t0 * c->hidden * 4;
    const int64_t out_elem = c->out_dt == DT_BF16 ? 2 : 4;
    sum_rows(addr, NULL, tfirst, c->in_dt, c->hidden, L, bias, c->num_bias,
             c->out + t0 * c->hidden * out_elem, c->out_dt, c->stream);
    s[RS_T] = t_end;
    for (int64_t d = 0; d < R; d++) {            /* the parts emptied, back to their experts */
        const int64_t n = c->count_in[d];
        if (d == c->me || !ring_streams(c, n)) continue;
        const int64_t cur = RS_CURSOR(s, R, d);
        const int64_t taken = cur == n ? ring_parts_of(c, n) : cur / c->part_rows;
        if (taken <= RS_TAKEN(s, R, d)) continue;
        RS_TAKEN(s, R, d) = taken;
        int64_t *flag = (int64_t *)(intptr_t)CX_PTR(c->cx, CX_IN_FLAG + c->ep)[d];
        publish(flag + RING_TAKEN, CX_PTR(c->cx, CX_BELLS)[d], c->epoch, &taken, 1);
    }
    return 1;
}

/* Whether this rank has written every part it owes. */
static int ring_sent_all(const ring_call *c) {
    for (int64_t o = 0; o < c->R; o++)
        if (o != c->me && ring_streams(c, c->count_out[o]) &&
            RS_SENT(c->state, c->R, o) < ring_parts_of(c, c->count_out[o]))
            return 0;
    return 1;
}

/* A sum of every word that a step of this rank waits on (the hand-backs of its owners, the
 * parts of its experts, every word of the signatures, the eager flags): changed, something
 * may go on. */
static uint64_t ring_words_now(const ring_call *c) {
    uint64_t sum = 0;
    const int64_t *out_flag = CX_PTR(c->cx, CX_OUT_FLAG + c->ep);
    const int64_t *in_flag = CX_PTR(c->cx, CX_IN_FLAG + c->ep);
    const int64_t *calls = CX_PTR(c->cx, CX_CALL_IN + c->cp), nw = c->cx[CX_CALL_WORDS];
    for (int64_t d = 0; d < c->R; d++) {
        const int64_t *o = (const int64_t *)(intptr_t)out_flag[d];
        const int64_t *i = (const int64_t *)(intptr_t)in_flag[d];
        const int64_t *call = (const int64_t *)(intptr_t)calls[d];
        sum += (uint64_t)__atomic_load_n(o + RING_TAKEN, __ATOMIC_RELAXED) +
               (uint64_t)__atomic_load_n(i + RING_WRITTEN, __ATOMIC_RELAXED) +
               (uint64_t)__atomic_load_n(i, __ATOMIC_RELAXED) +
               (uint64_t)__atomic_load_n(i + 1, __ATOMIC_RELAXED);
        for (int64_t k = 0; k < nw; k++)
            sum += (uint64_t)__atomic_load_n(call + k, __ATOMIC_RELAXED);
    }
    return sum;
}

/* At RING_LATE: which peers this rank was still waiting for - the experts whose next part
 * holds its sums back, the owners that had not handed back a part it needed. */
static void ring_silent(const ring_call *c) {
    const int64_t R = c->R, t0 = c->state[RS_T];
    for (int64_t d = 0; d < R; d++) {
        int silent = 0;
        if (d != c->me && ring_streams(c, c->count_in[d]) && t0 < c->T) {
            const int64_t *flag =
                (const int64_t *)(intptr_t)CX_PTR(c->cx, CX_IN_FLAG + c->ep)[d];
            const int64_t came = ring_word(flag + RING_WRITTEN, c->epoch) * c->part_rows;
            silent = came < c->count_in[d] && c->ids[c->first[d] + came] <= t0;
        }
        if (d != c->me && ring_streams(c, c->count_out[d])) {
            const int64_t *flag =
                (const int64_t *)(intptr_t)CX_PTR(c->cx, CX_OUT_FLAG + c->ep)[d];
            const int64_t p = RS_SENT(c->state, R, d);
            silent |= p < ring_parts_of(c, c->count_out[d]) &&
                      p - ring_word(flag + RING_TAKEN, c->epoch) >= c->parts;
        }
        RS_SILENT(c->state, R, d) = silent;
    }
}

/* The whole combine after moe_small_combine_start (this rank's eager pairs and signature
 * sent): this rank's streamed rows to each owner, part by part, and its own sums as its rows
 * come. `state` [RS_WORDS + 4R], zero at the first run; `index` int64 [T + 1 + the rows this
 * rank gets back]; out / out_w [T, hidden] / [T, K]. Returns SMALL_OK, SMALL_AGAIN (the wait's
 * slice ended: run again with the same state), SMALL_LATE_CALLS / SMALL_LATE_FLAGS (the
 * deadline, signatures or eager slots missing: small.py's Python waits raise), RING_LATE
 * (the deadline, parts or hand-backs missing; also when this rank was fenced; at the
 * deadline the word at cx[CX_DIFFER] is set where two signatures differ), RING_BAD_IDS,
 * or -(d + 1) for a rank whose eager slot holds another size or whose count is not the
 * handle's. */
int64_t moe_ring_combine(const int64_t *cx, int64_t ep, int64_t cp, int64_t epoch,
                         int64_t deadline_ns, int64_t *state,
                         const int64_t *count_in, const int64_t *count_out, const int64_t *ids,
                         const int64_t *first, int in_dt, int64_t hidden, int64_t K, int64_t T,
                         const int64_t *bias_addr, int num_bias, void *out, int out_dt,
                         float *out_w, int64_t *index, const int64_t *call_row,
                         const uint8_t *x, const float *topk_w, int64_t slot_rows,
                         int64_t part_rows, int64_t part_bytes, int64_t parts) {
    const int64_t out_elem = out_dt == DT_BF16 ? 2 : 4;
    const int64_t R = cx[CX_R], row_bytes = hidden * (in_dt == DT_BF16 ? 2 : 4);
    int64_t out_at[R], eager_at[2 * R], offs[4];
    int64_t *differ = (int64_t *)(intptr_t)cx[CX_DIFFER];
    for (int64_t o = 0, at = 0; o < R; at += count_out[o], o++) out_at[o] = at;
    *differ = 0;
    for (int64_t d = 0; d < R; d++) {
        if (count_in[d] != first[d + 1] - first[d]) return -(d + 1);
        slab_layout(count_in[d], row_bytes, 0, K, cx[CX_ALIGN], cx[CX_PAGE], offs);
        eager_at[2 * d] = offs[0];
        eager_at[2 * d + 1] = offs[3];
    }
    const ring_call c = {cx, ep, cp, epoch, cx[CX_ME], cx[CX_R], state, count_in, count_out,
                         ids, first, in_dt, out_dt, num_bias,
                         /* non-temporal sums where the whole output is large and aligned */
                         T * hidden * out_elem >= STREAM_MIN_BYTES &&
                         (uintptr_t)out % 64 == 0 && (hidden * out_elem) % 64 == 0,
                         hidden, row_bytes, K, T, bias_addr,
                         (uint8_t *)out, out_w, index, call_row, x, topk_w, slot_rows,
                         part_rows, part_bytes, parts, out_at, eager_at};
    const int64_t *fence = CX_PTR(cx, CX_FENCE), bell = cx[CX_BELL];
    const int64_t slice_end = now_ns() + WAIT_SLICE_NS;
    const int64_t until = slice_end < deadline_ns ? slice_end : deadline_ns;
    for (int64_t spins = 0;;) {
        const uint64_t seen = ring_words_now(&c);  /* what the steps below look at */
        int moved = ring_send(&c) > 0;
        if (!state[RS_CALLS])         /* (differing: noted, and on) */
            state[RS_CALLS] = ring_calls_came(&c);
        if (state[RS_CALLS] && !state[RS_FLAGS]) {
            const int64_t came = ring_flags_came(&c);
            if (came < 0) return came;
            state[RS_FLAGS] = came;
        }
        if (state[RS_CALLS] && state[RS_FLAGS]) {
            const int summed = ring_sum(&c);
            if (summed < 0) return RING_BAD_IDS;
            moved |= summed;
        }
        /* (signatures that differ: on to the deadline, as a peer on another path waits for
         * words this rank never sends; then every rank raises, in step for the next call) */
        if (state[RS_CALLS] && state[RS_FLAGS] && state[RS_T] >= T && ring_sent_all(&c) &&
            !state[RS_DIFFER])
            return SMALL_OK;
        if (moved) { spins = 0; continue; }
        if (__atomic_load_n(fence, __ATOMIC_RELAXED) || now_ns() > until) {
            if (until < deadline_ns && !__atomic_load_n(fence, __ATOMIC_RELAXED))
                return SMALL_AGAIN;
            *differ = state[RS_DIFFER];
            ring_silent(&c);
            return !state[RS_CALLS] ? SMALL_LATE_CALLS : !state[RS_FLAGS] ? SMALL_LATE_FLAGS
                                                                          : RING_LATE;
        }
        /* a peer's part or sum takes as long as a copy of megabytes: yield briefly, then
         * sleep until the doorbell rings (granted.c's waits, for the same reason) */
        const int64_t ns = backoff(spins++, 1);
        if (!ns) continue;
        __atomic_store_n(bell_at(bell), 1, __ATOMIC_SEQ_CST);      /* then a second look */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (ring_words_now(&c) == seen) sleep_on(bell, ns);
        else __atomic_store_n(bell_at(bell), 0, __ATOMIC_RELAXED);
    }
}
