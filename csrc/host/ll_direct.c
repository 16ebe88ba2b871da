/* Low-latency calls straight from the Buffer's arguments (moe_comm/host/ll_direct.py): each
 * half of a low-latency dispatch or combine as one C call, the waits included.
 *
 * Why: the C loops of a 64-token low-latency dispatch (cast, route, copies, pack) take tens
 * of microseconds, but the call around them cost ~500 us of Python - argument checks, the
 * route's and messages' tensors, a signal and a wait per peer - and with 4 ranks on 2 cores
 * half of each rank's CPU in a 128 x 7168 dispatch (docs/PERF.md, sessions 15 and 16).
 *
 * Same bytes at the same places as host/ll.py (its module docstring has the protocol): the
 * signature, then the messages, then the count row per destination; the FREE pushes after a
 * receive; the combine's rows at the owner's base and its DONE word. A rank here pairs with a
 * rank on the Python path. This file is compiled as part of host_ops.c (it uses the waits and
 * doorbells there) and included at its end.
 *
 * `lx`: the addresses of one low-latency layout (ll_direct.py's Context, built once), int64
 * words in this order: */
#include <signal.h>

enum {
    LX_R, LX_ME, LX_L, LX_M, LX_CROWDED, LX_FENCE, LX_BELL, LX_BELLS, LX_ROTATION, LX_READY,
    LX_NW_CALL, LX_NW_COUNT, LX_NW_ONE, LX_CALL_WORDS, LX_CAPACITY,
    LX_AREA,                       /* int64 [R]: rank r's first receive area (0: no areas) */
    LX_AREA_STRIDE,                /* bytes from one of a rank's receive areas to the next */
    LX_AREA_BYTES,                 /* bytes of all of a rank's receive areas */
    LX_COUNT_ROW,                  /* bytes from one count (or announce) row to the next */
    /* then two (buffers 0 and 1) of each, an int64 [R] array of addresses: */
    LX_PAYLOAD,                    /* rank r's dispatch payload blocks (row 0 of [le][src]) */
    LX_META = LX_PAYLOAD + 2,      /* rank r's dispatch meta blocks */
    LX_COUNT_OUT = LX_META + 2,    /* this rank's count row in rank r's region */
    LX_COUNT_IN = LX_COUNT_OUT + 2, /* source s's count row in this rank's region */
    LX_CALL_OUT = LX_COUNT_IN + 2, /* this rank's signature words in rank r's header */
    LX_CALL_IN = LX_CALL_OUT + 2,  /* source s's signature words in this rank's header */
    LX_DFREE_IN = LX_CALL_IN + 2,  /* rank r's dispatch FREE push in this rank's header */
    LX_DFREE_OUT = LX_DFREE_IN + 2, /* this rank's dispatch FREE push in rank r's header */
    LX_CFREE_IN = LX_DFREE_OUT + 2, /* the same for the combine */
    LX_CFREE_OUT = LX_CFREE_IN + 2,
    LX_DONE_IN = LX_CFREE_OUT + 2, /* rank r's combine DONE in this rank's header */
    LX_DONE_OUT = LX_DONE_IN + 2,  /* this rank's combine DONE in rank r's header */
    LX_COMBINE = LX_DONE_OUT + 2,  /* rank r's combine rows */
    LX_ANNOUNCE = LX_COMBINE + 2,  /* rank r's announce rows (row 0) */
    LX_WORDS = LX_ANNOUNCE + 2
};

/* What a half returns: LL_OK; LL_AGAIN: a wait's slice (WAIT_SLICE_NS) ran out before the
 * deadline (the caller lets Python's signal handlers run and calls again, resuming);
 * LL_LATE: the deadline passed or this rank's FENCE word was set (the caller raises through
 * the Python waits); LL_DIFFER: signatures or combine encodings differ (the caller runs the
 * Python receive, which raises CallMismatchError on every rank); LL_DECLINED: nothing
 * written, the Python protocol runs the call and says what is wrong; negative: a peer's
 * numbers outside this rank's layout (nothing copied; the caller raises). */
enum { LL_OK = 0, LL_AGAIN = 1, LL_LATE = 2, LL_DIFFER = 3, LL_DECLINED = 5 };

#define LX_PTR(lx, i) ((const int64_t *)(intptr_t)(lx)[i])
#define LL_DONE_LOGFMT (1ll << 30)      /* wire.LL_DONE_LOGFMT: the rows are LogFMT-encoded */
#define LL_ROWS_DIRECT (1ll << 30)      /* wire.LL_ROWS_DIRECT: a count row's base word flag */
/* A dispatch FREE push's value (ll_direct.py): 0, or the receive area the pusher gives the
 * call two on (its index + 1 in the low AREA_BITS) with the bytes reserved of it (in pages
 * above them): its senders may write their rows straight there. */
#define AREA_BITS 4
#define AREA_PAGE 4096ll
/* How long a sender that announced its counts to a rank waits for the announces of the
 * sources before it (its rows go after theirs) before it writes into the rank's blocks
 * instead (a source on ll.py's path never announces). */
#define DIRECT_WAIT_NS 2000000ll

int64_t moe_ll_context_words(void) { return LX_WORDS; }

/* small_wait over all R slots at where[] with the context's rest, for at most one slice;
 * returns LL_OK, LL_DIFFER (with `expect`: values differ), LL_AGAIN or LL_LATE. */
static int64_t lx_wait(const int64_t *lx, const int64_t *where, const int64_t *nwords,
                       const int64_t *expect, int64_t epoch, int64_t deadline_ns) {
    const int64_t slice_end = now_ns() + WAIT_SLICE_NS;
    const int64_t until = slice_end < deadline_ns ? slice_end : deadline_ns;
    const int64_t missing = small_wait(lx[LX_R], where, nwords, NULL, expect, epoch, until,
                                       LX_PTR(lx, LX_FENCE), lx[LX_BELL], (int)lx[LX_CROWDED],
                                       (uint8_t *)(intptr_t)lx[LX_READY]);
    if (missing == -1) return LL_DIFFER;
    if (!missing) return LL_OK;
    return until < deadline_ns && !*LX_PTR(lx, LX_FENCE) ? LL_AGAIN : LL_LATE;
}

/* Tests (tests/test_elastic.py): stop this process (SIGSTOP) once, after a send's fence check
 * and before its first write into a peer, as a rank frozen mid-call would. */
static int stop_before_peer_write;

int64_t moe_ll_stop_before_peer_write(int64_t on) {      /* returns the setting it ends */
    const int64_t was = stop_before_peer_write;
    stop_before_peer_write = (int)on;
    return was;
}

/* One send of a half to rank r (the rank's buffer is free): 1 when it is done, 0 when it
 * needs another call later (a dispatch waiting for announces; sent[r] says LL_ANNOUNCED). */
typedef int (*ll_send_fn)(void *state, int64_t r);
/* Whether a send that returned 0 to rank r can go on now (the look before sleeping). */
typedef int (*ll_ready_fn)(void *state, int64_t r);

/* sent[r] of a dispatch that signed its call to r (wrote its signature words, and its counts
 * into r's announce row where r gave an area) and has not written its rows yet: waiting for
 * the announces of the sources before it (LL_ANNOUNCED), or not (LL_SIGNED). ll_direct.py's
 * _drive_send waits only for ranks at 0; SKIPPED (2) is its mark of a rank masked unsent. */
#define LL_SENT 1
#define LL_SKIPPED 2
#define LL_ANNOUNCED 3
#define LL_SIGNED 4

/* Run send(state, r) for every rank r not yet sent[] (each after a look at this rank's FENCE
 * word: LL_LATE once it is set) once its FREE push (free_in[r], this rank's header) carries
 * free_epoch (free_epoch < 0: none awaited, the first two calls), in
 * the rotation (the next rank first, this one last) where several are free; sent[r] set
 * after each that is done (a send that returns 0 is called again later; ready, or NULL,
 * says before a sleep whether it could go on now). Sleeps on this rank's doorbell while
 * none can go on. Returns LL_OK, or LL_AGAIN / LL_LATE with sent[] saying who is done (a call
 * again goes on with the others). */
static int64_t ll_each_free(const int64_t *lx, const int64_t *free_in, int64_t free_epoch,
                            int64_t deadline_ns, uint8_t *sent, ll_send_fn send,
                            ll_ready_fn ready, void *state) {
    const int64_t R = lx[LX_R], *rotation = LX_PTR(lx, LX_ROTATION);
    const int64_t slice_end = now_ns() + WAIT_SLICE_NS;
    const int64_t until = slice_end < deadline_ns ? slice_end : deadline_ns;
    const int64_t *fence = LX_PTR(lx, LX_FENCE), bell = lx[LX_BELL];
    for (int64_t spins = 0;; spins++) {
        int64_t left = 0;
        for (int64_t j = 0; j < R; j++) {
            const int64_t r = rotation[j];
            if (sent[r] == LL_SENT || sent[r] == LL_SKIPPED) continue;
            const int64_t *w = (const int64_t *)(intptr_t)free_in[r];
            if (free_epoch >= 0 && (__atomic_load_n(w, __ATOMIC_ACQUIRE) >> 32) != free_epoch) {
                left++;
                continue;
            }
            /* a rank the survivors masked writes nothing more (ll.py's check_fence) */
            if (__atomic_load_n(fence, __ATOMIC_RELAXED)) return LL_LATE;
            if (stop_before_peer_write && r != lx[LX_ME]) {
                stop_before_peer_write = 0;
                raise(SIGSTOP);
            }
            if (send(state, r)) sent[r] = LL_SENT;
            else left++;
        }
        if (!left) return LL_OK;
        if (__atomic_load_n(fence, __ATOMIC_RELAXED)) return LL_LATE;
        if (now_ns() > until) return until < deadline_ns ? LL_AGAIN : LL_LATE;
        const int64_t ns = backoff(spins, (int)lx[LX_CROWDED]);
        if (!ns) continue;
        __atomic_store_n(bell_at(bell), 1, __ATOMIC_SEQ_CST);     /* then a second look */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        int any = 0;
        for (int64_t r = 0; r < R && !any; r++)
            any = sent[r] == LL_ANNOUNCED ? !ready || ready(state, r)
                : sent[r] == LL_SIGNED ||
                  (!sent[r] && (__atomic_load_n((const int64_t *)(intptr_t)free_in[r],
                                                __ATOMIC_RELAXED) >> 32) == free_epoch);
        if (!any) sleep_on(bell, ns);
        else __atomic_store_n(bell_at(bell), 0, __ATOMIC_RELAXED);
    }
}

/* ---- dispatch ---------------------------------------------------------------------------- */

struct ll_dispatch {
    const int64_t *lx;
    int64_t b, seq;
    const uint8_t *msgs;         /* message rows: fp8 bytes then scales, or the bf16 tokens */
    int64_t stride, T;           /* bytes a message; this rank's tokens */
    const int64_t *tok, *slot, *first, *call_row;
    int own_in_place;            /* fp8: the messages to itself stay in msgs (its receive) */
    uint8_t *seen;               /* uint8 [T] scratch of moe_ll_send */
    int stream;                  /* the messages to other ranks are large: non-temporal */
    int wait_free;               /* the FREE pushes were awaited (their values hold) */
    int64_t x_bytes, scale_bytes; /* a receive row's bytes, its scales' (fp8; else 0) */
    uint8_t *sent;               /* ll_each_free's */
    int64_t *announced;          /* int64 [R]: when this rank announced to each rank (ns) */
};

/* Rank r's receive area for this call (its FREE push's value, ll_direct.py), or NULL: none
 * given, or too small for this layout's receive (recv_x, then its scales). */
static uint8_t *area_of(const struct ll_dispatch *d, int64_t r) {
    const int64_t *lx = d->lx;
    if (!d->wait_free || !lx[LX_AREA]) return NULL;
    const int64_t *push = (const int64_t *)(intptr_t)LX_PTR(lx, LX_DFREE_IN + d->b)[r];
    const int64_t v = __atomic_load_n(push, __ATOMIC_ACQUIRE) & 0xFFFFFFFFll;
    const int64_t k = v & ((1 << AREA_BITS) - 1), reserved = (v >> AREA_BITS) * AREA_PAGE;
    const int64_t rows = lx[LX_L] * lx[LX_R] * lx[LX_M];
    const int64_t need = rows * (d->x_bytes + d->scale_bytes);
    if (!k || need > reserved || need > lx[LX_AREA_STRIDE] ||
        (k - 1) * lx[LX_AREA_STRIDE] + need > lx[LX_AREA_BYTES])
        return NULL;
    return (uint8_t *)(intptr_t)(LX_PTR(lx, LX_AREA)[r] + (k - 1) * lx[LX_AREA_STRIDE]);
}

/* Whether every source before this rank announced its counts to rank r for this call; off
 * [L] then holds where this rank's rows go in each of r's experts (after theirs). */
static int announces_in(const struct ll_dispatch *d, int64_t r, int64_t *off) {
    const int64_t *lx = d->lx, L = lx[LX_L];
    const uint8_t *rows = (const uint8_t *)(intptr_t)LX_PTR(lx, LX_ANNOUNCE + d->b)[r];
    for (int64_t le = 0; le < L; le++) off[le] = 0;
    for (int64_t s = 0; s < lx[LX_ME]; s++) {
        const int64_t *w = (const int64_t *)(rows + s * lx[LX_COUNT_ROW]);
        for (int64_t le = 0; le < L; le++) {
            const int64_t v = __atomic_load_n(&w[le], __ATOMIC_ACQUIRE);
            if (v >> 32 != d->seq) return 0;
            off[le] += v & 0xFFFFFFFFll;
        }
    }
    return 1;
}

static int ll_announces_ready(void *p, int64_t r) {
    const struct ll_dispatch *d = p;
    int64_t off[d->lx[LX_L]];
    return announces_in(d, r, off) || now_ns() - d->announced[r] >= DIRECT_WAIT_NS;
}

/* This rank's messages to rank r's experts straight into r's receive area: expert le's at
 * rows le * R * M + off[le] on (recv_x rows, x_bytes each, then their scales after all
 * rows), their meta into r's blocks as moe_ll_send writes it. Returns 0 (nothing written)
 * where a run would leave its expert's rows. */
static int direct_rows(const struct ll_dispatch *d, int64_t r, uint8_t *area,
                       const int64_t *off) {
    const int64_t *lx = d->lx, R = lx[LX_R], M = lx[LX_M], L = lx[LX_L], me = lx[LX_ME];
    const int64_t e_lo = r * L, xb = d->x_bytes, sb = d->scale_bytes;
    for (int64_t le = 0; le < L; le++)
        if (off[le] < 0 || off[le] + d->first[e_lo + le + 1] - d->first[e_lo + le] > R * M)
            return 0;
    uint8_t *scales = area + L * R * M * xb;
    int64_t *meta = (int64_t *)(intptr_t)LX_PTR(lx, LX_META + d->b)[r];
    for (int64_t le = 0; le < L; le++) {
        const int64_t lo = d->first[e_lo + le], hi = d->first[e_lo + le + 1];
        for (int64_t i = lo; i < hi; i++) {
            const int64_t row = le * R * M + off[le] + i - lo, t = d->tok[i];
            const uint8_t *msg = d->msgs + t * d->stride;
            copy_run(area + row * xb, msg, (size_t)xb, d->stream);
            if (sb) memcpy(scales + row * sb, msg + xb, (size_t)sb);
            meta[(le * R + me) * M + i - lo] = t << 8 | d->slot[i];
        }
    }
    if (d->stream) stream_done();
    return 1;
}

/* The count row this rank sends rank r: a count per local expert of r, then where r's
 * messages start in this rank's order. */
static void count_row(const struct ll_dispatch *d, int64_t r, int64_t *row) {
    const int64_t L = d->lx[LX_L], e_lo = r * L;
    for (int64_t le = 0; le < L; le++) row[le] = d->first[e_lo + le + 1] - d->first[e_lo + le];
    row[L] = d->first[e_lo];
}

/* Sign the call to rank r (its buffer is free): the signature words; where r gave an area,
 * this rank's counts into r's announce row, then the doorbells of the ranks after it (they
 * may wait for them). sent[r] becomes LL_ANNOUNCED where this rank then writes its rows
 * straight into r's area, else LL_SIGNED. */
static void ll_sign(struct ll_dispatch *d, int64_t r) {
    const int64_t *lx = d->lx, b = d->b, R = lx[LX_R], me = lx[LX_ME], L = lx[LX_L];
    int64_t *call = (int64_t *)(intptr_t)LX_PTR(lx, LX_CALL_OUT + b)[r];
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (int64_t i = 0; i < lx[LX_CALL_WORDS]; i++)
        __atomic_store_n(&call[i], (d->seq << 32) | d->call_row[i], __ATOMIC_RELAXED);
    d->sent[r] = LL_SIGNED;
    if (!area_of(d, r)) return;
    int64_t row[L + 1];
    count_row(d, r, row);
    int64_t *to = (int64_t *)(intptr_t)(LX_PTR(lx, LX_ANNOUNCE + b)[r] + me * lx[LX_COUNT_ROW]);
    for (int64_t le = 0; le < L; le++)
        __atomic_store_n(&to[le], (d->seq << 32) | row[le], __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    const int64_t *bells = LX_PTR(lx, LX_BELLS);
    for (int64_t s = me + 1; s < R; s++) ring(bells[s]);
    d->announced[r] = now_ns();
    /* (its own rows are its receive's to pack; without rows there is nothing to place) */
    if (r != me && d->first[(r + 1) * L] > d->first[r * L]) d->sent[r] = LL_ANNOUNCED;
}

/* ll.py's dispatch_send to rank r: the signature, the messages (a token's row once), then the
 * count row, then r's doorbell. Where r gave a receive area for this call, once the sources
 * before this rank announced their counts (ll_sign), the rows go straight into r's area (and
 * the count row is flagged LL_ROWS_DIRECT); after DIRECT_WAIT_NS without them, into r's
 * blocks. Returns 0 while it waits for them. */
static int ll_dispatch_to(void *p, int64_t r) {
    struct ll_dispatch *d = p;
    const int64_t *lx = d->lx, b = d->b;
    const int64_t R = lx[LX_R], me = lx[LX_ME], L = lx[LX_L], e_lo = r * L;
    const int64_t *bells = LX_PTR(lx, LX_BELLS);
    if (!d->sent[r]) ll_sign(d, r);
    int64_t row[L + 1];
    count_row(d, r, row);
    if (d->sent[r] == LL_ANNOUNCED) {
        int64_t off[L];
        uint8_t *area = area_of(d, r);
        if (area && announces_in(d, r, off) && direct_rows(d, r, area, off)) {
            row[L] |= LL_ROWS_DIRECT;
            publish((int64_t *)(intptr_t)LX_PTR(lx, LX_COUNT_OUT + b)[r], bells[r], d->seq, row,
                    L + 1);
            return 1;
        }
        if (area && now_ns() - d->announced[r] < DIRECT_WAIT_NS) return 0;
    }
    if (d->first[e_lo + L] > d->first[e_lo] && !(r == me && d->own_in_place))
        moe_ll_send(d->msgs, d->stride, d->stride, d->tok, d->slot, d->first, e_lo, L, R, me,
                    lx[LX_M], (uint8_t *)(intptr_t)LX_PTR(lx, LX_PAYLOAD + b)[r], d->stride,
                    (int64_t *)(intptr_t)LX_PTR(lx, LX_META + b)[r], d->T, d->seen,
                    d->stream);
    publish((int64_t *)(intptr_t)LX_PTR(lx, LX_COUNT_OUT + b)[r], bells[r], d->seq, row, L + 1);
    return 1;
}

/* A low-latency dispatch's send half (ll.py dispatch_send) on buffer b for call seq: x bf16
 * [T, H], topk [T, K] of E experts. First (resume 0): declines (LL_DECLINED, nothing
 * written) where an id lies outside [-1, E), an expert gets more than M messages (a token
 * naming it twice), or this rank's FENCE word is set; else routes (tok, slot [T * K], first
 * [E + 1]: moe_ll_route; counts [E] scratch), clears sent [R], signs the call to every
 * rank whose buffer is free (ll_sign), then casts to fp8 when fp8 (msgs [T, stride]: the
 * bytes, then the float32 scales at byte H; scales float32 [T, H / 128] and scratch float32
 * [H] scratch). Then sends to every rank once its buffer is free
 * (wait_free: call seq - 2's FREE push; none for the first two calls), resuming after
 * LL_AGAIN or LL_LATE with resume 1. */
int64_t moe_ll_direct_send(const int64_t *lx, int64_t b, int64_t resume, int64_t seq,
                           int64_t wait_free, int64_t deadline_ns, const uint16_t *x, int64_t T,
                           int64_t H, const int64_t *topk, int64_t K, int64_t E, int64_t fp8,
                           uint8_t *msgs, int64_t stride, float *scales, float *scratch,
                           int64_t *tok, int64_t *slot, int64_t *first, int64_t *counts,
                           const int64_t *call_row, uint8_t *sent, uint8_t *seen,
                           int64_t *announced) {
    const int64_t R = lx[LX_R];
    if (!resume) {
        if (*LX_PTR(lx, LX_FENCE) || moe_ll_route(topk, T, K, E, counts, first, tok, slot) < 0)
            return LL_DECLINED;
        for (int64_t e = 0; e < E; e++)
            if (counts[e] > lx[LX_M]) return LL_DECLINED;
        memset(sent, 0, (size_t)R);
    }
    const int64_t L = lx[LX_L], own = first[(lx[LX_ME] + 1) * L] - first[lx[LX_ME] * L];
    struct ll_dispatch d = {lx, b, seq, fp8 ? msgs : (const uint8_t *)x, stride, T, tok,
                            slot, first, call_row, (int)fp8, seen,
                            (first[E] - own) * stride >= STREAM_MIN_BYTES, (int)wait_free,
                            fp8 ? H : 2 * H, fp8 ? H / 128 * 4 : 0, sent, announced};
    /* where ranks give areas: sign the call to every rank whose buffer is free before the
     * cast and before writing any rows, so that the senders after this rank find its counts
     * early: a sender after it waits for them, and with ranks sharing cores its cast was a
     * wait for each of them (4 ranks on 2 cores, 128 x 7168 fp8: the last rank waited ~490 us
     * a call for the counts of those before it) */
    if (!resume && lx[LX_AREA] && wait_free && !*LX_PTR(lx, LX_FENCE))
        for (int64_t r = 0; r < R; r++) {
            const int64_t *w = (const int64_t *)(intptr_t)LX_PTR(lx, LX_DFREE_IN + b)[r];
            if ((__atomic_load_n(w, __ATOMIC_ACQUIRE) >> 32) == seq - 2) ll_sign(&d, r);
        }
    if (!resume && fp8) {
        moe_fp8_quantize(x, DT_BF16, T, H, H, scales, msgs, stride, scratch, H);
        /* the wait for the sources before this rank (DIRECT_WAIT_NS) starts after the cast */
        const int64_t cast_end = now_ns();
        for (int64_t r = 0; r < R; r++)
            if (sent[r] == LL_ANNOUNCED) announced[r] = cast_end;
    }
    return ll_each_free(lx, LX_PTR(lx, LX_DFREE_IN + b), wait_free ? seq - 2 : -1, deadline_ns,
                        sent, ll_dispatch_to, ll_announces_ready, &d);
}

/* A receive half's steps: LL_WAITS, the waits (and their checks); LL_READS, what reads what
 * came, then the FREE pushes. An elastic Buffer runs them apart, the survivors' agreement
 * between them (ll_direct.py); else both at once. */
enum { LL_WAITS = 1, LL_READS = 2 };

/* A low-latency dispatch's receive half (ll.py dispatch_recv) on buffer b for call seq, the
 * `steps` asked: every source's signature compared with call_row (LL_DIFFER: nothing read;
 * LL_LATE at once where this rank's FENCE word is set), every count row
 * (rows_in int64 [R, L + 1] gets their values), the rows packed (moe_ll_recv into recv_x of
 * x_bytes a row, recv_scales (or NULL), recv_meta, ranges, per_expert; this rank's own
 * messages read from own_msgs / own_tok / own_slot / own_first when not NULL; canon int64
 * [R * M] scratch); recv_count int32 [L] and, when not NULL, stats (int32 or int64: stats64)
 * += per_expert; return_base [R] = each source's base; then this rank's FREE push to every
 * rank. Returns LL_OK, LL_AGAIN / LL_LATE / LL_DIFFER (nothing read: the Python receive goes
 * on), or moe_ll_recv's error (-1, -2). */
int64_t moe_ll_direct_recv(const int64_t *lx, int64_t b, int64_t steps, int64_t seq,
                           int64_t deadline_ns, const int64_t *call_row, int64_t stride,
                           int64_t x_bytes, int64_t H, uint8_t *recv_x, float *recv_scales,
                           int64_t *recv_meta, int64_t *ranges, int64_t *per_expert,
                           int32_t *recv_count, void *stats, int64_t stats64,
                           int64_t *return_base, int64_t *rows_in, int64_t *canon,
                           const uint8_t *own_msgs, int64_t own_stride, const int64_t *own_tok,
                           const int64_t *own_slot, const int64_t *own_first,
                           int64_t area_given, int64_t free_value) {
    const int64_t R = lx[LX_R], me = lx[LX_ME], L = lx[LX_L];
    const int64_t *count_in = LX_PTR(lx, LX_COUNT_IN + b);
    if (steps & LL_WAITS) {
        if (*LX_PTR(lx, LX_FENCE)) return LL_LATE;    /* the survivors masked this rank */
        int64_t rc = lx_wait(lx, LX_PTR(lx, LX_CALL_IN + b), LX_PTR(lx, LX_NW_CALL), call_row,
                             seq, deadline_ns);
        if (rc != LL_OK) return rc;
        rc = lx_wait(lx, count_in, LX_PTR(lx, LX_NW_COUNT), NULL, seq, deadline_ns);
        if (rc != LL_OK) return rc;
    }
    if (!(steps & LL_READS)) return LL_OK;
    uint8_t direct[R];            /* the sources whose rows are in recv_x already */
    int any_direct = 0;
    for (int64_t s = 0; s < R; s++) {
        for (int64_t i = 0; i <= L; i++)
            rows_in[s * (L + 1) + i] = ((const int64_t *)(intptr_t)count_in[s])[i] & 0xFFFFFFFFll;
        direct[s] = (rows_in[s * (L + 1) + L] & LL_ROWS_DIRECT) != 0;
        rows_in[s * (L + 1) + L] &= ~LL_ROWS_DIRECT;
        any_direct |= direct[s];
    }
    if (any_direct && !area_given) return -3;
    const int err = moe_ll_recv(
        (const uint8_t *)(intptr_t)LX_PTR(lx, LX_PAYLOAD + b)[me], stride,
        (const int64_t *)(intptr_t)LX_PTR(lx, LX_META + b)[me], rows_in, L + 1, L, R, lx[LX_M],
        recv_x, x_bytes, (uint8_t *)recv_scales, H / 128 * 4, H, recv_meta, ranges, per_expert,
        me, own_msgs, own_stride, own_tok, own_slot, own_first, canon,
        any_direct ? direct : NULL, recv_x, (const uint8_t *)recv_scales);
    if (err) return err;
    for (int64_t le = 0; le < L; le++) {
        recv_count[le] = (int32_t)per_expert[le];
        if (stats && stats64) ((int64_t *)stats)[le] += per_expert[le];
        else if (stats)       /* (unsigned: a sum past INT32_MAX wraps, as torch's does) */
            ((int32_t *)stats)[le] = (int32_t)((uint32_t)((int32_t *)stats)[le] +
                                               (uint32_t)per_expert[le]);
    }
    for (int64_t s = 0; s < R; s++) return_base[s] = rows_in[s * (L + 1) + L];
    small_signal(R, LX_PTR(lx, LX_DFREE_OUT + b), LX_PTR(lx, LX_BELLS), seq, &free_value, 1);
    return LL_OK;
}

/* ---- combine ----------------------------------------------------------------------------- */

struct ll_combine {
    const int64_t *lx;
    int64_t b, seq, row_bytes;
    const uint8_t *x;            /* bf16 [L, R * M, H] */
    const int64_t *ranges, *bases;
    int64_t err;                 /* the first owner whose rows did not fit, -(owner + 1) */
};

/* ll.py's combine_send to owner r: this rank's rows for it, expert by expert (moe_ll_return),
 * at its base in r's combine rows, then the DONE word (the rows' count), then r's doorbell.
 * A base or run outside the combine rows sends nothing and sets err. */
static int ll_combine_to(void *p, int64_t r) {
    struct ll_combine *c = p;
    const int64_t *lx = c->lx, b = c->b;
    const int64_t R = lx[LX_R], L = lx[LX_L], M = lx[LX_M], cap = lx[LX_CAPACITY];
    int64_t n = 0;
    for (int64_t le = 0; le < L; le++) n += c->ranges[(le * R + r) * 2 + 1];
    if (n) {
        const int64_t base = c->bases[r];
        uint8_t *dst = (uint8_t *)(intptr_t)LX_PTR(lx, LX_COMBINE + b)[r];
        if (base < 0 || base > cap ||
            moe_ll_return(c->x, c->row_bytes, L * R * M, c->ranges, L, R, r, R * M,
                          dst + base * c->row_bytes, c->row_bytes, cap - base, c->row_bytes)) {
            if (!c->err) c->err = -(r + 1);
            return 1;
        }
    }
    publish((int64_t *)(intptr_t)LX_PTR(lx, LX_DONE_OUT + b)[r], LX_PTR(lx, LX_BELLS)[r],
            c->seq, &n, 1);
    return 1;
}

/* A low-latency combine's send half (ll.py combine_send, bf16 rows) on buffer b for call seq:
 * x bf16 [L, R * M, H] back to every owner once its buffer is free (wait_free as in
 * moe_ll_direct_send), ranges [L, R, 2] and bases [R] of the dispatch's handle. resume 0
 * declines (LL_DECLINED) where this rank's FENCE word is set, else clears sent [R]. Returns
 * ll_each_free's, or -(r + 1) for an owner r whose base would put rows outside its combine
 * rows (nothing sent to it; the others were). */
int64_t moe_ll_direct_combine_send(const int64_t *lx, int64_t b, int64_t resume, int64_t seq,
                                   int64_t wait_free, int64_t deadline_ns, const uint8_t *x,
                                   int64_t H, const int64_t *ranges, const int64_t *bases,
                                   uint8_t *sent) {
    if (!resume) {
        if (*LX_PTR(lx, LX_FENCE)) return LL_DECLINED;
        memset(sent, 0, (size_t)lx[LX_R]);
    }
    struct ll_combine c = {lx, b, seq, 2 * H, x, ranges, bases, 0};
    const int64_t rc = ll_each_free(lx, LX_PTR(lx, LX_CFREE_IN + b), wait_free ? seq - 2 : -1,
                                    deadline_ns, sent, ll_combine_to, NULL, &c);
    return c.err ? c.err : rc;
}

/* A low-latency combine's receive half (ll.py combine_recv, every rank active, no LogFMT) on
 * buffer b for call seq, the `steps` asked: every rank's DONE (LL_DIFFER where one says
 * LogFMT: nothing read; LL_LATE at once where this rank's FENCE word is set),
 * then out [T, H] (bf16) = per token the float32 sum of its weighted rows (moe_ll_combine of
 * the n rows from row `shift` of this rank's combine rows, tok / slot its messages; index
 * int64 [n + T + 1], w float32 [n], scratch float32 [2H]), then this rank's FREE push to
 * every rank. Returns LL_OK, LL_AGAIN / LL_LATE / LL_DIFFER, or -1 (a message outside
 * weights [T, K]). */
int64_t moe_ll_direct_combine_recv(const int64_t *lx, int64_t b, int64_t steps, int64_t seq,
                                   int64_t deadline_ns, int64_t shift, const int64_t *tok,
                                   const int64_t *slot, int64_t n, const float *weights,
                                   int64_t T, int64_t K, int64_t H, void *out, int64_t *index,
                                   float *w, float *scratch) {
    const int64_t R = lx[LX_R], me = lx[LX_ME];
    const int64_t *done = LX_PTR(lx, LX_DONE_IN + b);
    if (steps & LL_WAITS) {
        if (*LX_PTR(lx, LX_FENCE)) return LL_LATE;    /* the survivors masked this rank */
        const int64_t rc = lx_wait(lx, done, LX_PTR(lx, LX_NW_ONE), NULL, seq, deadline_ns);
        if (rc != LL_OK) return rc;
        for (int64_t s = 0; s < R; s++)
            if (*(const int64_t *)(intptr_t)done[s] & LL_DONE_LOGFMT) return LL_DIFFER;
    }
    if (!(steps & LL_READS)) return LL_OK;
    const uint8_t *rows = (const uint8_t *)(intptr_t)LX_PTR(lx, LX_COMBINE + b)[me] + shift * H * 2;
    if (moe_ll_combine(rows, 2 * H, tok, slot, n, weights, T, K, H, out, DT_BF16, index, w,
                       scratch))
        return -1;
    const int64_t zero = 0;
    small_signal(R, LX_PTR(lx, LX_CFREE_OUT + b), LX_PTR(lx, LX_BELLS), seq, &zero, 1);
    return LL_OK;
}
