/* Greedy decoding's argmax: the index of each row's largest logit, straight from the stored type.
 *
 * torch's CPU argmax has no vectorised path for 16-bit floats and a slow one for float32: over a
 * step's [32, 50257] logits it took 2.9 ms in bfloat16 and 0.76 ms in float32 on a 2-core Zen 4,
 * 3% of a decode step. Here a row is read twice, in vectors of float32 lanes (a 16-bit element is
 * widened in registers): once for its maximum, once for the first index holding it. The answer is
 * torch.argmax's: the first index of the maximum, and where a row holds a NaN, the first NaN's
 * index (NaN counts as the largest value), found by a plain scan of that row.
 *
 * Compiled for the CPU at hand (see build.py and vector.h): AVX-512 (16 lanes), AVX2 (8), or portable C.
 */
#include <math.h>
#include <stdint.h>

#include "vector.h"

#if defined(ISA_AVX512)
#define vf_nan_lanes(v) ((unsigned)_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q))
#define vf_equal_lanes(v, m) ((unsigned)_mm512_cmp_ps_mask(v, m, _CMP_EQ_OQ))
#define load_float32(p) _mm512_loadu_ps(p)
#define load_bfloat16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define load_float16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#elif defined(ISA_AVX2)
#define vf_nan_lanes(v) ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)))
#define vf_equal_lanes(v, m) ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, m, _CMP_EQ_OQ)))
#define load_float32(p) _mm256_loadu_ps(p)
#define load_bfloat16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define load_float16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#endif
#define VECTOR_CODE (LANES > 1) /* else every row is scanned */

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)x << 16};
    return v.f;
}
#define scalar_float32(x) (x)
#define scalar_bfloat16(x) bf16_to_float(x)
#define scalar_float16(x) ((float)(x))

#define DEFINE_ARGMAX(TYPE, T)                                                                              \
    static int64_t scan_##TYPE(const T *x, int64_t V) {                                                     \
        int64_t best = 0;                                                                                   \
        float top = scalar_##TYPE(x[0]);                                                                    \
        for (int64_t i = 0; i < V; i++) {                                                                   \
            const float v = scalar_##TYPE(x[i]);                                                            \
            if (isnan(v)) return i;                                                                         \
            if (v > top) top = v, best = i;                                                                 \
        }                                                                                                   \
        return best;                                                                                        \
    }                                                                                                       \
    static int64_t row_##TYPE(const T *x, int64_t V) {                                                      \
        if (!VECTOR_CODE || V < 2 * LANES) return scan_##TYPE(x, V);                                          \
        VECTOR_ROW_##TYPE                                                                                   \
    }                                                                                                       \
    int argmax_##TYPE(const T *x, int64_t n, int64_t V, int64_t row_stride, int64_t *out, int nthreads) {   \
        if (V < 1) return -1;                                                                               \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                  \
        for (int64_t r = 0; r < n; r++) out[r] = row_##TYPE(x + r * row_stride, V);                         \
        return 0;                                                                                           \
    }

#if VECTOR_CODE
/* The maximum over whole vectors and the tail, then the first vector holding it. */
#define VECTOR_ROW(TYPE)                                                                                    \
    vf top = load_##TYPE(x);                                                                                \
    unsigned nan = vf_nan_lanes(top);                                                                       \
    int64_t i = LANES;                                                                                      \
    for (; i + LANES <= V; i += LANES) {                                                                    \
        const vf v = load_##TYPE(x + i);                                                                    \
        nan |= vf_nan_lanes(v);                                                                             \
        top = vf_max(top, v);                                                                               \
    }                                                                                                       \
    float m = vf_hmax(top);                                                                                 \
    for (int64_t t = i; t < V; t++) {                                                                       \
        const float v = scalar_##TYPE(x[t]);                                                                \
        nan |= isnan(v);                                                                                    \
        m = v > m ? v : m;                                                                                  \
    }                                                                                                       \
    if (nan) return scan_##TYPE(x, V);                                                                      \
    const vf target = vf_set1(m);                                                                           \
    for (int64_t at = 0; at + LANES <= V; at += LANES) {                                                    \
        const unsigned hit = vf_equal_lanes(load_##TYPE(x + at), target);                                   \
        if (hit) return at + __builtin_ctz(hit);                                                            \
    }                                                                                                       \
    for (int64_t t = V - V % LANES; t < V; t++)                                                             \
        if (scalar_##TYPE(x[t]) == m) return t;                                                             \
    return scan_##TYPE(x, V); /* not reached: m is one of the row's values */
#define VECTOR_ROW_float32 VECTOR_ROW(float32)
#define VECTOR_ROW_bfloat16 VECTOR_ROW(bfloat16)
#define VECTOR_ROW_float16 VECTOR_ROW(float16)
#else
#define VECTOR_ROW_float32 return scan_float32(x, V);
#define VECTOR_ROW_bfloat16 return scan_bfloat16(x, V);
#define VECTOR_ROW_float16 return scan_float16(x, V);
#endif

DEFINE_ARGMAX(float32, float)
DEFINE_ARGMAX(bfloat16, uint16_t)
#ifdef __FLT16_MAX__ /* the compiler has _Float16 */
DEFINE_ARGMAX(float16, _Float16)
#endif
