/* The worker's C kernels' vector layer: float32 vectors of LANES lanes for the CPU at hand.
 *
 * A kernel is compiled for the machine it runs on (-march=native, see build.py), and the
 * preprocessor picks the widest code its features allow: AVX-512 with BW and VL (16 lanes; the
 * macro ISA_AVX512), AVX2 with FMA and F16C (8 lanes; ISA_AVX2), else portable C (1 lane, plain
 * floats). The same names work in each, so a kernel is written once:
 *   vf_zero() vf_set1(x) vf_add vf_sub vf_mul vf_div vf_fma(a, b, c) = a * b + c, vf_max(a, b) (b where either is
 *   NaN, as x86's max), vf_loadu(p) vf_storeu(p, v), vf_hsum(v) vf_hmax(v) across lanes, and
 *   vf_exp(x): e^x in each lane, and vf_hsums(s): LANES vectors' sums at once (lane j = the sum of s[j]).
 * build.py's cache key covers this file, so a kernel is rebuilt when it changes.
 */
#ifndef GOVERNOR_KERNELS_VECTOR_H
#define GOVERNOR_KERNELS_VECTOR_H

#include <math.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ISA_AVX512 1
#define LANES 16
typedef __m512 vf;
#define vf_zero() _mm512_setzero_ps()
#define vf_set1(x) _mm512_set1_ps(x)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_sub(a, b) _mm512_sub_ps(a, b)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_div(a, b) _mm512_div_ps(a, b)
#define vf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_max(a, b) _mm512_max_ps(a, b)
#define vf_loadu(p) _mm512_loadu_ps(p)
#define vf_storeu(p, v) _mm512_storeu_ps(p, v)
#define vf_hsum(v) _mm512_reduce_add_ps(v)
#define vf_hmax(v) _mm512_reduce_max_ps(v)
#define vf_lt(a, b) _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ)
#define vf_zero_where(m, v) _mm512_maskz_mov_ps((__mmask16)~(m), v)
#define vf_round(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT)
#define vf_pow2i(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
/* Lane j of the result is the sum of s[j]'s lanes, for j < 16: a transpose and add in four rounds
 * of shuffles (45 instructions), a third of sixteen separate reductions'. Each round halves the width
 * each vector holds of a key and doubles the keys it holds; the pairing keeps them in order. */
static inline vf vf_hsums(const vf *s) {
    vf t[8], u[4];
    for (int i = 0; i < 8; i++) { /* key j in the low 256 bits, key j + 4 in the high */
        const int j = i < 4 ? i : i + 4;
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[j], s[j + 4], 0x44), _mm512_shuffle_f32x4(s[j], s[j + 4], 0xEE));
    }
    for (int j = 0; j < 4; j++) /* keys j, j + 4, j + 8, j + 12 in the 128-bit lanes */
        u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[j], t[j + 4], 0x88), _mm512_shuffle_f32x4(t[j], t[j + 4], 0xDD));
    const vf w0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xEE));
    const vf w1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], 0x44), _mm512_shuffle_ps(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(w0, w1, 0x88), _mm512_shuffle_ps(w0, w1, 0xDD));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ISA_AVX2 1
#define LANES 8
typedef __m256 vf;
#define vf_zero() _mm256_setzero_ps()
#define vf_set1(x) _mm256_set1_ps(x)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_sub(a, b) _mm256_sub_ps(a, b)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_div(a, b) _mm256_div_ps(a, b)
#define vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_max(a, b) _mm256_max_ps(a, b)
#define vf_loadu(p) _mm256_loadu_ps(p)
#define vf_storeu(p, v) _mm256_storeu_ps(p, v)
static inline float vf_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vf_hmax(vf v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
#define vf_lt(a, b) _mm256_cmp_ps(a, b, _CMP_LT_OQ)
#define vf_zero_where(m, v) _mm256_andnot_ps(m, v)
#define vf_round(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vf_pow2i(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
/* Lane j of the result is the sum of s[j]'s lanes, for j < 8 (see the AVX-512 version). */
static inline vf vf_hsums(const vf *s) {
    vf t[4];
    for (int j = 0; j < 4; j++) /* key j in the low 128 bits, key j + 4 in the high */
        t[j] = _mm256_add_ps(_mm256_permute2f128_ps(s[j], s[j + 4], 0x20), _mm256_permute2f128_ps(s[j], s[j + 4], 0x31));
    const vf w0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
    const vf w1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(w0, w1, 0x88), _mm256_shuffle_ps(w0, w1, 0xDD));
}
#else
#define LANES 1
typedef float vf;
#define vf_zero() 0.f
#define vf_set1(x) (x)
#define vf_add(a, b) ((a) + (b))
#define vf_sub(a, b) ((a) - (b))
#define vf_mul(a, b) ((a) * (b))
#define vf_div(a, b) ((a) / (b))
#define vf_fma(a, b, c) ((a) * (b) + (c))
#define vf_max(a, b) ((a) > (b) ? (a) : (b))
#define vf_loadu(p) (*(p))
#define vf_storeu(p, v) (*(p) = (v))
#define vf_hsum(v) (v)
#define vf_hmax(v) (v)
#define vf_hsums(s) ((s)[0])
#endif

/* e^x in each lane. Below -87.3 (where float32 leaves its normal range) the answer is 0; NaN stays
 * NaN. The vector versions are Cephes' expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2],
 * within 2 ulp of libm's; they are meant for x <= 0 (a softmax's shifted scores), and overflow
 * past x = 88.7 where libm would give inf. */
#if LANES > 1
static inline vf vf_exp(vf x) {
    const vf lo = vf_set1(-87.33654f);
    const __typeof__(vf_lt(x, lo)) underflow = vf_lt(x, lo); /* NaN compares false and stays */
    x = vf_max(lo, x);                                       /* second operand NaN: NaN kept */
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fma(n, vf_set1(-0.693359375f), x);
    r = vf_fma(n, vf_set1(2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fma(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fma(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fma(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fma(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fma(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fma(vf_mul(p, r), r, vf_add(r, vf_set1(1.f)));
    return vf_zero_where(underflow, vf_mul(p, vf_pow2i(n)));
}
#else
#define vf_exp(x) expf(x)
#endif

#endif
