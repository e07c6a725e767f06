/* int8 linear layers: y = x @ W + b with W stored as int8 (one scale per output column) and x
 * quantized per row on the fly, in one call: quantize, integer GEMM, scale back, and for the MLP's
 * first layer GPT-2's GELU (worker/int8.py). The GELU as a post-op: 0.24 against 0.37 ms for a
 * separate torch op after the layer at 32 x 768 -> 3,072, 4.0 against 6.0 ms at 512 rows (2-core Zen 4).
 *
 * Why a kernel of its own: torch's `_int_mm` takes W as a plain tensor, so oneDNN reorders it on
 * every call, and the quantization and the scale-back around it are separate passes: at batch 32
 * on a 2-core Zen 4 they were 16-21% of a layer's time, 47% of a 768 x 768 one. Here W is packed
 * once, at load, in the order the vector loop reads it, and each thread keeps a tile of W's
 * columns in its cache while every row of x goes past it.
 *
 * Three vector paths, chosen by what the CPU has (the library is compiled for it, build.py):
 * - AVX512-VNNI: `vpdpbusd` multiplies unsigned by signed bytes and adds groups of four into
 *   int32 without saturating. x is stored offset by 128 (unsigned), and 128 x each column's sum is
 *   taken back in the scale-back (`col_corr`).
 * - AVX2 (Zen 3, Haswell on): `vpmaddubsw` sums pairs of products into int16 and saturates, which
 *   is why oneDNN's AVX2 int8 GEMM is wrong for full-range weights. With both sides within
 *   [-127, 127] and x's sign moved onto W (`vpsignb`, `vpabsb`: |x| times +-w), a pair sums to at
 *   most 2 x 127 x 127 = 32,258 < 32,767: exact. `vpmaddwd` then widens pairs into int32.
 * - portable C, the same arithmetic one element at a time.
 *
 * Packed layout: columns in tiles of TILE = 4 vectors (64 columns with AVX-512, 32 with AVX2);
 * within a tile, for each group of four rows of W (k, k+1, k+2, k+3), the tile's columns in order,
 * four bytes each (that column's four weights): one vector load feeds a vector of int32 lanes.
 * N is padded to a whole tile and K to a multiple of 4 with zero weights.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector.h" /* float vectors for the GELU: vf_exp (its own ISA choice, independent of the GEMM's) */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define INT8_VNNI 1
#define LANES32 16
#elif defined(__AVX2__)
#include <immintrin.h>
#define INT8_AVX2 1
#define LANES32 8
#else
#define LANES32 16
#endif
#define TILE (4 * LANES32) /* columns per tile: four vectors of int32 lanes */
#define ROWS 4             /* rows of x per pass over a tile */
#define OFFSET 128         /* VNNI: x stored as q + 128 */

const char *int8_linear_isa(void) {
#if defined(INT8_VNNI)
    return "avx512_vnni";
#elif defined(INT8_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

int64_t int8_linear_tile(void) { return TILE; }

/* Bytes of the packed form of a [k, n] weight. */
int64_t int8_packed_bytes(int64_t k, int64_t n) { return round_up(k, 4) * round_up(n, TILE); }

/* Pack w [k, n] (int8, rows `stride` apart, values in [-127, 127]) into `packed`
 * (int8_packed_bytes(k, n) bytes), and col_corr [round_up(n, TILE)]: 128 x each column's sum. */
void int8_pack(const int8_t *w, int64_t k, int64_t n, int64_t stride, int8_t *packed, int32_t *col_corr) {
    const int64_t groups = round_up(k, 4) / 4, n_pad = round_up(n, TILE);
    for (int64_t j = 0; j < n_pad; j++) {
        const int64_t tile = j / TILE, c = j % TILE;
        int32_t sum = 0;
        for (int64_t g = 0; g < groups; g++) {
            int8_t *dst = packed + ((tile * groups + g) * TILE + c) * 4;
            for (int r = 0; r < 4; r++) {
                const int64_t row = 4 * g + r;
                dst[r] = (j < n && row < k) ? w[row * stride + j] : 0;
                sum += dst[r];
            }
        }
        col_corr[j] = OFFSET * sum;
    }
}

/* One row of x to bytes: q = round(x / s), s = max|x| / 127 (a zero row: s = the smallest normal
 * float, q = 0), stored as q + 128 for VNNI and as q otherwise; K's padding is zero (q = 0). |q| is
 * at most 127 by construction (x / s within +-127, rounded to nearest even). */
static float quantize_row(const float *x, int64_t k, int64_t k_pad, uint8_t *q) {
    int64_t i = 0;
    float amax = 0.f;
#if defined(INT8_VNNI)
    __m512 vmax = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    amax = _mm512_reduce_max_ps(vmax);
#elif defined(INT8_AVX2)
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(magnitude, _mm256_loadu_ps(x + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
#endif
    for (; i < k; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float scale = fmaxf(amax, 1.17549435e-38f) / 127.f;
    const float inv = 1.f / scale;
    i = 0;
#if defined(INT8_VNNI)
    const int bias = OFFSET;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i offset = _mm512_set1_epi32(OFFSET);
    for (; i + 16 <= k; i += 16) {
        const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv)), offset);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtusepi32_epi8(v));
    }
#elif defined(INT8_AVX2)
    const int bias = 0;
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; i + 32 <= k; i += 32) {
        __m256i v[4];
        for (int c = 0; c < 4; c++) v[c] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * c), vinv));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
#else
    const int bias = 0;
#endif
    for (; i < k; i++) {
        float v = nearbyintf(x[i] * inv);
        v = fminf(fmaxf(v, -127.f), 127.f);
        q[i] = (uint8_t)((int)v + bias);
    }
    for (i = k; i < k_pad; i++) q[i] = (uint8_t)bias;
    return scale;
}

/* The int32 products of ROWS rows of quantized x (`a`, rows `k_pad` apart) with one tile of
 * packed W (`b`), into acc [ROWS][TILE]. */
static void tile_product(const uint8_t *a, int64_t k_pad, const int8_t *b, int32_t acc[ROWS][TILE]) {
    const int64_t groups = k_pad / 4;
#if defined(INT8_VNNI)
    __m512i s[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *bg = b + g * TILE * 4;
        const __m512i b0 = _mm512_loadu_si512(bg), b1 = _mm512_loadu_si512(bg + 64);
        const __m512i b2 = _mm512_loadu_si512(bg + 128), b3 = _mm512_loadu_si512(bg + 192);
        for (int r = 0; r < ROWS; r++) {
            int32_t four;
            memcpy(&four, a + r * k_pad + 4 * g, 4);
            const __m512i x = _mm512_set1_epi32(four);
            s[r][0] = _mm512_dpbusd_epi32(s[r][0], x, b0);
            s[r][1] = _mm512_dpbusd_epi32(s[r][1], x, b1);
            s[r][2] = _mm512_dpbusd_epi32(s[r][2], x, b2);
            s[r][3] = _mm512_dpbusd_epi32(s[r][3], x, b3);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_si512(acc[r] + 16 * c, s[r][c]);
#elif defined(INT8_AVX2)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < 4; c++) s[r][c] = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *bg = b + g * TILE * 4;
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)bg);
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(bg + 32));
        const __m256i b2 = _mm256_loadu_si256((const __m256i *)(bg + 64));
        const __m256i b3 = _mm256_loadu_si256((const __m256i *)(bg + 96));
        for (int r = 0; r < ROWS; r++) {
            int32_t four;
            memcpy(&four, a + r * k_pad + 4 * g, 4);
            const __m256i x = _mm256_set1_epi32(four), ax = _mm256_abs_epi8(x);
#define AVX2_STEP(c, bc) \
    s[r][c] = _mm256_add_epi32(s[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(bc, x)), ones))
            AVX2_STEP(0, b0);
            AVX2_STEP(1, b1);
            AVX2_STEP(2, b2);
            AVX2_STEP(3, b3);
#undef AVX2_STEP
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < 4; c++) _mm256_storeu_si256((__m256i *)(acc[r] + 8 * c), s[r][c]);
#else
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < TILE; c++) acc[r][c] = 0;
    for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < ROWS; r++) {
            const int8_t *x = (const int8_t *)(a + r * k_pad + 4 * g);
            for (int c = 0; c < TILE; c++) {
                const int8_t *w = b + (g * TILE + c) * 4;
                acc[r][c] += x[0] * w[0] + x[1] * w[1] + x[2] * w[2] + x[3] * w[3];
            }
        }
#endif
}

/* GPT-2's GELU (its tanh approximation) over y[0, n), in place, as the layer's post-op: the row
 * segment is still in L1, where a separate torch op would read and write the whole output again.
 * 0.5 y (1 + tanh(z)) = y sigmoid(2z), z = sqrt(2/pi) (y + 0.044715 y^3); with e = exp(-2|z|) in
 * (0, 1] (where vf_exp is exact to 2 ulp and cannot overflow), sigmoid(2z) = 1 / (1 + e) for z >= 0
 * and e / (1 + e) below. */
static inline float gelu_scalar(float y) {
    const float z = 0.7978845608f * (y + 0.044715f * y * y * y);
    return 0.5f * y * (1.f + tanhf(z));
}

static void gelu_inplace(float *y, int64_t n) {
    int64_t i = 0;
#if LANES > 1
    const vf c = vf_set1(0.7978845608f), k = vf_set1(0.044715f), one = vf_set1(1.f);
    for (; i + LANES <= n; i += LANES) {
        const vf v = vf_loadu(y + i);
        const vf z = vf_mul(c, vf_fma(vf_mul(k, v), vf_mul(v, v), v));
        const vf e = vf_exp(vf_mul(vf_set1(-2.f), vf_max(z, vf_mul(z, vf_set1(-1.f)))));
        const vf below = vf_zero_where(vf_lt(vf_zero(), z), vf_add(e, vf_set1(-1.f))); /* e - 1 where z <= 0 */
        vf_storeu(y + i, vf_mul(v, vf_div(vf_add(one, below), vf_add(one, e))));
    }
#endif
    for (; i < n; i++) y[i] = gelu_scalar(y[i]);
}

/* The quantized rows' buffer: one per calling thread, grown as needed and kept (a decode step
 * calls this dozens of times with the same sizes; fresh memory each time would fault its pages in).
 * Its size is the largest call's rows x inner size: a prefill of 8,192 tokens into a 3,072-wide
 * input keeps 25 MB. Rows past m (to a whole ROWS) are computed and never stored. int32 sums stay
 * exact to K = 2^31 / (255 x 127), about 66,000. */
static _Thread_local uint8_t *rows_buffer = NULL;
static _Thread_local int64_t rows_capacity = 0;

/* out [m, n] (rows `out_stride` apart) = x [m, k] (rows `x_stride` apart) @ W + bias, W packed by
 * int8_pack with its col_corr and col_scales [n]; bias [n] or NULL; `gelu`: GPT-2's GELU applied to
 * it. 0, or -1 where the buffer cannot be had. */
int int8_linear(const float *x, int64_t m, int64_t k, int64_t x_stride, const int8_t *packed, const int32_t *col_corr,
                const float *col_scales, const float *bias, int64_t n, float *out, int64_t out_stride, int gelu,
                int nthreads) {
    const int64_t k_pad = round_up(k, 4), m_pad = round_up(m, ROWS), tiles = round_up(n, TILE) / TILE;
    const int64_t need = m_pad * k_pad + m_pad * (int64_t)sizeof(float);
    if (need > rows_capacity) {
        uint8_t *grown = realloc(rows_buffer, (size_t)need);
        if (grown == NULL) return -1;
        rows_buffer = grown, rows_capacity = need;
    }
    uint8_t *a = rows_buffer;
    float *row_scales = (float *)(rows_buffer + m_pad * k_pad);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m_pad; r++) {
            if (r < m) {
                row_scales[r] = quantize_row(x + r * x_stride, k, k_pad, a + r * k_pad);
            } else {
                memset(a + r * k_pad, 0, (size_t)k_pad), row_scales[r] = 0.f;
            }
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int32_t acc[ROWS][TILE] __attribute__((aligned(64)));
            const int8_t *b = packed + t * k_pad * TILE;
            const int64_t j0 = t * TILE, cols = n - j0 < TILE ? n - j0 : TILE;
#if defined(INT8_VNNI)
            const int32_t *corr = col_corr + j0;
#else
            (void)col_corr; /* x was not offset: nothing to take back */
#endif
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
                tile_product(a + r0 * k_pad, k_pad, b, acc);
                for (int r = 0; r < ROWS && r0 + r < m; r++) {
                    float *y = out + (r0 + r) * out_stride + j0;
                    const float rs = row_scales[r0 + r];
                    for (int64_t c = 0; c < cols; c++) {
#if defined(INT8_VNNI)
                        const float v = (float)(acc[r][c] - corr[c]);
#else
                        const float v = (float)acc[r][c];
#endif
                        y[c] = v * (rs * col_scales[j0 + c]) + (bias ? bias[j0 + c] : 0.f);
                    }
                    if (gelu) gelu_inplace(y, cols);
                }
            }
        }
    }
    return 0;
}
