/* Quantized GGUF matmuls with AVX2 (x86-64 CPUs without AMX): int8 dot products, float32 scales.
 *
 * y[m, n] = sum_k x[m, k] * W[n, k], where W was repacked at load (engine_cpu/gguf.py), row by
 * row, as 32-value blocks along k (in the interleaved order below) in one of four packings:
 *   - PACK_U8: unsigned values u < 32 (Q5_0, Q5_1), one byte each;
 *   - PACK_U4: unsigned values u < 16 (the 4-bit types), two per byte;
 *   - PACK_S8: signed values v (Q8_0), one byte each;
 *   - PACK_U6: unsigned values u < 64 (Q6_K), 6 bits each: per group of 8 blocks, 128 bytes of
 *     nibbles as PACK_U4's then 64 bytes of the values' top 2 bits (gguf_layout.h's u6_vec);
 *   - PACK_U5: unsigned values u < 32 (Q5_K), 5 bits each: the nibbles, then 32 bytes of the
 *     values' top bits (u5_vec);
 * with, per group of G values (32, or 16 for Q6_K), a float32 scale s and, for the unsigned
 * packings, an offset o: W[n, k] = s[n, g] * u[n, k] + o[n, g] (W = s * v for PACK_S8).
 * Scales and offsets are [N, K / G] float32 (Q8_0: float16 scales, bit 9 of the layout word).
 * The types whose offset is -z times the scale (Q4_0 z = 8, Q5_0 16, Q6_K 32) store no
 * offsets: the entry points take `pack` | z << 16, and the kernels derive o = -z * s (z a
 * power of two, so the same float32 values as stored offsets). The K-quants (Q4_K, Q5_K,
 * Q6_K) keep their scales compact instead (bit 11, gguf_layout.h): per 256 values the file's
 * float16 d (and dmin) and integer sub-scales (and mins), s = d * sc and o = -(dmin * m)
 * computed in float32, exactly the float32 values the other form stores. Bits a weight read:
 * Q4_K 4 + 20 * 8 / 256 = 4.625 (6 with float32 scales and offsets), Q5_K 5.625 (10), Q6_K
 * 6 + 18 * 8 / 256 = 6.5625 (10); the GGUF file holds 4.5, 5.5 and 6.5625.
 *
 * x comes quantized per 32 values as llama.cpp and vLLM's GGUF kernels quantize activations
 * (gguf_avx2_quantize_rows): x[m, k] ~= xd[m, k / 32] * xq[m, k], xq int8 in [-127, 127], and
 * xs[m, g] = xd * sum of xq over group g (what an offset multiplies). Then
 *     y[m, n] = sum_b xd[m, b] * sum_{k in b} s * u * xq  +  sum_g o[n, g] * xs[m, g].
 *
 * A block's products are VPMADDUBSW (unsigned weights times signed activations into 16-bit pair
 * sums: at most 2 * 63 * 127, no saturation) and VPMADDWD into eight int32 lanes. Signed weights
 * take the sign trick (|v| times xq with v's sign). So that a lane's int32 sum belongs to one
 * block, rows (weights and activations alike) are stored in an interleaved order: each full
 * group of 8 blocks is 8 vectors of 32 bytes, lane l (4 bytes) of vector v holding values
 * 4v .. 4v + 3 of block l; a group of 4 blocks after those is 4 vectors, lanes l and l + 4 of
 * vector v holding values 8v .. 8v + 3 and 8v + 4 .. 8v + 7 of block l; the last K / 32 % 4
 * blocks stay in their own order (lanes 0-3 values 0-15, 4-7 values 16-31). PACK_U4 stores a
 * group of G blocks in 16 G bytes, byte j holding positions j and 16 G + j of the group's
 * unpacked order in its low and high nibble (for a block alone: values j and 16 + j). A
 * group's vectors then add up in int32 (exact; with compact K-quant scales the VPMADDUBSW
 * results of 8, 4 or 2 vectors add in int16 first, see dot_row) and are converted and scaled
 * once, against the
 * G blocks' scales, instead of once a block (measured: 0.67-0.95x the time of one scaling a
 * block; docs/benchmarks.md, seventh session). Each weight row is run against every
 * activation row while it is in L1.
 *
 * On a CPU with AVX-512 F, BW, VL and VNNI (this library is compiled with -march=native),
 * gguf_avx2_gemm hands the products of 2 or more activation rows to gguf_vnni.c, which reads
 * the same layout with VPDPBUSD on 64 bytes, unless bit 10 of the layout word asks for the
 * instructions here; one row runs here (faster: see gguf_avx2_gemm).
 *
 * Threads: an OpenMP loop over output rows, in the OpenMP runtime torch already loaded (see
 * engine_cpu/native.py).
 */
#include "gguf_layout.h"

#include <stdlib.h>

/* Scale i (of 1, 4 or 8 from i) of a row of float32 scales, or of float16 ones when sc16 */
static inline float scale1(const float *s, int sc16, int64_t i) {
    return sc16 ? _cvtsh_ss(((const uint16_t *)s)[i]) : s[i];
}
static inline __m128 scales4(const float *s, int sc16, int64_t i) {
    return sc16 ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)s + i)))
                : _mm_loadu_ps(s + i);
}
static inline __m256 scales8(const float *s, int sc16, int64_t i) {
    return sc16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + i)))
                : _mm256_loadu_ps(s + i);
}

int gguf_avx2_available(void) { return 1; }

/* Whether the products take the AVX-512 VNNI path of gguf_vnni.c (unless a layout word asks
 * for the AVX2 instructions): this library was compiled for a CPU that has it. */
int gguf_avx2_vnni(void) { return GGUF_HAVE_VNNI; }

/* Where values 4c .. 4c + 3 of block b sit in an unpacked row of nb blocks (the interleaved
 * order of the header): the byte offset in a PACK_U8 / PACK_S8 row or an activation row. */
static inline int64_t chunk_pos(int64_t nb, int64_t b, int c) {
    const int64_t n8 = nb - nb % 8;
    if (b < n8) /* lane b % 8 of vector c of the group */
        return 32 * (b - b % 8) + 32 * c + 4 * (b % 8);
    if (nb % 8 >= 4 && b < n8 + 4) /* lane b - n8 (c even) or b - n8 + 4 (c odd) of vector c / 2 */
        return 32 * n8 + 32 * (c >> 1) + 4 * (b - n8 + 4 * (c & 1));
    return 32 * b + 4 * c;
}

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* Quantize x [M, K] (bfloat16 when x_bf16, else float32; K a multiple of 32) per 32 values:
 * xq, xd (amax / 127 per 32) and xs = xd * sum(xq) per `group` (16 or 32) values. Rounding:
 * to nearest even (the MXCSR default). Threads only for many rows. */
void gguf_avx2_quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, int group,
                             int8_t *xq, float *xd, float *xs) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const int64_t n8 = K / 32 - K / 32 % 8, n4 = K / 32 % 8 >= 4 ? n8 + 4 : n8;
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < K / 32; b++) {
            __m256 v[4];
            __m256 amax = _mm256_setzero_ps();
            for (int h = 0; h < 4; h++) {
                v[h] = load8(x, x_bf16, m * K + 32 * b + 8 * h);
                amax = _mm256_max_ps(amax, _mm256_and_ps(v[h], abs_mask));
            }
            __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            a = _mm_max_ps(a, _mm_movehl_ps(a, a));
            a = _mm_max_ss(a, _mm_movehdup_ps(a));
            float mx = _mm_cvtss_f32(a);
            float d = mx / 127.0f;
            float id = mx > 0.0f ? 127.0f / mx : 0.0f;
            __m256i i[4];
            for (int h = 0; h < 4; h++)
                i[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], _mm256_set1_ps(id)));
            /* packs interleave the 128-bit lanes: the permute puts the 32 bytes back in order */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                           _mm256_packs_epi32(i[2], i[3]));
            p = _mm256_permutevar8x32_epi32(p, order);
            if (b < n4) { /* the interleaved order of the products (see the header) */
                uint32_t chunk[8];
                _mm256_storeu_si256((__m256i *)chunk, p);
                for (int c = 0; c < 8; c++)
                    memcpy(xq + m * K + chunk_pos(K / 32, b, c), &chunk[c], 4);
            } else {
                _mm256_storeu_si256((__m256i *)(xq + m * K + 32 * b), p);
            }
            int lo = hsum_epi32(_mm256_add_epi32(i[0], i[1]));
            int hi = hsum_epi32(_mm256_add_epi32(i[2], i[3]));
            if (group == 32) {
                xs[m * (K / 32) + b] = d * (float)(lo + hi);
            } else {
                xs[m * (K / 16) + 2 * b] = d * (float)lo;
                xs[m * (K / 16) + 2 * b + 1] = d * (float)hi;
            }
            xd[m * (K / 32) + b] = d;
        }
    }
}

/* One block of 32 weights as 32 bytes (unsigned values, or signed for PACK_S8). */
static inline __m256i load_block(const uint8_t *w, int pack) {
    if (pack == PACK_U4) {
        __m128i raw = _mm_loadu_si128((const __m128i *)w);
        __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
    }
    return _mm256_loadu_si256((const __m256i *)w);
}

/* Four values at position `local` of the 256 of a PACK_U6 (hb = 2) or PACK_U5 (hb = 1) group
 * at block g0 (16 + 4 hb bytes a block): the nibble of the first 128 bytes (low for positions
 * below 128, high above), plus bits hb (local / 32 hb) .. of the high plane moved to bit 4. */
static inline uint32_t split_plane_chunk(const uint8_t *w, int64_t g0, int64_t local, int hb) {
    const uint8_t *grp = w + (16 + 4 * hb) * g0;
    const int64_t plane = 32 * hb; /* bytes of the high plane */
    const uint32_t mask = hb == 2 ? 0x03030303u : 0x01010101u;
    uint32_t raw, hi;
    memcpy(&raw, grp + local % 128, 4);
    memcpy(&hi, grp + 128 + local % plane, 4);
    return (local < 128 ? raw & 0x0f0f0f0fu : (raw >> 4) & 0x0f0f0f0fu) |
           ((hi >> (hb * (local / plane))) & mask) << 4;
}

/* Block b of a packed row of nb blocks as its 32 values in their own order (the lookups and
 * the dequantization; the products read the interleaved order directly). */
static inline __m256i load_natural(const uint8_t *w, int64_t nb, int64_t b, int pack) {
    const int64_t n8 = nb - nb % 8, n4 = nb % 8 >= 4 ? n8 + 4 : n8;
    if (b >= n4)
        return load_block(w + b * block_bytes_of(pack), pack);
    const int64_t g0 = b < n8 ? b - b % 8 : n8, half = b < n8 ? 128 : 64; /* 16 * G */
    uint32_t out[8];
    for (int c = 0; c < 8; c++) {
        const int64_t p = chunk_pos(nb, b, c);
        if (pack == PACK_U6 || pack == PACK_U5) /* position p of the group's 256 */
            out[c] = split_plane_chunk(w, g0, p - 32 * g0, pack == PACK_U6 ? 2 : 1);
        else if (pack == PACK_U4) { /* position p of the group: low nibbles, then high ones */
            const int64_t local = p - 32 * g0;
            uint32_t raw;
            memcpy(&raw, w + 16 * g0 + local % half, 4);
            out[c] = local < half ? raw & 0x0f0f0f0fu : (raw >> 4) & 0x0f0f0f0fu;
        } else {
            memcpy(&out[c], w + p, 4);
        }
    }
    return _mm256_loadu_si256((const __m256i *)out);
}

/* One weight row against one activation row: sum_b xd[b] * s * (sum_{k in b} u * xq), plus the
 * offsets' term sum_g o[g] * xs[g] (or -z times sum_g s[g] * xs[g]). In a group of G = 8 or 4
 * blocks (the interleaved order above) lane l of every vector holds values of block l mod G, so
 * VPMADDUBSW and VPMADDWD leave each lane a partial sum of one block, the vectors' sums add up
 * in int32 (exact), and a group costs one conversion and one FMA against the G blocks' scales
 * instead of one per block. Blocks after the groups are scaled one at a time. */
static inline __attribute__((always_inline)) float dot_row(const uint8_t *w, const float *s,
                                                           const float *o, int64_t K, int pack,
                                                           int group, const int8_t *xq,
                                                           const float *xd, const float *xs,
                                                           int zero, int sc16, int ks) {
    const int64_t nb = K / 32, ng = K / group, n8 = nb - nb % 8;
    const int64_t n4 = nb % 8 >= 4 ? n8 + 4 : n8;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
/* Vector V of the group at block G0 of w (unpacked for PACK_U4, of size GS) into isum[I] */
#define DOT_VEC(G0, GS, V, I)                                                                  \
    do {                                                                                       \
        __m256i wv;                                                                            \
        if (pack == PACK_U6) {                                                                 \
            wv = u6_vec(w + 24 * (G0), (V));                                                   \
        } else if (pack == PACK_U5) {                                                          \
            wv = u5_vec(w + 20 * (G0), (V));                                                   \
        } else if (pack == PACK_U4) {                                                          \
            const int half_ = (GS) / 2;                                                        \
            __m256i raw_ = _mm256_loadu_si256(                                                 \
                (const __m256i *)(w + 16 * (G0) + 32 * ((V) % half_)));                        \
            wv = (V) < half_ ? _mm256_and_si256(raw_, nib)                                     \
                             : _mm256_and_si256(_mm256_srli_epi16(raw_, 4), nib);              \
        } else {                                                                               \
            wv = _mm256_loadu_si256((const __m256i *)(w + 32 * ((G0) + (V))));                 \
        }                                                                                      \
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * ((G0) + (V))));            \
        __m256i aw = wv;                                                                       \
        if (pack == PACK_S8) { /* sign trick */                                                \
            aw = _mm256_sign_epi8(wv, wv);                                                     \
            xv = _mm256_sign_epi8(xv, wv);                                                     \
        }                                                                                      \
        if (C16) { /* 16-bit sums of C16 vectors (see below) */                               \
            p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(aw, xv));                         \
            if (((V) + 1) % C16 == 0) {                                                        \
                isum[I] = _mm256_add_epi32(isum[I], _mm256_madd_epi16(p16, ones));             \
                p16 = _mm256_setzero_si256();                                                  \
            }                                                                                  \
        } else                                                                                 \
            isum[I] = _mm256_add_epi32(isum[I],                                                \
                                       _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones)); \
    } while (0)
    /* With compact scales (rows of whole super-blocks, only groups of 8 below) the offsets'
     * term sum_g o[g] * xs[g] (Q4_K / Q5_K: o = -(dmin * m)) or sum_g s[g] * xs[g] (Q6_K) adds
     * up in `t` as the group loop goes, the same FMAs in the same order as the loop after it
     * would make, so the same bits, without reading the records twice. */
    const int kmin = ks && group == 32;
    __m256 t = _mm256_setzero_ps();
    /* Compact K-quant rows: the VPMADDUBSW pair sums of C16 vectors add up exactly in 16 bits
     * before one VPMADDWD: Q4_K 8 (at most 2 * 15 * 127 = 3810 in magnitude each, 30480 for
     * eight), Q5_K 4 (4 * 7874 = 31496), Q6_K 2 (2 * 16002 = 32004) */
    const int C16 = !ks                ? 0
                    : pack == PACK_U4 ? 8
                    : pack == PACK_U5 ? 4
                    : pack == PACK_U6 ? 2
                                      : 0;
    __m256i p16 = _mm256_setzero_si256();
    for (int64_t g0 = 0; g0 < n8; g0 += 8) {
        __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        const __m256 d = _mm256_loadu_ps(xd + g0);
        if (group == 32) {
            for (int v = 0; v < 8; v++)
                DOT_VEC(g0, 8, v, 0);
            const __m256 sv = ks ? kscales8(s, g0 / 8) : scales8(s, sc16, g0);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[0]), _mm256_mul_ps(sv, d), acc);
            if (kmin) /* -(dmin m) xs + t: the stored offset's FMA, the same bits */
                t = _mm256_fnmadd_ps(kmins8(s, g0 / 8), _mm256_loadu_ps(xs + g0), t);
        } else { /* 16-value groups: vectors 0-3 hold values 0-15 of each block, 4-7 16-31 */
            for (int v = 0; v < 8; v++)
                DOT_VEC(g0, 8, v, v >> 2);
            const __m256 a = ks ? kscales8_q6(s, g0 / 8, 0) : _mm256_loadu_ps(s + 2 * g0);
            const __m256 b = ks ? kscales8_q6(s, g0 / 8, 1) : _mm256_loadu_ps(s + 2 * g0 + 8);
            const __m256i ev = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
            const __m256i od = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
            const __m256 se = _mm256_blend_ps(_mm256_permutevar8x32_ps(a, ev),
                                              _mm256_permutevar8x32_ps(b, ev), 0xf0);
            const __m256 so = _mm256_blend_ps(_mm256_permutevar8x32_ps(a, od),
                                              _mm256_permutevar8x32_ps(b, od), 0xf0);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[0]), _mm256_mul_ps(se, d), acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[1]), _mm256_mul_ps(so, d), acc);
            if (ks) { /* Q6_K: groups 2 g0 .. 2 g0 + 15 */
                t = _mm256_fmadd_ps(a, _mm256_loadu_ps(xs + 2 * g0), t);
                t = _mm256_fmadd_ps(b, _mm256_loadu_ps(xs + 2 * g0 + 8), t);
            }
        }
    }
    if (n4 > n8) { /* a group of four: lanes l and l + 4 hold block l */
        const int64_t g0 = n8;
        __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        const __m128 d4 = _mm_loadu_ps(xd + g0);
        const __m256 d = _mm256_set_m128(d4, d4);
        if (group == 32) {
            for (int v = 0; v < 4; v++)
                DOT_VEC(g0, 4, v, 0);
            const __m128 s4 = scales4(s, sc16, g0);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[0]),
                                  _mm256_mul_ps(_mm256_set_m128(s4, s4), d), acc);
        } else { /* vectors 0-1 hold values 0-15, 2-3 16-31 */
            for (int v = 0; v < 4; v++)
                DOT_VEC(g0, 4, v, v >> 1);
            const __m256 a = _mm256_loadu_ps(s + 2 * g0);
            const __m256 se = _mm256_permutevar8x32_ps(a, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
            const __m256 so = _mm256_permutevar8x32_ps(a, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[0]), _mm256_mul_ps(se, d), acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[1]), _mm256_mul_ps(so, d), acc);
        }
    }
#undef DOT_VEC
    for (int64_t b = n4; b < nb; b++) { /* blocks in their own order: lanes 0-3 values 0-15 */
        __m256i wv = load_block(w + b * block_bytes_of(pack), pack);
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
        __m256i aw = wv;
        if (pack == PACK_S8) {
            aw = _mm256_sign_epi8(wv, wv);
            xv = _mm256_sign_epi8(xv, wv);
        }
        __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones);
        __m256 sv = group == 32 ? _mm256_set1_ps(scale1(s, sc16, b))
                                : _mm256_set_m128(_mm_set1_ps(s[2 * b + 1]), _mm_set1_ps(s[2 * b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(sv, _mm256_set1_ps(xd[b])),
                              acc);
    }
    float v = hsum_ps(acc);
    if (ks) { /* (t summed above) */
        const float u = hsum_ps(t);
        v += kmin ? u : -(float)zero * u;
    } else if (o || zero) { /* sum_g o[g] * xs[g]; with a zero point, -z * sum_g s[g] * xs[g] */
        const float *oj = o ? o : s;
        int64_t g = 0;
        for (; g + 8 <= ng; g += 8)
            t = _mm256_fmadd_ps(_mm256_loadu_ps(oj + g), _mm256_loadu_ps(xs + g), t);
        float u = hsum_ps(t);
        for (; g < ng; g++)
            u += oj[g] * xs[g];
        v += o ? u : -(float)zero * u;
    }
    return v;
}

/* y [M, N] (float32, or bfloat16 by the layout word; row stride ldy) = x W^T for W packed as `pack` with `group`-value scales
 * (and offsets, NULL for PACK_S8) and x quantized by gguf_avx2_quantize_rows with the same
 * group. 16-value groups only with PACK_U8 (Q6_K). Each weight row is run against every
 * activation row while it sits in L1; above MB rows, tiles of 16 weight rows against MB
 * activation rows at a time, so that a prefill's activations (2048 rows of 640 bytes for 16
 * prompts of 128 tokens) stay in L2 instead of streaming from L3 once per weight row. */
enum { MB = 128 };

void gguf_avx2_gemm(const uint8_t *values, int layout, const float *scales, const float *offsets,
                    int64_t N, int64_t K, int group, const int8_t *xq, const float *xd,
                    const float *xs, int64_t M, void *y, int64_t ldy) {
#if GGUF_HAVE_VNNI
    /* One activation row (a decode step at batch 1) stays with the AVX2 instructions: there the
     * product is bound by reading the weights, and the row-by-row loop below read them faster
     * than gguf_vnni.c's tiles on the 2-core Zen 4 VM (the embedded Gemma 3's products at 2
     * threads: all but the 640 x 1024 Q4_K faster, the step's products 1.16x; its decode
     * 1.12-1.20x faster end to end, medians of interleaved rounds; at one thread the two were
     * even: docs/benchmarks.md, ninth CPU session). The two paths add the same products in
     * another order, so on such a CPU a row's result is the same bits in every batch of 2 rows
     * or more, and may differ from its result alone in the last bits. */
    if (!avx2_only_of(layout) && M > 1) {
        gguf_vnni_gemm(values, layout, scales, offsets, N, K, group, xq, xd, xs, M, y, ldy);
        return;
    }
#endif
    const int pack = pack_of(layout), zero = zero_of(layout), ybf = y_bf16_of(layout);
    const int sc16 = scales16_of(layout), ks = kscales_of(layout);
    const int64_t row_bytes = row_bytes_of(pack, K);
    const int64_t nb = K / 32, ng = K / group;
    /* up to MB rows: one tile of every row (decode) */
    const int64_t NT = M <= MB ? 1 : 16, nm = M <= MB ? M : MB;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < (N + NT - 1) / NT; t++)
    for (int64_t m0 = 0; m0 < M; m0 += nm)
    for (int64_t n = NT * t; n < NT * t + NT && n < N; n++) {
        const int64_t m1 = m0 + nm < M ? m0 + nm : M;
        const uint8_t *w = values + n * row_bytes;
        const float *s = scale_row(scales, sc16, ks, n, K, group);
        const float *o = offsets ? offsets + n * ng : 0;
/* pack, group and a zero zero point as constants, so that each combination compiles alone */
#define ROWS(PACK, GROUP, O, Z, SC16, KS)                                                      \
    for (int64_t r = m0; r < m1; r++)                                                          \
        store1(y, ybf, r * ldy + n,                                                            \
               dot_row(w, s, O, K, PACK, GROUP, xq + r * K, xd + r * nb, xs + r * ng, Z, SC16, KS));
        if (ks && pack == PACK_U4) /* Q4_K */
            ROWS(PACK_U4, 32, 0, 0, 0, 1)
        else if (ks && pack == PACK_U6) /* Q6_K */
            ROWS(PACK_U6, 16, 0, zero, 0, 1)
        else if (ks) /* Q5_K (compact scales come only with these three packings) */
            ROWS(PACK_U5, 32, 0, 0, 0, 1)
        else if (pack == PACK_S8 && sc16)
            ROWS(PACK_S8, 32, 0, 0, 1, 0)
        else if (pack == PACK_S8)
            ROWS(PACK_S8, 32, 0, 0, 0, 0)
        else if (pack == PACK_U4 && zero)
            ROWS(PACK_U4, 32, 0, zero, 0, 0)
        else if (pack == PACK_U4)
            ROWS(PACK_U4, 32, o, 0, 0, 0)
        else if (group == 16 && zero)
            ROWS(PACK_U8, 16, 0, zero, 0, 0)
        else if (group == 16)
            ROWS(PACK_U8, 16, o, 0, 0, 0)
        else if (zero)
            ROWS(PACK_U8, 32, 0, zero, 0, 0)
        else
            ROWS(PACK_U8, 32, o, 0, 0, 0)
#undef ROWS
    }
}

/* Rows n0 .. n1 - 1 of W dequantized into float32 `out` [n1 - n0, K]: s * u + o per group, one
 * rounding (s * u is exact, see engine/kernels/gguf.py), so each value equals the reference's.
 * For many activation rows (prefill) a float32 product over tiles of these beats the int8 dot
 * products, whose per-block float work grows with the rows. */
void gguf_avx2_dequantize(const uint8_t *values, int layout, const float *scales,
                          const float *offsets, int64_t n0, int64_t n1, int64_t K, int group,
                          float *out) {
    const int pack = pack_of(layout), zero = zero_of(layout), sc16 = scales16_of(layout);
    const int ks = kscales_of(layout), kmin = ks && group == 32;
    const int64_t row_bytes = row_bytes_of(pack, K);
    const int64_t ng = K / group;
#pragma omp parallel for schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = values + n * row_bytes;
        const float *s = scale_row(scales, sc16, ks, n, K, group);
        const float *o = offsets ? offsets + n * ng : 0;
        float *dst = out + (n - n0) * K;
        for (int64_t b = 0; b < K / 32; b++) {
            __m256i wv = load_natural(w, K / 32, b, pack);
            __m128i lo = _mm256_castsi256_si128(wv), hi = _mm256_extracti128_si256(wv, 1);
            __m128i quarter[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int q = 0; q < 4; q++) { /* values 8q .. 8q + 7 of the block */
                __m256i i32 = pack == PACK_S8 ? _mm256_cvtepi8_epi32(quarter[q])
                                              : _mm256_cvtepu8_epi32(quarter[q]);
                int64_t g = (32 * b + 8 * q) / group;
                const float sg = ks ? kscale1(s, group, g) : scale1(s, sc16, g);
                __m256 v = _mm256_mul_ps(_mm256_set1_ps(sg), _mm256_cvtepi32_ps(i32));
                if (o || zero || kmin)
                    v = _mm256_add_ps(v, _mm256_set1_ps(o      ? o[g]
                                                         : kmin ? koffset1(s, g)
                                                                : -(float)zero * sg));
                _mm256_storeu_ps(dst + 32 * b + 8 * q, v);
            }
        }
    }
}

/* gguf_avx2_quantize_rows then gguf_avx2_gemm in one call (a decode step makes about a hundred
 * of these, where each foreign call from Python costs microseconds): x [M, K] (bfloat16 when
 * x_bf16, else float32, contiguous) times W into y [M, N] (float32, or bfloat16 by bit 8 of the
 * layout word `pack`; row stride ldy, so that the products of a layer stored in runs of several
 * types fill their columns of one output). `scratch` holds
 * at least M * K + 4 * M * (K / 32 + K / 16) + 64 bytes, 64-byte aligned. */
void gguf_avx2_linear(const void *x, int x_bf16, const uint8_t *values, int pack,
                      const float *scales, const float *offsets, int64_t N, int64_t K, int group,
                      int64_t M, uint8_t *scratch, void *y, int64_t ldy) {
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(scratch + ((M * K + 63) & ~(int64_t)63));
    float *xs = xd + M * (K / 32);
    gguf_avx2_quantize_rows(x, x_bf16, M, K, group, xq, xd, xs);
    gguf_avx2_gemm(values, pack, scales, offsets, N, K, group, xq, xd, xs, M, y, ldy);
}

/* Rows ids[0 .. R - 1] of W dequantized (an embedding lookup) into out [R, K] (bfloat16 when
 * out_bf16, else float32), each value the reference's s * u + o rounded once to the dtype, then,
 * when `scaled`, multiplied by `scale` (already rounded to the dtype) and rounded again: the
 * embedding scale of Gemma, as the torch path applies it after the lookup. */
void gguf_avx2_rows(const uint8_t *values, int layout, const float *scales, const float *offsets,
                    const int64_t *ids, int64_t R, int64_t K, int group, void *out, int out_bf16,
                    int scaled, float scale) {
    const int pack = pack_of(layout), zero = zero_of(layout), sc16 = scales16_of(layout);
    const int ks = kscales_of(layout), kmin = ks && group == 32;
    const int64_t row_bytes = row_bytes_of(pack, K);
    const int64_t ng = K / group;
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = ids[r];
        const uint8_t *w = values + n * row_bytes;
        const float *s = scale_row(scales, sc16, ks, n, K, group);
        const float *o = offsets ? offsets + n * ng : 0;
        for (int64_t b = 0; b < K / 32; b++) {
            __m256i wv = load_natural(w, K / 32, b, pack);
            uint8_t raw[32];
            _mm256_storeu_si256((__m256i *)raw, wv);
            for (int j = 0; j < 32; j++) {
                const int64_t k = 32 * b + j, g = k / group;
                float u = pack == PACK_S8 ? (float)(int8_t)raw[j] : (float)raw[j];
                const float sg = ks ? kscale1(s, group, g) : scale1(s, sc16, g);
                float v = sg * u;
                if (o || zero || kmin)
                    v = v + (o ? o[g] : kmin ? koffset1(s, g) : -(float)zero * sg);
                if (out_bf16) {
                    if (scaled)
                        v = bf16_to_float(float_to_bf16(v)) * scale;
                    ((uint16_t *)out)[r * K + k] = float_to_bf16(v);
                } else {
                    ((float *)out)[r * K + k] = scaled ? v * scale : v;
                }
            }
        }
    }
}

/* act(gate) * up over T rows (cpu_ops.c) */
void cpu_gated_act(const void *x, int64_t x_row, void *out, int64_t o_row, int bf16, int64_t T,
                   int64_t I, int act);

/* One packed product of a stack of experts, as int64 words (engine_cpu/gguf.py fills them from
 * the stacked tensors): pointers to expert 0's values, scales and offsets (0: none), the layout
 * word of gguf_avx2_linear (bfloat16 output bit included), N, K, the group, and the byte
 * strides from one expert's values, scales and offsets to the next's. */
enum { MOE_VALUES, MOE_LAYOUT, MOE_SCALES, MOE_OFFSETS, MOE_N, MOE_K, MOE_GROUP, MOE_VSTRIDE,
       MOE_SSTRIDE, MOE_OSTRIDE, MOE_WORDS };

static void moe_product(const int64_t *d, int64_t e, const void *x, int x_bf16, int64_t M,
                        uint8_t *scratch, void *y, int64_t ldy) {
    const uint8_t *values = (const uint8_t *)d[MOE_VALUES] + e * d[MOE_VSTRIDE];
    const float *scales = (const float *)((const char *)d[MOE_SCALES] + e * d[MOE_SSTRIDE]);
    const float *offsets =
        d[MOE_OFFSETS] ? (const float *)((const char *)d[MOE_OFFSETS] + e * d[MOE_OSTRIDE]) : 0;
    gguf_avx2_linear(x, x_bf16, values, (int)d[MOE_LAYOUT], scales, offsets, d[MOE_N], d[MOE_K],
                     (int)d[MOE_GROUP], M, scratch, y, ldy);
}

/* o += float32(y * w), the product rounded before the sum (no fused multiply-add), as the torch
 * loop's multiply then index_add_ round it */
__attribute__((optimize("fp-contract=off"))) static void
moe_add_weighted(float *o, const uint8_t *y, int bf16, float w, int64_t H) {
    if (bf16) {
        for (int64_t h = 0; h < H; h++) {
            const float v = bf16_to_float(((const uint16_t *)y)[h]) * w;
            o[h] += v;
        }
    } else {
        for (int64_t h = 0; h < H; h++) {
            const float v = ((const float *)y)[h] * w;
            o[h] += v;
        }
    }
}

/* The routed experts of one MoE layer whose experts are packed GGUF stacks
 * (engine.quantization.gguf_moe), in one call: what engine.kernels.reference.routed_expert_calls
 * computes with gguf_linear, the SiLU-and-mul and gguf_linear per expert, without the host
 * loop's torch ops (about 60 a layer at batch 1).
 *
 * x [T, H] (bfloat16 when bf16, else float32); ids int32 [T, top_k] (ids outside [0, E): an
 * expert another rank holds, skipped) and weights float32 [T, top_k]; desc: n_gu descriptors of
 * the gate/up products (one [2I, H] product, or gate and up [I, H] each), then the down
 * product's [H, I]. The pairs are taken expert by expert, in pair order within an expert (a
 * counting sort), each expert's rows gathered, multiplied through gate/up (in the activations'
 * dtype), SiLU-and-mul, down, and out[t] += weight * y in float32, in that order: the same
 * operations, in the same order, as the torch loop over the same kernels, so the same bits.
 * work: 4 T top_k bytes rounded up to 64, then T (2 H + 3 I) values of the activations' dtype;
 * scratch: gguf_avx2_linear's for T rows of max(H, I) values; acc float32 [T, H], overwritten;
 * out [T, H] in the activations' dtype: the sums rounded once (bfloat16), or acc itself
 * (float32). Every buffer is the caller's, so that a native plan can replay the call. */
void gguf_avx2_moe(const void *x, int bf16, int64_t T, int64_t H, const int32_t *ids,
                   const float *weights, int64_t top_k, int64_t E, const int64_t *desc, int n_gu,
                   int64_t I, uint8_t *scratch, uint8_t *work, float *acc, void *result) {
    float *out = acc;
    const int64_t P = T * top_k, es = bf16 ? 2 : 4;
    int32_t *order = (int32_t *)work; /* pairs sorted by expert */
    uint8_t *xs = work + ((4 * P + 63) & ~(int64_t)63);
    uint8_t *gu = xs + T * H * es, *act = gu + 2 * T * I * es, *y = act + T * I * es;
    const int64_t *down = desc + n_gu * MOE_WORDS;
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    int64_t *start = (int64_t *)calloc((size_t)E + 1, sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0 && ids[p] < E)
            start[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++)
        start[e + 1] += start[e];
    int64_t *fill = (int64_t *)malloc((size_t)E * sizeof(int64_t));
    memcpy(fill, start, (size_t)E * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0 && ids[p] < E)
            order[fill[ids[p]]++] = (int32_t)p;
    free(fill);
    for (int64_t e = 0; e < E; e++) {
        /* At most T rows at a time: the buffers hold T rows, and a routing that gives one
         * token the same expert twice (top-k never does) would give an expert more pairs. */
        for (int64_t c = start[e]; c < start[e + 1]; c += T) {
            const int64_t n = start[e + 1] - c < T ? start[e + 1] - c : T;
            const int32_t *pairs = order + c;
            for (int64_t r = 0; r < n; r++)
                memcpy(xs + r * H * es, (const uint8_t *)x + (pairs[r] / top_k) * H * es,
                       (size_t)(H * es));
            for (int g = 0, col = 0; g < n_gu; col += (int)desc[g * MOE_WORDS + MOE_N], g++)
                moe_product(desc + g * MOE_WORDS, e, xs, bf16, n, scratch, gu + col * es, 2 * I);
            cpu_gated_act(gu, 2 * I, act, I, bf16, n, I, 0);
            moe_product(down, e, act, bf16, n, scratch, y, H);
            for (int64_t r = 0; r < n; r++)
                moe_add_weighted(out + (pairs[r] / top_k) * H, y + r * H * es, bf16,
                                 weights[pairs[r]], H);
        }
    }
    free(start);
    if (bf16)
        for (int64_t i = 0; i < T * H; i++)
            ((uint16_t *)result)[i] = float_to_bf16(acc[i]);
    else if ((void *)acc != result)
        memcpy(result, acc, (size_t)(T * H) * sizeof(float));
}
