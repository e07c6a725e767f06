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
 * Scores, the softmax and the weighted sum are computed in float32 whatever the storage type.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_HEAD_DIM 256

static inline float bf16_load(uint16_t x) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)x << 16};
    return v.f;
}

static inline uint16_t bf16_store(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16); /* round to nearest even */
}

#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                      \
    int NAME(const T *q, int64_t q_row_stride, const T *keys, const T *values, int64_t head_stride,        \
             const int64_t *rows, const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t n, \
             T *out, int64_t out_row_stride, int64_t H, int64_t D, int64_t block_size, float scale,         \
             int nthreads) {                                                                                \
        if (D > MAX_HEAD_DIM) return -1;                                                                    \
        int failed = 0;                                                                                     \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                              \
        for (int64_t task = 0; task < n * H; task++) {                                                      \
            int64_t i = task / H, h = task % H, len = lens[i];                                              \
            const T *qv = q + rows[i] * q_row_stride + h * D;                                               \
            const int64_t *table = tables + i * table_stride;                                               \
            float qf[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];                                                      \
            float *scores = malloc(sizeof(float) * (size_t)(len > 0 ? len : 1));                            \
            if (scores == NULL) {                                                                           \
                _Pragma("omp atomic write") failed = 1;                                                     \
                continue;                                                                                   \
            }                                                                                               \
            for (int64_t d = 0; d < D; d++) {                                                               \
                qf[d] = LOAD(qv[d]) * scale;                                                                \
                acc[d] = 0.f;                                                                               \
            }                                                                                               \
            float m = -INFINITY;                                                                            \
            for (int64_t t0 = 0; t0 < len; t0 += block_size) { /* block by block: no division per token */  \
                const T *K = keys + h * head_stride + table[t0 / block_size] * block_size * D;               \
                const int64_t count = len - t0 < block_size ? len - t0 : block_size;                        \
                for (int64_t j = 0; j < count; j++) {                                                       \
                    const T *k = K + j * D;                                                                 \
                    float s = 0.f;                                                                          \
                    _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s += qf[d] * LOAD(k[d]); \
                    scores[t0 + j] = s;                                                                     \
                    if (s > m) m = s;                                                                       \
                }                                                                                           \
            }                                                                                               \
            float sum = 0.f;                                                                                \
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                             \
                const T *V = values + h * head_stride + table[t0 / block_size] * block_size * D;             \
                const int64_t count = len - t0 < block_size ? len - t0 : block_size;                        \
                for (int64_t j = 0; j < count; j++) {                                                       \
                    const float p = expf(scores[t0 + j] - m);                                               \
                    const T *v = V + j * D;                                                                 \
                    sum += p;                                                                               \
                    _Pragma("omp simd") for (int64_t d = 0; d < D; d++) acc[d] += p * LOAD(v[d]);           \
                }                                                                                           \
            }                                                                                               \
            free(scores);                                                                                   \
            const float inv = len > 0 ? 1.f / sum : 0.f;                                                    \
            T *o = out + rows[i] * out_row_stride + h * D;                                                  \
            for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[d] * inv);                                     \
        }                                                                                                   \
        return failed ? -2 : 0;                                                                             \
    }

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
DEFINE_DECODE_ATTENTION(decode_attention_float32, float, F32_LOAD, F32_STORE)
DEFINE_DECODE_ATTENTION(decode_attention_bfloat16, uint16_t, bf16_load, bf16_store)

#ifdef __FLT16_MAX__ /* the compiler has _Float16 (GCC >= 12 and clang on x86-64) */
#define F16_LOAD(x) ((float)(x))
#define F16_STORE(x) ((_Float16)(x))
DEFINE_DECODE_ATTENTION(decode_attention_float16, _Float16, F16_LOAD, F16_STORE)
#endif
