/* The layout word and the scale rows of the AVX2 family's GGUF products, shared by
 * gguf_avx2.c (the AVX2 instructions) and gguf_vnni.c (AVX-512 VNNI); gguf_avx2.c's header
 * describes the packings. */
#ifndef ENGINE_CPU_GGUF_LAYOUT_H
#define ENGINE_CPU_GGUF_LAYOUT_H

#include "avx2_common.h"

enum { PACK_U8 = 0, PACK_U4 = 1, PACK_S8 = 2, PACK_U6 = 3, PACK_U5 = 4 };

/* (PACK_U6 and PACK_U5 have no block of their own: rows of whole groups of 8 blocks only, see
 * gguf_avx2.c) */
static inline int64_t block_bytes_of(int pack) { return pack == PACK_U4 ? 16 : 32; }

/* Bytes of a packed row of K values */
static inline int64_t row_bytes_of(int pack, int64_t K) {
    return pack == PACK_U4   ? K / 2
           : pack == PACK_U6 ? K / 4 * 3
           : pack == PACK_U5 ? K / 8 * 5
                             : K;
}

/* Vector v (0-7) of the 32 values of a PACK_U6 (hb = 2, 192 bytes) or PACK_U5 (hb = 1, 160
 * bytes) group of 8 blocks at `group`: the low nibbles (v < 4) or high nibbles (v >= 4) of bytes
 * 32 (v % 4) .. of the first 128 (as PACK_U4), plus 16 times the hb bits hb (v / hb) .. of bytes
 * 32 (v % hb) .. of the high plane that follows (64 or 32 bytes). Those bits move to bit 4 by
 * one 16-bit shift of at most 4 (left by 4 - hb (v / hb), right when negative), and the mask
 * keeps bits from the same byte. The lookups' twin is gguf_avx2.c's split_plane_chunk. */
static inline __m256i split_plane_vec(const uint8_t *group, int v, int hb) {
    const __m256i nib = _mm256_set1_epi8(0x0f);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(group + 32 * (v % 4)));
    const __m256i lo = v < 4 ? _mm256_and_si256(raw, nib)
                             : _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(group + 128 + 32 * (v % hb)));
    const int sh = 4 - hb * (v / hb);
    const __m256i hs = sh > 0 ? _mm256_slli_epi16(h, sh) : sh < 0 ? _mm256_srli_epi16(h, -sh) : h;
    const __m256i top = _mm256_set1_epi8((char)(((1 << hb) - 1) << 4)); /* 0x30 or 0x10 */
    return _mm256_or_si256(lo, _mm256_and_si256(hs, top));
}
static inline __m256i u6_vec(const uint8_t *group, int v) { return split_plane_vec(group, v, 2); }
static inline __m256i u5_vec(const uint8_t *group, int v) { return split_plane_vec(group, v, 1); }

/* The packing and the zero point of a layout word (see gguf_avx2.c's header); for the
 * products, bit 8 asks for y in bfloat16 (rounded to nearest even, as torch's conversion of the
 * float32 y). */
static inline int pack_of(int word) { return word & 0xff; }
static inline int y_bf16_of(int word) { return (word >> 8) & 1; }
/* Bit 9: the scales are float16 (PACK_S8 only: Q8_0's own scales, exact in float16, 2 bytes a
 * block fewer to read; converted 8 at a time, a group of 8 blocks costs one conversion). */
static inline int scales16_of(int word) { return (word >> 9) & 1; }
/* Bit 10: the products keep to the AVX2 instructions on a CPU with AVX-512 VNNI (tests of the
 * AVX2 path there; engine_cpu/gguf.py sets it). */
static inline int avx2_only_of(int word) { return (word >> 10) & 1; }
static inline int zero_of(int word) { return (word >> 16) & 0xff; }
/* Bit 11: the K-quants' compact scales (Q4_K, Q5_K, Q6_K; rows a multiple of 256 values). The
 * scales array then holds, per row, one record a super-block of 256 values as the GGUF block
 * holds its scales: Q4_K / Q5_K (32-value groups) 20 bytes, float16 d and dmin then 8 uint8
 * sub-scales sc and 8 uint8 mins m, a group's scale d * sc and its offset -(dmin * m);
 * Q6_K (16-value groups, zero point 32) 18 bytes, float16 d then 16 int8 sub-scales sc, a
 * group's scale d * sc. A float16 times an integer below 2^8 in magnitude is exact in float32,
 * so these are bit for bit the float32 scales and offsets of the other form, computed where
 * they are used; the offsets argument is NULL. */
static inline int kscales_of(int word) { return (word >> 11) & 1; }
enum { KREC_MIN = 20, KREC_Q6 = 18 };
static inline int64_t krec_bytes(int group) { return group == 16 ? KREC_Q6 : KREC_MIN; }

/* Bytes of one row's scales: [K / group] float32 (or float16 when sc16), or K / 256 records */
static inline int64_t scale_row_bytes(int sc16, int ks, int64_t K, int group) {
    return ks ? (K / 256) * krec_bytes(group) : (K / group) * (sc16 ? 2 : 4);
}

/* Row n's scales */
static inline const float *scale_row(const float *scales, int sc16, int ks, int64_t n,
                                     int64_t K, int group) {
    return (const float *)((const char *)scales + n * scale_row_bytes(sc16, ks, K, group));
}

/* The record of super-block sb of a row of compact scales */
static inline const uint8_t *krec(const float *s, int group, int64_t sb) {
    return (const uint8_t *)s + sb * krec_bytes(group);
}
static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Compact scales: the 8 scales of the 32-value groups of super-block sb (Q4_K / Q5_K), its 8
 * offsets -(dmin * m) negated (dmin * m: the caller subtracts), and Q6_K's 16 scales as two
 * vectors (groups 0-7, 8-15 of the super-block). */
static inline __m256 kscales8(const float *s, int64_t sb) {
    const uint8_t *r = krec(s, 32, sb);
    const __m128i raw = _mm_loadl_epi64((const __m128i *)(r + 4));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw));
    return _mm256_mul_ps(_mm256_set1_ps(f16_at(r)), sc);
}
static inline __m256 kmins8(const float *s, int64_t sb) {
    const uint8_t *r = krec(s, 32, sb);
    const __m128i raw = _mm_loadl_epi64((const __m128i *)(r + 12));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw));
    return _mm256_mul_ps(_mm256_set1_ps(f16_at(r + 2)), m);
}
static inline __m256 kscales8_q6(const float *s, int64_t sb, int half) {
    const uint8_t *r = krec(s, 16, sb);
    const __m256 sc = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(r + 2 + 8 * half))));
    return _mm256_mul_ps(_mm256_set1_ps(f16_at(r)), sc);
}

/* Group g's scale and offset (compact scales), one at a time (lookups, dequantization) */
static inline float kscale1(const float *s, int group, int64_t g) {
    const int per = 256 / group;
    const uint8_t *r = krec(s, group, g / per);
    if (group == 16)
        return f16_at(r) * (float)(int8_t)r[2 + g % per];
    return f16_at(r) * (float)r[4 + g % per];
}
static inline float koffset1(const float *s, int64_t g) {
    const uint8_t *r = krec(s, 32, g / 8);
    return -(f16_at(r + 2) * (float)r[12 + g % 8]);
}

/* Whether this library was compiled with the AVX-512 VNNI products (gguf_vnni.c): -march=native
 * on a CPU with AVX-512 F, BW, VL and VNNI. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&                 \
    defined(__AVX512VNNI__)
#define GGUF_HAVE_VNNI 1
/* y = x W^T as gguf_avx2_gemm's (same arguments), in AVX-512 VNNI dot products */
void gguf_vnni_gemm(const uint8_t *values, int layout, const float *scales, const float *offsets,
                    int64_t N, int64_t K, int group, const int8_t *xq, const float *xd,
                    const float *xs, int64_t M, void *y, int64_t ldy);
#else
#define GGUF_HAVE_VNNI 0
#endif

#endif
