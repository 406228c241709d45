/* Native plans: a recorded sequence of this library's kernel calls, run by one foreign call.
 *
 * A decode step of a small model on the CPU is about a hundred and fifty kernel calls, each a
 * few microseconds of work, and calling them one by one from Python costs as much again as the
 * work (engine_cpu/plan.py, which records them, says how much). A plan is one int64 array of
 * entries [function, argument count, arguments...]: each function is the `_p` twin of a kernel
 * below, which unpacks its arguments from the array (pointers and integers as they are, floats
 * as the bits of a double), and cpu_plan_run calls them in order.
 */
#include <stdint.h>
#include <string.h>

void gguf_avx2_linear(const void *x, int x_bf16, const uint8_t *values, int pack,
                      const float *scales, const float *offsets, int64_t N, int64_t K, int group,
                      int64_t M, uint8_t *scratch, void *y, int64_t ldy);
void gguf_avx2_rows(const uint8_t *values, int pack, const float *scales, const float *offsets,
                    const int64_t *ids, int64_t R, int64_t K, int group, void *out, int out_bf16,
                    int scaled, float scale);
void cpu_rms_norm(const void *x, int64_t x_row, int64_t x_head, void *out, int64_t o_row,
                  int64_t o_head, int bf16, int64_t T, int64_t H, int64_t D, const float *w,
                  float eps);
void cpu_fused_add_rms_norm(const void *x, int64_t x_row, const void *residual, int64_t r_row,
                            void *normed, void *summed, int bf16, int64_t T, int64_t D,
                            const float *w, float eps);
void cpu_qk_norm_rotary(void *q, int64_t q_row, int64_t q_heads, void *k, int64_t k_row,
                        int64_t k_heads, int bf16, int64_t T, int64_t D, const int64_t *positions,
                        const float *cos_sin, const float *q_w, const float *k_w, float eps);
void cpu_write_kv(const void *key, int64_t k_row, int64_t k_head, const void *value,
                  int64_t v_row, int64_t v_head, void *cache, int64_t plane,
                  const int64_t *slots, int bf16, int64_t T, int64_t H, int64_t D);
void cpu_paged_decode(const void *q, int64_t q_row, int64_t q_head, const void *k_cache,
                      const void *v_cache, const int32_t *block_table, int64_t bt_row,
                      const int32_t *seq_lens, void *out, int64_t o_row, int64_t o_head,
                      int bf16, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                      float scale, float softcap, int64_t window, const float *sinks);
void cpu_gated_act(const void *x, int64_t x_row, void *out, int64_t o_row, int bf16, int64_t T,
                   int64_t I, int act);
void cpu_topk_softmax(const void *logits, int64_t row, int bf16, int64_t T, int64_t E,
                      int64_t top_k, int renorm, float *weights, int32_t *ids);
void cpu_dense_linear(const void *x, int64_t x_row, int x_bf16, int64_t T, int64_t K,
                      const void *w, int w_bf16, int64_t N, void *y, int64_t y_row, int y_bf16);
void gguf_avx2_moe(const void *x, int bf16, int64_t T, int64_t H, const int32_t *ids,
                   const float *weights, int64_t top_k, int64_t E, const int64_t *desc, int n_gu,
                   int64_t I, uint8_t *scratch, uint8_t *work, float *acc, void *result);

#define P(i) ((void *)(intptr_t)a[i])
#define I(i) (a[i])

static inline float F(const int64_t *a, int i) {
    double d;
    memcpy(&d, a + i, sizeof d);
    return (float)d;
}

void gguf_avx2_linear_p(const int64_t *a) {
    gguf_avx2_linear(P(0), (int)I(1), P(2), (int)I(3), P(4), P(5), I(6), I(7), (int)I(8), I(9),
                     P(10), P(11), I(12));
}

void gguf_avx2_rows_p(const int64_t *a) {
    gguf_avx2_rows(P(0), (int)I(1), P(2), P(3), P(4), I(5), I(6), (int)I(7), P(8), (int)I(9),
                   (int)I(10), F(a, 11));
}

void cpu_rms_norm_p(const int64_t *a) {
    cpu_rms_norm(P(0), I(1), I(2), P(3), I(4), I(5), (int)I(6), I(7), I(8), I(9), P(10), F(a, 11));
}

void cpu_fused_add_rms_norm_p(const int64_t *a) {
    cpu_fused_add_rms_norm(P(0), I(1), P(2), I(3), P(4), P(5), (int)I(6), I(7), I(8), P(9),
                           F(a, 10));
}

void cpu_qk_norm_rotary_p(const int64_t *a) {
    cpu_qk_norm_rotary(P(0), I(1), I(2), P(3), I(4), I(5), (int)I(6), I(7), I(8), P(9), P(10),
                       P(11), P(12), F(a, 13));
}

void cpu_write_kv_p(const int64_t *a) {
    cpu_write_kv(P(0), I(1), I(2), P(3), I(4), I(5), P(6), I(7), P(8), (int)I(9), I(10), I(11),
                 I(12));
}

void cpu_paged_decode_p(const int64_t *a) {
    cpu_paged_decode(P(0), I(1), I(2), P(3), P(4), P(5), I(6), P(7), P(8), I(9), I(10),
                     (int)I(11), I(12), I(13), I(14), I(15), I(16), F(a, 17), F(a, 18), I(19),
                     P(20));
}

void cpu_gated_act_p(const int64_t *a) {
    cpu_gated_act(P(0), I(1), P(2), I(3), (int)I(4), I(5), I(6), (int)I(7));
}

void cpu_topk_softmax_p(const int64_t *a) {
    cpu_topk_softmax(P(0), I(1), (int)I(2), I(3), I(4), I(5), (int)I(6), P(7), P(8));
}

void cpu_dense_linear_p(const int64_t *a) {
    cpu_dense_linear(P(0), I(1), (int)I(2), I(3), I(4), P(5), (int)I(6), I(7), P(8), I(9),
                     (int)I(10));
}

void gguf_avx2_moe_p(const int64_t *a) {
    gguf_avx2_moe(P(0), (int)I(1), I(2), I(3), P(4), P(5), I(6), I(7), P(8), (int)I(9), I(10),
                  P(11), P(12), P(13), P(14));
}

typedef void (*plan_fn)(const int64_t *);

/* Run the n entries of `plan` in order. */
void cpu_plan_run(const int64_t *plan, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        plan_fn fn = (plan_fn)(intptr_t)plan[0];
        const int64_t argc = plan[1];
        fn(plan + 2);
        plan += 2 + argc;
    }
}
