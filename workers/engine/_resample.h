/* Shared by _resample.c (the module: validation, passes, output), _resample_kernels.c (Pillow's weights, the
 * portable kernels) and _resample_avx2.c (the same two kernels with AVX2 intrinsics). */
#ifndef VLMQ_RESAMPLE_H
#define VLMQ_RESAMPLE_H

#include <stdint.h>

#define PRECISION_BITS (32 - 8 - 2) /* Pillow's 8-bit fixed point: 22 fraction bits, room for overshoot */
#define HALF (1 << (PRECISION_BITS - 1))
#define ROWS 32             /* rows per horizontal block */
#define LANES (3 * ROWS)    /* (row, channel) lanes of a transposed block */
#define STRIDE (LANES + 4)  /* bytes per pixel column of a transposed block: the lanes, then padding */
#define RUN 32              /* bytes of a row per vertical run (its accumulators stay in registers) */

/* functions shared between the files, kept out of the module's exported symbols */
#if defined(__GNUC__) || defined(__clang__)
#define INTERNAL __attribute__((visibility("hidden")))
#else
#define INTERNAL
#endif

typedef struct {
    int ksize;  /* taps per output sample: the widest span */
    int *start; /* [n] first input sample read; start + ksize <= input size */
    int32_t *k; /* [n, ksize] fixed-point weights, zero outside the sample's span */
} Taps;

/* Pillow's taps of a side resized from in_size to out_size; 0, or -1 when out of memory */
INTERNAL int make_taps(int in_size, int out_size, Taps *t);
INTERNAL void free_taps(Taps *t);

/* rows[r][3 * width] for r < nrows (<= ROWS) -> block[x * STRIDE + 3 * r + c] */
INTERNAL void transpose(const uint8_t *const *rows, int width, int nrows, uint8_t *block);
/* nrows transposed rows [in_w, STRIDE] -> dst[r][3 * out_w], each dst row with one spare byte after it */
INTERNAL void horizontal(const uint8_t *block, const Taps *t, int out_w, uint8_t *const *dst, int nrows);
/* ksize rows (weights k) -> one row of n bytes */
INTERNAL void vertical(const uint8_t *const *rows, const int32_t *k, int ksize, int n, uint8_t *out);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2_KERNELS 1
/* as horizontal() and vertical(); vertical_avx2 needs n >= RUN */
INTERNAL void horizontal_avx2(const uint8_t *block, const Taps *t, int out_w, uint8_t *const *dst, int nrows);
INTERNAL void vertical_avx2(const uint8_t *const *rows, const int32_t *k, int ksize, int n, uint8_t *out);
#endif

#endif
