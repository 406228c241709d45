/* Quantized GGUF matmuls with AVX-512 VNNI (VPDPBUSD), for x86-64 CPUs that have it and no AMX
 * (Intel since Ice Lake and Cascade Lake, AMD since Zen 4): the products of gguf_avx2.c, on the
 * same packed weights and quantized activations (its header describes both), which
 * gguf_avx2_gemm hands here for 2 or more activation rows where this library was compiled
 * with AVX-512 F, BW, VL and VNNI (one row stays with the AVX2 instructions, which read the
 * weights faster there).
 *
 * What differs from the AVX2 instructions:
 *  - one VPDPBUSD (unsigned bytes times signed bytes, four products added into each int32 lane,
 *    no saturation) replaces VPMADDUBSW + VPMADDWD + VPADDD, on 64 bytes instead of 32. A
 *    64-byte vector is two of gguf_avx2.c's 32-byte ones, so lanes l and l + 8 hold the same
 *    block (l mod 8 in a group of 8 blocks, l mod 4 in the group of 4): the float lanes are
 *    scaled with the group's scales repeated, and stay 16 wide to one horizontal sum a result;
 *  - Q8_0's signed values q are read as q + 128 (an XOR of the sign bit, once per weight vector
 *    for all the activation rows of a tile) instead of the sign trick's two VPSIGNB per vector
 *    and row, and take the offset term of the types with a zero point, -128 * s * xs;
 *  - register tiles of 2 weight rows by up to 4 activation rows: each weight vector is loaded
 *    once for four rows, each activation vector once for two weight rows;
 *  - the offset terms sum_g o[g] * xs[g] 16 groups an FMA into the same accumulator (with the
 *    K-quants' compact scales, gguf_layout.h, the offsets -(dmin * m) or Q6_K's scales are
 *    computed from the records there, the same float32 values).
 * A block's int32 lane sum is exact (at most 32 * 255 * 127 < 2^24, so its float32 conversion
 * too). Every (weight row, activation row) pair runs the same instructions in the same order
 * whichever tile it falls in, so a row's result does not depend on the rows batched with it
 * (from 2 rows on; alone, it is gguf_avx2.c's, which adds in another order).
 */
#include "gguf_layout.h"

#if GGUF_HAVE_VNNI

/* Weight rows and activation rows of a register tile; above MB activation rows, tiles of NT
 * weight rows against MB activation rows (gguf_avx2.c's cache tiling for prefills). */
enum { WB = 2, RB = 4, MB = 128, NT = 16 };
_Static_assert(WB * RB == 8, "store_tile sums eight accumulators");

/* v in both 256-bit halves */
static inline __m512 dup8(__m256 v) {
    const __m512 z = _mm512_castps256_ps512(v);
    return _mm512_shuffle_f32x4(z, z, 0x44);
}

/* Scales i .. i + 7 of a row (float32, or float16 when sc16), in both halves */
static inline __m512 scales8x2(const float *s, int sc16, int64_t i) {
    return dup8(sc16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + i)))
                     : _mm256_loadu_ps(s + i));
}

/* Scales i .. i + 3 of a row, in each quarter */
static inline __m512 scales4x4(const float *s, int sc16, int64_t i) {
    return _mm512_broadcast_f32x4(
        sc16 ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)s + i)))
             : _mm_loadu_ps(s + i));
}

/* Values i .. i + 15 of a row of n (float32, or float16 when sc16), zeros from n on */
static inline __m512 load16(const float *s, int sc16, int64_t i, int64_t n) {
    const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
    if (sc16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)s + i));
    return _mm512_maskz_loadu_ps(m, s + i);
}

/* Compact scales (gguf_layout.h): Q6_K's 16 scales of super-block sb */
static inline __m512 kscales16_q6(const float *s, int64_t sb) {
    const uint8_t *r = krec(s, 16, sb);
    const __m128i raw = _mm_loadu_si128((const __m128i *)(r + 2));
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    return _mm512_mul_ps(_mm512_set1_ps(f16_at(r)), sc);
}

/* Compact scales: the offsets -(dmin * m) of 32-value groups g .. g + 15 of a row of ng (Q4_K /
 * Q5_K; g a multiple of 8), zeros from ng on as load16's */
static inline __m512 koffsets16(const float *s, int64_t g, int64_t ng) {
    const __m256 lo = kmins8(s, g / 8);
    const __m256 hi = g + 8 < ng ? kmins8(s, g / 8 + 1) : _mm256_setzero_ps();
    const __m512i dm = _mm512_castps_si512(
        _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1));
    const __mmask16 m = g + 8 < ng ? (__mmask16)0xffff : (__mmask16)0x00ff;
    /* negated (exact, -0 for m = 0 as the stored offsets), +0 outside the row */
    return _mm512_castsi512_ps(_mm512_maskz_xor_epi32(m, dm, _mm512_set1_epi32((int)0x80000000u)));
}

static inline __m512i unsigned_q8(__m512i v, int pack) {
    return pack == PACK_S8 ? _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)) : v;
}

/* Vector j (0-3) of the group of 8 blocks at block g0 of a weight row, as unsigned bytes:
 * vectors 2j and 2j + 1 of gguf_avx2.c's order (for PACK_U4, the low nibbles of the group's
 * 128 bytes are vectors 0-3, the high ones 4-7) */
static inline __m512i wvec8(const uint8_t *w, int64_t g0, int j, int pack) {
    if (pack == PACK_U6) { /* positions 64 j ..: gguf_layout.h's u6_vec, 64 bytes at a time */
        const uint8_t *grp = w + 24 * g0;
        const __m512i raw = _mm512_loadu_si512((const void *)(grp + 64 * (j & 1)));
        const __m512i lo = _mm512_and_si512(j < 2 ? raw : _mm512_srli_epi16(raw, 4),
                                            _mm512_set1_epi8(0x0f));
        const __m512i h = _mm512_loadu_si512((const void *)(grp + 128));
        const int sh = 4 - 2 * j;
        const __m512i hs = sh > 0   ? _mm512_slli_epi16(h, sh)
                           : sh < 0 ? _mm512_srli_epi16(h, -sh)
                                    : h;
        return _mm512_or_si512(lo, _mm512_and_si512(hs, _mm512_set1_epi8(0x30)));
    }
    if (pack == PACK_U5) { /* gguf_avx2.c's vectors 2j and 2j + 1: bits 2j, 2j + 1 */
        return _mm512_inserti64x4(_mm512_castsi256_si512(u5_vec(w + 20 * g0, 2 * j)),
                                  u5_vec(w + 20 * g0, 2 * j + 1), 1);
    }
    if (pack == PACK_U4) {
        __m512i raw = _mm512_loadu_si512((const void *)(w + 16 * g0 + 64 * (j & 1)));
        if (j >= 2)
            raw = _mm512_srli_epi16(raw, 4);
        return _mm512_and_si512(raw, _mm512_set1_epi8(0x0f));
    }
    return unsigned_q8(_mm512_loadu_si512((const void *)(w + 32 * g0 + 64 * j)), pack);
}

/* Vector j (0-1) of the group of 4 blocks at block g0 (PACK_U4: 64 bytes, low nibbles then
 * high ones) */
static inline __m512i wvec4(const uint8_t *w, int64_t g0, int j, int pack) {
    if (pack == PACK_U4) {
        __m512i raw = _mm512_loadu_si512((const void *)(w + 16 * g0));
        if (j)
            raw = _mm512_srli_epi16(raw, 4);
        return _mm512_and_si512(raw, _mm512_set1_epi8(0x0f));
    }
    return unsigned_q8(_mm512_loadu_si512((const void *)(w + 32 * g0 + 64 * j)), pack);
}

/* Block b alone (in its own order: lanes 0-3 values 0-15, 4-7 values 16-31) */
static inline __m256i wblock(const uint8_t *w, int64_t b, int pack) {
    if (pack == PACK_U4) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(w + 16 * b));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                _mm256_set1_epi8(0x0f));
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * b));
    return pack == PACK_S8 ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
}


/* One product's operands (gguf_avx2_gemm's arguments) */
struct gemm {
    const uint8_t *values;
    const float *scales, *offsets;
    int64_t K;
    const int8_t *xq;
    const float *xd, *xs;
    void *y;
    int64_t ldy;
    int ybf, zero;
};

/* float32 -> bfloat16 bits (in the low half of each lane) as float_to_bf16 rounds them */
static inline __m128i bf16_bits(__m128 v) {
    const __m128i u = _mm_castps_si128(v);
    const __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    const __m128i even = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(_mm_set1_epi32(0x7fff), odd)), 16);
    const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)),
                                        _mm_set1_epi32(0x7f800000));
    return _mm_blendv_epi8(even, _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x40)), nan);
}

/* The tile's results: acc[i * RB + q] (16 lanes each; zeros outside the tile) summed, all in
 * one tree, and stored at y[r + q, n + i]. The tree adds each accumulator's lanes in the same
 * order whatever the others hold, so a result does not depend on the tile's shape; it costs
 * about a third of one horizontal sum per result. */
static inline __attribute__((always_inline)) void store_tile(const struct gemm *a, int64_t n,
                                                              int wb, int64_t r, int rb,
                                                              const __m512 acc[WB * RB]) {
    __m256 h[WB * RB];
    for (int k = 0; k < WB * RB; k++)
        h[k] = _mm256_add_ps(_mm512_castps512_ps256(acc[k]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[k]), 1)));
    const __m256 h01 = _mm256_hadd_ps(h[0], h[1]), h23 = _mm256_hadd_ps(h[2], h[3]);
    const __m256 h45 = _mm256_hadd_ps(h[4], h[5]), h67 = _mm256_hadd_ps(h[6], h[7]);
    const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
    /* row n's results for activation rows r .. r + 3, and row n + 1's */
    const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(q0), _mm256_extractf128_ps(q0, 1));
    const __m128 hi = _mm_add_ps(_mm256_castps256_ps128(q1), _mm256_extractf128_ps(q1, 1));
    /* (row n, row n + 1) for activation rows r, r + 1 and r + 2, r + 3 */
    const __m128 p01 = _mm_unpacklo_ps(lo, hi), p23 = _mm_unpackhi_ps(lo, hi);
    if (a->ybf) {
        const __m128i b = _mm_packus_epi32(bf16_bits(p01), bf16_bits(p23));
        uint16_t v[8];
        _mm_storeu_si128((__m128i *)v, b);
        for (int q = 0; q < rb; q++)
            memcpy((uint16_t *)a->y + (r + q) * a->ldy + n, v + 2 * q, 2 * wb);
    } else {
        float v[8];
        _mm_storeu_ps(v, p01);
        _mm_storeu_ps(v + 4, p23);
        for (int q = 0; q < rb; q++)
            memcpy((float *)a->y + (r + q) * a->ldy + n, v + 2 * q, 4 * wb);
    }
}

/* One group of G = 8 or 4 blocks at block g0 (the interleaved order of gguf_avx2.c's header)
 * for a tile's weight rows w[i] against its activation rows x[q], into acc[i][q]. In a group
 * of 8, 64-byte vector j (0-3) holds gguf_avx2.c's vectors 2j and 2j + 1, so lanes l and l + 8
 * hold block l; in the group of 4, vector j (0-1) likewise and lanes l, l + 4, l + 8, l + 12
 * hold block l: the group's scales and the activations' are loaded repeated to match. One
 * body for both (G, wb, rb, pack, group and sc16 are constants where inlined: the two
 * instances compile as the two loops written out did). */
static inline __attribute__((always_inline)) void group_tile(
    int G, int64_t g0, int wb, int rb, int pack, int group, int sc16, int ks,
    const uint8_t *const w[WB],
    const float *const s[WB], const int8_t *const x[RB], const float *const d[RB],
    __m512 acc[WB][RB]) {
    const int nv = G / 2;                   /* 64-byte vectors of the group */
    const int halves = group == 16 ? 2 : 1; /* 16-value groups: values 0-15, then 16-31 */
    /* for 16-value groups, lane l's scale sits at 2 (l mod G) (+ 1 for values 16-31) */
    const __m512i even = G == 8 ? _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14)
                                : _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    for (int h = 0; h < halves; h++) {
        __m512i isum[WB][RB];
        for (int i = 0; i < wb; i++)
            for (int q = 0; q < rb; q++)
                isum[i][q] = _mm512_setzero_si512();
        for (int j = h * nv / halves; j < (h + 1) * nv / halves; j++) {
            __m512i wv[WB];
            for (int i = 0; i < wb; i++)
                wv[i] = G == 8 ? wvec8(w[i], g0, j, pack) : wvec4(w[i], g0, j, pack);
            for (int q = 0; q < rb; q++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(x[q] + 32 * g0 + 64 * j));
                for (int i = 0; i < wb; i++)
                    isum[i][q] = _mm512_dpbusd_epi32(isum[i][q], wv[i], xv);
            }
        }
        __m512 sv[WB];
        for (int i = 0; i < wb; i++) {
            if (group == 32) {
                sv[i] = ks       ? dup8(kscales8(s[i], g0 / 8)) /* (G 8: one super-block) */
                        : G == 8 ? scales8x2(s[i], sc16, g0)
                                 : scales4x4(s[i], sc16, g0);
            } else { /* lane l: block l's scale of values 0-15 (h 0) or 16-31 */
                const __m512 both = ks       ? kscales16_q6(s[i], g0 / 8)
                                    : G == 8 ? _mm512_loadu_ps(s[i] + 2 * g0)
                                             : _mm512_maskz_loadu_ps(0xff, s[i] + 2 * g0);
                sv[i] = _mm512_permutexvar_ps(
                    h ? _mm512_add_epi32(even, _mm512_set1_epi32(1)) : even, both);
            }
        }
        for (int q = 0; q < rb; q++) {
            const __m512 dv = G == 8 ? dup8(_mm256_loadu_ps(d[q] + g0))
                                     : _mm512_broadcast_f32x4(_mm_loadu_ps(d[q] + g0));
            for (int i = 0; i < wb; i++)
                acc[i][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][q]),
                                            _mm512_mul_ps(sv[i], dv), acc[i][q]);
        }
    }
}

/* y for weight rows n .. n + wb - 1 against activation rows r .. r + rb - 1 (wb <= WB,
 * rb <= RB; constants where inlined, as are pack, group, has_offsets, and sc16). */
static inline __attribute__((always_inline)) void tile(const struct gemm *a, int64_t n, int wb,
                                                        int64_t r, int rb, int pack, int group,
                                                        int has_offsets, int sc16, int ks) {
    const int64_t K = a->K;
    const float *offsets = has_offsets ? a->offsets : 0;
    const int zero = has_offsets ? 0 : a->zero;
    const uint8_t *values = a->values;
    const float *scales = a->scales, *xd = a->xd, *xs = a->xs;
    const int8_t *xq = a->xq;
    const int64_t nb = K / 32, ng = K / group, n8 = nb - nb % 8;
    const int64_t n4 = nb % 8 >= 4 ? n8 + 4 : n8;
    const int64_t row_bytes = row_bytes_of(pack, K);
    const int z = pack == PACK_S8 ? 128 : zero; /* Q8_0 read as q + 128 */
    const int kmin = ks && group == 32;         /* compact Q4_K / Q5_K: offsets -(dmin * m) */
    const uint8_t *w[WB];
    const float *s[WB], *o[WB];
    const int8_t *x[RB];
    const float *d[RB], *xsr[RB];
    __m512 acc[WB][RB];
    for (int i = 0; i < wb; i++) {
        w[i] = values + (n + i) * row_bytes;
        s[i] = scale_row(scales, sc16, ks, n + i, K, group);
        o[i] = offsets ? offsets + (n + i) * ng : 0;
        for (int q = 0; q < rb; q++)
            acc[i][q] = _mm512_setzero_ps();
    }
    for (int q = 0; q < rb; q++) {
        x[q] = xq + (r + q) * K;
        d[q] = xd + (r + q) * nb;
        xsr[q] = xs + (r + q) * ng;
    }
    for (int64_t g0 = 0; g0 < n8; g0 += 8)
        group_tile(8, g0, wb, rb, pack, group, sc16, ks, w, s, x, d, acc);
    if (n4 > n8) /* the group of 4 */
        group_tile(4, n8, wb, rb, pack, group, sc16, ks, w, s, x, d, acc);
    for (int64_t b = n4; b < nb; b++) { /* blocks alone, 256 bits */
        for (int i = 0; i < wb; i++) {
            const __m256i wv = wblock(w[i], b, pack);
            const __m256 sv =
                group == 32 ? _mm256_set1_ps(sc16 ? _cvtsh_ss(((const uint16_t *)s[i])[b]) : s[i][b])
                            : _mm256_set_m128(_mm_set1_ps(s[i][2 * b + 1]), _mm_set1_ps(s[i][2 * b]));
            for (int q = 0; q < rb; q++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x[q] + 32 * b));
                const __m256i isum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);
                const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(isum),
                                               _mm256_mul_ps(sv, _mm256_set1_ps(d[q][b])));
                acc[i][q] = _mm512_add_ps(acc[i][q], _mm512_zextps256_ps512(t));
            }
        }
    }
    if (offsets || z || kmin) { /* sum_g o[g] * xs[g], o = -z * s where the type has a zero point */
        for (int64_t g = 0; g < ng; g += 16) {
            __m512 ov[WB];
            for (int i = 0; i < wb; i++)
                ov[i] = offsets ? load16(o[i], 0, g, ng)
                        : kmin  ? koffsets16(s[i], g, ng)
                        : _mm512_mul_ps(ks ? kscales16_q6(s[i], g / 16) : load16(s[i], sc16, g, ng),
                                        _mm512_set1_ps(-(float)z));
            for (int q = 0; q < rb; q++) {
                const __m512 xv = load16(xsr[q], 0, g, ng);
                for (int i = 0; i < wb; i++)
                    acc[i][q] = _mm512_fmadd_ps(ov[i], xv, acc[i][q]);
            }
        }
    }
    __m512 all[WB * RB];
    for (int k = 0; k < WB * RB; k++)
        all[k] = k / RB < wb && k % RB < rb ? acc[k / RB][k % RB] : _mm512_setzero_ps();
    store_tile(a, n, wb, r, rb, all);
}

/* Weight rows n0 .. n1 - 1 against activation rows m0 .. m1 - 1 in register tiles, one
 * function per type's constants (kept out of line: one function holding every type's tiles
 * spilled its pointers to the stack and ran a row at a time 1.5-2.5x slower) */
#define TILES(NAME, PACK, GROUP, HAS_OFFSETS, SC16, KS)                                           \
    static __attribute__((noinline)) void NAME(const struct gemm *a, int64_t n0, int64_t n1,   \
                                               int64_t m0, int64_t m1) {                       \
        for (int64_t r = m0; r < m1;) {                                                        \
            const int rb = m1 - r >= 4 ? 4 : m1 - r >= 2 ? 2 : 1;                              \
            for (int64_t n = n0; n < n1; n += WB) {                                            \
                const int wb = n1 - n >= 2 ? 2 : 1;                                            \
                if (wb == 2 && rb == 4)                                                        \
                    tile(a, n, 2, r, 4, PACK, GROUP, HAS_OFFSETS, SC16, KS);                       \
                else if (wb == 2 && rb == 2)                                                   \
                    tile(a, n, 2, r, 2, PACK, GROUP, HAS_OFFSETS, SC16, KS);                       \
                else if (wb == 2)                                                              \
                    tile(a, n, 2, r, 1, PACK, GROUP, HAS_OFFSETS, SC16, KS);                       \
                else if (rb == 4)                                                              \
                    tile(a, n, 1, r, 4, PACK, GROUP, HAS_OFFSETS, SC16, KS);                       \
                else if (rb == 2)                                                              \
                    tile(a, n, 1, r, 2, PACK, GROUP, HAS_OFFSETS, SC16, KS);                       \
                else                                                                           \
                    tile(a, n, 1, r, 1, PACK, GROUP, HAS_OFFSETS, SC16, KS);                       \
            }                                                                                  \
            r += rb;                                                                           \
        }                                                                                      \
    }
TILES(tiles_s8_16, PACK_S8, 32, 0, 1, 0)
TILES(tiles_s8, PACK_S8, 32, 0, 0, 0)
TILES(tiles_u4_zero, PACK_U4, 32, 0, 0, 0)
TILES(tiles_u4, PACK_U4, 32, 1, 0, 0)
TILES(tiles_u8_16_zero, PACK_U8, 16, 0, 0, 0)
TILES(tiles_u8_16, PACK_U8, 16, 1, 0, 0)
TILES(tiles_u8_zero, PACK_U8, 32, 0, 0, 0)
TILES(tiles_u8, PACK_U8, 32, 1, 0, 0)
TILES(tiles_u4_k, PACK_U4, 32, 0, 0, 1)
TILES(tiles_u6_16_k, PACK_U6, 16, 0, 0, 1)
TILES(tiles_u5_k, PACK_U5, 32, 0, 0, 1)
#undef TILES

/* Bytes n0 .. n1 of an array into the cache ahead of their use. Without it the weights of a
 * decode step arrived at a third of the AVX2 path's rate: the hardware prefetchers did not run
 * ahead of these loops (a 16384 x 640 Q8_0 slab at one row took 1.2 ms, 0.44 ms with the next
 * rows fetched here). */
static inline void prefetch(const void *base, int64_t n0, int64_t n1) {
    for (int64_t at = n0; at < n1; at += 64)
        _mm_prefetch((const char *)base + at, _MM_HINT_T0);
}

void gguf_vnni_gemm(const uint8_t *values, int layout, const float *scales, const float *offsets,
                    int64_t N, int64_t K, int group, const int8_t *xq, const float *xd,
                    const float *xs, int64_t M, void *y, int64_t ldy) {
    const int pack = pack_of(layout), zero = zero_of(layout), sc16 = scales16_of(layout);
    const int ks = kscales_of(layout);
    const struct gemm a = {values, scales, offsets, K, xq, xd, xs, y, ldy, y_bf16_of(layout), zero};
    void (*run)(const struct gemm *, int64_t, int64_t, int64_t, int64_t) =
        ks ? (pack == PACK_U4 ? tiles_u4_k : pack == PACK_U6 ? tiles_u6_16_k : tiles_u5_k)
        : pack == PACK_S8 ? (sc16 ? tiles_s8_16 : tiles_s8)
        : pack == PACK_U4 ? (zero ? tiles_u4_zero : tiles_u4)
        : group == 16   ? (zero ? tiles_u8_16_zero : tiles_u8_16)
                        : (zero ? tiles_u8_zero : tiles_u8);
    /* up to MB rows (decode): a pair of weight rows against every row */
    const int64_t nt = M <= MB ? WB : NT, nm = M <= MB ? M : MB;
    /* the weight rows a tile prefetches: those PF rows on (4 rows, 2.5 KB at K = 640, did
     * best at one activation row; a prefill's tile of 16 rows fetches the next tile) */
    const int64_t pf = nt > 4 ? nt : 4, row_bytes = row_bytes_of(pack, K);
    const int64_t scale_bytes = scale_row_bytes(sc16, ks, K, group);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < (N + nt - 1) / nt; t++) {
        const int64_t n1 = nt * t + nt < N ? nt * t + nt : N;
        const int64_t p0 = nt * t + pf < N ? nt * t + pf : N, p1 = n1 + pf < N ? n1 + pf : N;
        prefetch(values, p0 * row_bytes, p1 * row_bytes);
        prefetch(scales, p0 * scale_bytes, p1 * scale_bytes);
        if (offsets)
            prefetch(offsets, p0 * (K / group) * 4, p1 * (K / group) * 4);
        for (int64_t m0 = 0; m0 < M; m0 += nm)
            run(&a, nt * t, n1, m0, m0 + nm < M ? m0 + nm : M);
    }
}

#endif
