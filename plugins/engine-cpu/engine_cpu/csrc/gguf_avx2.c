/* Quantized GGUF matmuls with AVX2 (x86-64 CPUs without AMX): int8 dot products, float32 scales.
 *
 * y[m, n] = sum_k x[m, k] * W[n, k], where W was repacked at load (engine_cpu/gguf.py), row by
 * row, as 32-value blocks along k in one of three packings:
 *   - PACK_U8: unsigned values u < 64 (the 5- and 6-bit types), one byte each;
 *   - PACK_U4: unsigned values u < 16 (the 4-bit types), two per byte: byte j of a block holds
 *     value j in its low nibble and value 16 + j in its high nibble;
 *   - PACK_S8: signed values v (Q8_0), one byte each;
 * with, per group of G values (32, or 16 for Q6_K), a float32 scale s and, for the unsigned
 * packings, an offset o: W[n, k] = s[n, g] * u[n, k] + o[n, g] (W = s * v for PACK_S8).
 * Scales and offsets are [N, K / G]. The types whose offset is -z times the scale (Q4_0 z = 8,
 * Q5_0 16, Q6_K 32) store no offsets: the entry points take `pack` | z << 16, and the kernels
 * derive o = -z * s (z a power of two, so the same float32 values as stored offsets).
 *
 * x comes quantized per 32 values as llama.cpp and vLLM's GGUF kernels quantize activations
 * (gguf_avx2_quantize_rows): x[m, k] ~= xd[m, k / 32] * xq[m, k], xq int8 in [-127, 127], and
 * xs[m, g] = xd * sum of xq over group g (what an offset multiplies). Then
 *     y[m, n] = sum_b xd[m, b] * sum_{k in b} s * u * xq  +  sum_g o[n, g] * xs[m, g].
 *
 * A block's products are VPMADDUBSW (unsigned weights times signed activations into 16-bit pair
 * sums: at most 2 * 63 * 127, no saturation) and VPMADDWD into eight int32 lanes, lanes 0-3
 * holding values 0-15 and lanes 4-7 values 16-31, so a 16-value group's two scales apply to the
 * two halves. Signed weights take the sign trick (|v| times xq with v's sign). The int32 sums
 * are exact; each block's is converted and scaled into float32 accumulators, one per activation
 * row, up to four rows per pass over a weight row, so a weight block is loaded and unpacked once
 * per four rows.
 *
 * Threads: an OpenMP loop over output rows, in the OpenMP runtime torch already loaded (see
 * engine_cpu/native.py).
 */
#include "avx2_common.h"

enum { PACK_U8 = 0, PACK_U4 = 1, PACK_S8 = 2 };

static inline int64_t block_bytes_of(int pack) { return pack == PACK_U4 ? 16 : 32; }

/* The packing and the zero point of a layout word (see the header). */
static inline int pack_of(int word) { return word & 0xff; }
static inline int zero_of(int word) { return (word >> 16) & 0xff; }

int gguf_avx2_available(void) { return 1; }

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
            _mm256_storeu_si256((__m256i *)(xq + m * K + 32 * b),
                                _mm256_permutevar8x32_epi32(p, order));
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

/* Output rows n .. n + NW - 1 (NW = 1 or 2; their packed rows `row_bytes` apart) against
 * activation rows 0 .. ROWS - 1 of xq (NW, ROWS, pack and group constants after inlining, so
 * that the NW x ROWS accumulators live in registers): each activation block is loaded once for
 * both weight rows, each weight block once for every activation row. */
static inline __attribute__((always_inline)) void tile_dot(
    const uint8_t *w, int64_t row_bytes, const float *s, const float *o, int64_t K, int pack,
    int group, const int8_t *xq, const float *xd, const float *xs, int NW, int ROWS, float *y,
    int64_t ldy, int zero) {
    const int64_t nb = K / 32, ng = K / group;
    const int64_t block_bytes = pack == PACK_U4 ? 16 : 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][4];
    for (int j = 0; j < NW; j++)
        for (int r = 0; r < ROWS; r++)
            acc[j][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i wv[2], aw[2];
        __m256 sv[2];
        for (int j = 0; j < NW; j++) {
            wv[j] = load_block(w + j * row_bytes + b * block_bytes, pack);
            aw[j] = pack == PACK_S8 ? _mm256_sign_epi8(wv[j], wv[j]) : wv[j]; /* |v|: sign trick */
            const float *sj = s + j * ng;
            sv[j] = group == 32 ? _mm256_set1_ps(sj[b])
                                : _mm256_set_m128(_mm_set1_ps(sj[2 * b + 1]), _mm_set1_ps(sj[2 * b]));
        }
        for (int r = 0; r < ROWS; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + 32 * b));
            __m256 d = _mm256_broadcast_ss(xd + r * nb + b);
            for (int j = 0; j < NW; j++) {
                __m256i xj = pack == PACK_S8 ? _mm256_sign_epi8(xv, wv[j]) : xv;
                __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], xj), ones);
                acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(sv[j], d),
                                            acc[j][r]);
            }
        }
    }
    for (int j = 0; j < NW; j++) {
        /* sum_g o[g] * xs[r, g]; with a zero point, -z * sum_g s[g] * xs[r, g] (exact) */
        const float *oj = o ? o + j * ng : zero ? s + j * ng : 0;
        for (int r = 0; r < ROWS; r++) {
            float v = hsum_ps(acc[j][r]);
            if (oj) {
                const float *xr = xs + r * ng;
                __m256 t = _mm256_setzero_ps();
                int64_t g = 0;
                for (; g + 8 <= ng; g += 8)
                    t = _mm256_fmadd_ps(_mm256_loadu_ps(oj + g), _mm256_loadu_ps(xr + g), t);
                float u = hsum_ps(t);
                for (; g < ng; g++)
                    u += oj[g] * xr[g];
                v += o ? u : -(float)zero * u;
            }
            y[r * ldy + j] = v;
        }
    }
}

/* One output row against one activation row (batch-1 decode), 32-value groups, K >= 256: the
 * same sums as tile_dot in fewer instructions a block, where one activation row leaves the
 * product bound by them (measured: 10-13% less time than tile_dot for the vocabulary and the
 * Q5_0 layers of the embedded Gemma 3, one thread; docs/benchmarks.md, sixth session). Eight blocks' scales are loaded and
 * multiplied by the activation's as one vector, from which each block takes its lane (no
 * scalar loads); the last eight end at the row's last block, the lanes already done skipped.
 * Even and odd blocks go to two accumulators. The offsets' term sum_g o[g] * xs[g] (or -z
 * times sum_g s[g] * xs[g]) rides along, eight groups at a time. */
static inline __attribute__((always_inline)) float dot_m1(const uint8_t *w, const float *s,
                                                          const float *o, int64_t K, int pack,
                                                          const int8_t *xq, const float *xd,
                                                          const float *xs, int zero) {
    const int64_t nb = K / 32, bb = block_bytes_of(pack);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), osum = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < nb; c0 += 8) {
        const int64_t base = c0 + 8 <= nb ? c0 : nb - 8; /* the last eight blocks */
        const int skip = (int)(c0 - base);                /* lanes an earlier pass did */
        const __m256 sc = _mm256_loadu_ps(s + base);
        const __m256 c = _mm256_mul_ps(sc, _mm256_loadu_ps(xd + base));
        if (zero || o) {
            __m256 ov = zero ? sc : _mm256_loadu_ps(o + base);
            if (skip) /* zero the lanes already counted */
                ov = _mm256_and_ps(ov, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_epi32(skip - 1))));
            osum = _mm256_fmadd_ps(ov, _mm256_loadu_ps(xs + base), osum);
        }
#define DOT_BLOCK(I, ACC)                                                                      \
    do {                                                                                       \
        const int64_t b_ = base + (I);                                                         \
        __m256i wv = load_block(w + b_ * bb, pack);                                            \
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * b_));                      \
        __m256i aw = wv;                                                                       \
        if (pack == PACK_S8) { /* sign trick */                                                \
            aw = _mm256_sign_epi8(wv, wv);                                                     \
            xv = _mm256_sign_epi8(xv, wv);                                                     \
        }                                                                                      \
        __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones)); \
        ACC = _mm256_fmadd_ps(f, _mm256_permutevar8x32_ps(c, _mm256_set1_epi32(I)), ACC);     \
    } while (0)
        if (!skip) { /* constant lanes */
            DOT_BLOCK(0, acc0); DOT_BLOCK(1, acc1); DOT_BLOCK(2, acc0); DOT_BLOCK(3, acc1);
            DOT_BLOCK(4, acc0); DOT_BLOCK(5, acc1); DOT_BLOCK(6, acc0); DOT_BLOCK(7, acc1);
        } else {
            for (int i = skip; i < 8; i++)
                DOT_BLOCK(i, acc0);
        }
#undef DOT_BLOCK
    }
    float v = hsum_ps(_mm256_add_ps(acc0, acc1));
    if (zero) /* offsets -z times the scales */
        v += -(float)zero * hsum_ps(osum);
    else if (o)
        v += hsum_ps(osum);
    return v;
}

/* Output rows n .. n + NW - 1 against every activation row, four at a time. */
static inline __attribute__((always_inline)) void rows_all(
    const uint8_t *w, int64_t row_bytes, const float *s, const float *o, int64_t K, int pack,
    int group, const int8_t *xq, const float *xd, const float *xs, int64_t M, int NW, float *y,
    int64_t ldy, int zero) {
    const int64_t nb = K / 32, ng = K / group;
    int64_t m0 = 0;
#define TILE(R)                                                                                \
    tile_dot(w, row_bytes, s, o, K, pack, group, xq + m0 * K, xd + m0 * nb, xs + m0 * ng, NW, \
             R, y + m0 * ldy, ldy, zero)
    for (; m0 + 4 <= M; m0 += 4)
        TILE(4);
    switch (M - m0) {
    case 3: TILE(3); break;
    case 2: TILE(2); break;
    case 1: TILE(1); break;
    default: break;
    }
#undef TILE
}

/* y [M, N] (float32, row stride ldy) = x W^T for W packed as `pack` with `group`-value scales
 * (and offsets, NULL for PACK_S8) and x quantized by gguf_avx2_quantize_rows with the same
 * group. 16-value groups only with PACK_U8 (Q6_K). */
void gguf_avx2_gemm(const uint8_t *values, int layout, const float *scales, const float *offsets,
                    int64_t N, int64_t K, int group, const int8_t *xq, const float *xd,
                    const float *xs, int64_t M, float *y, int64_t ldy) {
    const int pack = pack_of(layout), zero = zero_of(layout);
    const int64_t row_bytes = pack == PACK_U4 ? K / 2 : K;
    const int64_t ng = K / group;
    /* Two weight rows per pass only for many activation rows: with few, the product is bound
     * by the weight reads, and two streams per thread read slower than one (measured: 1.5x
     * the time of one stream at 1-4 rows, 8-16% faster from 16 rows). */
    const int step = M >= 16 ? 2 : 1;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < (N + step - 1) / step; p++) {
        int64_t n = step * p;
        const uint8_t *w = values + n * row_bytes;
        const float *s = scales + n * ng;
        const float *o = offsets ? offsets + n * ng : 0;
        float *out = y + n;
/* A zero point of 0 (offsets stored, or none) as a constant, so that that code is as before */
#define ROWS_Z(NW, Z)                                                                          \
    do {                                                                                       \
        if (pack == PACK_U4)                                                                   \
            rows_all(w, row_bytes, s, o, K, PACK_U4, 32, xq, xd, xs, M, NW, out, ldy, Z);      \
        else if (pack == PACK_S8)                                                              \
            rows_all(w, row_bytes, s, 0, K, PACK_S8, 32, xq, xd, xs, M, NW, out, ldy, 0);      \
        else if (group == 16)                                                                  \
            rows_all(w, row_bytes, s, o, K, PACK_U8, 16, xq, xd, xs, M, NW, out, ldy, Z);      \
        else                                                                                   \
            rows_all(w, row_bytes, s, o, K, PACK_U8, 32, xq, xd, xs, M, NW, out, ldy, Z);      \
    } while (0)
#define ROWS(NW)                                                                               \
    do {                                                                                       \
        if (zero)                                                                              \
            ROWS_Z(NW, zero);                                                                  \
        else                                                                                   \
            ROWS_Z(NW, 0);                                                                     \
    } while (0)
        if (M == 1 && group == 32 && K >= 256) {
            if (pack == PACK_U4)
                out[0] = dot_m1(w, s, o, K, PACK_U4, xq, xd, xs, zero);
            else if (pack == PACK_S8)
                out[0] = dot_m1(w, s, 0, K, PACK_S8, xq, xd, xs, 0);
            else
                out[0] = dot_m1(w, s, o, K, PACK_U8, xq, xd, xs, zero);
        } else if (n + 1 < N && step == 2)
            ROWS(2);
        else
            ROWS(1);
#undef ROWS
#undef ROWS_Z
    }
}

/* Rows n0 .. n1 - 1 of W dequantized into float32 `out` [n1 - n0, K]: s * u + o per group, one
 * rounding (s * u is exact, see engine/kernels/gguf.py), so each value equals the reference's.
 * For many activation rows (prefill) a float32 product over tiles of these beats the int8 dot
 * products, whose per-block float work grows with the rows. */
void gguf_avx2_dequantize(const uint8_t *values, int layout, const float *scales,
                          const float *offsets, int64_t n0, int64_t n1, int64_t K, int group,
                          float *out) {
    const int pack = pack_of(layout), zero = zero_of(layout);
    const int64_t row_bytes = pack == PACK_U4 ? K / 2 : K;
    const int64_t block_bytes = pack == PACK_U4 ? 16 : 32;
    const int64_t ng = K / group;
#pragma omp parallel for schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = values + n * row_bytes;
        const float *s = scales + n * ng;
        const float *o = offsets ? offsets + n * ng : 0;
        float *dst = out + (n - n0) * K;
        for (int64_t b = 0; b < K / 32; b++) {
            __m256i wv = load_block(w + b * block_bytes, pack);
            __m128i lo = _mm256_castsi256_si128(wv), hi = _mm256_extracti128_si256(wv, 1);
            __m128i quarter[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int q = 0; q < 4; q++) { /* values 8q .. 8q + 7 of the block */
                __m256i i32 = pack == PACK_S8 ? _mm256_cvtepi8_epi32(quarter[q])
                                              : _mm256_cvtepu8_epi32(quarter[q]);
                int64_t g = (32 * b + 8 * q) / group;
                __m256 v = _mm256_mul_ps(_mm256_set1_ps(s[g]), _mm256_cvtepi32_ps(i32));
                if (o || zero)
                    v = _mm256_add_ps(v, _mm256_set1_ps(o ? o[g] : -(float)zero * s[g]));
                _mm256_storeu_ps(dst + 32 * b + 8 * q, v);
            }
        }
    }
}

/* gguf_avx2_quantize_rows then gguf_avx2_gemm in one call (a decode step makes about a hundred
 * of these, where each foreign call from Python costs microseconds): x [M, K] (bfloat16 when
 * x_bf16, else float32, contiguous) times W into y [M, N] (row stride ldy, so that the products
 * of a layer stored in runs of several types fill their columns of one output). `scratch` holds
 * at least M * K + 4 * M * (K / 32 + K / 16) + 64 bytes, 64-byte aligned. */
void gguf_avx2_linear(const void *x, int x_bf16, const uint8_t *values, int pack,
                      const float *scales, const float *offsets, int64_t N, int64_t K, int group,
                      int64_t M, uint8_t *scratch, float *y, int64_t ldy) {
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
    const int pack = pack_of(layout), zero = zero_of(layout);
    const int64_t row_bytes = pack == PACK_U4 ? K / 2 : K;
    const int64_t block_bytes = pack == PACK_U4 ? 16 : 32;
    const int64_t ng = K / group;
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = ids[r];
        const uint8_t *w = values + n * row_bytes;
        const float *s = scales + n * ng;
        const float *o = offsets ? offsets + n * ng : 0;
        for (int64_t b = 0; b < K / 32; b++) {
            __m256i wv = load_block(w + b * block_bytes, pack);
            uint8_t raw[32];
            _mm256_storeu_si256((__m256i *)raw, wv);
            for (int j = 0; j < 32; j++) {
                const int64_t k = 32 * b + j, g = k / group;
                float u = pack == PACK_S8 ? (float)(int8_t)raw[j] : (float)raw[j];
                float v = s[g] * u;
                if (o || zero)
                    v = v + (o ? o[g] : -(float)zero * s[g]);
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
