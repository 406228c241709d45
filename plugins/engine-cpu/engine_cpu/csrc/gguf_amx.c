/* Quantized GGUF matmuls on Intel AMX (Sapphire Rapids and later): int8 tiles, float32 scales.
 *
 * y[m, n] = sum_k x[m, k] * W[n, k], where
 *   - W was repacked at load (engine_cpu/gguf.py) into signed 8-bit values v and, per group of
 *     G (32, or 16 for Q6_K) values along k, a float32 scale s and optionally an offset o:
 *     W[n, k] = s[n, g] * v[n, k] + o[n, g]. The values are laid out as AMX's B operand, one
 *     16-row by G-value tile after another: tile (t, g) holds rows 16t..16t+15, values
 *     gG..gG+G-1, as G/4 rows of 64 bytes, byte 4j + b of tile row r being v[16t + j, gG + 4r + b]
 *     ("VNNI" order). Scales and offsets are [N/16, K/G, 16].
 *   - x comes quantized per 32 values (as llama.cpp and vLLM's GGUF kernels quantize
 *     activations): x[m, k] ~= xd[m, k/32] * xq[m, k], xq int8 in [-127, 127], and
 *     xs[m, g] = xd * sum of xq over group g (for the offsets).
 *
 * One group of 16 output rows and up to 16 activation rows is one TDPBSSD (exact int32 sums),
 * whose 16 x 16 result is scaled into float32 accumulators:
 *     acc[m, :] += (xd[m] * s[:]) * C[m, :] + xs[m, g] * o[:].
 *
 * Threads: an OpenMP loop over tiles of 16 output rows, in the OpenMP runtime torch already
 * loaded (see engine_cpu/native.py). The tile configuration is per thread, so every thread
 * loads it at the start of its share; the kernel asks Linux for AMX permission once
 * (arch_prctl ARCH_REQ_XCOMP_PERM), and gguf_amx_available() says whether that was granted.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__AMX_INT8__) || !defined(__AMX_BF16__) || !defined(__AMX_TILE__) || \
    !defined(__AVX512BF16__)
#error "gguf_amx needs AMX-INT8 and AVX-512"
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 1 when the kernel may use AMX in this process (asks the kernel on the first call). */
int gguf_amx_available(void) {
    static int state = -1;
    if (state < 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

/* Tiles 0, 1 = C (rows x 16 int32), 2, 3 = A (rows x G int8), 4, 5 = B (G/4 x 64 bytes):
 * two groups in flight. */
static void configure(int rows, int group) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int i = 0; i < 2; i++) {
        c.rows[i] = (uint8_t)rows;
        c.colsb[i] = 64;
        c.rows[2 + i] = (uint8_t)rows;
        c.colsb[2 + i] = (uint16_t)group;
        c.rows[4 + i] = (uint8_t)(group / 4);
        c.colsb[4 + i] = 64;
    }
    _tile_loadconfig(&c);
}

/* Quantize x [M, K] (bfloat16 when x_bf16, else float32; K a multiple of 32) per 32 values:
 * xq, xd (amax / 127 per 32), and xs = xd * sum(xq) per `group` (16 or 32) values. Threads
 * only for many rows: a decode row takes about a microsecond. */
void gguf_quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, int group, int8_t *xq,
                        float *xd, float *xs) {
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < K / 32; b++) {
            __m512 v[2];
            for (int h = 0; h < 2; h++) {
                int64_t at = m * K + 32 * b + 16 * h;
                if (x_bf16) { /* bf16 -> float32: the 16 bits on top */
                    __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at));
                    v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
                } else {
                    v[h] = _mm512_loadu_ps((const float *)x + at);
                }
            }
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            float d = amax / 127.0f;
            float id = d > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = xq + m * K + 32 * b;
            int sums[2] = {0, 0};
            for (int h = 0; h < 2; h++) {
                __m512 f = _mm512_mul_ps(v[h], _mm512_set1_ps(id));
                __m512i i = _mm512_cvt_roundps_epi32(f, _MM_FROUND_TO_NEAREST_INT |
                                                            _MM_FROUND_NO_EXC);
                _mm_storeu_si128((__m128i *)(q + 16 * h), _mm512_cvtsepi32_epi8(i));
                sums[h] = _mm512_reduce_add_epi32(i);
            }
            if (group == 32) {
                xs[m * (K / 32) + b] = d * (float)(sums[0] + sums[1]);
            } else {
                xs[m * (K / 16) + 2 * b] = d * (float)sums[0];
                xs[m * (K / 16) + 2 * b + 1] = d * (float)sums[1];
            }
            xd[m * (K / 32) + b] = d;
        }
    }
}

/* One 16-row output tile against activation rows m0 .. m0 + ROWS - 1 (ROWS a constant after
 * inlining, so that the float32 accumulators live in registers): per group one TDPBSSD, then
 * acc[r] += (C[r] * s) * xd[r] (+ o * xs[r, g]). */
static inline __attribute__((always_inline)) void tile_rows(
    const int8_t *vt, const float *st, const float *ot, int64_t groups, int group,
    int64_t tile_bytes, const int8_t *xq, const float *xd, const float *xs, int64_t K, int64_t m0,
    int ROWS, int32_t *c, float *out_rows, int64_t ldo, int width) {
    __m512 acc[16];
    for (int r = 0; r < ROWS; r++)
        acc[r] = _mm512_setzero_ps();
    const int64_t kd = K / 32;
    for (int64_t g0 = 0; g0 < groups; g0 += 2) {
        /* Two groups in flight: each has its own C, A and B tiles (0/1, 2/3, 4/5), so the
         * second product does not wait for the first one's result to be stored. */
        int pair = g0 + 1 < groups;
        _tile_zero(0);
        _tile_loadd(2, xq + m0 * K + g0 * group, K);
        _tile_loadd(4, vt + g0 * tile_bytes, 64);
        _tile_dpbssd(0, 2, 4);
        if (pair) {
            _tile_zero(1);
            _tile_loadd(3, xq + m0 * K + (g0 + 1) * group, K);
            _tile_loadd(5, vt + (g0 + 1) * tile_bytes, 64);
            _tile_dpbssd(1, 3, 5);
        }
        _tile_stored(0, c, 64);
        if (pair)
            _tile_stored(1, c + 256, 64);
        __asm__ volatile("" ::: "memory"); /* the tile stores write c: no load before them */
        for (int h = 0; h <= pair; h++) {
            int64_t g = g0 + h;
            __m512 s = _mm512_loadu_ps(st + 16 * g);
            int64_t kb = g * group / 32; /* the activations' 32-value block */
            for (int r = 0; r < ROWS; r++) {
                __m512 p = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(c + 256 * h + 16 * r))),
                    s);
                acc[r] = _mm512_fmadd_ps(p, _mm512_set1_ps(xd[(m0 + r) * kd + kb]), acc[r]);
            }
            if (ot) {
                __m512 o = _mm512_loadu_ps(ot + 16 * g);
                for (int r = 0; r < ROWS; r++)
                    acc[r] =
                        _mm512_fmadd_ps(o, _mm512_set1_ps(xs[(m0 + r) * groups + g]), acc[r]);
            }
        }
    }
    __mmask16 keep = (__mmask16)((1u << width) - 1);
    for (int r = 0; r < ROWS; r++)
        _mm512_mask_storeu_ps(out_rows + r * ldo, keep, acc[r]);
}

/* y [M, N_out] (float32, row stride ldy) = x W^T for the packed W ([N/16] tiles, N padded to
 * a multiple of 16; only the first N_out columns are written) and x quantized by
 * gguf_quantize_rows with the same group. `offsets` may be NULL. */
void gguf_amx_gemm(const int8_t *values, const float *scales, const float *offsets, int64_t N,
                   int64_t N_out, int64_t K, int group, const int8_t *xq, const float *xd,
                   const float *xs, int64_t M, float *y, int64_t ldy) {
    const int64_t tiles = N / 16, groups = K / group;
    const int64_t tile_bytes = 16 * (int64_t)group; /* one (t, g) tile of values */
#pragma omp parallel
    {
        int configured_rows = -1;
        int32_t c[2 * 16 * 16];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int8_t *vt = values + t * groups * tile_bytes;
            const float *st = scales + t * groups * 16;
            const float *ot = offsets ? offsets + t * groups * 16 : NULL;
            int64_t n0 = 16 * t;
            int width = N_out - n0 < 16 ? (int)(N_out - n0) : 16;
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                int rows = M - m0 < 16 ? (int)(M - m0) : 16;
                if (rows != configured_rows) {
                    configure(rows, group);
                    configured_rows = rows;
                }
                float *out = y + m0 * ldy + n0;
                switch (rows) {
#define ROWS(R)                                                                                \
    case R:                                                                                    \
        tile_rows(vt, st, ot, groups, group, tile_bytes, xq, xd, xs, K, m0, R, c, out, ldy,     \
                  width);                                                                      \
        break;
                    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9)
                    ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
                }
            }
        }
        if (configured_rows >= 0)
            _tile_release();
    }
}

/* ---- bfloat16 activations, for many rows (prefill) ------------------------------------------
 * With many activation rows the int8 path's per-group float work (a scale per row and group)
 * dominates. Here each 16-row output tile is dequantized once per call into bfloat16 B tiles
 * (VNNI pairs: B row i holds, for each of the 16 output rows, the weights of values 2i and
 * 2i + 1 of the group), w = fma(s, v, o) rounded to nearest even: the weights the dense
 * bfloat16 layer would hold. TDPBF16PS then accumulates every group into float32 tiles, with
 * no per-group work per activation row. */

/* Tiles for this path: 0-3 = C (2 x 2 blocks of 16 x 16 float32: activation tile i, output
 * tile j at 2i + j), 4, 5 = A (rows x 32 bf16), 6, 7 = B (16 x 64 bytes). */
static void configure_bf16(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = i >= 6 ? 16 : (uint8_t)rows;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* Dequantize the `groups` groups of one 16-row tile into bf16 B tiles of 32 values (1 KB each)
 * at `out`. For a 16-value group (Q6_K) two groups make one B tile. */
static void dequantize_tile_bf16(const int8_t *vt, const float *st, const float *ot,
                                 int64_t groups, int group, uint16_t *out) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t g = 0; g < groups; g++) {
        __m512 s = _mm512_loadu_ps(st + 16 * g);
        __m512 o = ot ? _mm512_loadu_ps(ot + 16 * g) : _mm512_setzero_ps();
        __m512 sq[4], oq[4]; /* lanes 4i..4i+3 <- output row 4q + i */
        for (int q = 0; q < 4; q++) {
            __m512i idx = _mm512_add_epi32(_mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2),
                                           _mm512_set1_epi32(4 * q));
            sq[q] = _mm512_permutexvar_ps(idx, s);
            oq[q] = _mm512_permutexvar_ps(idx, o);
        }
        const int8_t *v = vt + g * 16 * (int64_t)group;
        /* the group's values start at B row (g * group / 2) % 16 of tile (g * group) / 32 */
        uint16_t *b = out + (g * group / 32) * 512 + ((g * group / 2) % 16) * 32;
        for (int r = 0; r < group / 4; r++) { /* values 4r .. 4r + 3 of each output row */
            __m512 f[4];
            for (int q = 0; q < 4; q++) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(v + 64 * r + 16 * q));
                f[q] = _mm512_fmadd_ps(sq[q], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), oq[q]);
            }
            /* bf16 dwords: (output row, value pair), rows 0-7 then 8-15 */
            __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
            __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
            _mm512_storeu_si512((void *)(b + 64 * r), _mm512_permutex2var_epi32(lo, even, hi));
            _mm512_storeu_si512((void *)(b + 64 * r + 32), _mm512_permutex2var_epi32(lo, odd, hi));
        }
    }
}

static inline void store_c(float *c, int rows, float *y, int64_t ldy, int width) {
    __mmask16 keep = (__mmask16)((1u << width) - 1);
    for (int r = 0; r < rows; r++)
        _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_loadu_ps(c + 16 * r));
}

/* y [M, N_out] (float32, row stride ldy) = x W^T for bf16 x [M, K] (contiguous) and the packed
 * W; `scratch` holds 2 * K / 32 KB per thread (threads x K * 64 bytes). Two output tiles are
 * dequantized at a time and multiplied with two activation tiles at a time: per 32 values
 * four TDPBF16PS for two A and two B loads. */
void gguf_amx_gemm_bf16(const int8_t *values, const float *scales, const float *offsets,
                        int64_t N, int64_t N_out, int64_t K, int group, const uint16_t *x,
                        int64_t M, float *y, int64_t ldy, uint16_t *scratch) {
    const int64_t tiles = N / 16, groups = K / group, btiles = K / 32;
    const int64_t tile_bytes = 16 * (int64_t)group;
    const int64_t pairs = (tiles + 1) / 2;
#pragma omp parallel
    {
        uint16_t *bt = scratch + (int64_t)omp_get_thread_num() * 2 * btiles * 512;
        int configured_rows = -1;
        float c[16 * 16];
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            int64_t t0 = 2 * p;
            int two_n = t0 + 1 < tiles;
            for (int j = 0; j <= two_n; j++) {
                int64_t t = t0 + j;
                dequantize_tile_bf16(values + t * groups * tile_bytes, scales + t * groups * 16,
                                     offsets ? offsets + t * groups * 16 : NULL, groups, group,
                                     bt + j * btiles * 512);
            }
            /* Two activation tiles at a time while a second one of the same height follows
             * (a shorter last tile takes a pass of its own, with its own configuration). */
            for (int64_t m0 = 0, step = 0; m0 < M; m0 += step) {
                int rows = M - m0 < 16 ? (int)(M - m0) : 16;
                int two_m = M - m0 - 16 >= rows;
                step = two_m ? 32 : 16;
                if (rows != configured_rows) {
                    configure_bf16(rows);
                    configured_rows = rows;
                }
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < btiles; kb++) {
                    _tile_loadd(6, bt + kb * 512, 64);
                    _tile_loadd(4, x + m0 * K + 32 * kb, 2 * K);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two_n) {
                        _tile_loadd(7, bt + (btiles + kb) * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (two_m) {
                        _tile_loadd(5, x + (m0 + 16) * K + 32 * kb, 2 * K);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two_n)
                            _tile_dpbf16ps(3, 5, 7);
                    }
                }
                for (int i = 0; i <= two_m; i++)
                    for (int j = 0; j <= two_n; j++) {
                        int64_t n0 = 16 * (t0 + j);
                        int width = N_out - n0 < 16 ? (int)(N_out - n0) : 16;
                        switch (2 * i + j) {
                        case 0: _tile_stored(0, c, 64); break;
                        case 1: _tile_stored(1, c, 64); break;
                        case 2: _tile_stored(2, c, 64); break;
                        default: _tile_stored(3, c, 64); break;
                        }
                        __asm__ volatile("" ::: "memory");
                        store_c(c, rows, y + (m0 + 16 * i) * ldy + n0, ldy, width);
                    }
            }
        }
        if (configured_rows >= 0)
            _tile_release();
    }
}
