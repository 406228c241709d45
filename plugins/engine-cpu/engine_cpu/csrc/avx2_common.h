/* Helpers shared by the AVX2 family's sources (gguf_avx2.c, cpu_ops.c). */
#ifndef ENGINE_CPU_AVX2_COMMON_H
#define ENGINE_CPU_AVX2_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the avx2 kernels need AVX2, FMA and F16C"
#endif

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight values from element `at` of x (bfloat16 when bf16, else float32) as float32. */
static inline __m256 load8(const void *x, int bf16, int64_t at) {
    if (bf16) { /* bf16 -> float32: the 16 bits on top */
        __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
    return _mm256_loadu_ps((const float *)x + at);
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16, rounded to nearest even as torch rounds (NaN stays NaN). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Eight float32 -> bfloat16 as float_to_bf16 rounds them: the bits in the low half of each lane */
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd);
    const __m256i even = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(even, quiet, nan);
}

/* v rounded to bfloat16 (as float_to_bf16), as float32 */
static inline __m256 round8_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

/* v rounded to bfloat16 (as float_to_bf16) into p[0 .. 7] */
static inline void store8_bf16(uint16_t *p, __m256 v) {
    const __m256i b = bf16_bits8(v); /* lanes below 2^16: the unsigned saturation keeps them */
    _mm_storeu_si128((__m128i *)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

static inline float load1(const void *x, int bf16, int64_t at) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[at]) : ((const float *)x)[at];
}

static inline void store1(void *x, int bf16, int64_t at, float v) {
    if (bf16)
        ((uint16_t *)x)[at] = float_to_bf16(v);
    else
        ((float *)x)[at] = v;
}

#endif
