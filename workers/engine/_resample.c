/* Pillow's bicubic resize of packed RGB images, bit for bit, fused with Qwen2-VL's normalise + patchify: the
 * module vlmq.workers.engine._resample (validation, passes, output; the kernels are in _resample_kernels.c and
 * _resample_avx2.c).
 *
 * Like Pillow, a pass whose side keeps its size is skipped, and each pass rounds to 8 bits. Pillow < 13 always
 * runs the horizontal pass first, on the input rows the vertical pass reads; Pillow 13 runs the vertical one
 * first when the height shrinks by more than twice as many pixels as the width (`order` picks the rule; the
 * Python side checks which one the installed Pillow follows).
 *
 * Integer sums are exact, so the order of the terms is free: the horizontal pass transposes ROWS rows and works
 * on all of them at once (3 * ROWS contiguous lanes per tap), the vertical pass on contiguous runs of a row.
 * Horizontal-first rows live in a ring just large enough for the vertical taps, so they are still in cache when
 * read. Each output row then goes to an RGB output or into a band of patch*merge rows, and each full band,
 * through a per-(channel, byte) float table, straight into its patch rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_resample.h"

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
            uint8_t *row = w->line + w->in_row * r;
            vertical_any(w->taps, w->v.k + (size_t)ksize * (y0 + r), ksize, (int)w->in_row, row);
            w->src[r] = row;
            w->dst[r] = w->rows + w->pitch * r;
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
    if (name && strcmp(name, "portable") == 0) {
        avx2 = 0;
    } else if (name && strcmp(name, "avx2") == 0) {
        if (!check(cpu_has_avx2(), "this build or CPU has no AVX2 kernels")) return NULL;
        avx2 = 1;
    } else if (name) {
        return PyErr_Format(PyExc_ValueError, "kernels are 'avx2' or 'portable', not '%s'", name);
    }
    return PyUnicode_FromString(avx2 ? "avx2" : "portable");
}

static PyMethodDef methods[] = {
    {"kernels", kernels, METH_VARARGS,
     "kernels([name]): the kernels in use, 'avx2' or 'portable'; with a name, switch to them (for tests)."},
    {"resize_rgb", resize_rgb, METH_VARARGS,
     "resize_rgb(src, in_h, in_w, (out_h, out_w), order, out): Pillow's bicubic resize of RGB bytes into out."},
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
