/* The layout word and the scale rows of the AVX2 family's GGUF products, shared by
 * gguf_avx2.c (the AVX2 instructions) and gguf_vnni.c (AVX-512 VNNI); gguf_avx2.c's header
 * describes the packings. */
#ifndef ENGINE_CPU_GGUF_LAYOUT_H
#define ENGINE_CPU_GGUF_LAYOUT_H

#include "avx2_common.h"

enum { PACK_U8 = 0, PACK_U4 = 1, PACK_S8 = 2 };

static inline int64_t block_bytes_of(int pack) { return pack == PACK_U4 ? 16 : 32; }

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

/* Row n's scales in an [N, ng] array of float32, or of float16 when sc16 */
static inline const float *scale_row(const float *scales, int sc16, int64_t n, int64_t ng) {
    return (const float *)((const char *)scales + n * ng * (sc16 ? 2 : 4));
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
