/* Pillow's bicubic resize of packed RGB images, bit for bit, fused with Qwen2-VL's normalise + patchify.
 *
 * The arithmetic is Pillow's (libImaging/Resample.c, unchanged since Pillow 4): for each output sample,
 * weights w = cubic((x - center + 0.5) / filterscale) over the input samples whose centres lie within
 * support = 2 * filterscale of the output's centre (filterscale = max(1, in/out): the kernel widens when
 * shrinking), divided by their sum, then rounded to fixed point with 22 fraction bits. A pass computes
 * (1 << 21) + sum(v * w) in int32 and clips (s >> 22) to 0..255. The horizontal pass runs first, on the
 * input rows the vertical pass reads, into 8-bit rows; a pass whose side keeps its size is skipped.
 *
 * Integer sums are exact, so the order of the terms is free: the horizontal pass transposes ROWS input
 * rows and works on all of them at once (3 * ROWS contiguous lanes per tap), the vertical pass works on
 * contiguous runs of a row; both loops auto-vectorise. Horizontal rows live in a ring buffer just large
 * enough for the vertical taps, so they are still in cache when read. Each output row then goes either
 * to an RGB output or, through a per-(channel, byte) float table, straight into its patch rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_resample.h"

#define TILE 128 /* pixels per transposed tile */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif
#ifdef __SSE2__
#include <emmintrin.h>
#endif

static int avx2; /* use the AVX2 kernels (set at import where the CPU has AVX2) */

typedef struct {
    const float *table; /* [3, 256] value of each (channel, byte) */
    float *out;         /* [gh * gw, 3 * tp * p * p] */
    int p, m, tp, width;
} Patches;

typedef struct {
    const uint8_t *src; /* [in_h, in_w, 3] */
    int in_h, in_w, out_h, out_w;
    int order;    /* 0: horizontal pass first (Pillow < 13); 1: Pillow 13's choice of the first pass */
    uint8_t *rgb; /* [out_h, out_w, 3], or NULL to write patches */
    Patches patches;
} Job;

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

static inline uint8_t clip8(int32_t s) {
    s >>= PRECISION_BITS;
    return (uint8_t)(s < 0 ? 0 : s > 255 ? 255 : s);
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

static void free_taps(Taps *t) {
    free(t->start);
    free(t->k);
    t->start = NULL;
    t->k = NULL;
}

static int make_taps(int in_size, int out_size, Taps *t) {
    double scale = (double)(float)in_size / out_size; /* Pillow takes the box as floats */
    double filterscale = scale < 1.0 ? 1.0 : scale;
    int bound = (int)ceil(2.0 * filterscale) * 2 + 1; /* Pillow's ksize, a bound on every count */
    double *w = malloc(sizeof(double) * bound * out_size);
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

/* nrows (<= ROWS) transposed rows [in_w, STRIDE] -> dst[r][3 * out_w] (rows padded by one byte: each pixel is
   stored as 4 bytes, the spare one overwritten by the next pixel) */
static void horizontal(const uint8_t *block, const Taps *t, int out_w, uint8_t *const *dst, int nrows) {
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

/* rows[r][3 * width] -> block[x * STRIDE + 3 * r + c], TILE pixels of every row at a time so the block's tile
   stays in L1, the next tile of each row prefetched (ROWS short reads from memory otherwise wait on it, and this
   copy was as slow as the horizontal pass); a pixel per 4-byte copy (the spare byte lands in the next row's lane, written after, or in the
   padding); the last pixel of a row is copied as 3 bytes */
static void transpose(const uint8_t *const *rows, int width, int nrows, uint8_t *block) {
    for (int x0 = 0; x0 < width - 1; x0 += TILE) {
        int x1 = x0 + TILE < width - 1 ? x0 + TILE : width - 1;
        for (int r = 0; r < nrows; r++) {
            for (int b = 3 * x1; b < 3 * (x1 + TILE) && b < 3 * width; b += 64) PREFETCH(rows[r] + b); /* next tile */
            for (int x = x0; x < x1; x++) memcpy(block + (size_t)x * STRIDE + 3 * r, rows[r] + 3 * x, 4);
        }
    }
    for (int r = 0; r < nrows; r++) memcpy(block + (size_t)(width - 1) * STRIDE + 3 * r, rows[r] + 3 * (width - 1), 3);
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

/* ksize rows -> one row of n bytes; a short tail is redone as the last full run (same values) */
static void vertical(const uint8_t *const *rows, const int32_t *k, int ksize, int n, uint8_t *out) {
    if (n < RUN) vertical_run(rows, k, ksize, 0, n, out);
    for (int j0 = 0; n >= RUN && j0 < n; j0 += RUN)
        vertical_run(rows, k, ksize, j0 + RUN <= n ? j0 : n - RUN, RUN, out);
}

static void horizontal_any(const uint8_t *block, const Taps *t, int out_w, uint8_t *const *dst, int nrows) {
#ifdef HAVE_AVX2_KERNELS
    if (avx2) {
        horizontal_avx2(block, t, out_w, dst, nrows);
        return;
    }
#endif
    horizontal(block, t, out_w, dst, nrows);
}

static void vertical_any(const uint8_t *const *rows, const int32_t *k, int ksize, int n, uint8_t *out) {
#ifdef HAVE_AVX2_KERNELS
    if (avx2 && n >= RUN) {
        vertical_avx2(rows, k, ksize, n, out);
        return;
    }
#endif
    vertical(rows, k, ksize, n, out);
}

/* n floats to dst past the caches where SSE2 allows (n % 4 == 0, dst 16-byte aligned): the output is far
   larger than the caches and is not read back here, so this saves reading each line in before writing it */
static void stream_floats(float *dst, const float *src, size_t n) {
#ifdef __SSE2__
    if ((uintptr_t)dst % 16 == 0 && n % 4 == 0) {
        for (size_t i = 0; i < n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
        return;
    }
#endif
    memcpy(dst, src, sizeof(float) * n);
}

/* A band of p*m RGB rows (row r at band + r * out_row) -> its patch rows, written in memory order.
   Band bi holds the patch rows from bi * (gw/m) * m*m on: merge blocks left to right, inside one the patches
   row-major; each patch row is, for every channel c and frame t, the p*p values of the patch, every frame the
   same. */
static void patch_band(const Patches *pt, int bi, const uint8_t *band, size_t out_row, float *values) {
    int p = pt->p, m = pt->m, blocks = pt->width / (p * m);
    size_t pp = (size_t)p * p;
    float *d = pt->out + (size_t)bi * blocks * m * m * 3 * pt->tp * pp;
    for (int bj = 0; bj < blocks; bj++)
        for (int mi = 0; mi < m; mi++)
            for (int mj = 0; mj < m; mj++) {
                const uint8_t *patch = band + mi * p * out_row + 3 * (size_t)(bj * m + mj) * p;
                for (int c = 0; c < 3; c++) {
                    const float *table = pt->table + 256 * c;
                    for (int i = 0; i < p; i++)
                        for (int j = 0; j < p; j++) values[i * p + j] = table[patch[i * out_row + 3 * j + c]];
                    for (int t = 0; t < pt->tp; t++, d += pp) stream_floats(d, values, pp);
                }
            }
}

typedef struct {
    Taps h, v;
    int need_h, need_v, vertical_first;
    size_t in_row, out_row, pitch; /* bytes per input row, per output row, per buffered output row */
    uint8_t *rows;                  /* buffered rows: the ring (horizontal first) or one block (vertical first) */
    int ring_rows;
    uint8_t *block, *line, *band, *dst[ROWS]; /* band: p*m output rows, for patches */
    float *values;                            /* one patch's p*p values of one channel */
    const uint8_t **taps, *src[ROWS];
} Work;

static void free_work(Work *w) {
    free_taps(&w->h);
    free_taps(&w->v);
    free(w->rows);
    free(w->block);
    free(w->line);
    free(w->band);
    free(w->values);
    free(w->taps);
}

static int alloc_work(const Job *job, Work *w) {
    w->need_h = job->out_w != job->in_w;
    w->need_v = job->out_h != job->in_h;
    /* Pillow 13 runs the vertical pass first when the height shrinks by more than twice the width's shrink */
    w->vertical_first = job->order == 1 && w->need_h && w->need_v && job->out_h < job->in_h &&
                        job->in_h - job->out_h > 2 * (job->in_w - job->out_w);
    w->in_row = (size_t)job->in_w * 3;
    w->out_row = (size_t)job->out_w * 3;
    w->pitch = w->out_row + 1;
    if (w->need_h && make_taps(job->in_w, job->out_w, &w->h)) return -1;
    if (w->need_v && make_taps(job->in_h, job->out_h, &w->v)) return -1;
    w->ring_rows = (w->need_v ? w->v.ksize : 1) + ROWS;
    w->rows = w->need_h ? malloc(w->pitch * w->ring_rows) : NULL;
    w->block = w->need_h ? calloc((size_t)job->in_w + 1, STRIDE) : NULL;
    w->line = malloc((w->vertical_first ? ROWS : 1) * (w->in_row > w->out_row ? w->in_row : w->out_row));
    w->taps = malloc(sizeof(uint8_t *) * (w->need_v ? w->v.ksize : 1));
    w->band = job->rgb ? NULL : malloc(w->out_row * job->patches.p * job->patches.m);
    w->values = job->rgb ? NULL : malloc(sizeof(float) * job->patches.p * job->patches.p);
    return (w->need_h && !(w->rows && w->block)) || !(w->line && w->taps) || !(job->rgb || (w->band && w->values))
               ? -1
               : 0;
}

/* output row y -> the RGB output, or the band; a full band -> patch rows */
static void emit(const Job *job, const Work *w, int y, const uint8_t *row) {
    int rows = job->patches.p * job->patches.m;
    if (job->rgb) {
        memcpy(job->rgb + w->out_row * y, row, w->out_row);
        return;
    }
    memcpy(w->band + w->out_row * (y % rows), row, w->out_row);
    if (y % rows == rows - 1) patch_band(&job->patches, y / rows, w->band, w->out_row, w->values);
}

/* vertical taps of output row y, read from the input or from the ring of horizontal rows */
static int point_taps(const Job *job, Work *w, int y, int from_ring) {
    int lo = w->need_v ? w->v.start[y] : y, ksize = w->need_v ? w->v.ksize : 1;
    for (int i = 0; i < ksize; i++)
        w->taps[i] = from_ring ? w->rows + w->pitch * ((lo + i) % w->ring_rows) : job->src + w->in_row * (lo + i);
    return ksize;
}

/* horizontal pass over input rows [*done, upto), ROWS at a time, into the ring */
static void fill_ring(const Job *job, Work *w, int *done, int upto) {
    while (*done < upto) {
        int nrows = job->in_h - *done < ROWS ? job->in_h - *done : ROWS;
        for (int r = 0; r < nrows; r++) {
            w->src[r] = job->src + w->in_row * (*done + r);
            w->dst[r] = w->rows + w->pitch * ((*done + r) % w->ring_rows);
        }
        transpose(w->src, job->in_w, nrows, w->block);
        horizontal_any(w->block, &w->h, job->out_w, w->dst, nrows);
        *done += nrows;
    }
}

/* Pillow's default order: horizontal rows as the vertical taps need them, then one output row at a time */
static void horizontal_first(const Job *job, Work *w) {
    int done = 0;
    for (int y = 0; y < job->out_h; y++) {
        int lo = w->need_v ? w->v.start[y] : y, ksize = w->need_v ? w->v.ksize : 1;
        if (w->need_h) {
            done = done < lo ? lo : done; /* rows below lo are never read again */
            fill_ring(job, w, &done, lo + ksize);
        }
        point_taps(job, w, y, w->need_h);
        if (w->need_v) vertical_any(w->taps, w->v.k + (size_t)ksize * y, ksize, (int)w->out_row, w->line);
        emit(job, w, y, w->need_v ? w->line : w->taps[0]);
    }
}

/* ROWS output rows at a time: vertical pass at the input width, then horizontal */
static void vertical_first(const Job *job, Work *w) {
    for (int y0 = 0; y0 < job->out_h; y0 += ROWS) {
        int nrows = job->out_h - y0 < ROWS ? job->out_h - y0 : ROWS;
        for (int r = 0; r < nrows; r++) {
            int ksize = point_taps(job, w, y0 + r, 0);
            w->src[r] = w->line + w->in_row * r;
            w->dst[r] = w->rows + w->pitch * r;
            vertical_any(w->taps, w->v.k + (size_t)ksize * (y0 + r), ksize, (int)w->in_row, (uint8_t *)w->src[r]);
        }
        transpose(w->src, job->in_w, nrows, w->block);
        horizontal_any(w->block, &w->h, job->out_w, w->dst, nrows);
        for (int r = 0; r < nrows; r++) emit(job, w, y0 + r, w->dst[r]);
    }
}

static int run(const Job *job) {
    Work w = {0};
    int err = alloc_work(job, &w);
    if (!err && w.vertical_first)
        vertical_first(job, &w);
    else if (!err)
        horizontal_first(job, &w);
    free_work(&w);
#ifdef __SSE2__
    _mm_sfence(); /* the streamed stores are visible before the caller reads the output */
#endif
    return err;
}

static int cpu_has_avx2(void) {
#ifdef HAVE_AVX2_KERNELS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static PyObject *run_released(const Job *job) {
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = run(job); /* touches no Python object: other threads run meanwhile */
    Py_END_ALLOW_THREADS
    if (err) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int check(int ok, const char *message) {
    if (!ok) PyErr_SetString(PyExc_ValueError, message);
    return ok;
}

static int check_sizes(const Py_buffer *src, const Job *job) {
    return check(job->in_h > 0 && job->in_w > 0 && job->out_h > 0 && job->out_w > 0, "sizes must be positive") &&
           check(job->order == 0 || job->order == 1, "order must be 0 or 1") &&
           check(src->len == (Py_ssize_t)job->in_h * job->in_w * 3, "src must hold in_h * in_w * 3 bytes");
}

static PyObject *resize_rgb(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    Job job = {0};
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*ii(ii)iw*", &src, &job.in_h, &job.in_w, &job.out_h, &job.out_w, &job.order,
                          &out))
        return NULL;
    job.src = src.buf;
    job.rgb = out.buf;
    if (check_sizes(&src, &job) &&
        check(out.len == (Py_ssize_t)job.out_h * job.out_w * 3, "out must hold out_h * out_w * 3 bytes"))
        result = run_released(&job);
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

static int check_patches(const Py_buffer *table, const Py_buffer *out, const Job *job) {
    const Patches *pt = &job->patches;
    int factor = pt->p * pt->m;
    return check(pt->p > 0 && pt->m > 0 && pt->tp > 0, "patch, merge and temporal must be positive") &&
           check(job->out_h % factor == 0 && job->out_w % factor == 0, "out sides must be multiples of patch*merge") &&
           check(table->len == 3 * 256 * (Py_ssize_t)sizeof(float), "table must be float32 [3, 256]") &&
           check(out->len == (Py_ssize_t)job->out_h * job->out_w * 3 * pt->tp * (Py_ssize_t)sizeof(float),
                 "out must be float32 [out_h * out_w / patch**2, 3 * temporal * patch**2]");
}

static PyObject *resize_patches(PyObject *self, PyObject *args) {
    Py_buffer src, table, out;
    Job job = {0};
    Patches *pt = &job.patches;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*ii(ii)iy*w*iii", &src, &job.in_h, &job.in_w, &job.out_h, &job.out_w, &job.order,
                          &table, &out, &pt->p, &pt->m, &pt->tp))
        return NULL;
    job.src = src.buf;
    pt->table = table.buf;
    pt->out = out.buf;
    pt->width = job.out_w;
    if (check_sizes(&src, &job) && check_patches(&table, &out, &job)) result = run_released(&job);
    PyBuffer_Release(&src);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *kernels(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|s", &name)) return NULL;
    if (name && strcmp(name, "portable") == 0)
        avx2 = 0;
    else if (name && strcmp(name, "avx2") == 0 && check(cpu_has_avx2(), "this build or CPU has no AVX2 kernels"))
        avx2 = 1;
    else if (name && !PyErr_Occurred())
        return PyErr_Format(PyExc_ValueError, "kernels are 'avx2' or 'portable', not %R", PyTuple_GET_ITEM(args, 0));
    return PyErr_Occurred() ? NULL : PyUnicode_FromString(avx2 ? "avx2" : "portable");
}

static PyMethodDef methods[] = {
    {"kernels", kernels, METH_VARARGS,
     "kernels([name]): the kernels in use, 'avx2' or 'portable'; with a name, switch to them (for tests)."},
    {"resize_rgb", resize_rgb, METH_VARARGS,
     "resize_rgb(src, in_h, in_w, (out_h, out_w), order, out): Pillow's bicubic resize of packed RGB bytes into out."},
    {"resize_patches", resize_patches, METH_VARARGS,
     "resize_patches(src, in_h, in_w, (out_h, out_w), order, table, out, patch, merge, temporal): resize, look every "
     "byte up in table[channel], write Qwen2-VL patch rows into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_resample", NULL, -1, methods};

PyMODINIT_FUNC PyInit__resample(void) {
    avx2 = cpu_has_avx2();
    return PyModule_Create(&module);
}
