/* The small per-layer ops of a CPU decode step, one call each instead of ten torch ops:
 * RMSNorm (plain and with the residual add), the per-head q/k RMSNorm with the rotary
 * embedding, the KV-cache write and paged decode attention. Activations and caches are float32
 * or bfloat16 (`bf16` flags); arithmetic is float32 throughout, each result rounded once to the
 * activation dtype, in the order of the torch reference (engine/kernels/reference.py,
 * engine/attention_backends/torch_ref.py). Sums run in eight float32 lanes, so a result can
 * differ from torch's in the last bit.
 *
 * Strides are in elements. Threads (OpenMP, torch's runtime; see engine_cpu/native.py) only
 * where the work is large enough to pay for waking them: a decode row takes microseconds.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "avx2_common.h"

#define PARALLEL_WORK (1 << 16)

/* sum of squares of x[0..D) */
static inline float sum_squares(const void *x, int bf16, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        __m256 v = load8(x, bf16, i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float s = hsum_ps(acc);
    for (; i < D; i++) {
        float v = load1(x, bf16, i);
        s += v * v;
    }
    return s;
}

/* out = (x * rsqrt(mean(x^2) + eps)) * w over one row of D values; `tmp` (D floats) gets the
 * float32 result when not NULL. */
static inline void norm_row(const void *x, void *out, int bf16, int64_t D, const float *w,
                            float eps, float *tmp) {
    float r = 1.0f / sqrtf(sum_squares(x, bf16, D) / (float)D + eps);
    for (int64_t i = 0; i < D; i++) {
        float v = load1(x, bf16, i) * r * w[i];
        if (out)
            store1(out, bf16, i, v);
        if (tmp)
            tmp[i] = v;
    }
}

static inline const void *at(const void *base, int bf16, int64_t offset) {
    return (const char *)base + offset * (bf16 ? 2 : 4);
}

static inline void *at_mut(void *base, int bf16, int64_t offset) {
    return (char *)base + offset * (bf16 ? 2 : 4);
}

/* RMSNorm of T x H rows of D values: row (t, h) at x + t * x_row + h * x_head, written at
 * out + t * o_row + h * o_head (per-head views of a fused projection are such rows). */
void cpu_rms_norm(const void *x, int64_t x_row, int64_t x_head, void *out, int64_t o_row,
                  int64_t o_head, int bf16, int64_t T, int64_t H, int64_t D, const float *w,
                  float eps) {
#pragma omp parallel for collapse(2) schedule(static) if (T * H * D >= PARALLEL_WORK)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++)
            norm_row(at(x, bf16, t * x_row + h * x_head),
                     at_mut(out, bf16, t * o_row + h * o_head), bf16, D, w, eps, NULL);
}

/* summed = x + residual (rounded to the dtype), normed = RMSNorm(summed); rows of D values,
 * x and residual with their own row strides, the outputs contiguous. */
void cpu_fused_add_rms_norm(const void *x, int64_t x_row, const void *residual, int64_t r_row,
                            void *normed, void *summed, int bf16, int64_t T, int64_t D,
                            const float *w, float eps) {
#pragma omp parallel for schedule(static) if (T * D >= PARALLEL_WORK)
    for (int64_t t = 0; t < T; t++) {
        const void *xr = at(x, bf16, t * x_row);
        const void *rr = at(residual, bf16, t * r_row);
        void *sr = at_mut(summed, bf16, t * D);
        for (int64_t i = 0; i < D; i++)
            store1(sr, bf16, i, load1(xr, bf16, i) + load1(rr, bf16, i));
        norm_row(sr, at_mut(normed, bf16, t * D), bf16, D, w, eps, NULL);
    }
}

/* In place, for each token t and each of the `heads` heads of x (row t at x + t * x_row,
 * head h at + h * D): the per-head RMSNorm when w is not NULL (rounded to the dtype, as the
 * separate op returns it), then the rotary embedding over the whole head in the "neox" layout
 * (halves rotated): cos/sin of position positions[t] from cos_sin [positions, D] (cos then sin
 * halves, float32). */
static void norm_rotary(void *x, int64_t x_row, int64_t heads, int bf16, int64_t T, int64_t D,
                        const int64_t *positions, const float *cos_sin, const float *w,
                        float eps) {
    const int64_t half = D / 2;
#pragma omp parallel for collapse(2) schedule(static) if (T * heads * D >= PARALLEL_WORK)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) {
            float buf[1024];
            float *v = D <= 1024 ? buf : malloc(D * sizeof(float));
            void *row = at_mut(x, bf16, t * x_row + h * D);
            if (w) {
                norm_row(row, NULL, bf16, D, w, eps, v);
                if (bf16)
                    for (int64_t i = 0; i < D; i++)
                        v[i] = bf16_to_float(float_to_bf16(v[i]));
            } else {
                for (int64_t i = 0; i < D; i++)
                    v[i] = load1(row, bf16, i);
            }
            const float *cs = cos_sin + positions[t] * D;
            for (int64_t j = 0; j < half; j++) {
                float c = cs[j], s = cs[half + j];
                float x1 = v[j], x2 = v[half + j];
                store1(row, bf16, j, x1 * c + x2 * -s);
                store1(row, bf16, half + j, x2 * c + x1 * s);
            }
            if (v != buf)
                free(v);
        }
}

void cpu_qk_norm_rotary(void *q, int64_t q_row, int64_t q_heads, void *k, int64_t k_row,
                        int64_t k_heads, int bf16, int64_t T, int64_t D, const int64_t *positions,
                        const float *cos_sin, const float *q_w, const float *k_w, float eps) {
    norm_rotary(q, q_row, q_heads, bf16, T, D, positions, cos_sin, q_w, eps);
    norm_rotary(k, k_row, k_heads, bf16, T, D, positions, cos_sin, k_w, eps);
}

/* The cache [2, slots, H, D] (contiguous; `plane` = slots * H * D elements per half) gets key
 * and value rows (token t, head h at + t * row + h * head) at slots[t]; negative slots
 * (padding) are skipped. The cache has the activations' dtype. */
void cpu_write_kv(const void *key, int64_t k_row, int64_t k_head, const void *value,
                  int64_t v_row, int64_t v_head, void *cache, int64_t plane,
                  const int64_t *slots, int bf16, int64_t T, int64_t H, int64_t D) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots[t];
        if (slot < 0)
            continue;
        for (int64_t h = 0; h < H; h++) {
            memcpy(at_mut(cache, bf16, (slot * H + h) * D), at(key, bf16, t * k_row + h * k_head),
                   D * size);
            memcpy(at_mut(cache, bf16, plane + (slot * H + h) * D),
                   at(value, bf16, t * v_row + h * v_head), D * size);
        }
    }
}

static inline float dot(const float *q, const void *k, int bf16, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k, bf16, i), acc);
    float s = hsum_ps(acc);
    for (; i < D; i++)
        s += q[i] * load1(k, bf16, i);
    return s;
}

/* exp(x) in eight float32 lanes: x = n ln2 + r (|r| <= ln2 / 2, ln2 split in two parts so r is
 * exact), e^r from a degree-6 polynomial (Cephes' expf coefficients), 2^n put into the
 * exponent. Within 2 ulp of expf over the clamped range; the clamp keeps 2^n finite. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Positions [p0, p1) of request b's context for KV head kh (its G query heads, already in
 * float32 at qf [G, D]): per head the largest score m[g], the sum of exp(score - m[g]) l[g] and
 * the exp-weighted sum of values acc[g, :] (not yet divided by l). An empty range gives
 * m = -inf, l = 0, acc = 0. `scores` holds G * (p1 - p0) floats. */
static void decode_part(const float *qf, const void *k_cache, const void *v_cache,
                        const int32_t *table, int bf16, int64_t Hkv, int64_t kh, int64_t G,
                        int64_t D, int64_t BS, float scale, float softcap, int64_t p0,
                        int64_t p1, float *scores, float *m, float *l, float *acc) {
    const int64_t n = p1 - p0;
    for (int64_t p = p0; p < p1; p++) {
        int64_t slot = (int64_t)table[p / BS] * BS + p % BS;
        const void *krow = at(k_cache, bf16, (slot * Hkv + kh) * D);
        for (int64_t g = 0; g < G; g++) {
            float sc = dot(qf + g * D, krow, bf16, D) * scale;
            if (softcap > 0.0f)
                sc = softcap * tanhf(sc / softcap);
            scores[g * n + p - p0] = sc;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * n, mx = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < n; j++)
            mx = sg[j] > mx ? sg[j] : mx;
        int64_t j = 0;
        __m256 t8 = _mm256_setzero_ps();
        for (; j + 8 <= n; j += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), _mm256_set1_ps(mx)));
            _mm256_storeu_ps(sg + j, e);
            t8 = _mm256_add_ps(t8, e);
        }
        total = hsum_ps(t8);
        for (; j < n; j++) {
            sg[j] = expf(sg[j] - mx);
            total += sg[j];
        }
        m[g] = mx;
        l[g] = total;
        for (int64_t i = 0; i < D; i++)
            acc[g * D + i] = 0.0f;
    }
    for (int64_t p = p0; p < p1; p++) {
        int64_t slot = (int64_t)table[p / BS] * BS + p % BS;
        const void *vrow = at(v_cache, bf16, (slot * Hkv + kh) * D);
        for (int64_t g = 0; g < G; g++) {
            const float w = scores[g * n + p - p0];
            __m256 wv = _mm256_set1_ps(w);
            float *ag = acc + g * D;
            int64_t i = 0;
            for (; i + 8 <= D; i += 8)
                _mm256_storeu_ps(ag + i,
                                 _mm256_fmadd_ps(wv, load8(vrow, bf16, i), _mm256_loadu_ps(ag + i)));
            for (; i < D; i++)
                ag[i] += w * load1(vrow, bf16, i);
        }
    }
}

/* Decode attention: request b's one query (heads Hq; row b at q + b * q_row, head h at
 * + h * q_head) against its keys and values at positions [start, seq_lens[b]) through the
 * block table (row b at block_table + b * bt_row; position p in block p / BS, slot p % BS),
 * start = seq_lens[b] - window when window > 0 (a sliding window), else 0. Caches
 * [num_blocks, BS, Hkv, D] contiguous, query head h reading KV head h / (Hq / Hkv). Scores
 * q.k * scale, soft-capped as cap * tanh(s / cap) when softcap > 0, softmax, then the weighted
 * sum of values, written at out + b * o_row + h * o_head (zeros for an empty context). With
 * attention sinks (`sinks` float32 [Hq], not NULL) query head h's softmax has one more score,
 * sinks[h], with no value: never soft-capped or masked, it joins the maximum and adds
 * exp(sinks[h] - max) to the denominator.
 *
 * Threads over (request, KV head); where those are fewer than the threads (batch 1, models
 * with one KV head), each context is also cut into up to `threads` slices of at least
 * MIN_SPLIT positions, whose partial softmax sums are combined per head afterwards, as split-K
 * decode kernels on GPUs do; the sink is folded in there, once per (request, query head),
 * never per slice. The exponentials run eight lanes at a time (exp8). */
#define MIN_SPLIT 64
#define MAX_SPLITS 64
void cpu_paged_decode(const void *q, int64_t q_row, int64_t q_head, const void *k_cache,
                      const void *v_cache, const int32_t *block_table, int64_t bt_row,
                      const int32_t *seq_lens, void *out, int64_t o_row, int64_t o_head,
                      int bf16, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                      float scale, float softcap, int64_t window, const float *sinks) {
    const int64_t G = Hq / Hkv;
    int64_t work = 0, longest = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        const int64_t n = window > 0 && len > window ? window : len;
        work += n;
        longest = n > longest ? n : longest;
    }
    const int parallel = work * Hq * D >= PARALLEL_WORK;
    const int64_t threads = parallel ? omp_get_max_threads() : 1;
    int64_t S = 1; /* slices per (request, KV head) */
    if (B * Hkv < threads) {
        S = (threads + B * Hkv - 1) / (B * Hkv);
        if (S > longest / MIN_SPLIT)
            S = longest / MIN_SPLIT > 1 ? longest / MIN_SPLIT : 1;
        if (S > MAX_SPLITS)
            S = MAX_SPLITS;
    }
    /* Per (request, KV head, slice): m [G], l [G], acc [G, D]. */
    const int64_t part = G * (D + 2);
    float *parts = malloc((size_t)(B * Hkv * S * part) * sizeof(float));
#pragma omp parallel for collapse(3) schedule(dynamic) if (parallel)
    for (int64_t b = 0; b < B; b++)
        for (int64_t kh = 0; kh < Hkv; kh++)
            for (int64_t sl = 0; sl < S; sl++) {
                const int64_t len = seq_lens[b];
                const int64_t start = window > 0 && len > window ? len - window : 0;
                const int64_t n = len - start;
                const int64_t p0 = start + n * sl / S, p1 = start + n * (sl + 1) / S;
                float *pt = parts + ((b * Hkv + kh) * S + sl) * part;
                float *qf = malloc((G * D + G * (p1 - p0 + 1)) * sizeof(float));
                for (int64_t g = 0; g < G; g++)
                    for (int64_t i = 0; i < D; i++)
                        qf[g * D + i] = load1(q, bf16, b * q_row + (kh * G + g) * q_head + i);
                decode_part(qf, k_cache, v_cache, block_table + b * bt_row, bf16, Hkv, kh, G,
                            D, BS, scale, softcap, p0, p1, qf + G * D, pt, pt + G, pt + 2 * G);
                free(qf);
            }
    /* Combine the slices: out = sum_s acc_s e^(m_s - M) / (sum_s l_s e^(m_s - M) [+ e^(sink -
     * M)]), M the largest m_s (and the sink): the sink's term once per (request, head). */
    for (int64_t b = 0; b < B; b++)
        for (int64_t kh = 0; kh < Hkv; kh++)
            for (int64_t g = 0; g < G; g++) {
                const float *p = parts + (b * Hkv + kh) * S * part;
                float mx = -INFINITY, total = 0.0f;
                for (int64_t sl = 0; sl < S; sl++)
                    mx = p[sl * part + g] > mx ? p[sl * part + g] : mx;
                if (sinks) {
                    const float sink = sinks[kh * G + g];
                    mx = sink > mx ? sink : mx;
                    total = expf(sink - mx);
                }
                float wts[MAX_SPLITS];
                for (int64_t sl = 0; sl < S; sl++) {
                    const float *ps = p + sl * part;
                    wts[sl] = ps[G + g] > 0.0f ? expf(ps[g] - mx) : 0.0f;
                    total += ps[G + g] * wts[sl];
                }
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                const int64_t o = b * o_row + (kh * G + g) * o_head;
                for (int64_t i = 0; i < D; i++) {
                    float v = 0.0f;
                    for (int64_t sl = 0; sl < S; sl++)
                        v += p[sl * part + 2 * G + g * D + i] * wts[sl];
                    store1(out, bf16, o + i, v * inv);
                }
            }
    free(parts);
}

/* act(gate) * up for T rows of [gate (I values), up (I values)] (row stride x_row) into out
 * (row stride o_row): act 0 = SiLU, gate / (1 + e^-gate); act 1 = GELU with the tanh
 * approximation, 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), computed as
 * g / (1 + e^(-2u)), the same function. float32 arithmetic, one rounding to the dtype at the
 * end (bfloat16: act(gate) rounded before the product, as torch's two ops); vectorized exp,
 * so a value can differ from torch's in the last bits. */
void cpu_gated_act(const void *x, int64_t x_row, void *out, int64_t o_row, int bf16, int64_t T,
                   int64_t I, int act) {
#pragma omp parallel for schedule(static) if (T * I >= PARALLEL_WORK)
    for (int64_t t = 0; t < T; t++) {
        const void *gate = at(x, bf16, t * x_row);
        const void *up = at(x, bf16, t * x_row + I);
        void *o = at_mut(out, bf16, t * o_row);
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 g = load8(gate, bf16, i), u = load8(up, bf16, i), z = g;
            if (act == 1) { /* z = 2u = 2 sqrt(2/pi) (g + 0.044715 g^3) */
                __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
                z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f),
                                  _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
            }
            __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f),
                                       exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)));
            __m256 a = _mm256_div_ps(g, den);
            if (bf16) /* act(gate) rounded to bfloat16 first, as torch's two ops round it */
                store8_bf16((uint16_t *)o + i, _mm256_mul_ps(round8_bf16(a), u));
            else
                _mm256_storeu_ps((float *)o + i, _mm256_mul_ps(a, u));
        }
        for (; i < I; i++) {
            float g = load1(gate, bf16, i), u = load1(up, bf16, i), z = g;
            if (act == 1)
                z = 1.5957691216057308f * (g + 0.044715f * g * g * g);
            float a = g / (1.0f + expf(-z));
            if (bf16)
                a = bf16_to_float(float_to_bf16(a));
            store1(o, bf16, i, a * u);
        }
    }
}

/* The index of each row's maximum, as torch.argmax(x, dim=-1) gives it: the first (lowest) one
 * when tied, the first NaN where a row has one (a NaN counts as the maximum), 0 for a row of
 * -inf. x [rows, n] float32 (n >= 1), row stride ld; out int64 [rows]. Eight lanes keep their
 * strictly greater maximum and its index (so each lane's is its first), merged at the end by
 * value, then lowest index. Rows over threads when there are several; a greedy batch-1 step's
 * one row (the vocabulary's logits, just written, in cache) on one thread took 255 us through
 * torch.argmax. */
void cpu_argmax_f32(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * ld;
        float m = -INFINITY;
        int64_t mi = 0, i = 0;
        int nan = 0;
        if (n >= 8) {
            __m256 best = _mm256_set1_ps(-INFINITY), nans = _mm256_setzero_ps();
            __m256i bidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = bidx;
            const __m256i eight = _mm256_set1_epi32(8);
            for (; i + 8 <= n; i += 8) {
                __m256 a = _mm256_loadu_ps(v + i);
                __m256 gt = _mm256_cmp_ps(a, best, _CMP_GT_OQ);
                best = _mm256_blendv_ps(best, a, gt);
                bidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bidx),
                                                             _mm256_castsi256_ps(idx), gt));
                nans = _mm256_or_ps(nans, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
                idx = _mm256_add_epi32(idx, eight);
            }
            nan = _mm256_movemask_ps(nans) != 0;
            float bv[8];
            int32_t bi[8];
            _mm256_storeu_ps(bv, best);
            _mm256_storeu_si256((__m256i *)bi, bidx);
            m = bv[0];
            mi = bi[0];
            for (int l = 1; l < 8; l++)
                if (bv[l] > m || (bv[l] == m && bi[l] < mi)) {
                    m = bv[l];
                    mi = bi[l];
                }
        }
        for (int64_t j = i; j < n && !nan; j++) {
            if (isnan(v[j]))
                nan = 1;
            else if (v[j] > m || j == 0) {
                m = v[j];
                mi = j;
            }
        }
        if (nan) { /* the first NaN */
            for (int64_t j = 0; j < n; j++)
                if (isnan(v[j])) {
                    mi = j;
                    break;
                }
        }
        out[r] = mi;
    }
}

/* Softmax routing of T tokens over E experts (engine.kernels.reference.moe_topk_softmax):
 * logits row t at logits + t * row (bfloat16 when bf16, else float32); the softmax in float32
 * (exp(x - max) / sum), the top_k largest probabilities in descending order, ties to the lower
 * expert index, divided by their sum when renorm; weights float32 [T, top_k], ids int32
 * (top_k <= E; a row of NaN logits picks its first experts, with NaN weights). */
void cpu_topk_softmax(const void *logits, int64_t row, int bf16, int64_t T, int64_t E,
                      int64_t top_k, int renorm, float *weights, int32_t *ids) {
    float *p = (float *)malloc((size_t)E * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        const void *x = at(logits, bf16, t * row);
        float m = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++)
            m = fmaxf(m, load1(x, bf16, e));
        for (int64_t e = 0; e < E; e++) {
            p[e] = expf(load1(x, bf16, e) - m);
            sum += p[e];
        }
        for (int64_t e = 0; e < E; e++)
            p[e] = p[e] / sum;
        float *w = weights + t * top_k, chosen = 0.0f;
        int32_t *id = ids + t * top_k;
        for (int64_t k = 0; k < top_k; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best]))
                    best = e;
            for (int64_t e = 0; best < 0 && e < E; e++) /* NaN logits: the first not taken */
                if (p[e] != -1.0f)
                    best = e;
            w[k] = p[best];
            id[k] = (int32_t)best;
            p[best] = -1.0f; /* taken */
            chosen += w[k];
        }
        if (renorm)
            for (int64_t k = 0; k < top_k; k++)
                w[k] = w[k] / chosen;
    }
    free(p);
}

/* y[t, n] = sum_k x[t, k] w[n, k] for T rows of K values and N outputs (a router's product):
 * x, w and y each bfloat16 or float32 (their flags), sums in float32 (eight lanes, then the
 * tail), rounded once to y's dtype. Rows at x + t * x_row and y + t * y_row; w contiguous. */
void cpu_dense_linear(const void *x, int64_t x_row, int x_bf16, int64_t T, int64_t K,
                      const void *w, int w_bf16, int64_t N, void *y, int64_t y_row, int y_bf16) {
#pragma omp parallel for schedule(static) if (T * N * K >= 32 * PARALLEL_WORK)
    for (int64_t n = 0; n < N; n++) {
        const void *wn = at(w, w_bf16, n * K);
        for (int64_t t = 0; t < T; t++) {
            const void *xt = at(x, x_bf16, t * x_row);
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            int64_t k = 0;
            for (; k + 16 <= K; k += 16) {
                a0 = _mm256_fmadd_ps(load8(xt, x_bf16, k), load8(wn, w_bf16, k), a0);
                a1 = _mm256_fmadd_ps(load8(xt, x_bf16, k + 8), load8(wn, w_bf16, k + 8), a1);
            }
            for (; k + 8 <= K; k += 8)
                a0 = _mm256_fmadd_ps(load8(xt, x_bf16, k), load8(wn, w_bf16, k), a0);
            float s = hsum_ps(_mm256_add_ps(a0, a1));
            for (; k < K; k++)
                s += load1(xt, x_bf16, k) * load1(wn, w_bf16, k);
            store1(y, y_bf16, t * y_row + n, s);
        }
    }
}
