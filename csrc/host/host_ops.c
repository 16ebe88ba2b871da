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

/* A receive that packs at least this many bytes, a combine that returns as many to one
 * owner, and a normal dispatch's payload for one destination write them with non-temporal
 * stores (see copy_stream); smaller ones stay in the cache, where the caller (or the owner's
 * sum) reads them next. */
#ifndef STREAM_MIN_BYTES
#define STREAM_MIN_BYTES (2 << 20)
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define MOE_AVX512_STREAM 1
#include <immintrin.h>
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

/* Whether the CPU has what the AVX-512 versions use: F (the copies), F/BW/VL/DQ (the fp8
 * cast and the sums) */
static int cpu_has_avx512f(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

static int cpu_has_avx512bw(void) {
    __builtin_cpu_init();
    return cpu_has_avx512f() && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

/* An AVX-512 version's setting: -1 until first asked (then whether the CPU has it), 0 off
 * (a test's switch), 1 on */
static inline int avx512_on(int *setting, int (*cpu_has)(void)) {
    if (__builtin_expect(*setting < 0, 0)) *setting = cpu_has();
    return *setting;
}

/* The tests' switch of a version (moe_stream_avx512, moe_sum_avx512, moe_fp8_avx512): on =
 * 0 turns it off, 1 back on where the CPU has it, -1 only asks. Returns the setting now. */
#define AVX512_SWITCH(name, setting, cpu_has) \
    int name(int on) { \
        if (on == 0) setting = 0; \
        if (on == 1) setting = -1; \
        return avx512_on(&setting, cpu_has); \
    }

/* 16 inputs (bf16 or float32) as float32 */
AVX512_TARGET static inline __m512 load16(const void *x, int in_dt) {
    if (in_dt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
    return _mm512_loadu_ps((const float *)x);
}
#else
#define AVX512_SWITCH(name, setting, cpu_has) \
    int name(int on) { \
        (void)on; \
        return 0; \
    }
#endif
#ifdef MOE_AVX512_STREAM

/* copy_stream with 64-byte stores, each a whole line: a low-latency receive's pack of
 * 7 KB rows (4 ranks, 128 x 7168 fp8) took 7-12% less of the dispatch's time than with
 * 16-byte ones, calls alternating in one run; one large copy is as fast either way. */
__attribute__((target("avx512f"))) static void copy_stream_avx512(uint8_t *d, const uint8_t *s,
                                                                   size_t n) {
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;          /* to a line boundary */
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64)
        _mm512_stream_si512((__m512i *)(d + i), _mm512_loadu_si512((const void *)(s + i)));
    memcpy(d + i, s + i, n - i);
}

/* whether copy_stream uses 64-byte stores (tests check both versions' bytes) */
static int stream_avx512 = -1;
#endif
AVX512_SWITCH(moe_stream_avx512, stream_avx512, cpu_has_avx512f)

/* memcpy for output written once and not read back during the call: non-temporal stores
 * where the CPU has them (x86-64: SSE2, or AVX-512's whole lines), which skip reading the
 * destination's lines into the cache first and leave the cache to what the call reads (the
 * peers' messages). 25-30% faster than memcpy for the rows of a large receive. The caller
 * ends with stream_done(). */
static inline void copy_stream(uint8_t *d, const uint8_t *s, size_t n) {
#ifdef MOE_AVX512_STREAM
    if (avx512_on(&stream_avx512, cpu_has_avx512f)) {
        copy_stream_avx512(d, s, n);
        return;
    }
#endif
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

/* STREAM_MIN_BYTES, for native.py (which checks its own copy against it). */
int64_t moe_stream_min_bytes(void) { return STREAM_MIN_BYTES; }

/* copy_stream where `stream` (a run of at least STREAM_MIN_BYTES in all), else memcpy. */
static inline void copy_run(uint8_t *d, const uint8_t *s, size_t n, int stream) {
    if (stream)
        copy_stream(d, s, n);
    else
        memcpy(d, s, n);
}

/* Channels a token's sum takes at a time: a float32 accumulator of 256 channels (1 KB) stays
 * in registers and L1 while the token's rows stream through it, so each row is read once and
 * each output written once, with no accumulator row of `hidden` floats to zero, reread and
 * convert (that cost about a third more time with two ranks sharing the memory bandwidth). */
#define SUM_CHUNK 256

/* Channel h of the row at src (bfloat16 when bf16, else float32) as float32, times wt
 * (rounded) when weighted: one term of a token's sum, as the torch code forms it. Inlined
 * with constant flags, so each dtype and weighting gets a loop of its own. */
#define ALWAYS_INLINE inline __attribute__((always_inline))
static ALWAYS_INLINE float term(const void *src, int bf16, int weighted, float wt, int64_t h) {
    const float v = bf16 ? bf16_to_f32(((const uint16_t *)src)[h]) : ((const float *)src)[h];
    if (!weighted) return v;
    const float p = v * wt;
    return p;
}

/* out[h] for h < n from a float32 accumulator value (out_dt bf16 or float32). */
static ALWAYS_INLINE void put_out(void *out, int out_bf16, int64_t h, float v) {
    if (out_bf16)
        ((uint16_t *)out)[h] = f32_to_bf16(v);
    else
        ((float *)out)[h] = v;
}

/* Channels [h0, h0 + n) of one token's sum: acc = 0, + each of its `rows` rows' terms (rows
 * at addr, weights wt), + each float32 bias row (bias_at elements into each), then into out
 * (already at the token's channel h0). Rows are taken two at a time, and a token of at most
 * two rows and no bias (every token of a two-rank combine) goes straight to out: each pass
 * over the chunk reads and writes the accumulator once, not once per row. The sum was
 * compute-bound that way: 1024 tokens of 2 x 7168 bf16 rows took 2.7 ms in one process,
 * 2.0 ms now. Each channel still sees exactly acc = 0, acc += t0, acc += t1, ...,
 * acc += bias, in that order. */
static ALWAYS_INLINE void sum_chunk(const int64_t *addr, const float *wt, int64_t rows,
                                    int bf16, int weighted, const int64_t *bias_addr,
                                    int num_bias, int64_t bias_at, int64_t h0, int64_t n,
                                    void *out, int out_bf16, float *acc) {
#define ROW(i) ((const void *)(intptr_t)addr[i])
#define W(i) (weighted ? wt[i] : 1.0f)
#define TERM(i, h) term(ROW(i), bf16, weighted, W(i), h0 + (h))
    if (num_bias == 0 && rows <= 2) {
        if (rows == 0)
            for (int64_t h = 0; h < n; h++) put_out(out, out_bf16, h, 0.0f);
        else if (rows == 1)
            for (int64_t h = 0; h < n; h++) put_out(out, out_bf16, h, 0.0f + TERM(0, h));
        else
            for (int64_t h = 0; h < n; h++)
                put_out(out, out_bf16, h, (0.0f + TERM(0, h)) + TERM(1, h));
        return;
    }
    int64_t i = 0;
    if (rows >= 2) {
        for (int64_t h = 0; h < n; h++) acc[h] = (0.0f + TERM(0, h)) + TERM(1, h);
        i = 2;
    } else if (rows == 1) {
        for (int64_t h = 0; h < n; h++) acc[h] = 0.0f + TERM(0, h);
        i = 1;
    } else {
        for (int64_t h = 0; h < n; h++) acc[h] = 0.0f;
    }
    for (; i + 2 <= rows; i += 2)
        for (int64_t h = 0; h < n; h++) acc[h] = (acc[h] + TERM(i, h)) + TERM(i + 1, h);
    if (i < rows)
        for (int64_t h = 0; h < n; h++) acc[h] += TERM(i, h);
    for (int k = 0; k < num_bias; k++) {
        const float *b = (const float *)(intptr_t)bias_addr[k] + bias_at + h0;
        for (int64_t h = 0; h < n; h++) acc[h] += b[h];
    }
    for (int64_t h = 0; h < n; h++) put_out(out, out_bf16, h, acc[h]);
#undef TERM
#undef W
#undef ROW
}

/* ---- The per-token sums with AVX-512 intrinsics (x86-64 with GCC or clang) ---------------
 * sum_chunk's loops, vectorised by the compiler, ran a two-rank combine's sum (1024 tokens of
 * 2 x 7168 bf16 rows) at about three quarters of a copy's memory traffic: the accumulator
 * goes through L1 between row pairs, each output value through a staging row. Here a token's
 * 128 channels stay in 8 registers while its rows are added, and their bf16 (or float32)
 * results go straight to out. Per channel the same operations in the same order: acc = 0 +
 * term(row 0), + term(row 1), ..., + each bias; term = v or the rounded v * w. */
#ifdef MOE_AVX512_STREAM
#define SUM_LANES 128

/* whether the sums use it (tests check both versions' bits) */
static int sum_avx512 = -1;

/* f32_to_bf16 of 16 lanes: round to nearest even, NaN -> 0x7FC0 */
AVX512_TARGET static inline __m256i sum_bf16_16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(
        u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

/* Channels [h0, h0 + 16 * lanes) of one token's sum (sum_token_avx512), inlined with a
 * constant `lanes` for whole chunks so that the accumulators stay in registers. */
AVX512_TARGET static ALWAYS_INLINE void sum_lanes_avx512(
        const int64_t *addr, const float *wt, int64_t rows, int bf16, int weighted,
        const int64_t *bias_addr, int num_bias, int64_t bias_at, int64_t h0, const int lanes,
        void *out, int out_bf16, int stream) {
    const int64_t in_elem = bf16 ? 2 : 4;
    __m512 acc[SUM_LANES / 16];
    for (int j = 0; j < lanes; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; i++) {
        const char *row = (const char *)(intptr_t)addr[i] + h0 * in_elem;
        const __m512 w = _mm512_set1_ps(weighted ? wt[i] : 1.0f);
        for (int j = 0; j < lanes; j++) {
            __m512 v = load16(row + j * 16 * in_elem, bf16 ? DT_BF16 : DT_F32);
            if (weighted) v = _mm512_mul_ps(v, w);
            acc[j] = _mm512_add_ps(acc[j], v);
        }
    }
    for (int k = 0; k < num_bias; k++) {
        const float *b = (const float *)(intptr_t)bias_addr[k] + bias_at + h0;
        for (int j = 0; j < lanes; j++)
            acc[j] = _mm512_add_ps(acc[j], _mm512_loadu_ps(b + j * 16));
    }
    if (out_bf16) {
        /* two registers' bf16 to a whole 64-byte line: AMD's non-temporal stores of half
         * lines each took a trip to memory of their own (2.5x slower sums) */
        __m512i *o = (__m512i *)((uint16_t *)out + h0);
        int j = 0;
        for (; j + 2 <= lanes; j += 2) {
            const __m512i pair = _mm512_inserti64x4(
                _mm512_castsi256_si512(sum_bf16_16(acc[j])), sum_bf16_16(acc[j + 1]), 1);
            if (stream) _mm512_stream_si512(o + j / 2, pair);
            else _mm512_storeu_si512(o + j / 2, pair);
        }
        if (j < lanes)          /* (not when streaming: its rows are whole lines) */
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + h0) + j, sum_bf16_16(acc[j]));
    } else {
        float *o = (float *)out + h0;
        for (int j = 0; j < lanes; j++) {
            if (stream) _mm512_stream_ps(o + j * 16, acc[j]);
            else _mm512_storeu_ps(o + j * 16, acc[j]);
        }
    }
}

/* One token's sum, all `hidden` channels (a multiple of 16), into out (its row): rows at
 * addr (weights wt when weighted), then the float32 biases (bias_at elements into each).
 * stream: non-temporal stores (out's row aligned for them). next: the next token's rows, to
 * prefetch chunk by chunk. */
AVX512_TARGET static ALWAYS_INLINE void sum_token_avx512(const int64_t *addr, const float *wt,
                                               int64_t rows, int bf16, int weighted,
                                               const int64_t *bias_addr, int num_bias,
                                               int64_t bias_at, int64_t hidden, void *out,
                                               int out_bf16, int stream, const int64_t *next,
                                               int64_t next_rows) {
    const int64_t in_elem = bf16 ? 2 : 4;
    int64_t h0 = 0;
    for (; h0 < hidden; h0 += SUM_LANES) {
        const int64_t n = hidden - h0 < SUM_LANES ? hidden - h0 : SUM_LANES;
        for (int64_t i = 0; i < next_rows; i++) {
            const char *p = (const char *)(intptr_t)next[i] + h0 * in_elem;
            for (int64_t b = 0; b < n * in_elem; b += 64) __builtin_prefetch(p + b, 0, 3);
        }
        if (n == SUM_LANES)
            sum_lanes_avx512(addr, wt, rows, bf16, weighted, bias_addr, num_bias, bias_at, h0,
                             SUM_LANES / 16, out, out_bf16, stream);
        else
            sum_lanes_avx512(addr, wt, rows, bf16, weighted, bias_addr, num_bias, bias_at, h0,
                             (int)n / 16, out, out_bf16, stream);
    }
}

/* moe_sum_rows with sum_token_avx512, one loop per input dtype and weighting (constant
 * flags: no branches in the channel loops). */
AVX512_TARGET static void sum_rows_avx512(const int64_t *row_addr, const float *weight,
                                              const int64_t *first, int bf16, int64_t hidden,
                                              int64_t num_tokens, const int64_t *bias_addr,
                                              int num_bias, void *out, int out_bf16,
                                              int stream) {
    const size_t out_elem = out_bf16 ? 2 : 4;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t *next = t + 1 < num_tokens ? row_addr + first[t + 1] : NULL;
        const int64_t next_rows = next ? first[t + 2] - first[t + 1] : 0;
        void *o = (char *)out + (size_t)(t * hidden) * out_elem;
#define SUM_TOKEN_AS(B, WD) \
    sum_token_avx512(row_addr + first[t], WD ? weight + first[t] : NULL, \
                     first[t + 1] - first[t], B, WD, bias_addr, num_bias, t * hidden, hidden, \
                     o, out_bf16, stream, next, next_rows)
        if (bf16 && !weight) SUM_TOKEN_AS(1, 0);
        else if (bf16) SUM_TOKEN_AS(1, 1);
        else if (!weight) SUM_TOKEN_AS(0, 0);
        else SUM_TOKEN_AS(0, 1);
#undef SUM_TOKEN_AS
    }
    if (stream) stream_done();
}
#endif

AVX512_SWITCH(moe_sum_avx512, sum_avx512, cpu_has_avx512bw)

/* GCC's unroll-and-jam (-O3) merged two passes of sum_chunk's row-pair loop into one scalar
 * loop over four rows wherever a token has more than 7 (every token of a top-8 low-latency
 * combine), in place of the vectorised pair loop: the sums ran at ~10 GB/s from memory, a
 * third of that speed. Off for the sums (the bits are the same either way). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-loop-unroll-and-jam")
#endif

/* Per-token sums of rows given by address.
 * For token t, the rows are entries [first[t], first[t+1]) of row_addr (each a row of
 * `hidden` channels of dtype in_dt), in the order they are added: acc = 0; acc += w * row
 * (or acc += row without weights); then acc += bias_k[t] for each float32 [T, hidden]
 * bias; out[t] = acc converted to out_dt. Each channel sees exactly these operations; the
 * channels go SUM_CHUNK at a time (sum_chunk). stream: out written with non-temporal stores. */
MOE_CLONES static void sum_rows(const int64_t *row_addr, const float *weight,
                                const int64_t *first, int in_dt, int64_t hidden,
                                int64_t num_tokens, const int64_t *bias_addr, int num_bias,
                                void *out, int out_dt, int stream) {
    float acc[SUM_CHUNK];
    const int bf16 = in_dt == DT_BF16, out_bf16 = out_dt == DT_BF16;
    const size_t out_elem = out_bf16 ? 2 : 4;
    const int64_t in_elem = bf16 ? 2 : 4;
    uint8_t staged[SUM_CHUNK * 4] __attribute__((aligned(64)));
#ifdef MOE_AVX512_STREAM
    /* its non-temporal stores write whole 64-byte lines: out's rows must start on them */
    if (hidden % 16 == 0 && avx512_on(&sum_avx512, cpu_has_avx512bw) &&
        (!stream || ((uintptr_t)out % 64 == 0 && (hidden * (int64_t)out_elem) % 64 == 0))) {
        sum_rows_avx512(row_addr, weight, first, bf16, hidden, num_tokens, bias_addr,
                        num_bias, out, out_bf16, stream);
        return;
    }
#endif
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t *addr = row_addr + first[t], rows = first[t + 1] - first[t];
        const float *wt = weight ? weight + first[t] : NULL;
        const int64_t *next = t + 1 < num_tokens ? row_addr + first[t + 1] : NULL;
        const int64_t next_rows = next ? first[t + 2] - first[t + 1] : 0;
        for (int64_t h0 = 0; h0 < hidden; h0 += SUM_CHUNK) {
            const int64_t n = hidden - h0 < SUM_CHUNK ? hidden - h0 : SUM_CHUNK;
            char *o0 = (char *)out + (size_t)(t * hidden + h0) * out_elem;
            void *o = stream ? (void *)staged : (void *)o0;
            for (int64_t j = 0; j < next_rows; j++) {
                const char *p = (const char *)(intptr_t)next[j] + h0 * in_elem;
                for (int64_t b = 0; b < n * in_elem; b += 64) __builtin_prefetch(p + b, 0, 3);
            }
            /* one loop nest per input dtype, weighting and output dtype: constant flags */
#define SUM_CHUNK_AS(B, WD, OB) \
    sum_chunk(addr, wt, rows, B, WD, bias_addr, num_bias, t * hidden, h0, n, o, OB, acc)
            if (bf16 && !weight && out_bf16) SUM_CHUNK_AS(1, 0, 1);
            else if (bf16 && !weight) SUM_CHUNK_AS(1, 0, 0);
            else if (bf16 && out_bf16) SUM_CHUNK_AS(1, 1, 1);
            else if (bf16) SUM_CHUNK_AS(1, 1, 0);
            else if (!weight && out_bf16) SUM_CHUNK_AS(0, 0, 1);
            else if (!weight) SUM_CHUNK_AS(0, 0, 0);
            else if (out_bf16) SUM_CHUNK_AS(0, 1, 1);
            else SUM_CHUNK_AS(0, 1, 0);
#undef SUM_CHUNK_AS
            if (stream) copy_stream((uint8_t *)o0, staged, (size_t)n * out_elem);
        }
    }
    if (stream) stream_done();
}

/* sum_rows with non-temporal stores where out is at least STREAM_MIN_BYTES (a sum in pieces,
 * csrc/host/ring.c, decides for the whole output instead). `scratch` is no longer used. */
MOE_CLONES void moe_sum_rows(const int64_t *row_addr, const float *weight, const int64_t *first,
                  int in_dt, int64_t hidden, int64_t num_tokens, const int64_t *bias_addr,
                  int num_bias, void *out, int out_dt, float *scratch) {
    (void)scratch;
    sum_rows(row_addr, weight, first, in_dt, hidden, num_tokens, bias_addr, num_bias, out,
             out_dt, (size_t)(num_tokens * hidden) * (out_dt == DT_BF16 ? 2 : 4) >=
             STREAM_MIN_BYTES);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

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

/* ---- The fp8 cast with AVX-512 intrinsics (x86-64 with GCC or clang) ---------------------
 * The compiler's vectorisation of the scalar loop below spends most of its time outside the
 * arithmetic (a float32 copy of the row, byte packing by shuffles: ~550 us for 128 x 7168).
 * This version keeps 16 values in registers from the bf16 or float32 input to the 16 e4m3
 * bytes (one vpmovdb): ~220 us, the same operations per value, so the same bits. It still
 * divides: the divider is not what bounds it (a multiplication by 1 / s saved 10%, and made
 * exact - with a check near rounding edges, or one FMA correction - it was slower); the
 * operations per lane are, and e4m3_16_normal has fewer. */
#ifdef MOE_AVX512_STREAM
#define MOE_AVX512_CAST 1

/* f32_to_e4m3 of clamp(q, -448, 448) for 16 lanes, as bytes: the clamp on the magnitude's
 * bits (448 = 0x43E00000; a NaN's bits lie above it, and it is replaced by 0x7F anyway) */
AVX512_TARGET static inline __m128i e4m3_16(__m512 q) {
    const __m512i u = _mm512_castps_si512(q);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i c = _mm512_min_epi32(a, _mm512_set1_epi32(0x43E00000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(c, 20), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(0x7FFFF)), odd);
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(up, 20),
                                            _mm512_set1_epi32(120 << 3));
    const __m512 scaled = _mm512_add_ps(_mm512_mul_ps(_mm512_castsi512_ps(c),
                                                      _mm512_set1_ps(512.0f)),
                                        _mm512_set1_ps(8388608.0f));
    const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(scaled),
                                         _mm512_set1_epi32(0x4B000000));
    const __mmask16 small = _mm512_cmplt_epi32_mask(c, _mm512_set1_epi32(0x3C800000));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000));
    __m512i code = _mm512_mask_blend_epi32(small, normal, sub);
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7F));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}

/* e4m3_16 for lanes whose magnitude lies in [2^-6, 464] (normal codes, no clamp): the same
 * bytes in 8 operations fewer. Up to 464 the rounding to 3 mantissa bits gives 448 (464 is
 * the tie between 448 and 480, and 448's last bit is even), as the clamp does; a block's
 * largest value divided by its scale lands a few ulps either side of 448, so a bound at 448
 * cast a block twice where it landed above (6% of torch.randn blocks, 32% of uniform ones;
 * 128 x 7168 bf16: 107 against 94 us, and 163 against 91 for uniform values). A lane
 * outside that range is added to *special, and its byte is wrong: the caller casts that
 * block again with e4m3_16. */
/* The lanes of magnitude bits a that the short paths cannot cast: a - 2^-6 as unsigned
 * above 464 - 2^-6 (below 2^-6, where it wraps, above 464, or NaN) */
AVX512_TARGET static inline __mmask16 e4m3_special(__m512i a) {
    return _mm512_cmpgt_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(0x3C800000)),
                                   _mm512_set1_epi32(0x43E80000 - 0x3C800000));
}

AVX512_TARGET static inline __m128i e4m3_16_normal(__m512 q, __mmask16 *special) {
    const __m512i u = _mm512_castps_si512(q);
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    *special |= e4m3_special(a);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF)), odd);
    const __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(up, 20),
                                          _mm512_set1_epi32(120 << 3));
    /* code | (u >> 24 & 0x80): the sign, in one ternary-logic operation */
    return _mm512_cvtepi32_epi8(_mm512_ternarylogic_epi32(
        code, _mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80), 0xF8));
}

/* e4m3_16_normal's code of each lane of q (|q| in [2^-6, 464]; others added to *special)
 * shifted left by 20, and q's bits in *u. The rounding to 3 mantissa bits is the FPU's:
 * |q| + 2^(e+20), e the exponent of |q|, keeps 3 bits of its mantissa, rounded to nearest
 * even, and taking 2^(e+20) away again is exact; the code is then the rounded bits less
 * those of 2^-7 (bias 7 against 127). Both with the rounding in the instruction, not the
 * thread's MXCSR: a caller's fesetround(FE_UPWARD) would turn 449 into NaN's code. */
AVX512_TARGET static inline __m512i e4m3_code20(__m512 q, __m512i *u, __mmask16 *special) {
    *u = _mm512_castps_si512(q);
    const __m512i a = _mm512_and_si512(*u, _mm512_set1_epi32(0x7FFFFFFF));
    *special |= e4m3_special(a);
    const __m512 c = _mm512_castsi512_ps(_mm512_add_epi32(
        _mm512_and_si512(a, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(20 << 23)));
#define NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    const __m512 r = _mm512_sub_round_ps(_mm512_add_round_ps(_mm512_castsi512_ps(a), c, NEAREST),
                                         c, NEAREST);
#undef NEAREST
    return _mm512_sub_epi32(_mm512_castps_si512(r), _mm512_set1_epi32(120 << 23));
}

/* e4m3_16_normal's bytes of 32 bf16 inputs divided by s, from one 64-byte load: the even
 * inputs (the low halves of its 32-bit lanes) become floats with one shift and the odd ones
 * with one mask, where load16 spends a widening shuffle and a shift on 16; their codes, each
 * with its sign, meet in 16-bit lanes packed by one vpmovdw. The shift and shuffle units
 * bound this loop: 128 x 7168 in ~78 us against ~91 with e4m3_16_normal (the same bytes:
 * every bf16 at 8 scales). */
AVX512_TARGET static inline __m256i e4m3_32_bf16_normal(const char *in, __m512 s,
                                                        __mmask16 *special) {
    const __m512i v = _mm512_loadu_si512((const void *)in);
    __m512i ue, uo;
    const __m512i even = e4m3_code20(
        _mm512_div_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), s), &ue, special);
    const __m512i odd = e4m3_code20(
        _mm512_div_ps(_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(
            (int)0xFFFF0000))), s), &uo, special);
    /* (code | sign << 7) in bits 0-7 for the even inputs, in bits 8-15 for the odd ones */
    const __m512i lo = _mm512_ternarylogic_epi32(_mm512_srli_epi32(even, 20),
                                                 _mm512_srli_epi32(ue, 24),
                                                 _mm512_set1_epi32(0x80), 0xF8);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi32(odd, 12),
                                                 _mm512_srli_epi32(uo, 16),
                                                 _mm512_set1_epi32(0x8000), 0xF8);
    return _mm512_cvtepi32_epi16(_mm512_or_si512(lo, hi));
}

/* One token's row: hidden values of x (bf16 or float32) into e4m3 bytes at o (not over x:
 * a block may be read again after its bytes are written). A block is
 * cast with e4m3_16_normal, and again with e4m3_16 only where one of its quotients is below
 * 2^-6, above 464 or NaN (a block of real activations rarely has one). */
AVX512_TARGET static void cast_row_avx512(const void *x, int in_dt, int64_t hidden,
                                          const float *scales, uint8_t *o) {
    const size_t elem = in_dt == DT_BF16 ? 2 : 4;
    for (int64_t g = 0; g < hidden / FP8_BLOCK; g++) {
        const __m512 s = _mm512_set1_ps(scales[g]);
        const char *in = (const char *)x + g * FP8_BLOCK * elem;
        uint8_t *out = o + g * FP8_BLOCK;
        __mmask16 special = 0;
        if (in_dt == DT_BF16)
            for (int i = 0; i < FP8_BLOCK; i += 32)
                _mm256_storeu_si256((__m256i *)(out + i),
                                    e4m3_32_bf16_normal(in + i * elem, s, &special));
        else
            for (int i = 0; i < FP8_BLOCK; i += 16)
                _mm_storeu_si128((__m128i *)(out + i), e4m3_16_normal(
                    _mm512_div_ps(load16(in + i * elem, in_dt), s), &special));
        if (special)
            for (int i = 0; i < FP8_BLOCK; i += 16)
                _mm_storeu_si128((__m128i *)(out + i),
                                 e4m3_16(_mm512_div_ps(load16(in + i * elem, in_dt), s)));
    }
}

/* whether moe_fp8_cast uses it (tests check both versions' bits) */
static int cast_avx512 = -1;
#endif
AVX512_SWITCH(moe_fp8_avx512, cast_avx512, cpu_has_avx512bw)

/* out[t, c] = e4m3(clamp(x[t, c] / scales[t, c / 128], -448, 448)); out rows out_stride
 * bytes apart (a message row), x rows x_stride elements apart. With scales_at >= 0 the row's
 * float32 scales follow at that byte of its out row (a low-latency message: data, scales). */
MOE_CLONES void moe_fp8_cast(const void *x, int in_dt, int64_t num_tokens, int64_t hidden,
                  int64_t x_stride, const float *scales, uint8_t *out, int64_t out_stride,
                  float *scratch, int64_t scales_at) {
    const int64_t groups = hidden / FP8_BLOCK;
    const size_t elem = in_dt == DT_BF16 ? 2 : 4;
#ifdef MOE_AVX512_CAST
    if (avx512_on(&cast_avx512, cpu_has_avx512bw)) {
        for (int64_t t = 0; t < num_tokens; t++) {
            uint8_t *o = out + t * out_stride;
            cast_row_avx512((const char *)x + t * x_stride * elem, in_dt, hidden,
                            scales + t * groups, o);
            if (scales_at >= 0) memcpy(o + scales_at, scales + t * groups, (size_t)groups * 4);
        }
        return;
    }
#endif
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

/* moe_fp8_scales then moe_fp8_cast, token by token (scales without rounding): the cast reads
 * the row the scales just read from the L1 cache instead of the whole x a second time. */
void moe_fp8_quantize(const void *x, int in_dt, int64_t num_tokens, int64_t hidden,
                      int64_t x_stride, float *scales, uint8_t *out, int64_t out_stride,
                      float *scratch, int64_t scales_at) {
    const size_t row_bytes = (size_t)x_stride * (in_dt == DT_BF16 ? 2 : 4);
    const int64_t groups = hidden / FP8_BLOCK;
    for (int64_t t = 0; t < num_tokens; t++) {
        const void *row = (const char *)x + t * row_bytes;
        moe_fp8_scales(row, in_dt, 1, hidden, x_stride, scales + t * groups, scratch);
        moe_fp8_cast(row, in_dt, 1, hidden, x_stride, scales + t * groups,
                     out + t * out_stride, out_stride, scratch, scales_at);
    }
}

/* n bytes from src to dst with non-temporal stores (copy_stream), fenced: a normal combine's
 * large return to its owner (normal.py put_back), and the benchmark's copy bar
 * (bench/call_timing.py), which times it beside torch's plain copy since the exchange's large
 * payloads are written this way and a plain copy is no upper bound for them. */
void moe_copy_stream(uint8_t *dst, const uint8_t *src, int64_t n) {
    copy_stream(dst, src, (size_t)n);
    stream_done();
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

/* The words that describe one destination of moe_put_rows_multi. */
enum { PUT_IDS, PUT_N, PUT_LO, PUT_X, PUT_SCALES, PUT_IDX, PUT_W, PUT_WORDS };

/* Row j of one destination's sub-arrays from this rank's token t (moe_put_rows_multi). */
static inline void put_row(int64_t j, int64_t t, const uint8_t *x, int64_t x_stride,
                           int64_t row_bytes, const uint8_t *scales, int64_t scales_stride,
                           int64_t scale_bytes, const int64_t *topk_idx, const float *topk_w,
                           int64_t K, int64_t lo, int64_t num_local, const int64_t *dest,
                           int stream) {
    copy_run((uint8_t *)(intptr_t)dest[PUT_X] + j * row_bytes, x + t * x_stride,
             (size_t)row_bytes, stream);
    if (scale_bytes)
        memcpy((uint8_t *)(intptr_t)dest[PUT_SCALES] + j * scale_bytes,
               scales + t * scales_stride, (size_t)scale_bytes);
    if (!K) return;
    int64_t *dst_idx = (int64_t *)(intptr_t)dest[PUT_IDX] + j * K;
    float *dst_w = (float *)(intptr_t)dest[PUT_W] + j * K;
    for (int64_t k = 0; k < K; k++) {
        const int64_t e = topk_idx[t * K + k], local = e - lo;
        const int mine = e >= 0 && local >= 0 && local < num_local;
        dst_idx[k] = mine ? local : -1;
        dst_w[k] = mine && topk_w ? topk_w[t * K + k] : 0.0f;
    }
}

/* A normal dispatch's rows for `ndest` destinations (exchange.put_rows), in one pass over x
 * instead of a dozen torch operations per destination. dest[PUT_WORDS * d ...] describes
 * destination d: its `n` token ids (ids), lo (its first expert), and the addresses of its
 * sub-arrays. For j < n, token t = ids[j] of this rank's num_tokens gives row j of each: its
 * payload (row_bytes of x, rows x_stride bytes apart) into dst_x (row_bytes apart), its scales
 * (scale_bytes of scales, scales_stride apart; none when scale_bytes is 0) into dst_scales, its
 * K top-k ids made local to the destination (id - lo where lo <= id < lo + num_local, else -1)
 * into dst_idx and their weights (0 on the slots made -1; all 0 without topk_w) into dst_w
 * (none when K is 0): layout.local_topk's values.
 *
 * The destinations advance together, PUT_BLOCK tokens of x at a time (their ids ascend, as
 * a dispatch sends them; any order is still copied right): a token going to several ranks
 * is read from memory once and from the cache after, where one destination after the other
 * read all of x again for each. A destination's payload of STREAM_MIN_BYTES or more goes with
 * non-temporal stores: 2 ranks of 1024 x 7168 bf16 dispatched in 3.7-4.0 ms a call instead of
 * 4.7-4.9 (session 17). Every id is checked first: returns -1 (nothing written) for a token
 * outside [0, num_tokens), else 0. */
#define PUT_BLOCK 32
int moe_put_rows_multi(const uint8_t *x, int64_t x_stride, int64_t num_tokens,
                       int64_t row_bytes, const uint8_t *scales, int64_t scales_stride,
                       int64_t scale_bytes, const int64_t *topk_idx, const float *topk_w,
                       int64_t K, int64_t num_local, const int64_t *dests, int64_t ndest) {
    int stream = 0;
    for (int64_t d = 0; d < ndest; d++) {
        const int64_t *dest = dests + d * PUT_WORDS;
        const int64_t *ids = (const int64_t *)(intptr_t)dest[PUT_IDS];
        for (int64_t j = 0; j < dest[PUT_N]; j++)
            if (ids[j] < 0 || ids[j] >= num_tokens) return -1;
        stream |= dest[PUT_N] * row_bytes >= STREAM_MIN_BYTES;
    }
    int64_t at[ndest > 0 ? ndest : 1];              /* each destination's next row */
    for (int64_t d = 0; d < ndest; d++) at[d] = 0;
    for (int64_t bound = PUT_BLOCK, left = 1; left; bound += PUT_BLOCK) {
        left = 0;
        for (int64_t d = 0; d < ndest; d++) {
            const int64_t *dest = dests + d * PUT_WORDS;
            const int64_t *ids = (const int64_t *)(intptr_t)dest[PUT_IDS], n = dest[PUT_N];
            const int big = n * row_bytes >= STREAM_MIN_BYTES;
            int64_t j = at[d];
            for (; j < n && (ids[j] < bound || bound >= num_tokens); j++)
                put_row(j, ids[j], x, x_stride, row_bytes, scales, scales_stride, scale_bytes,
                        topk_idx, topk_w, K, dest[PUT_LO], num_local, dest, big);
            at[d] = j;
            left |= j < n;
        }
    }
    if (stream) stream_done();
    return 0;
}

/* moe_put_rows_multi for one destination, its sub-arrays given one by one. */
static int moe_put_rows(const uint8_t *x, int64_t x_stride, int64_t num_tokens,
                        const int64_t *ids, int64_t n, int64_t row_bytes, const uint8_t *scales,
                        int64_t scales_stride, int64_t scale_bytes, const int64_t *topk_idx,
                        const float *topk_w, int64_t K, int64_t lo, int64_t num_local,
                        uint8_t *dst_x, uint8_t *dst_scales, int64_t *dst_idx, float *dst_w) {
    const int64_t dest[PUT_WORDS] = {(intptr_t)ids, n, lo, (intptr_t)dst_x,
                                     (intptr_t)dst_scales, (intptr_t)dst_idx, (intptr_t)dst_w};
    return moe_put_rows_multi(x, x_stride, num_tokens, row_bytes, scales, scales_stride,
                              scale_bytes, topk_idx, topk_w, K, num_local, dest, 1);
}

/* counts [num_local] = how many of the n ids (received top-k ids, -1 for none) name each
 * local expert: layout.aligned_expert_counts's bincount in one pass. Returns -1 (counts
 * unfinished) for an id at or past num_local. */
int moe_count_experts(const int64_t *ids, int64_t n, int64_t num_local, int64_t *counts) {
    for (int64_t e = 0; e < num_local; e++) counts[e] = 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] >= num_local) return -1;
        if (ids[i] >= 0) counts[ids[i]]++;
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
 * (token << 8 | slot) into the same row of meta. With `seen` (uint8 [num_tokens] scratch, or
 * NULL to write every row) only a token's first message to this rank gets its row: a token
 * routed to k experts of one rank is sent once instead of k times, and the receiver reads
 * every message of it from that first row (moe_ll_recv). `stream`: the rows with
 * non-temporal stores (copy_stream), for a call whose messages to other ranks come to
 * STREAM_MIN_BYTES or more: the receiver reads them from memory, not from the lines of this
 * core's cache, which regular stores first read for ownership (128 x 7168 fp8: dispatch
 * 3-10% faster on 4 ranks, 0-7% on 2). Returns -1 (nothing written) when an expert has more
 * than M messages (they would run into the next block), -2 for a token outside
 * [0, num_tokens). */
int moe_ll_send(const uint8_t *msgs, int64_t msg_stride, int64_t nbytes, const int64_t *tok,
                const int64_t *slot, const int64_t *first, int64_t e_lo, int64_t num_local,
                int64_t R, int64_t me, int64_t M, uint8_t *payload, int64_t payload_stride,
                int64_t *meta, int64_t num_tokens, uint8_t *seen, int stream) {
    for (int64_t le = 0; le < num_local; le++)
        if (first[e_lo + le + 1] - first[e_lo + le] > M) return -1;
    for (int64_t i = first[e_lo]; i < first[e_lo + num_local]; i++)
        if (tok[i] < 0 || tok[i] >= num_tokens) return -2;
    if (seen) memset(seen, 0, (size_t)num_tokens);
    for (int64_t le = 0; le < num_local; le++) {
        const int64_t lo = first[e_lo + le], hi = first[e_lo + le + 1];
        const int64_t row0 = (le * R + me) * M;
        for (int64_t i = lo; i < hi; i++) {
            if (!seen || !seen[tok[i]])
                copy_run(payload + (row0 + i - lo) * payload_stride, msgs + tok[i] * msg_stride,
                         (size_t)nbytes, stream);
            if (seen) seen[tok[i]] = 1;
            meta[row0 + i - lo] = tok[i] << 8 | slot[i];
        }
    }
    if (stream) stream_done();
    return 0;
}

/* The row a message's bytes are read from: its token's first row from source src (canon,
 * filled by first_rows), or its own row when the token in its meta is outside [0, M). */
static inline int64_t source_row(const int64_t *meta, int64_t row, int64_t src, int64_t M,
                                 const int64_t *canon) {
    const int64_t t = meta[row] >> 8;
    return t >= 0 && t < M ? canon[src * M + t] : row;
}

/* canon [R][M]: for every source (but this rank when its own messages are read in place) and
 * token, the first row of its blocks, in block order (expert, then place), whose meta names
 * that token. Only rows within the (checked) counts are read. */
static void first_rows(const int64_t *meta, const int64_t *counts, int64_t count_stride,
                       int64_t L, int64_t R, int64_t M, int64_t me, int own_in_place,
                       int64_t *canon) {
    for (int64_t src = 0; src < R; src++) {
        if (own_in_place && src == me) continue;
        int64_t *first = canon + src * M;
        for (int64_t t = 0; t < M; t++) first[t] = -1;
        for (int64_t le = 0; le < L; le++) {
            const int64_t row0 = (le * R + src) * M, c = counts[src * count_stride + le];
            for (int64_t i = 0; i < c; i++) {
                const int64_t t = meta[row0 + i] >> 8;
                if (t >= 0 && t < M && first[t] < 0) first[t] = row0 + i;
            }
        }
    }
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
 * start: moe_ll_route's, from its first local expert on).
 * A message's bytes are read from its token's first row from the same source (first in block
 * order: expert, then place), found by the token in the meta; moe_ll_send writes only that
 * row. A token outside [0, M) in a peer's meta is not looked up: its own row is read.
 * `canon` int64 [R * M] scratch. direct (uint8 [R], or NULL): the sources that wrote their
 * rows straight into a receive area (host/ll_direct.py) at their packed places, rows then
 * scales as in recv_x and recv_scales: direct_x and direct_scales; they are copied from there
 * unless recv_x is that area. Returns -1 (nothing copied) when a count lies outside [0, M],
 * -2 when this rank's own count row disagrees with own_first. */
int moe_ll_recv(const uint8_t *payload, int64_t stride, const int64_t *meta,
                const int64_t *counts, int64_t count_stride, int64_t L, int64_t R, int64_t M,
                uint8_t *recv_x, int64_t x_bytes, uint8_t *recv_scales, int64_t scale_bytes,
                int64_t scales_at, int64_t *recv_meta, int64_t *ranges, int64_t *per_expert,
                int64_t me, const uint8_t *own_msgs, int64_t own_stride, const int64_t *own_tok,
                const int64_t *own_slot, const int64_t *own_first, int64_t *canon,
                const uint8_t *direct, const uint8_t *direct_x, const uint8_t *direct_scales) {
    int64_t total = 0;
    for (int64_t src = 0; src < R; src++)
        for (int64_t le = 0; le < L; le++) {
            const int64_t c = counts[src * count_stride + le];
            if (c < 0 || c > M) return -1;
            if (own_msgs && src == me && c != own_first[le + 1] - own_first[le]) return -2;
            total += c;
        }
    first_rows(meta, counts, count_stride, L, R, M, me, own_msgs != NULL, canon);
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
            if (direct && direct[src]) {           /* its rows are at their places already */
                if (direct_x != recv_x) {
                    copy_run(recv_x + packed * x_bytes, direct_x + packed * x_bytes,
                             (size_t)(c * x_bytes), stream);
                    if (recv_scales)
                        memcpy(recv_scales + packed * scale_bytes,
                               direct_scales + packed * scale_bytes, (size_t)(c * scale_bytes));
                }
                for (int64_t i = 0; i < c; i++, packed++) recv_meta[packed] = meta[row0 + i];
                continue;
            }
            for (int64_t i = 0; i < c; i++, packed++) {
                const int64_t m = own ? own_first[le] + i : 0;
                const uint8_t *msg = own ? own_msgs + own_tok[m] * own_stride
                                         : payload + source_row(meta, row0 + i, src, M, canon) *
                                                     stride;
                copy_run(recv_x + packed * x_bytes, msg, (size_t)x_bytes, stream);
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
            copy_run(dst + at * dst_stride, from, (size_t)(c * nbytes),
                     total * nbytes >= STREAM_MIN_BYTES);
        } else {
            for (int64_t j = 0; j < c; j++)
                memcpy(dst + (at + j) * dst_stride, from + j * src_stride, (size_t)nbytes);
        }
        at += c;
    }
    stream_done();
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

/* ---- Small normal-mode calls: every pair's rows in an eager slot (moe_comm/host/small.py) --
 * A normal call of a few tokens moves a few KB per pair; as Python its per-destination steps
 * (index tensors, slab views, signal words, waits, copies out) cost ~0.6 ms a call, several
 * times MPI's whole exchange. These functions do the steps of such a call over all peers in
 * one C call each: the same bytes at the same places as the Python protocol (moe_comm/host/
 * eager.py, exchange.py), so a rank on either path pairs with a rank on the other. */

#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline int64_t round_up_i64(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* wire.SlabLayout(rows, row_bytes, scale_cols, topk) (no mask columns): offs[4] of its
 * payload, scales, top-k ids and weights; returns its nbytes. */
static int64_t slab_layout(int64_t rows, int64_t row_bytes, int64_t scale_cols, int64_t topk,
                           int64_t align, int64_t page, int64_t *offs) {
    const int64_t sizes[4] = {rows * row_bytes, rows * scale_cols * 4, rows * topk * 8,
                              rows * topk * 4};
    int64_t at = 0;
    for (int i = 0; i < 4; i++) { offs[i] = at; at = round_up_i64(at + sizes[i], align); }
    return round_up_i64(at, page);     /* the empty mask sub-array starts at `at` */
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);        /* Python's time.monotonic() clock */
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Spin, yield, then sleep (moe_comm/shm/atomics.py Backoff's steps): a spinning rank must not
 * starve the peer it waits for when ranks share cores. Pauses or yields, or returns how long
 * to sleep (ns; 0: none). */
static int64_t backoff(int64_t spins, int crowded) {
    if (spins < 32) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
        return 0;
    }
    if (crowded) {
        if (spins < 64) { sched_yield(); return 0; }
        return spins < 256 ? 20000 : spins < 1024 ? 200000 : 1000000;
    }
    if (spins < 1024) { sched_yield(); return 0; }
    return spins < 4096 ? 20000 : 200000;
}

/* Doorbells (wire.DOORBELL_WORD, one header word a rank): a rank about to sleep in a wait sets
 * its own to 1 and sleeps on it (a futex in shared memory) for at most its backoff's time; a
 * writer that published words for a rank and finds its doorbell set clears it and wakes it,
 * so the sleeper goes on when its words come, not when its sleep ends (ranks that outnumber
 * the cores sleep in most waits). The Python protocol's writers ring too where this library
 * is loaded (host/doorbell.py); a rank without it does not, and its reader sleeps its time
 * out, as it would without doorbells. The store of the doorbell and the
 * reader's second look at its slots, like the writer's stores and its look at the doorbell,
 * are ordered by full fences, so one of them sees the other's. */
static inline uint32_t *bell_at(int64_t addr) { return (uint32_t *)(intptr_t)addr; }

static void ring(int64_t bell_addr) {
    uint32_t *bell = bell_at(bell_addr);
    if (__atomic_load_n(bell, __ATOMIC_RELAXED) && __atomic_exchange_n(bell, 0, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void sleep_on(int64_t bell_addr, int64_t ns) {
    struct timespec ts = {ns / 1000000000, ns % 1000000000};
    syscall(SYS_futex, bell_at(bell_addr), FUTEX_WAIT, 1, &ts, NULL, 0);
    __atomic_store_n(bell_at(bell_addr), 0, __ATOMIC_RELAXED);
}

/* The doorbells from Python (host/doorbell.py): a Python wait arms its rank's doorbell
 * (stores 1, then a full fence), takes a second look at its words, and sleeps on it for at
 * most `ns` unless they came (moe_bell_sleep clears it after); a Python writer, after its
 * words, rings the reader's (moe_ring_bell: a full fence, then a wake if the bell is set). */
void moe_arm_bell(int64_t bell_addr) {
    __atomic_store_n(bell_at(bell_addr), 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

void moe_bell_sleep(int64_t bell_addr, int64_t ns) { sleep_on(bell_addr, ns); }

void moe_ring_bell(int64_t bell_addr) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);          /* the words stored before, then */
    ring(bell_addr);
}

/* Token ids each rank gets: in_rank bool [T, R] (strides in elements) -> ids, grouped by rank
 * and ascending within it, and first [R + 1] (rank d's ids are ids[first[d]:first[d+1]]). */
static void small_ids(const uint8_t *in_rank, int64_t T, int64_t R, int64_t st, int64_t sr,
                      int64_t *ids, int64_t *first) {
    for (int64_t d = 0; d <= R; d++) first[d] = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 0; d < R; d++) first[d + 1] += in_rank[t * st + d * sr] != 0;
    for (int64_t d = 0; d < R; d++) first[d + 1] += first[d];
    for (int64_t d = 0; d < R; d++) {
        int64_t at = first[d];
        for (int64_t t = 0; t < T; t++) if (in_rank[t * st + d * sr]) ids[at++] = t;
    }
}

/* What a dispatch writes for one destination (exchange.put_rows): the rows of tokens ids[0..n)
 * of this rank's T as a SlabLayout of n rows at `base` (moe_put_rows into its sub-arrays:
 * payload, scales of scale_cols 4-byte columns, rows s_row bytes apart, top-k ids made local
 * to the destination's experts [lo, lo + num_local) and their weights). Returns the slab's
 * nbytes. */
static int64_t put_dispatch_rows(uint8_t *base, const int64_t *ids, int64_t n,
                                 const uint8_t *x, int64_t x_stride, int64_t T,
                                 int64_t row_bytes, const uint8_t *scales, int64_t s_row,
                                 int64_t scale_cols, const int64_t *topk_idx,
                                 const float *topk_w, int64_t K, int64_t lo, int64_t num_local,
                                 int64_t align, int64_t page) {
    int64_t offs[4];
    const int64_t nbytes = slab_layout(n, row_bytes, scale_cols, K, align, page, offs);
    moe_put_rows(x, x_stride, T, ids, n, row_bytes, scales, s_row, scale_cols * 4, topk_idx,
                 topk_w, K, lo, num_local, base + offs[0], base + offs[1],
                 (int64_t *)(base + offs[2]), (float *)(base + offs[3]));
    return nbytes;
}

/* Signal words: `values` tagged with `epoch` into `words`, after every earlier write; then
 * the reader's doorbell rung. */
static inline void publish(int64_t *words, int64_t bell, int64_t epoch, const int64_t *values,
                           int64_t n) {
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (int64_t i = 0; i < n; i++)
        __atomic_store_n(&words[i], (epoch << 32) | values[i], __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    ring(bell);
}

/* A dispatch's eager sends (eager.send), in the order of `dests` (nd ranks): rank d's rows
 * (ids[first[d]:first[d+1]]) into its slot of this rank at slot[d] (a byte address), then
 * the slot's flag at flag[d]: DONE_WRITTEN and the bytes written; then its doorbell rung
 * (bells[d]). Ranks without rows are skipped, those with more than slot_rows (their rows go
 * to a granted region: eager.pairs), and rank `skip` (this rank, whose receive then takes its
 * rows from x; -1: none). */
static void small_dispatch_send(int64_t skip, int64_t nd, const int64_t *dests,
                                const int64_t *slot,
                                const int64_t *flag, const int64_t *bells, const int64_t *ids,
                                const int64_t *first,
                                int64_t epoch, const uint8_t *x, int64_t x_stride, int64_t T,
                                int64_t row_bytes, const uint8_t *scales, int64_t s_row,
                                int64_t scale_cols, const int64_t *topk_idx,
                                const float *topk_w, int64_t K, int64_t num_local, int64_t align,
                                int64_t page, int64_t done_written, int64_t slot_rows) {
    for (int64_t j = 0; j < nd; j++) {
        const int64_t d = dests[j];
        const int64_t n = first[d + 1] - first[d];
        if (!n || n > slot_rows || d == skip) continue;
        const int64_t nbytes = put_dispatch_rows(
            (uint8_t *)(intptr_t)slot[d], ids + first[d], n, x, x_stride,
            T, row_bytes, scales, s_row, scale_cols, topk_idx, topk_w, K, d * num_local,
            num_local, align, page);
        const int64_t words[2] = {done_written, nbytes};
        publish((int64_t *)(intptr_t)flag[d], bells[d], epoch, words, 2);
    }
}

/* A combine's eager sends: to each owner o (the no = R ranks in the order of `owners`; none
 * without rows, nor with more than slot_rows: a granted region takes those, eager.pairs)
 * this rank's count[o] received rows from it (those after the rows of the
 * owners before o) of x and their weights (float32 [*, K], or none), as a SlabLayout of
 * count[o] rows (scales none, top-k ids left unwritten: a combine sends none) at slot[o],
 * then the flag, and its doorbell rung (bells[o]). To itself (o = me) only the flag: the
 * rows stay in x, where the receive reads them, as the Python protocol's combine does. */
static void small_combine_send(int64_t no, const int64_t *owners, const int64_t *slot,
                               const int64_t *flag, const int64_t *bells, const int64_t *count,
                               int64_t epoch, const uint8_t *x, int64_t row_bytes,
                               const float *topk_w, int64_t K, int64_t align, int64_t page,
                               int64_t done_written, int64_t me, int64_t slot_rows) {
    int64_t start[no];                /* owner o's rows start after those of the ranks before */
    for (int64_t o = 0, at = 0; o < no; at += count[o], o++) start[o] = at;
    for (int64_t j = 0; j < no; j++) {
        const int64_t o = owners[j], n = count[o];
        if (!n || n > slot_rows) continue;
        int64_t offs[4];
        const int64_t nbytes = slab_layout(n, row_bytes, 0, K, align, page, offs);
        uint8_t *base = (uint8_t *)(intptr_t)slot[o];
        if (o != me) {                /* this rank's own rows stay in x (small_combine_recv) */
            memcpy(base + offs[0], x + start[o] * row_bytes, (size_t)(n * row_bytes));
            if (K && topk_w) memcpy(base + offs[3], topk_w + start[o] * K, (size_t)(n * K * 4));
        }
        const int64_t words[2] = {done_written, nbytes};
        publish((int64_t *)(intptr_t)flag[o], bells[o], epoch, words, 2);
    }
}

/* The same tagged `values` (n words) into the slot at words[j] of each of nr ranks (one
 * release fence for all: HostComm.signal_each), then their doorbells rung (bells[j]). */
static void small_signal(int64_t nr, const int64_t *words, const int64_t *bells, int64_t epoch,
                         const int64_t *values, int64_t n) {
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (int64_t j = 0; j < nr; j++) {
        int64_t *w = (int64_t *)(intptr_t)words[j];
        for (int64_t i = 0; i < n; i++)
            __atomic_store_n(&w[i], (epoch << 32) | values[i], __ATOMIC_RELAXED);
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int64_t j = 0; j < nr; j++) ring(bells[j]);
}

/* Wait until each of the n slots (words[j]: the address of nwords[j] signal words) carries
 * `epoch` in every word, until deadline_ns (CLOCK_MONOTONIC) or until this rank's FENCE word
 * (*fence) is set, sleeping on this rank's doorbell (`bell`) when it sleeps; with `need`,
 * only the slots j with need[j] != 0. ready[j] = 1 for the
 * slots that came (or were not waited for). Returns how many did not (0: all came; the
 * caller then reads them after this function's acquire fence), or, with `expect`, -1 when
 * all came but a slot's values (the words' low 32 bits) are not expect[0..nwords[j]). */
static int64_t still_missing(int64_t n, const int64_t *words, const int64_t *nwords,
                             int64_t epoch, uint8_t *ready, int64_t missing) {
    for (int64_t j = 0; j < n && missing; j++) {
        if (ready[j]) continue;
        const int64_t *w = (const int64_t *)(intptr_t)words[j];
        int all = 1;
        for (int64_t i = 0; i < nwords[j] && all; i++)
            all = (__atomic_load_n(&w[i], __ATOMIC_RELAXED) >> 32) == epoch;
        if (all) { ready[j] = 1; missing--; }
    }
    return missing;
}

static int64_t small_wait(int64_t n, const int64_t *words, const int64_t *nwords,
                          const int64_t *need, const int64_t *expect, int64_t epoch,
                          int64_t deadline_ns, const int64_t *fence, int64_t bell, int crowded,
                          uint8_t *ready) {
    int64_t missing = 0;
    for (int64_t j = 0; j < n; j++) {
        ready[j] = need && !need[j];
        missing += !ready[j];
    }
    for (int64_t spins = 0; missing; spins++) {
        missing = still_missing(n, words, nwords, epoch, ready, missing);
        if (!missing) break;
        if (__atomic_load_n(fence, __ATOMIC_RELAXED) || now_ns() > deadline_ns) break;
        const int64_t ns = backoff(spins, crowded);
        if (!ns) continue;
        __atomic_store_n(bell_at(bell), 1, __ATOMIC_SEQ_CST);      /* then a second look */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        missing = still_missing(n, words, nwords, epoch, ready, missing);
        if (missing) sleep_on(bell, ns);
        else __atomic_store_n(bell_at(bell), 0, __ATOMIC_RELAXED);
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (missing || !expect) return missing;
    for (int64_t j = 0; j < n; j++) {
        const int64_t *w = (const int64_t *)(intptr_t)words[j];
        for (int64_t i = 0; i < nwords[j]; i++)
            if ((w[i] & 0xFFFFFFFFll) != expect[i]) return -1;
    }
    return 0;
}

/* A dispatch's receive from the eager slots (eager.copy_out of every source): source s's
 * count[s] rows, a SlabLayout at slot[s], to rows [row0[s], row0[s] + count[s]) of the
 * outputs (payload [*, row_bytes]; scales [*, scale_cols] 4-byte; ids int64 and weights
 * float32 [*, K], each NULL when not returned), in source order (row0[s]: the rows of the
 * sources before s), but for source `skip` (-1: none), whose rows the caller copies. Each
 * slot's flag (flag[s]:
 * two words) must say the bytes that layout spans; returns -(s + 1) for the first source
 * whose does not (nothing copied), else 0. local_counts [num_local] (or NULL): how many
 * received ids name each local expert. */
static int64_t small_dispatch_recv(int64_t R, const int64_t *slot, const int64_t *flag,
                                   const int64_t *count, int64_t row_bytes,
                                   int64_t scale_cols, int64_t K, int64_t align, int64_t page,
                                   uint8_t *out_x, uint8_t *out_s, int64_t *out_i, float *out_w,
                                   int64_t num_local, int64_t *local_counts, int64_t skip) {
    int64_t offs[4];
    for (int64_t s = 0; s < R; s++) {
        if (!count[s] || s == skip) continue;
        const int64_t nbytes = slab_layout(count[s], row_bytes, scale_cols, K, align, page, offs);
        const int64_t said = ((const int64_t *)(intptr_t)flag[s])[1] & 0xFFFFFFFFll;
        if (said != nbytes) return -(s + 1);
    }
    if (local_counts) for (int64_t e = 0; e < num_local; e++) local_counts[e] = 0;
    for (int64_t s = 0, r = 0; s < R; r += count[s], s++) {
        const int64_t n = count[s];
        if (!n || s == skip) continue;
        slab_layout(n, row_bytes, scale_cols, K, align, page, offs);
        const uint8_t *base = (const uint8_t *)(intptr_t)slot[s];
        memcpy(out_x + r * row_bytes, base + offs[0], (size_t)(n * row_bytes));
        if (out_s) memcpy(out_s + r * scale_cols * 4, base + offs[1], (size_t)(n * scale_cols * 4));
        if (out_i) {
            const int64_t *ids = (const int64_t *)(base + offs[2]);
            memcpy(out_i + r * K, ids, (size_t)(n * K * 8));
            if (local_counts)
                for (int64_t i = 0; i < n * K; i++)
                    if (ids[i] >= 0 && ids[i] < num_local) local_counts[ids[i]]++;
        }
        if (out_w) memcpy(out_w + r * K, base + offs[3], (size_t)(n * K * 4));
    }
    return 0;
}

/* A combine's receive: the rows each expert rank d sent back (count[d] rows of `hidden`
 * channels of in_dt, a SlabLayout at slot[d]; with K, weights float32 [count[d], K] after
 * them) summed per token as normal.py's _reduce does - token ids[first[d] + i] for row i
 * of d; out [T, hidden] (out_dt) = 0 + the rows in rank order + each bias (moe_sum_rows);
 * out_w [T, K] = 0 + the weights in rank order (index_add_). Flags checked as in
 * small_dispatch_recv (returns -(d + 1)). index: int64 [T + 1 + sum(count)];
 * scratch float32 [2 * hidden]. The rows this rank returned to itself are read from own_x
 * (and their weights from own_w), where they are: its x. */
static int64_t small_combine_recv(int64_t R, const int64_t *slot, const int64_t *flag,
                                  const int64_t *count, const int64_t *ids, const int64_t *first,
                                  int in_dt, int64_t hidden, int64_t K, int64_t align,
                                  int64_t page, int64_t T, const int64_t *bias_addr, int num_bias,
                                  void *out, int out_dt, float *out_w, int64_t *index,
                                  float *scratch, int64_t me, const uint8_t *own_x,
                                  const float *own_w) {
    const int64_t row_bytes = hidden * (in_dt == DT_BF16 ? 2 : 4);
    int64_t offs[4];
    for (int64_t d = 0; d < R; d++) {
        if (!count[d]) continue;
        const int64_t nbytes = slab_layout(count[d], row_bytes, 0, K, align, page, offs);
        const int64_t said = ((const int64_t *)(intptr_t)flag[d])[1] & 0xFFFFFFFFll;
        if (said != nbytes) return -(d + 1);
        if (count[d] != first[d + 1] - first[d]) return -(d + 1);
    }
    int64_t *tfirst = index, *addr = index + T + 1;
    for (int64_t t = 0; t <= T; t++) tfirst[t] = 0;
    for (int64_t d = 0; d < R; d++)
        for (int64_t i = 0; i < count[d]; i++) tfirst[ids[first[d] + i] + 1]++;
    for (int64_t t = 0; t < T; t++) tfirst[t + 1] += tfirst[t];
    if (K) for (int64_t i = 0; i < T * K; i++) out_w[i] = 0.0f;
    for (int64_t d = 0; d < R; d++) {            /* rank order: each token's rows in it */
        if (!count[d]) continue;
        slab_layout(count[d], row_bytes, 0, K, align, page, offs);
        const uint8_t *base = (const uint8_t *)(intptr_t)slot[d];
        const uint8_t *rows = d == me ? own_x : base + offs[0];
        const float *weights = d == me ? own_w : (const float *)(base + offs[3]);
        for (int64_t i = 0; i < count[d]; i++) {
            const int64_t t = ids[first[d] + i];
            addr[tfirst[t]++] = (int64_t)(intptr_t)(rows + i * row_bytes);
            if (K) {
                const float *w = weights + i * K;
                for (int64_t k = 0; k < K; k++) out_w[t * K + k] += w[k];
            }
        }
    }
    for (int64_t t = T; t > 0; t--) tfirst[t] = tfirst[t - 1];   /* cursors back to starts */
    tfirst[0] = 0;
    moe_sum_rows(addr, NULL, tfirst, in_dt, hidden, T, bias_addr, num_bias, out, out_dt,
                 scratch);
    return 0;
}

/* The phases of a small call, each one C call (host/small.py). `cx`: the addresses a Buffer's
 * small calls use (small.Addresses.context, built once), int64 words in this order: */
enum {
    CX_R, CX_CROWDED, CX_FENCE, CX_BELL, CX_READY, CX_ROTATION, CX_BELLS, CX_NW_CALL,
    CX_NW_COUNT, CX_NW_FLAG, CX_ALIGN, CX_PAGE, CX_DONE_WRITTEN, CX_CALL_WORDS, CX_DIFFER, CX_ME,
    /* then two (parities 0 and 1) of each: */
    CX_OUT_SLOT, CX_OUT_FLAG = CX_OUT_SLOT + 2, CX_IN_SLOT = CX_OUT_FLAG + 2,
    CX_IN_FLAG = CX_IN_SLOT + 2, CX_CALL_OUT = CX_IN_FLAG + 2, CX_CALL_IN = CX_CALL_OUT + 2,
    CX_COUNT_OUT = CX_CALL_IN + 2, CX_COUNT_IN = CX_COUNT_OUT + 2, CX_WORDS = CX_COUNT_IN + 2
};

/* What a phase returns when it cannot finish: small.py raises through the Python waits, or
 * names the source; SMALL_AGAIN: a wait's slice (WAIT_SLICE_NS) ran out before its deadline,
 * and small.py calls the phase again to go on waiting (resume: nothing is sent twice), so
 * Python's signal handlers (Ctrl-C) run at least every slice. A finish phase whose signatures
 * differ does not stop: it sets the word at cx[CX_DIFFER] and goes on (sizes are still
 * checked before any copy), since the Python protocol also waits for the slots before it
 * checks the signatures; a start phase stops there (Python checks them before the counts). */
enum { SMALL_OK = 0, SMALL_LATE_CALLS = 1, SMALL_LATE_COUNTS = 2, SMALL_LATE_FLAGS = 3,
       SMALL_AGAIN = 4 };
#define WAIT_SLICE_NS 50000000ll

#define CX_PTR(cx, i) ((const int64_t *)(intptr_t)(cx)[i])

int64_t moe_small_context_words(void) { return CX_WORDS; }

/* Wait for the R slots at where[] (nwords[] words each; only those need[j] != 0 with `need`)
 * and, with `expect`, compare their values with it: small_wait with the context's rest, for
 * at most one slice. Returns 0, the slots still missing at the deadline, -1 (values differ)
 * or -2 (the slice ended first). */
static int64_t cx_wait(const int64_t *cx, const int64_t *where, const int64_t *nwords,
                       const int64_t *need, const int64_t *expect, int64_t epoch,
                       int64_t deadline_ns) {
    const int64_t slice_end = now_ns() + WAIT_SLICE_NS;
    const int64_t until = slice_end < deadline_ns ? slice_end : deadline_ns;
    const int64_t missing = small_wait(cx[CX_R], where, nwords, need, expect, epoch, until,
                                       CX_PTR(cx, CX_FENCE), cx[CX_BELL], (int)cx[CX_CROWDED],
                                       (uint8_t *)(intptr_t)cx[CX_READY]);
    if (missing > 0 && until < deadline_ns && !*CX_PTR(cx, CX_FENCE)) return -2;   /* again */
    return missing;
}

/* The signature (call_row) to every rank, at call parity cp. */
static void cx_post_call(const int64_t *cx, int64_t cp, int64_t epoch, const int64_t *call_row) {
    small_signal(cx[CX_R], CX_PTR(cx, CX_CALL_OUT + cp), CX_PTR(cx, CX_BELLS), epoch, call_row,
                 cx[CX_CALL_WORDS]);
}

/* Every rank's signature at call parity cp, compared with call_row (the word at cx[CX_DIFFER]
 * set if any differs). */
static int64_t cx_check_calls(const int64_t *cx, int64_t cp, int64_t epoch,
                              int64_t deadline_ns, const int64_t *call_row) {
    const int64_t w = cx_wait(cx, CX_PTR(cx, CX_CALL_IN + cp), CX_PTR(cx, CX_NW_CALL), NULL,
                              call_row, epoch, deadline_ns);
    if (w == -1) *(int64_t *)(intptr_t)cx[CX_DIFFER] = 1;
    return w > 0 ? SMALL_LATE_CALLS : w == -2 ? SMALL_AGAIN : SMALL_OK;
}

/* A small dispatch up to its count matrix. A fresh dispatch (count parity np >= 0): each
 * rank's tokens from in_rank into ids / first (small_ids); the rows into every destination's
 * slot at eager parity ep (small_dispatch_send); the signature (call parity cp); this rank's
 * counts (at np); every rank's signature compared and every rank's counts read into matrix
 * [R, R] (values). A cached dispatch (np < 0): ids / first are the handle's, and the phase
 * ends with the signature sent. Returns SMALL_OK or what stopped it; `resume` (after
 * SMALL_AGAIN or a late slot): only the waits, everything before them was done; 2: and go
 * on past signatures that differ (the caller checked them: a test that turns checks off).
 * T: this rank's tokens, in x and in_rank (NULL for a dispatch of no tokens: torch gives
 * empty tensors no storage); scales row-major, rows s_row bytes apart. (small_start's
 * `skip`: a rank whose rows are not sent, small_dispatch_send's.) */
static int64_t small_start(const int64_t *cx, int64_t ep, int64_t cp, int64_t np,
                           int64_t resume, int64_t epoch, int64_t deadline_ns,
                           const uint8_t *in_rank, int64_t T, int64_t st, int64_t sr,
                           int64_t *ids, int64_t *first, const uint8_t *x, int64_t x_stride,
                           int64_t row_bytes, const uint8_t *scales, int64_t s_row,
                           int64_t scale_cols, const int64_t *topk_idx, const float *topk_w,
                           int64_t K, int64_t num_local, const int64_t *call_row,
                           int64_t *matrix, int64_t skip, int64_t slot_rows) {
    const int64_t R = cx[CX_R];
    int64_t *differ = (int64_t *)(intptr_t)cx[CX_DIFFER];
    *differ = 0;
    if (!resume) {
        if (np >= 0) small_ids(in_rank, T, R, st, sr, ids, first);
        small_dispatch_send(skip, R, CX_PTR(cx, CX_ROTATION), CX_PTR(cx, CX_OUT_SLOT + ep),
                            CX_PTR(cx, CX_OUT_FLAG + ep), CX_PTR(cx, CX_BELLS), ids, first,
                            epoch, x, x_stride, T, row_bytes, scales, s_row, scale_cols,
                            topk_idx, topk_w, K, num_local, cx[CX_ALIGN], cx[CX_PAGE],
                            cx[CX_DONE_WRITTEN], slot_rows);
        cx_post_call(cx, cp, epoch, call_row);
        if (np < 0) return SMALL_OK;
        int64_t counts[R];
        for (int64_t d = 0; d < R; d++) counts[d] = first[d + 1] - first[d];
        small_signal(R, CX_PTR(cx, CX_COUNT_OUT + np), CX_PTR(cx, CX_BELLS), epoch, counts, R);
    }
    const int64_t calls = cx_check_calls(cx, cp, epoch, deadline_ns, call_row);
    if (calls != SMALL_OK || (*differ && resume < 2))
        return calls;          /* differ: Python raises before the counts (resume 2: go on) */
    const int64_t *where = CX_PTR(cx, CX_COUNT_IN + np);
    const int64_t late = cx_wait(cx, where, CX_PTR(cx, CX_NW_COUNT), NULL, NULL, epoch,
                                 deadline_ns);
    if (late) return late == -2 ? SMALL_AGAIN : SMALL_LATE_COUNTS;
    for (int64_t s = 0; s < R; s++)
        for (int64_t d = 0; d < R; d++)
            matrix[s * R + d] = ((const int64_t *)(intptr_t)where[s])[d] & 0xFFFFFFFFll;
    return SMALL_OK;
}

int64_t moe_small_dispatch_start(const int64_t *cx, int64_t ep, int64_t cp, int64_t np,
                                 int64_t resume, int64_t epoch, int64_t deadline_ns,
                                 const uint8_t *in_rank,
                                 int64_t T, int64_t st, int64_t sr, int64_t *ids,
                                 int64_t *first, const uint8_t *x, int64_t x_stride,
                                 int64_t row_bytes, const uint8_t *scales, int64_t s_row,
                                 int64_t scale_cols, const int64_t *topk_idx,
                                 const float *topk_w, int64_t K, int64_t num_local,
                                 const int64_t *call_row, int64_t *matrix) {
    return small_start(cx, ep, cp, np, resume, epoch, deadline_ns, in_rank, T, st, sr, ids,
                       first, x, x_stride, row_bytes, scales, s_row, scale_cols, topk_idx,
                       topk_w, K, num_local, call_row, matrix, -1, INT64_MAX);
}

/* The rest of a small dispatch every pair of which went eagerly: the slots of the ranks
 * sending this rank rows (count [R]), with call_row (a cached dispatch) the signatures at
 * call parity cp, then every source's rows copied out (small_dispatch_recv). Returns
 * SMALL_OK, what stopped it, or -(s + 1) for a source whose slot holds another size.
 * (small_finish's `skip`: a source not waited for nor read, small_dispatch_recv's.) */
static int64_t small_finish(const int64_t *cx, int64_t ep, int64_t cp, int64_t epoch,
                            int64_t deadline_ns, const int64_t *count, int64_t row_bytes,
                            int64_t scale_cols, int64_t K, uint8_t *out_x, uint8_t *out_s,
                            int64_t *out_i, float *out_w, int64_t num_local,
                            int64_t *local_counts, const int64_t *call_row, int64_t skip) {
    const int64_t R = cx[CX_R];
    int64_t need[R];                  /* the sources waited for */
    for (int64_t s = 0; s < R; s++) need[s] = s == skip ? 0 : count[s];
    *(int64_t *)(intptr_t)cx[CX_DIFFER] = 0;
    const int64_t late = cx_wait(cx, CX_PTR(cx, CX_IN_FLAG + ep), CX_PTR(cx, CX_NW_FLAG), need,
                                 NULL, epoch, deadline_ns);
    if (late) return late == -2 ? SMALL_AGAIN : SMALL_LATE_FLAGS;
    if (call_row) {
        const int64_t calls = cx_check_calls(cx, cp, epoch, deadline_ns, call_row);
        if (calls != SMALL_OK) return calls;
    }
    return small_dispatch_recv(R, CX_PTR(cx, CX_IN_SLOT + ep), CX_PTR(cx, CX_IN_FLAG + ep),
                               count, row_bytes, scale_cols, K, cx[CX_ALIGN], cx[CX_PAGE],
                               out_x, out_s, out_i, out_w, num_local, local_counts, skip);
}

int64_t moe_small_dispatch_finish(const int64_t *cx, int64_t ep, int64_t cp, int64_t epoch,
                                  int64_t deadline_ns, const int64_t *count,
                                  int64_t row_bytes, int64_t scale_cols, int64_t K,
                                  uint8_t *out_x, uint8_t *out_s, int64_t *out_i, float *out_w,
                                  int64_t num_local, int64_t *local_counts,
                                  const int64_t *call_row) {
    return small_finish(cx, ep, cp, epoch, deadline_ns, count, row_bytes, scale_cols, K, out_x,
                        out_s, out_i, out_w, num_local, local_counts, call_row, -1);
}

/* A small combine's sends: this rank's rows back into every owner's slot at eager parity ep
 * (count [R]: the rows each owner sent this rank; small_combine_send), then the signature. */
void moe_small_combine_start(const int64_t *cx, int64_t ep, int64_t cp, int64_t epoch,
                             const int64_t *count, const uint8_t *x, int64_t row_bytes,
                             const float *topk_w, int64_t K, const int64_t *call_row,
                             int64_t slot_rows) {
    small_combine_send(cx[CX_R], CX_PTR(cx, CX_ROTATION), CX_PTR(cx, CX_OUT_SLOT + ep),
                       CX_PTR(cx, CX_OUT_FLAG + ep), CX_PTR(cx, CX_BELLS), count, epoch, x,
                       row_bytes, topk_w, K, cx[CX_ALIGN], cx[CX_PAGE], cx[CX_DONE_WRITTEN],
                       cx[CX_ME], slot_rows);
    cx_post_call(cx, cp, epoch, call_row);
}

/* The rest of a small combine every pair of which went eagerly: the slots of the ranks
 * returning rows (count [R]), the signatures, then the per-token sums (small_combine_recv;
 * own_x / own_w: this rank's rows for itself and their weights, in its x).
 * Returns SMALL_OK, what stopped it, or -(d + 1) for a rank whose slot holds another size. */
int64_t moe_small_combine_finish(const int64_t *cx, int64_t ep, int64_t cp, int64_t epoch,
                                 int64_t deadline_ns, const int64_t *count,
                                 const int64_t *ids, const int64_t *first, int in_dt,
                                 int64_t hidden, int64_t K, int64_t T,
                                 const int64_t *bias_addr, int num_bias, void *out, int out_dt,
                                 float *out_w, int64_t *index, float *scratch,
                                 const int64_t *call_row, const uint8_t *own_x,
                                 const float *own_w) {
    *(int64_t *)(intptr_t)cx[CX_DIFFER] = 0;
    const int64_t late = cx_wait(cx, CX_PTR(cx, CX_IN_FLAG + ep), CX_PTR(cx, CX_NW_FLAG), count,
                                 NULL, epoch, deadline_ns);
    if (late) return late == -2 ? SMALL_AGAIN : SMALL_LATE_FLAGS;
    const int64_t calls = cx_check_calls(cx, cp, epoch, deadline_ns, call_row);
    if (calls != SMALL_OK) return calls;
    return small_combine_recv(cx[CX_R], CX_PTR(cx, CX_IN_SLOT + ep), CX_PTR(cx, CX_IN_FLAG + ep),
                              count, ids, first, in_dt, hidden, K, cx[CX_ALIGN], cx[CX_PAGE], T,
                              bias_addr, num_bias, out, out_dt, out_w, index, scratch,
                              cx[CX_ME], own_x, own_w);
}

/* layout.dispatch_layout of topk [T, K] (E experts over R ranks, E / R each): per_rank [R]
 * tokens with an expert on each rank (once per token), per_expert [E] (token, slot) pairs,
 * in_rank bool [T, R]. Returns -1 (nothing counted) for an id outside [-1, E). */
int moe_dispatch_layout(const int64_t *topk, int64_t T, int64_t K, int64_t E, int64_t R,
                        int32_t *per_rank, int32_t *per_expert, uint8_t *in_rank) {
    const int64_t num_local = E / R;
    for (int64_t i = 0; i < T * K; i++)
        if (topk[i] < -1 || topk[i] >= E) return -1;
    memset(per_rank, 0, (size_t)R * 4);
    memset(per_expert, 0, (size_t)E * 4);
    memset(in_rank, 0, (size_t)(T * R));
    for (int64_t t = 0; t < T; t++) {
        uint8_t *row = in_rank + t * R;
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = topk[t * K + k];
            if (e < 0) continue;
            per_expert[e]++;
            const int64_t r = e / num_local;
            if (r < R && !row[r]) { row[r] = 1; per_rank[r]++; }
        }
    }
    return 0;
}

/* Whether a caller's layout (per_rank int32 [R], per_expert int32 [E], in_rank bool [T, R],
 * contiguous) is what moe_dispatch_layout gives for topk [T, K]: 1 if so, 0 if not or an id
 * is outside [-1, E). R and E at most native.LAYOUT_CHECK_MAX (their counters are on the
 * stack). Checked in one pass with nothing allocated but two counters on the
 * stack (a dispatch that passes get_dispatch_layout's outputs, as DeepEP's callers do, pays
 * for a check, not a second layout). */
int moe_layout_matches(const int64_t *topk, int64_t T, int64_t K, int64_t E, int64_t R,
                       const int32_t *per_rank, const int32_t *per_expert,
                       const uint8_t *in_rank) {
    const int64_t num_local = E / R;
    int32_t ranks[R], experts[E];
    uint8_t row[R];
    memset(ranks, 0, sizeof ranks);
    memset(experts, 0, sizeof experts);
    for (int64_t t = 0; t < T; t++) {
        memset(row, 0, sizeof row);
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = topk[t * K + k];
            if (e < -1 || e >= E) return 0;
            if (e < 0) continue;
            experts[e]++;
            row[e / num_local] = 1;
        }
        for (int64_t r = 0; r < R; r++) {
            if ((in_rank[t * R + r] != 0) != row[r]) return 0;
            ranks[r] += row[r];
        }
    }
    for (int64_t r = 0; r < R; r++) if (ranks[r] != per_rank[r]) return 0;
    for (int64_t e = 0; e < E; e++) if (experts[e] != per_expert[e]) return 0;
    return 1;
}

/* Whether a call on count matrix [R, R] (rows s sends d; `by_row`: each rank's rows are those
 * its row sums, else its column's) goes all in eager slots: every pair within slot_rows and
 * every rank's rows within heap_rows (small._in_slots). */
static int small_all_eager(const int64_t *matrix, int64_t R, int64_t slot_rows,
                           int64_t heap_rows, int by_row) {
    for (int64_t i = 0; i < R; i++) {
        int64_t sum = 0;
        for (int64_t j = 0; j < R; j++) {
            const int64_t m = by_row ? matrix[i * R + j] : matrix[j * R + i];
            if (m > slot_rows) return 0;
            sum += m;
        }
        if (sum > heap_rows) return 0;
    }
    return 1;
}

/* What a dispatch's count matrix [R, R] (rows s send to d) means for rank me: info[0] the
 * rows it receives, info[1] whether the call goes all in eager slots (small_all_eager, by
 * column), recv_count[s] = matrix[s, me]. */
void moe_small_matrix_info(const int64_t *matrix, int64_t R, int64_t me, int64_t slot_rows,
                           int64_t heap_rows, int64_t *info, int64_t *recv_count) {
    info[0] = 0;
    for (int64_t s = 0; s < R; s++) info[0] += recv_count[s] = matrix[s * R + me];
    info[1] = small_all_eager(matrix, R, slot_rows, heap_rows, 0);
}

/* The rest of a dispatch begun by moe_small_dispatch_direct or moe_small_cached_direct,
 * every pair of which went eagerly: moe_small_dispatch_finish's, but this rank's own rows
 * (count[me] of them, ids[first[me]:first[me + 1]] of its x [T, row_bytes], with their
 * top-k ids made local and weights, K of each, when K) go from x straight into their place
 * in the outputs, a copy less than through its own slot (small_dispatch_send skipped it). */
int64_t moe_small_direct_finish(const int64_t *cx, int64_t ep, int64_t cp, int64_t epoch,
                                int64_t deadline_ns, const int64_t *count, int64_t row_bytes,
                                int64_t K, uint8_t *out_x, int64_t *out_i, float *out_w,
                                int64_t num_local, int64_t *local_counts,
                                const int64_t *call_row, const uint8_t *x, int64_t T,
                                const int64_t *ids, const int64_t *first,
                                const int64_t *topk_idx, const float *topk_w) {
    const int64_t me = cx[CX_ME], n = count[me];
    if (n != first[me + 1] - first[me]) return -(me + 1);
    const int64_t rc = small_finish(cx, ep, cp, epoch, deadline_ns, count, row_bytes, 0, K,
                                    out_x, NULL, out_i, out_w, num_local, local_counts, call_row,
                                    me);
    if (rc != SMALL_OK || !n) return rc;
    int64_t row0 = 0;
    for (int64_t s = 0; s < me; s++) row0 += count[s];
    if (moe_put_rows(x, row_bytes, T, ids + first[me], n, row_bytes, NULL, 0, 0, topk_idx,
                     topk_w, K, me * num_local, num_local, out_x + row0 * row_bytes, NULL,
                     out_i + row0 * K, out_w + row0 * K))
        return -(me + 1);
    if (local_counts && K)
        for (int64_t i = row0 * K; i < (row0 + n) * K; i++)
            if (out_i[i] >= 0) local_counts[out_i[i]]++;
    return SMALL_OK;
}

/* This rank's own rows into its own slot, as small_dispatch_send writes them: for a dispatch
 * begun by moe_small_dispatch_direct (which skipped them) that goes on in the Python
 * protocol, which reads them there (none beyond slot_rows: a granted region takes them). */
void moe_small_send_own(const int64_t *cx, int64_t ep, int64_t epoch, const int64_t *ids,
                        const int64_t *first, const uint8_t *x, int64_t T, int64_t row_bytes,
                        const int64_t *topk_idx, const float *topk_w, int64_t K,
                        int64_t num_local, int64_t slot_rows) {
    const int64_t me = cx[CX_ME];
    small_dispatch_send(-1, 1, &me, CX_PTR(cx, CX_OUT_SLOT + ep), CX_PTR(cx, CX_OUT_FLAG + ep),
                        CX_PTR(cx, CX_BELLS), ids, first, epoch, x, row_bytes, T, row_bytes,
                        NULL, 0, 0, topk_idx, topk_w, K, num_local, cx[CX_ALIGN], cx[CX_PAGE],
                        cx[CX_DONE_WRITTEN], slot_rows);
}

/* Returned by moe_small_dispatch_direct where it does not take the call: nothing written. */
#define SMALL_DECLINED 5

/* A fresh small dispatch straight from the caller's arguments (host/direct.py): topk [T, K]
 * of E experts and its layout (per_rank int32 [R], per_expert int32 [E], in_rank bool [T, R],
 * all contiguous), x rows of row_bytes, weights float32 [T, K]. Declines (SMALL_DECLINED,
 * before anything is written anywhere) where the caller's layout is not topk's or an id lies
 * outside [-1, E) (moe_layout_matches), or where this rank's FENCE word is set (its peers
 * masked it): the Python protocol then runs the call, and raises what is wrong. Else
 * moe_small_dispatch_start of a fresh dispatch at count parity cp (ids [T * R], first
 * [R + 1], matrix [R, R]), but for this rank's own rows (moe_small_direct_finish takes them
 * from x) and the rows of ranks beyond an eager slot of slot_rows (granted regions take them:
 * the call goes on in the Python protocol, normal.dispatch's `started`), and, when it returns
 * SMALL_OK, moe_small_matrix_info into info [2] and recv_count [R]. */
int64_t moe_small_dispatch_direct(const int64_t *cx, int64_t ep, int64_t cp, int64_t epoch,
                                  int64_t deadline_ns, const int64_t *topk, int64_t T,
                                  int64_t K, int64_t E, const int32_t *per_rank,
                                  const int32_t *per_expert, const uint8_t *in_rank,
                                  const uint8_t *x, int64_t row_bytes, const float *topk_w,
                                  int64_t slot_rows, int64_t heap_rows,
                                  const int64_t *call_row, int64_t *ids, int64_t *first,
                                  int64_t *matrix, int64_t *info, int64_t *recv_count) {
    const int64_t R = cx[CX_R];
    if (*CX_PTR(cx, CX_FENCE) || !moe_layout_matches(topk, T, K, E, R, per_rank, per_expert,
                                                     in_rank))
        return SMALL_DECLINED;
    const int64_t rc = small_start(cx, ep, cp, cp, 0, epoch, deadline_ns, in_rank, T, R, 1, ids,
                                   first, x, row_bytes, row_bytes, NULL, 0, 0, topk, topk_w, K,
                                   E / R, call_row, matrix, cx[CX_ME], slot_rows);
    if (rc == SMALL_OK)
        moe_small_matrix_info(matrix, R, cx[CX_ME], slot_rows, heap_rows, info, recv_count);
    return rc;
}

/* A cached small dispatch straight from the caller's arguments (host/direct.py): the rows of
 * the handle's tokens (ids, first) of x [T, row_bytes] again, into out_x, which holds the
 * rows this rank receives (matrix[:, me] summed). Declines (SMALL_DECLINED, nothing written)
 * where a pair of the handle's matrix would not fit a slot or a rank's rows its heap, or
 * this rank's FENCE word is set. Else moe_small_dispatch_start of a cached dispatch (but
 * for this rank's own rows), then moe_small_direct_finish (signatures checked there); count
 * [R] gets matrix[:, me], for a caller that goes on after SMALL_AGAIN or a late slot with
 * moe_small_direct_finish. */
int64_t moe_small_cached_direct(const int64_t *cx, int64_t ep, int64_t cp, int64_t epoch,
                                int64_t deadline_ns, const int64_t *matrix, int64_t slot_rows,
                                int64_t heap_rows, const int64_t *ids, const int64_t *first,
                                const uint8_t *x, int64_t T, int64_t row_bytes, uint8_t *out_x,
                                const int64_t *call_row, int64_t *count) {
    const int64_t R = cx[CX_R], me = cx[CX_ME];
    if (*CX_PTR(cx, CX_FENCE) || !small_all_eager(matrix, R, slot_rows, heap_rows, 0))
        return SMALL_DECLINED;
    for (int64_t s = 0; s < R; s++) count[s] = matrix[s * R + me];
    const int64_t rc = small_start(cx, ep, cp, -1, 0, epoch, deadline_ns, NULL, T, 0, 0,
                                   (int64_t *)ids, (int64_t *)first, x, row_bytes, row_bytes,
                                   NULL, 0, 0, NULL, NULL, 0, 0, call_row, NULL, me,
                                   slot_rows);
    if (rc != SMALL_OK) return rc;
    return moe_small_direct_finish(cx, ep, cp, epoch, deadline_ns, count, row_bytes, 0, out_x,
                                   NULL, NULL, 0, NULL, call_row, x, T, ids, first, NULL, NULL);
}

/* A small combine straight from the caller's arguments (host/direct.py): x [N, hidden] of
 * dtype dt (host_ops.c's DT_*) and weights float32 [N, K] (or NULL) back to the tokens'
 * ranks of the handle's matrix, ids and first, summed per token into out [T, hidden] and
 * out_w [T, K]. Declines (SMALL_DECLINED, nothing written) where a pair would not fit a slot
 * or a rank's rows its heap, or this rank's FENCE word is set. Else
 * moe_small_combine_start, then moe_small_combine_finish (no biases); counts [2R] get
 * matrix[:, me] and matrix[me, :], for a caller that goes on with moe_small_combine_finish
 * (index: int64 [T + 1 + first[R]], scratch: float32 [2 * hidden]). */
int64_t moe_small_combine_direct(const int64_t *cx, int64_t ep, int64_t cp, int64_t epoch,
                                 int64_t deadline_ns, const int64_t *matrix, int64_t slot_rows,
                                 int64_t heap_rows, const int64_t *ids, const int64_t *first,
                                 const uint8_t *x, int dt, int64_t hidden, const float *topk_w,
                                 int64_t K, int64_t T, void *out, float *out_w, int64_t *index,
                                 float *scratch, const int64_t *call_row, int64_t *counts) {
    const int64_t R = cx[CX_R], me = cx[CX_ME];
    if (*CX_PTR(cx, CX_FENCE) || !small_all_eager(matrix, R, slot_rows, heap_rows, 1))
        return SMALL_DECLINED;
    int64_t own = 0;                  /* this rank's rows for itself start there in x */
    for (int64_t s = 0; s < R; s++) {
        counts[s] = matrix[s * R + me];
        counts[R + s] = matrix[me * R + s];
        if (s < me) own += counts[s];
    }
    const int64_t row_bytes = hidden * (dt == DT_F32 ? 4 : 2);
    moe_small_combine_start(cx, ep, cp, epoch, counts, x, row_bytes, topk_w, K, call_row,
                            INT64_MAX);
    return moe_small_combine_finish(cx, ep, cp, epoch, deadline_ns, counts + R, ids, first, dt,
                                    hidden, K, T, NULL, 0, out, dt, out_w, index, scratch,
                                    call_row, x + own * row_bytes,
                                    topk_w ? topk_w + own * K : NULL);
}

/* Low-latency calls straight from the Buffer's arguments (moe_comm/host/ll_direct.py), in a
 * file of their own, built as part of this one: they use the waits and doorbells above. */
#include "ll_direct.c"

/* The payload phase of a granted normal dispatch (moe_comm/host/granted.py), the same way. */
#include "granted.c"

/* A normal combine too large for the eager slots, streamed through them (host/ring.py). */
#include "ring.c"
