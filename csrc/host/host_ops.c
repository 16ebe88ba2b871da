/* The host backend's per-element loops, in C (moe_comm/host/native.py builds and loads this
 * file with the system C compiler; without one, the same results come from torch).
 *
 * Each function gives the same bits as the torch code it replaces (moe_comm/quant.py,
 * moe_comm/host/reduce.py): float32 arithmetic in the same order, one rounding per operation
 * (the build passes -ffp-contract=off, so no fused multiply-add), round-to-nearest-even
 * conversions. Vectorising over the hidden channels keeps that order per channel.
 *
 * dtype codes: DT_F32 = 0, DT_BF16 = 1 (native.py's DTYPES).
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };

/* Each exported loop is built several times on x86-64, for AVX-512 (x86-64-v4), AVX2 and the
 * baseline, and the loader picks the one the CPU runs (GCC's target_clones): the AVX2 build is
 * 2-3x faster than the baseline (it has vector blends and 8-wide conversions), the AVX-512 one
 * halves the fp8 cast again (16 lanes, byte packing in one instruction, 32 registers: no
 * spills); all give the same bits (same operations per channel, no FMA). GCC names the
 * x86-64-v4 level from version 12 on. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define MOE_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__)
#define MOE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MOE_CLONES
#endif

static inline float bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* bfloat16 is the top half of a float32: widening is a shift, exact */
static inline float bf16_to_f32(uint16_t b) { return bits_to_f32((uint32_t)b << 16); }

/* float32 -> bfloat16, round to nearest even; NaN -> 0x7FC0 (torch's scalar rule) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Row `row` of a [*, hidden] matrix of dtype `dt` as float32 into `dst`. */
static inline void load_row(const void *src, int dt, int64_t hidden, float *dst) {
    if (dt == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t h = 0; h < hidden; h++) dst[h] = bf16_to_f32(s[h]);
    } else {
        memcpy(dst, src, (size_t)hidden * 4);
    }
}

/* Channels a token's sum takes at a time: a float32 accumulator of 256 channels (1 KB) stays
 * in registers and L1 while the token's rows stream through it, so each row is read once and
 * each output written once, with no accumulator row of `hidden` floats to zero, reread and
 * convert (that cost about a third more time with two ranks sharing the memory bandwidth). */
#define SUM_CHUNK 256

/* acc[0, n) += channels [h0, h0 + n) of the row at src (dtype in_dt), each times wt first
 * (rounded, then added) when weighted: the per-channel order of the torch code. */
static inline void add_chunk(float *acc, const void *src, int in_dt, int weighted, float wt,
                             int64_t h0, int64_t n) {
    if (in_dt == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src + h0;
        if (weighted) {
            for (int64_t h = 0; h < n; h++) { float p = bf16_to_f32(s[h]) * wt; acc[h] += p; }
        } else {
            for (int64_t h = 0; h < n; h++) acc[h] += bf16_to_f32(s[h]);
        }
    } else {
        const float *s = (const float *)src + h0;
        if (weighted) {
            for (int64_t h = 0; h < n; h++) { float p = s[h] * wt; acc[h] += p; }
        } else {
            for (int64_t h = 0; h < n; h++) acc[h] += s[h];
        }
    }
}

/* Per-token sums of rows given by address.
 * For token t, the rows are entries [first[t], first[t+1]) of row_addr (each a row of
 * `hidden` channels of dtype in_dt), in the order they are added: acc = 0; acc += w * row
 * (or acc += row without weights); then acc += bias_k[t] for each float32 [T, hidden]
 * bias; out[t] = acc converted to out_dt. Each channel sees exactly these operations; the
 * channels go SUM_CHUNK at a time. `scratch` (float32 [2 * hidden]) is no longer used. */
MOE_CLONES void moe_sum_rows(const int64_t *row_addr, const float *weight, const int64_t *first,
                  int in_dt, int64_t hidden, int64_t num_tokens, const int64_t *bias_addr,
                  int num_bias, void *out, int out_dt, float *scratch) {
    (void)scratch;
    float acc[SUM_CHUNK];
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t h0 = 0; h0 < hidden; h0 += SUM_CHUNK) {
            const int64_t n = hidden - h0 < SUM_CHUNK ? hidden - h0 : SUM_CHUNK;
            for (int64_t h = 0; h < n; h++) acc[h] = 0.0f;
            for (int64_t i = first[t]; i < first[t + 1]; i++)
                add_chunk(acc, (const void *)(intptr_t)row_addr[i], in_dt, weight != NULL,
                          weight ? weight[i] : 1.0f, h0, n);
            for (int k = 0; k < num_bias; k++) {
                const float *b = (const float *)(intptr_t)bias_addr[k] + t * hidden + h0;
                for (int64_t h = 0; h < n; h++) acc[h] += b[h];
            }
            if (out_dt == DT_BF16) {
                uint16_t *o = (uint16_t *)out + t * hidden + h0;
                for (int64_t h = 0; h < n; h++) o[h] = f32_to_bf16(acc[h]);
            } else {
                memcpy((float *)out + t * hidden + h0, acc, (size_t)n * 4);
            }
        }
    }
}

/* reduce.sum_rows_per_token (and the low-latency weighted sum) over segments of rows, the
 * order of the rows found here rather than by torch sorts in Python (a few tenths of a ms a
 * call): segment k is seg[4k .. 4k + 3] = (address of its first row, row stride in bytes,
 * rows, address of its int64 token ids, one per row, in any order). A token's rows are added
 * in segment order, within a segment in row order (a stable counting sort by token), then
 * moe_sum_rows. weight: float32, one per row over all segments in that order, or NULL.
 * index: int64 [rows + num_tokens + 1], w_sorted: float32 [rows] (when weighted). Returns -1
 * (nothing written to out) for a token id outside [0, num_tokens). */
int moe_sum_segments(const int64_t *seg, int64_t num_seg, const float *weight, int in_dt,
                     int64_t hidden, int64_t num_tokens, const int64_t *bias_addr, int num_bias,
                     void *out, int out_dt, int64_t *index, float *w_sorted) {
    int64_t n = 0;
    for (int64_t k = 0; k < num_seg; k++) n += seg[4 * k + 2];
    int64_t *addr = index, *first = index + n;
    for (int64_t t = 0; t <= num_tokens; t++) first[t] = 0;
    for (int64_t k = 0; k < num_seg; k++) {
        const int64_t *ids = (const int64_t *)(intptr_t)seg[4 * k + 3];
        for (int64_t j = 0; j < seg[4 * k + 2]; j++) {
            if (ids[j] < 0 || ids[j] >= num_tokens) return -1;
            first[ids[j] + 1]++;
        }
    }
    for (int64_t t = 0; t < num_tokens; t++) first[t + 1] += first[t];
    /* place each row at its token's cursor (first[t] moves to the token's end, then back) */
    for (int64_t k = 0, i = 0; k < num_seg; k++) {
        const int64_t *ids = (const int64_t *)(intptr_t)seg[4 * k + 3];
        for (int64_t j = 0; j < seg[4 * k + 2]; j++, i++) {
            const int64_t at = first[ids[j]]++;
            addr[at] = seg[4 * k] + j * seg[4 * k + 1];
            if (weight) w_sorted[at] = weight[i];
        }
    }
    for (int64_t t = num_tokens; t > 0; t--) first[t] = first[t - 1];
    first[0] = 0;
    moe_sum_rows(addr, weight ? w_sorted : NULL, first, in_dt, hidden, num_tokens, bias_addr,
                 num_bias, out, out_dt, NULL);
    return 0;
}

#define FP8_BLOCK 128
#define FP8_MAX 448.0f

/* Per-128-channel scales of x [T, hidden] (row stride x_stride elements):
 * max(|x| over the block, 1e-4) / 448 into scales [T, hidden / 128].
 * |x| as the sign-cleared bit pattern: for floats of one sign the bit patterns order as the
 * values do, and NaN patterns lie above infinity, so an integer max is torch's NaN-propagating
 * max(amax, -amin) (the sign of a NaN aside), without a branch. */
MOE_CLONES void moe_fp8_scales(const void *x, int in_dt, int64_t num_tokens, int64_t hidden,
                    int64_t x_stride, float *scales, float *scratch) {
    (void)scratch;
    const int64_t groups = hidden / FP8_BLOCK;
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t g = 0; g < groups; g++) {
            float m;
            if (in_dt == DT_BF16) {
                const uint16_t *v = (const uint16_t *)x + t * x_stride + g * FP8_BLOCK;
                uint16_t top = 0;
                for (int i = 0; i < FP8_BLOCK; i++) {
                    uint16_t a = v[i] & 0x7FFFu;
                    top = a > top ? a : top;
                }
                m = bf16_to_f32(top);
            } else {
                const uint32_t *v = (const uint32_t *)x + t * x_stride + g * FP8_BLOCK;
                uint32_t top = 0;
                for (int i = 0; i < FP8_BLOCK; i++) {
                    uint32_t a = v[i] & 0x7FFFFFFFu;
                    top = a > top ? a : top;
                }
                m = bits_to_f32(top);
            }
            if (m < 1e-4f) m = 1e-4f;            /* NaN stays NaN: the comparison is false */
            scales[t * groups + g] = m / FP8_MAX;
        }
    }
}

/* float32 -> e4m3fn (no infinities; 0x7F is NaN), round to nearest even, for |v| <= 448
 * (the caller clamps), without branches so the loop vectorises. Normal values (2^-6 and
 * up): add 0x7FFFF plus the lowest kept mantissa bit, then keep the top 3 mantissa bits
 * (a carry moves into the exponent, as it should); re-bias the exponent from 127 to 7.
 * Below 2^-6 the value is a multiple of 2^-9: mag * 512 + 2^23 makes the FPU round it to an
 * integer, nearest even (8 = 2^-6 is the first normal code, so both agree at the edge). */
static inline uint8_t f32_to_e4m3(float v) {
    /* signed 32-bit arithmetic (the sign bit is cleared first): it vectorises on plain SSE2 */
    int32_t u = (int32_t)f32_to_bits(v);
    int32_t sign = (u >> 24) & 0x80;
    int32_t a = u & 0x7FFFFFFF;
    int32_t c = a > 0x7F800000 ? 0x7F800000 : a;           /* NaN: no signed overflow below */
    int32_t normal = ((c + 0x7FFFF + ((c >> 20) & 1)) >> 20) - (120 << 3);
    int32_t sub = (int32_t)f32_to_bits(bits_to_f32((uint32_t)c) * 512.0f + 8388608.0f) -
                  0x4B000000;
    int32_t code = a < 0x3C800000 ? sub : normal;             /* 0x3C800000 = 2^-6 */
    code = a > 0x7F800000 ? 0x7F : code;
    return (uint8_t)(sign | code);
}

/* out[t, c] = e4m3(clamp(x[t, c] / scales[t, c / 128], -448, 448)); out rows out_stride
 * bytes apart (a message row), x rows x_stride elements apart. With scales_at >= 0 the row's
 * float32 scales follow at that byte of its out row (a low-latency message: data, scales). */
MOE_CLONES void moe_fp8_cast(const void *x, int in_dt, int64_t num_tokens, int64_t hidden,
                  int64_t x_stride, const float *scales, uint8_t *out, int64_t out_stride,
                  float *scratch, int64_t scales_at) {
    const int64_t groups = hidden / FP8_BLOCK;
    const size_t elem = in_dt == DT_BF16 ? 2 : 4;
    for (int64_t t = 0; t < num_tokens; t++) {
        load_row((const char *)x + t * x_stride * elem, in_dt, hidden, scratch);
        uint8_t *o = out + t * out_stride;
        for (int64_t g = 0; g < groups; g++) {
            const float s = scales[t * groups + g];
            const float *v = scratch + g * FP8_BLOCK;
            for (int i = 0; i < FP8_BLOCK; i++) {
                float q = v[i] / s;
                /* torch.clamp: NaN passes through (both comparisons are false) */
                q = q < -FP8_MAX ? -FP8_MAX : q;
                q = q > FP8_MAX ? FP8_MAX : q;
                o[g * FP8_BLOCK + i] = f32_to_e4m3(q);
            }
        }
        if (scales_at >= 0) memcpy(o + scales_at, scales + t * groups, (size_t)groups * 4);
    }
}

/* dst row dst_rows[i] (or i when dst_rows is NULL) = src row src_rows[i] (or i), nbytes
 * each: a gather and a scatter in one pass (rows stride bytes apart on each side). Every
 * index is checked against src_count / dst_count first: returns -1 (nothing copied) for a
 * source row outside, -2 for a destination row outside, else 0. */
int moe_copy_rows(const uint8_t *src, int64_t src_stride, const int64_t *src_rows,
                  int64_t src_count, uint8_t *dst, int64_t dst_stride, const int64_t *dst_rows,
                  int64_t dst_count, int64_t n, int64_t nbytes) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = src_rows ? src_rows[i] : i, d = dst_rows ? dst_rows[i] : i;
        if (s < 0 || s >= src_count) return -1;
        if (d < 0 || d >= dst_count) return -2;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = src_rows ? src_rows[i] : i, d = dst_rows ? dst_rows[i] : i;
        memcpy(dst + d * dst_stride, src + s * src_stride, (size_t)nbytes);
    }
    return 0;
}

/* A normal dispatch's rows for one destination (exchange.put_rows), in one pass instead of a
 * dozen torch operations per destination: for j < n, token t = ids[j] of this rank's
 * num_tokens gives row j of each of the destination's sub-arrays: its payload (row_bytes of
 * x, rows x_stride bytes apart) into dst_x (row_bytes apart), its scales (scale_bytes of
 * scales, scales_stride apart; none when scale_bytes is 0) into dst_scales, its K top-k ids
 * made local to the destination (id - lo where lo <= id < lo + num_local, else -1) into
 * dst_idx and their weights (0 on the slots made -1; all 0 without topk_w) into dst_w (none
 * when K is 0): layout.local_topk's values. Every id is checked first: returns -1 (nothing
 * written) for a token outside [0, num_tokens), else 0. */
int moe_put_rows(const uint8_t *x, int64_t x_stride, int64_t num_tokens, const int64_t *ids,
                 int64_t n, int64_t row_bytes, const uint8_t *scales, int64_t scales_stride,
                 int64_t scale_bytes, const int64_t *topk_idx, const float *topk_w, int64_t K,
                 int64_t lo, int64_t num_local, uint8_t *dst_x, uint8_t *dst_scales,
                 int64_t *dst_idx, float *dst_w) {
    for (int64_t j = 0; j < n; j++)
        if (ids[j] < 0 || ids[j] >= num_tokens) return -1;
    for (int64_t j = 0; j < n; j++)
        memcpy(dst_x + j * row_bytes, x + ids[j] * x_stride, (size_t)row_bytes);
    if (scale_bytes)
        for (int64_t j = 0; j < n; j++)
            memcpy(dst_scales + j * scale_bytes, scales + ids[j] * scales_stride,
                   (size_t)scale_bytes);
    for (int64_t j = 0; j < n && K; j++) {
        const int64_t *e = topk_idx + ids[j] * K;
        for (int64_t k = 0; k < K; k++) {
            const int64_t local = e[k] - lo;
            const int mine = e[k] >= 0 && local >= 0 && local < num_local;
            dst_idx[j * K + k] = mine ? local : -1;
            dst_w[j * K + k] = mine && topk_w ? topk_w[ids[j] * K + k] : 0.0f;
        }
    }
    return 0;
}

/* ---- Low-latency mode: each phase of a call in one C call (moe_comm/host/ll.py) ----------
 * A low-latency call moves few bytes; as torch operations its bookkeeping (sorts, index
 * tensors, one small copy per expert) cost ~1 ms of Python per call, several times the copies
 * themselves. These functions do a phase's index arithmetic and its copies in one pass. */

/* The sender's sort: its (token, slot) messages ordered by expert, then token, then slot (a
 * counting sort of topk [T, K]; -1 slots send nothing), what torch's stable sort by expert of
 * the (token, slot) pairs in row order gives. counts [E]: messages per expert; first [E + 1]:
 * where each expert's messages start (first[E] = all); tok, slot [T * K]: the messages.
 * Returns the number of messages, or -1 (tok/slot untouched) for an id outside [-1, E). */
int64_t moe_ll_route(const int64_t *topk, int64_t T, int64_t K, int64_t E, int64_t *counts,
                     int64_t *first, int64_t *tok, int64_t *slot) {
    for (int64_t e = 0; e < E; e++) counts[e] = 0;
    for (int64_t i = 0; i < T * K; i++) {
        const int64_t e = topk[i];
        if (e < -1 || e >= E) return -1;
        if (e >= 0) counts[e]++;
    }
    first[0] = 0;                      /* first[e + 1]: expert e's cursor, then its end */
    for (int64_t e = 0; e < E; e++) first[e + 1] = e ? first[e] + counts[e - 1] : 0;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = topk[t * K + k];
            if (e < 0) continue;
            const int64_t at = first[e + 1]++;
            tok[at] = t;
            slot[at] = k;
        }
    }
    return first[E];
}

/* The send to one rank: the messages of its experts [e_lo, e_lo + num_local) (tok, slot, first
 * from moe_ll_route), each message row of msgs (nbytes of it) into the receiver's block
 * [le][me]: row (le * R + me) * M + its place among the expert's messages, and its meta
 * (token << 8 | slot) into the same row of meta. Returns -1 (nothing written) when an expert
 * has more than M messages (they would run into the next block). */
int moe_ll_send(const uint8_t *msgs, int64_t msg_stride, int64_t nbytes, const int64_t *tok,
                const int64_t *slot, const int64_t *first, int64_t e_lo, int64_t num_local,
                int64_t R, int64_t me, int64_t M, uint8_t *payload, int64_t payload_stride,
                int64_t *meta) {
    for (int64_t le = 0; le < num_local; le++)
        if (first[e_lo + le + 1] - first[e_lo + le] > M) return -1;
    for (int64_t le = 0; le < num_local; le++) {
        const int64_t lo = first[e_lo + le], hi = first[e_lo + le + 1];
        const int64_t row0 = (le * R + me) * M;
        for (int64_t i = lo; i < hi; i++) {
            memcpy(payload + (row0 + i - lo) * payload_stride, msgs + tok[i] * msg_stride,
                   (size_t)nbytes);
            meta[row0 + i - lo] = tok[i] << 8 | slot[i];
        }
    }
    return 0;
}

/* A receive that packs at least this many bytes writes them with non-temporal stores (see
 * copy_stream); smaller ones stay in the cache, where the caller reads them next. */
#ifndef STREAM_MIN_BYTES
#define STREAM_MIN_BYTES (2 << 20)
#endif

/* memcpy for output written once and not read back during the call: non-temporal stores
 * where the CPU has them (x86-64: SSE2), which skip reading the destination's lines into
 * the cache first and leave the cache to what the call reads (the peers' messages). 25-30%
 * faster than memcpy for the rows of a large receive. The caller ends with stream_done(). */
static inline void copy_stream(uint8_t *d, const uint8_t *s, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;          /* to a 16-byte boundary */
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        const __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    for (; i + 16 <= n; i += 16)
        _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    memcpy(d + i, s + i, n - i);
#else
    memcpy(d, s, n);
#endif
}

/* Non-temporal stores are weakly ordered: fence them before anything that follows. */
static inline void stream_done(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* The receive: each local expert's rows, source by source, from the blocks [le][src] of this
 * rank's region (payload rows `stride` bytes apart, meta beside) packed into recv_x
 * [L][R * M] (x_bytes per row), with their scales (scale_bytes at byte scales_at of a message,
 * into recv_scales rows; none when recv_scales is NULL) and meta (recv_meta [L][R * M], -1
 * past an expert's rows). counts [R][count_stride]: source src's count for each local expert
 * (its row as received). Fills ranges [L][R][2] (first packed row, count) and per_expert [L].
 * own_msgs (or NULL): the rows this rank sent itself were not copied into its region; they
 * are read from its own messages instead (own_msgs rows own_stride bytes apart; own_tok,
 * own_slot its sorted messages, own_first [L + 1] where its messages to each local expert
 * start: moe_ll_route's, from its first local expert on). Returns -1 (nothing copied) when a
 * count lies outside [0, M], -2 when this rank's own count row disagrees with own_first. */
int moe_ll_recv(const uint8_t *payload, int64_t stride, const int64_t *meta,
                const int64_t *counts, int64_t count_stride, int64_t L, int64_t R, int64_t M,
                uint8_t *recv_x, int64_t x_bytes, uint8_t *recv_scales, int64_t scale_bytes,
                int64_t scales_at, int64_t *recv_meta, int64_t *ranges, int64_t *per_expert,
                int64_t me, const uint8_t *own_msgs, int64_t own_stride, const int64_t *own_tok,
                const int64_t *own_slot, const int64_t *own_first) {
    int64_t total = 0;
    for (int64_t src = 0; src < R; src++)
        for (int64_t le = 0; le < L; le++) {
            const int64_t c = counts[src * count_stride + le];
            if (c < 0 || c > M) return -1;
            if (own_msgs && src == me && c != own_first[le + 1] - own_first[le]) return -2;
            total += c;
        }
    const int stream = total * x_bytes >= STREAM_MIN_BYTES;
    for (int64_t le = 0; le < L; le++) {
        int64_t packed = le * R * M;
        const int64_t start = packed;
        for (int64_t src = 0; src < R; src++) {
            const int64_t c = counts[src * count_stride + le];
            const int64_t row0 = (le * R + src) * M;
            const int own = own_msgs && src == me;
            ranges[(le * R + src) * 2] = packed - start;
            ranges[(le * R + src) * 2 + 1] = c;
            for (int64_t i = 0; i < c; i++, packed++) {
                const int64_t m = own ? own_first[le] + i : 0;
                const uint8_t *msg = own ? own_msgs + own_tok[m] * own_stride
                                         : payload + (row0 + i) * stride;
                if (stream)
                    copy_stream(recv_x + packed * x_bytes, msg, (size_t)x_bytes);
                else
                    memcpy(recv_x + packed * x_bytes, msg, (size_t)x_bytes);
                if (recv_scales)
                    memcpy(recv_scales + packed * scale_bytes, msg + scales_at,
                           (size_t)scale_bytes);
                recv_meta[packed] = own ? own_tok[m] << 8 | own_slot[m] : meta[row0 + i];
            }
        }
        per_expert[le] = packed - start;
        for (; packed < start + R * M; packed++) recv_meta[packed] = -1;
    }
    if (stream) stream_done();
    return 0;
}

/* The combine's return of an expert rank's rows to one owner: for each local expert le in
 * turn, its rows from that owner, [le * rows_per_expert + first, + count) of src (src_count
 * rows, src_stride bytes apart; (first, count) = ranges[le][owner], ranges [L][R][2] as
 * moe_ll_recv filled it), to the next rows of dst (dst_count rows); nbytes each. Returns -1
 * (nothing copied) when a run leaves src, -2 when dst has too few rows. */
int moe_ll_return(const uint8_t *src, int64_t src_stride, int64_t src_count,
                  const int64_t *ranges, int64_t L, int64_t R, int64_t owner,
                  int64_t rows_per_expert, uint8_t *dst, int64_t dst_stride, int64_t dst_count,
                  int64_t nbytes) {
    int64_t total = 0;
    for (int64_t le = 0; le < L; le++) {
        const int64_t first = ranges[(le * R + owner) * 2], c = ranges[(le * R + owner) * 2 + 1];
        if (first < 0 || c < 0 || first + c > rows_per_expert ||
            le * rows_per_expert + first + c > src_count) return -1;
        total += c;
    }
    if (total > dst_count) return -2;
    for (int64_t le = 0, at = 0; le < L; le++) {
        const int64_t first = ranges[(le * R + owner) * 2], c = ranges[(le * R + owner) * 2 + 1];
        const uint8_t *from = src + (le * rows_per_expert + first) * src_stride;
        if (src_stride == nbytes && dst_stride == nbytes) {      /* one run, one copy */
            memcpy(dst + at * dst_stride, from, (size_t)(c * nbytes));
        } else {
            for (int64_t j = 0; j < c; j++)
                memcpy(dst + (at + j) * dst_stride, from + j * src_stride, (size_t)nbytes);
        }
        at += c;
    }
    return 0;
}

/* The combine's sum: out [T, hidden] (out_dt) = per token t, the float32 sum over the rows i
 * of token tok[i], in row order, of weights[tok[i], slot[i]] * row i (rows: n of `hidden`
 * bf16, row_stride bytes apart; weights float32 [T, K]): moe_sum_rows's weighted sum, with
 * the rows found by a stable counting sort by token. `index` int64 [n + T + 1], `w` float32
 * [n], scratch float32 [2 * hidden]. Returns -1 (nothing written) for a token or slot out of
 * range. */
int moe_ll_combine(const uint8_t *rows, int64_t row_stride, const int64_t *tok,
                   const int64_t *slot, int64_t n, const float *weights, int64_t T, int64_t K,
                   int64_t hidden, void *out, int out_dt, int64_t *index, float *w,
                   float *scratch) {
    int64_t *addr = index, *first = index + n;
    for (int64_t t = 0; t <= T; t++) first[t] = 0;
    for (int64_t i = 0; i < n; i++) {
        if (tok[i] < 0 || tok[i] >= T || slot[i] < 0 || slot[i] >= K) return -1;
        first[tok[i] + 1]++;
    }
    for (int64_t t = 0; t < T; t++) first[t + 1] += first[t];
    /* place row i at its token's cursor (first[t] moves to the token's end, then back) */
    for (int64_t i = 0; i < n; i++) {
        const int64_t at = first[tok[i]]++;
        addr[at] = (int64_t)(intptr_t)(rows + i * row_stride);
        w[at] = weights[tok[i] * K + slot[i]];
    }
    for (int64_t t = T; t > 0; t--) first[t] = first[t - 1];
    first[0] = 0;
    moe_sum_rows(addr, w, first, DT_BF16, hidden, T, NULL, 0, out, out_dt, scratch);
    return 0;
}
