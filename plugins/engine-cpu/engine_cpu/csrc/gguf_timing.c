/* A timing loop around gguf_avx2_linear for engine_cpu/gguf_kernel_timing.py (not part of the
 * kernel library: that module compiles this file with gguf_avx2.c and gguf_vnni.c into a
 * library of its own). The loop runs in C so that a call of a few microseconds is timed
 * without the cost of a foreign call from Python. */
#include <time.h>

#include "gguf_layout.h"

void gguf_avx2_linear(const void *x, int x_bf16, const uint8_t *values, int pack,
                      const float *scales, const float *offsets, int64_t N, int64_t K, int group,
                      int64_t M, uint8_t *scratch, void *y, int64_t ldy);

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return 1e9 * (double)t.tv_sec + (double)t.tv_nsec;
}

/* One gguf_avx2_linear call on each of the `copies` packed copies of a weight (values[c],
 * scales[c], offsets[c] or NULL), in turn, so that each call reads its weight from memory as a
 * decode step does (the copies together outgrow the last-level cache); the nanoseconds of each
 * call into ns[c]. x [M, K] float32, y [M, N] float32. */
void gguf_time_linear(int64_t copies, const uint8_t *const *values, const float *const *scales,
                      const float *const *offsets, int layout, int64_t N, int64_t K, int group,
                      const float *x, int64_t M, uint8_t *scratch, float *y, double *ns) {
    for (int64_t c = 0; c < copies; c++) {
        const double t0 = now_ns();
        gguf_avx2_linear(x, 0, values[c], layout, scales[c], offsets[c], N, K, group, M, scratch,
                         y, N);
        ns[c] = now_ns() - t0;
    }
}
