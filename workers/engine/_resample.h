/* Shared by _resample.c (Pillow's weights, the passes, the portable kernels, the Python glue) and
 * _resample_avx2.c (the same two kernels with AVX2 intrinsics). */
#ifndef VLMQ_RESAMPLE_H
#define VLMQ_RESAMPLE_H

#include <stdint.h>

#define PRECISION_BITS (32 - 8 - 2) /* Pillow's 8-bit fixed point: 22 fraction bits, room for overshoot */
#define HALF (1 << (PRECISION_BITS - 1))
#define ROWS 32             /* rows per horizontal block */
#define LANES (3 * ROWS)    /* (row, channel) lanes of a transposed block */
#define STRIDE (LANES + 4)  /* bytes per pixel column of a transposed block: the lanes, then padding */
#define RUN 32              /* bytes of a row per vertical run (its accumulators stay in registers) */

typedef struct {
    int ksize;  /* taps per output sample: the widest span */
    int *start; /* [n] first input sample read; start + ksize <= input size */
    int32_t *k; /* [n, ksize] fixed-point weights, zero outside the sample's span */
} Taps;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2_KERNELS 1
/* nrows (<= ROWS) transposed rows [in_w, STRIDE] -> dst[r][3 * out_w], each row with one spare byte */
void horizontal_avx2(const uint8_t *block, const Taps *t, int out_w, uint8_t *const *dst, int nrows);
/* ksize rows (weights k) -> one row of n >= RUN bytes */
void vertical_avx2(const uint8_t *const *rows, const int32_t *k, int ksize, int n, uint8_t *out);
#endif

#endif
