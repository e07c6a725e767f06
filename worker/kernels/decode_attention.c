/* Decode attention over a paged KV arena, one call per layer for every single-token query of a step.
 *
 * Query i (packed row rows[i]) attends to the first lens[i] tokens of its sequence, whose blocks
 * are tables[i * table_stride + 0, 1, ...]: token t lies at arena row
 * tables[i * table_stride + t / block_size] * block_size + t % block_size. The keys and values are
 * read where they lie, block by block, with no gather and no padding. Work is split over
 * (query, head) pairs with OpenMP; torch's own libgomp serves it (same soname), so the calling
 * thread's team is reused rather than a second one created (see worker/backends/gpt2.py).
 *
 * Layouts, strides in elements:
 *   q      [row, head, d]  at q + row * q_row_stride + head * D + d
 *   keys   [head, r, d]    at keys + head * head_stride + r * D + d   (values alike; r an arena row)
 *   out    [row, head, d]  at out + row * out_row_stride + head * D + d
 *   new_k  [row, head, d]  at new_k + row * new_row_stride + head * D + d   (new_v alike)
 *
 * Given new_k and new_v (else NULL), each query row first writes its own token's key and value,
 * the layer's projections of its row, into the arena at row slots[row], then attends (its length
 * counts that token): one pass over the memory instead of a separate scatter before the call.
 *
 * One pass per (query, head), as llama.cpp's CPU flash attention and FlashDecoding do: keys are
 * taken GROUP at a time; their scores set a running maximum, the running sum and accumulator are
 * rescaled when it grows (the online softmax), and the group's values are added in. Nothing is
 * allocated, so there is no failure path inside the parallel loop. Everything is computed in
 * float32 whatever the storage type: a bfloat16 or float16 element is widened in registers.
 *
 * The build compiles for the CPU at hand (-march=native, see build.py), and the preprocessor picks
 * the vector code for its features: AVX-512 (16 lanes; with AVX512-BF16 the QK dot products are
 * VDPBF16PS on the stored bfloat16 pairs), AVX2 with FMA and F16C (8 lanes), else portable C.
 * decode_attention_isa() names the choice, for the worker's log.
 *
 * A vector holds LANES float32 lanes. A row of D elements is read as ceil(D / CHUNK) chunks: for
 * float32 and float16 a chunk is LANES elements in order, for bfloat16 it is 2 * LANES elements
 * widened into two vectors, the even-indexed elements and the odd-indexed ones (a shift and a mask
 * of the 32-bit pairs, no shuffle). q and the accumulator use the same order, which a dot product
 * and an axpy do not care about; it is undone once per (query, head) when the output is written.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_HEAD_DIM 256
#define TASK_COST 16 /* a (query, head) task's fixed cost, in keys, when tasks are split between threads */
#define GROUP 16 /* keys scored, exponentiated and accumulated together: a multiple of LANES */
#define CHAINS 4 /* independent sums in a group's weighted sum of values */

#include "vector.h"

#define MAX_VECTORS (MAX_HEAD_DIM / LANES + 2) /* a row's vectors, a padded tail included */

const char *decode_attention_isa(void) {
#if defined(ISA_AVX512) && defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(ISA_AVX512)
    return "avx512";
#elif defined(ISA_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

/* ------------------------------------------------------------- reading rows, per storage type -- */
/* Each type T defines: CHUNK_T elements per chunk; VECTORS_T per chunk; widen_T(p, n, v) filling
 * v[0 .. VECTORS_T) from the chunk's first n elements (the rest read as 0); and store_T, the
 * rounding of a float32 output element to T. */

static inline float bf16_load(uint16_t x) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)x << 16};
    return v.f;
}

static inline uint16_t bf16_store(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16); /* round to nearest even */
}

#define CHUNK_float32 LANES
#define VECTORS_float32 1
static inline void widen_float32(const float *p, int n, vf *v) {
#if defined(ISA_AVX512)
    v[0] = n >= LANES ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
#else
    if (n >= LANES) {
        v[0] = vf_loadu(p);
    } else {
        float tail[LANES] = {0};
        memcpy(tail, p, sizeof(float) * (size_t)n);
        v[0] = vf_loadu(tail);
    }
#endif
}
#define store_float32(x) (x)

#define CHUNK_bfloat16 (2 * LANES)
#define VECTORS_bfloat16 2
static inline void widen_bfloat16(const uint16_t *p, int n, vf *v) {
#if defined(ISA_AVX512)
    const __m512i x = n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
    v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    v[1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
#elif defined(ISA_AVX2)
    uint16_t tail[16] = {0};
    if (n < 16) memcpy(tail, p, sizeof(uint16_t) * (size_t)n);
    const __m256i x = _mm256_loadu_si256((const __m256i *)(n < 16 ? tail : p));
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    v[1] = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
#else
    v[0] = bf16_load(p[0]);
    v[1] = n > 1 ? bf16_load(p[1]) : 0.f;
#endif
}
#define store_bfloat16(x) bf16_store(x)

#ifdef __FLT16_MAX__ /* the compiler has _Float16 (GCC >= 12 and clang on x86-64) */
#define CHUNK_float16 LANES
#define VECTORS_float16 1
static inline void widen_float16(const _Float16 *p, int n, vf *v) {
#if defined(ISA_AVX512)
    const __m256i x = n >= 16 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
    v[0] = _mm512_cvtph_ps(x);
#elif defined(ISA_AVX2)
    _Float16 tail[8] = {0};
    if (n < 8) memcpy(tail, p, sizeof(_Float16) * (size_t)n);
    v[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(n < 8 ? tail : p)));
#else
    (void)n; /* a chunk is one element */
    v[0] = (float)p[0];
#endif
}
#define store_float16(x) ((_Float16)(x))
#endif

/* ------------------------------------------------------------------ reading ahead, sharing out -- */
/* Asks for `bytes` of keys and values from element `at` into L2: a block's keys and values are
 * each one run of addresses, but the runs of one sequence's blocks need not be adjacent. L2 rather
 * than L1: a block of GPT-2's bfloat16 keys and values is 64 lines, more misses than L1 tracks, and
 * asking for L1 stalled the loop (+25% at 512 tokens of context). */
static inline void prefetch_block(const void *keys, const void *values, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch((const char *)keys + b, 0, 2);
        __builtin_prefetch((const char *)values + b, 0, 2);
    }
}

/* The tasks [first, end) of the calling thread: contiguous runs of (query, head) tasks, one per
 * thread, of about equal cost (lens[i] + TASK_COST keys each). Contiguous, so a thread knows its
 * next task and can read ahead for it; by cost, so long and short contexts still share the work
 * evenly (a plain static split would not, and a dynamic one would not know the next task). */
static inline void share_tasks(const int64_t *lens, int64_t n, int64_t H, int64_t total, int64_t *first,
                               int64_t *end) {
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const int64_t threads = 1, me = 0;
#endif
    const int64_t lo = total * me / threads, hi = total * (me + 1) / threads;
    int64_t at = 0, task = 0;
    *first = *end = n * H;
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < H; h++, task++) {
            if (at >= lo && *first == n * H) *first = task;
            if (at >= hi) {
                *end = task;
                return;
            }
            at += lens[i] + TASK_COST;
        }
    }
}

static inline int any_nan(const float *x, int n) {
    for (int j = 0; j < n; j++)
        if (isnan(x[j])) return 1;
    return 0;
}

/* -------------------------------------------------------------------------- the kernel, per type -- */
#define DEFINE_DECODE_ATTENTION(TYPE, T)                                                                    \
    /* The QK dot product with key row k, its lanes not yet summed (vf_hsums sums a group's at once). */ \
    static inline vf dot_##TYPE(const vf *qv, const T *k, int64_t D) {                                      \
        vf s = vf_zero();                                                                                   \
        for (int64_t c = 0, at = 0; at < D; c++, at += CHUNK_##TYPE) {                                      \
            vf kv[VECTORS_##TYPE];                                                                          \
            widen_##TYPE(k + at, (int)(D - at), kv);                                                        \
            for (int u = 0; u < VECTORS_##TYPE; u++) s = vf_fma(qv[c * VECTORS_##TYPE + u], kv[u], s);      \
        }                                                                                                   \
        return s;                                                                                           \
    }                                                                                                       \
    /* acc += sum over j < count of p[j] * row j of V (rows D apart): chunk by chunk, so each           \
     * chunk's accumulators stay in registers across the group, in CHAINS sums of every CHAINS-th row \
     * so that the FMAs do not wait on each other (one chain is latency-bound at small head dims). */  \
    static inline void axpy_group_##TYPE(vf *acc, const float *p, const T *V, int count, int64_t D) {       \
        for (int64_t c = 0, at = 0; at < D; c++, at += CHUNK_##TYPE) {                                      \
            vf a[CHAINS][VECTORS_##TYPE];                                                                   \
            for (int u = 0; u < VECTORS_##TYPE; u++) {                                                      \
                a[0][u] = acc[c * VECTORS_##TYPE + u];                                                      \
                for (int r = 1; r < CHAINS; r++) a[r][u] = vf_zero();                                       \
            }                                                                                               \
            int j = 0;                                                                                      \
            for (; j + CHAINS <= count; j += CHAINS) /* r unrolled: the chains stay in registers */        \
                for (int r = 0; r < CHAINS; r++) {                                                          \
                    vf vv[VECTORS_##TYPE];                                                                  \
                    widen_##TYPE(V + (j + r) * D + at, (int)(D - at), vv);                                  \
                    const vf pj = vf_set1(p[j + r]);                                                        \
                    for (int u = 0; u < VECTORS_##TYPE; u++) a[r][u] = vf_fma(pj, vv[u], a[r][u]);          \
                }                                                                                           \
            for (; j < count; j++) {                                                                        \
                vf vv[VECTORS_##TYPE];                                                                      \
                widen_##TYPE(V + j * D + at, (int)(D - at), vv);                                            \
                const vf pj = vf_set1(p[j]);                                                                \
                for (int u = 0; u < VECTORS_##TYPE; u++) a[0][u] = vf_fma(pj, vv[u], a[0][u]);              \
            }                                                                                               \
            for (int u = 0; u < VECTORS_##TYPE; u++) {                                                      \
                for (int r = 1; r < CHAINS; r++) a[0][u] = vf_add(a[0][u], a[r][u]);                         \
                acc[c * VECTORS_##TYPE + u] = a[0][u];                                                      \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    static void attend_##TYPE(const T *qrow, const T *K0, const T *V0, const int64_t *table, int64_t len,    \
                              int64_t D, int64_t block_size, float scale, T *o) {                           \
        vf qv[MAX_VECTORS], acc[MAX_VECTORS];                                                               \
        int nv = 0;                                                                                         \
        for (int64_t at = 0; at < D; at += CHUNK_##TYPE, nv += VECTORS_##TYPE)                             \
            widen_##TYPE(qrow + at, (int)(D - at), qv + nv);                                                \
        for (int u = 0; u < nv; u++) {                                                                      \
            qv[u] = vf_mul(qv[u], vf_set1(scale));                                                          \
            acc[u] = vf_zero();                                                                             \
        }                                                                                                   \
        DOT_SETUP_##TYPE                                                                                    \
        float m = -INFINITY;                                                                                \
        vf sum = vf_zero(); /* the weights' sum, lane by lane */                                           \
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                                  \
            const int64_t base = table[t0 / block_size] * block_size * D;                                   \
            const T *K = K0 + base, *V = V0 + base;                                                         \
            if (t0 + block_size < len) /* the next block lies elsewhere: no hardware prefetcher guesses it */ \
                prefetch_block(K0 + table[t0 / block_size + 1] * block_size * D,                           \
                               V0 + table[t0 / block_size + 1] * block_size * D, block_size * D * (int64_t)sizeof(T)); \
            const int64_t in_block = len - t0 < block_size ? len - t0 : block_size;                         \
            for (int64_t g = 0; g < in_block; g += GROUP) {                                                 \
                const int count = (int)(in_block - g < GROUP ? in_block - g : GROUP);                      \
                float p[GROUP];                                                                             \
                vf part[GROUP], score[GROUP / LANES], most = vf_set1(-INFINITY);                            \
                for (int j = 0; j < count; j++) part[j] = DOT_##TYPE(K + (g + j) * D);                     \
                for (int j = count; j < GROUP; j++) part[j] = vf_zero();                                    \
                for (int v = 0; v < GROUP / LANES; v++)                                                     \
                    vf_storeu(p + v * LANES, vf_mul(vf_hsums(part + v * LANES), vf_set1(SCORE_SCALE_##TYPE))); \
                for (int j = count; j < GROUP; j++) p[j] = -INFINITY; /* past the group's end: no weight */ \
                for (int v = 0; v < GROUP / LANES; v++) {                                                   \
                    score[v] = vf_loadu(p + v * LANES);                                                     \
                    most = vf_max(score[v], most); /* a NaN score is passed over, as in a scalar max */      \
                }                                                                                           \
                const float top = vf_hmax(most);                                                            \
                if (top == -INFINITY && m == -INFINITY && !any_nan(p, count))                               \
                    continue; /* every weight so far is 0 (scores of -inf): nothing to add, nor -inf - -inf */ \
                if (top > m) { /* a new maximum: rescale what was summed under the old one */               \
                    const vf rescale = vf_set1(expf(m - top));                                              \
                    sum = vf_mul(sum, rescale);                                                             \
                    for (int u = 0; u < nv; u++) acc[u] = vf_mul(acc[u], rescale);                          \
                    m = top;                                                                                \
                }                                                                                           \
                for (int v = 0; v < GROUP / LANES; v++) {                                                   \
                    const vf e = vf_exp(vf_sub(score[v], vf_set1(m)));                                      \
                    sum = vf_add(sum, e);                                                                   \
                    vf_storeu(p + v * LANES, e);                                                            \
                }                                                                                           \
                axpy_group_##TYPE(acc, p, V + g * D, count, D);                                             \
            }                                                                                               \
        }                                                                                                   \
        const float inv = len > 0 ? 1.f / vf_hsum(sum) : 0.f;                                               \
        float flat[MAX_VECTORS * LANES];                                                                    \
        for (int u = 0; u < nv; u++) vf_storeu(flat + u * LANES, vf_mul(acc[u], vf_set1(inv)));             \
        for (int64_t d = 0; d < D; d++) { /* undo the chunk order (see the top of the file) */              \
            const int64_t c = d / CHUNK_##TYPE, e = d % CHUNK_##TYPE;                                       \
            const int64_t lane = VECTORS_##TYPE == 1 ? e : (e % 2) * LANES + e / 2;                         \
            o[d] = store_##TYPE(flat[c * CHUNK_##TYPE + lane]);                                             \
        }                                                                                                   \
    }                                                                                                       \
    int decode_attention_##TYPE(const T *q, int64_t q_row_stride, T *keys, T *values,                        \
                                int64_t head_stride, const int64_t *rows, const int64_t *tables,             \
                                int64_t table_stride, const int64_t *lens, int64_t n, const T *new_k,        \
                                const T *new_v, int64_t new_row_stride, const int64_t *slots, T *out,        \
                                int64_t out_row_stride, int64_t H, int64_t D, int64_t block_size,            \
                                float scale, int nthreads) {                                                 \
        if (D < 1 || D > MAX_HEAD_DIM || block_size < 1) return -1;                                         \
        int64_t total = 0;                                                                                  \
        for (int64_t i = 0; i < n; i++) total += (lens[i] + TASK_COST) * H;                                 \
        _Pragma("omp parallel num_threads(nthreads)") {                                                     \
            int64_t first, end;                                                                             \
            share_tasks(lens, n, H, total, &first, &end);                                                   \
            for (int64_t task = first; task < end; task++) {                                                \
                const int64_t i = task / H, h = task % H;                                                   \
                const int64_t i1 = (task + 1) / H, h1 = (task + 1) % H;                                     \
                if (task + 1 < end && lens[i1] > 0) { /* the next task's first block, read meanwhile */     \
                    const int64_t in_first = lens[i1] < block_size ? lens[i1] : block_size;                 \
                    const int64_t at = h1 * head_stride + tables[i1 * table_stride] * block_size * D;       \
                    prefetch_block(keys + at, values + at, in_first * D * (int64_t)sizeof(T));              \
                }                                                                                           \
                if (new_k != NULL) { /* the row's own key and value, into its arena row */                   \
                    const int64_t from = rows[i] * new_row_stride + h * D;                                  \
                    const int64_t to = h * head_stride + slots[rows[i]] * D;                                \
                    memcpy(keys + to, new_k + from, sizeof(T) * (size_t)D);                                 \
                    memcpy(values + to, new_v + from, sizeof(T) * (size_t)D);                               \
                }                                                                                           \
                attend_##TYPE(q + rows[i] * q_row_stride + h * D, keys + h * head_stride,                   \
                              values + h * head_stride, tables + i * table_stride, lens[i], D, block_size,  \
                              scale, out + rows[i] * out_row_stride + h * D);                               \
            }                                                                                               \
        }                                                                                                   \
        return 0;                                                                                           \
    }

/* The QK dot product of the scaled, widened query with key row k, lanes unsummed, and the factor
 * that scales the summed scores (1: the query was scaled). */
#define DOT_SETUP_float32
#define DOT_float32(k) dot_float32(qv, k, D)
#define SCORE_SCALE_float32 1.f
#define DOT_SETUP_float16
#define DOT_float16(k) dot_float16(qv, k, D)
#define SCORE_SCALE_float16 1.f

#if defined(ISA_AVX512) && defined(__AVX512BF16__)
/* VDPBF16PS multiplies the stored bfloat16 pairs of q and k and sums each pair into a float32
 * lane: half the instructions of widening k. The scale is applied to the sum instead of q, so q
 * stays exactly as stored. */
static inline __m512 dot_bfloat16_pairs(const __m512bh *qb, const uint16_t *k, int64_t D) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t c = 0, at = 0; at < D; c++, at += 32) {
        const __m512i x = D - at >= 32 ? _mm512_loadu_si512(k + at)
                                       : _mm512_maskz_loadu_epi16((__mmask32)((1ull << (D - at)) - 1), k + at);
        s = _mm512_dpbf16_ps(s, qb[c], (__m512bh)x);
    }
    return s;
}
#define DOT_SETUP_bfloat16                                                                                 \
    __m512bh qb[MAX_HEAD_DIM / 32];                                                                         \
    for (int64_t c = 0, at = 0; at < D; c++, at += 32)                                                      \
        qb[c] = (__m512bh)(D - at >= 32 ? _mm512_loadu_si512(qrow + at)                                     \
                                        : _mm512_maskz_loadu_epi16((__mmask32)((1ull << (D - at)) - 1), qrow + at));
#define DOT_bfloat16(k) dot_bfloat16_pairs(qb, k, D)
#define SCORE_SCALE_bfloat16 scale
#else
#define DOT_SETUP_bfloat16
#define DOT_bfloat16(k) dot_bfloat16(qv, k, D)
#define SCORE_SCALE_bfloat16 1.f
#endif

DEFINE_DECODE_ATTENTION(float32, float)
DEFINE_DECODE_ATTENTION(bfloat16, uint16_t)
#ifdef __FLT16_MAX__
DEFINE_DECODE_ATTENTION(float16, _Float16)
#endif
