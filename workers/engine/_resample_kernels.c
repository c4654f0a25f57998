/* Pillow's bicubic weights, and the portable C kernels of the two passes (any compiler, any CPU).
 *
 * Pillow (libImaging/Resample.c, the same arithmetic since Pillow 4): for each output sample, the input samples
 * whose centres lie within support = 2 * filterscale of its centre (filterscale = max(1, in/out): the kernel
 * widens when shrinking) get w = cubic((x - center + 0.5) / filterscale), divided by their sum, rounded to
 * fixed point with 22 fraction bits. A pass computes (1 << 21) + sum(v * w) in int32 and clips (s >> 22) to
 * 0..255. The doubles here round as Pillow's do: same operations in the same order, no FMA contraction
 * (setup.py builds with -ffp-contract=off).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "_resample.h"

#define TILE 128 /* pixels per transposed tile */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif

static double cubic(double x) {
    /* Keys' kernel with a = -0.5, each operation as Pillow writes it so the doubles round the same */
    const double a = -0.5;
    if (x < 0.0) x = -x;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

static int32_t fixed_point(double w) { /* round half away from zero, as Pillow does */
    return (int32_t)(w < 0 ? -0.5 + w * (1 << PRECISION_BITS) : 0.5 + w * (1 << PRECISION_BITS));
}

/* Pillow's span [lo, lo + count) and normalised weights w[0:count] of output sample i */
static int span(int i, int in_size, double scale, double filterscale, double *w, int *count) {
    double support = 2.0 * filterscale, center = (i + 0.5) * scale, sum = 0.0;
    int lo = (int)(center - support + 0.5), hi = (int)(center + support + 0.5);
    lo = lo < 0 ? 0 : lo;
    hi = hi > in_size ? in_size : hi;
    for (int x = 0; x < hi - lo; x++) {
        w[x] = cubic((x + lo - center + 0.5) * (1.0 / filterscale));
        sum += w[x];
    }
    for (int x = 0; x < hi - lo; x++)
        if (sum != 0.0) w[x] /= sum;
    *count = hi - lo;
    return lo;
}

void free_taps(Taps *t) {
    free(t->start);
    free(t->k);
    t->start = NULL;
    t->k = NULL;
}

int make_taps(int in_size, int out_size, Taps *t) {
    double scale = (double)(float)in_size / out_size; /* Pillow takes the box as floats */
    double filterscale = scale < 1.0 ? 1.0 : scale;
    int bound = (int)ceil(2.0 * filterscale) * 2 + 1; /* Pillow's ksize, a bound on every count */
    double *w = malloc(sizeof(double) * bound * (size_t)out_size);
    int *lo = malloc(sizeof(int) * out_size), *count = malloc(sizeof(int) * out_size);
    int ok = w && lo && count;
    t->ksize = 1;
    for (int i = 0; ok && i < out_size; i++) {
        lo[i] = span(i, in_size, scale, filterscale, w + (size_t)bound * i, &count[i]);
        t->ksize = count[i] > t->ksize ? count[i] : t->ksize;
    }
    t->start = ok ? malloc(sizeof(int) * out_size) : NULL;
    t->k = ok ? calloc((size_t)t->ksize * out_size, sizeof(int32_t)) : NULL;
    ok = ok && t->start && t->k;
    for (int i = 0; ok && i < out_size; i++) { /* shift the window left at the far edge */
        int s = lo[i] < in_size - t->ksize ? lo[i] : in_size - t->ksize;
        int32_t *k = t->k + (size_t)t->ksize * i + (lo[i] - s);
        t->start[i] = s;
        for (int x = 0; x < count[i]; x++) k[x] = fixed_point(w[(size_t)bound * i + x]);
    }
    free(w);
    free(lo);
    free(count);
    if (!ok) free_taps(t);
    return ok ? 0 : -1;
}

static inline uint8_t clip8(int32_t s) {
    s >>= PRECISION_BITS;
    return (uint8_t)(s < 0 ? 0 : s > 255 ? 255 : s);
}

/* each pixel stored as 4 bytes, the spare one overwritten by the next pixel */
void horizontal(const uint8_t *block, const Taps *t, int out_w, uint8_t *const *dst, int nrows) {
    for (int x = 0; x < out_w; x++) {
        const uint8_t *col = block + (size_t)t->start[x] * STRIDE;
        const int32_t *k = t->k + (size_t)x * t->ksize;
        int32_t acc[LANES];
        uint8_t px[LANES + 1];
        for (int j = 0; j < LANES; j++) acc[j] = HALF;
        for (int i = 0; i < t->ksize; i++) {
            int32_t ki = k[i];
            if (ki == 0) continue; /* padding; also keeps GCC from unroll-and-jamming the loop scalar */
            for (int j = 0; j < LANES; j++) acc[j] += col[i * STRIDE + j] * ki;
        }
        for (int j = 0; j < LANES; j++) px[j] = clip8(acc[j]);
        for (int r = 0; r < nrows; r++) memcpy(dst[r] + 3 * x, px + 3 * r, 4);
    }
}

/* TILE pixels of every row at a time, so the block's tile stays in L1, with the next tile of each row prefetched
   (else the ROWS short reads from memory wait on it, and this copy took as long as the horizontal pass); a pixel
   per 4-byte copy, the spare byte landing in the next row's lane (written after) or in the padding; the last
   pixel of a row as 3 bytes */
void transpose(const uint8_t *const *rows, int width, int nrows, uint8_t *block) {
    for (int x0 = 0; x0 < width - 1; x0 += TILE) {
        int x1 = x0 + TILE < width - 1 ? x0 + TILE : width - 1;
        for (int r = 0; r < nrows; r++) {
            for (int b = 3 * x1; b < 3 * (x1 + TILE) && b < 3 * width; b += 64) PREFETCH(rows[r] + b);
            for (int x = x0; x < x1; x++) memcpy(block + (size_t)x * STRIDE + 3 * r, rows[r] + 3 * x, 4);
        }
    }
    uint8_t *last = block + (size_t)(width - 1) * STRIDE;
    for (int r = 0; r < nrows; r++) memcpy(last + 3 * r, rows[r] + 3 * ((size_t)width - 1), 3);
}

/* bytes [j0, j0 + len) of the vertical pass; with len = RUN the accumulators stay in registers */
static inline void vertical_run(const uint8_t *const *rows, const int32_t *k, int ksize, int j0, int len,
                                uint8_t *out) {
    int32_t acc[RUN];
    for (int j = 0; j < len; j++) acc[j] = HALF;
    for (int i = 0; i < ksize; i++) {
        const uint8_t *r = rows[i] + j0;
        int32_t ki = k[i];
        if (ki == 0) continue; /* padding; also keeps GCC from unroll-and-jamming the loop scalar */
        for (int j = 0; j < len; j++) acc[j] += r[j] * ki;
    }
    for (int j = 0; j < len; j++) out[j0 + j] = clip8(acc[j]);
}

/* a short tail is redone as the last full run (same values) */
void vertical(const uint8_t *const *rows, const int32_t *k, int ksize, int n, uint8_t *out) {
    if (n < RUN) vertical_run(rows, k, ksize, 0, n, out);
    for (int j0 = 0; n >= RUN && j0 < n; j0 += RUN)
        vertical_run(rows, k, ksize, j0 + RUN <= n ? j0 : n - RUN, RUN, out);
}
