/* The two resize kernels with AVX2 16-bit multiply-adds, exact to the same int32 sums as Pillow's.
 *
 * vpmaddwd multiplies int16 pairs and adds each pair into an int32: 16 products per instruction, where
 * vpmulld gives 8. Pixels fit int16; a weight k (|k| < 2^23) does not, so it is split as
 * k = kh * 2^11 + kl with kl = k & 2047 and kh = k >> 11 (both fit int16), two taps are interleaved
 * (pixels of taps i and i+1 side by side), and per lane
 *     sum_i v_i * k_i = (sum_i v_i * kh_i) * 2^11 + sum_i v_i * kl_i,
 * every partial sum an exact int32 (|sum v * kl| <= 255 * 2047 * ksize, |sum v * kh| <= |total| / 2^11 + that).
 * Then (s + HALF) >> 22 and two saturating packs clip to 0..255, which is clip8.
 */
#include "_resample.h"

#ifdef HAVE_AVX2_KERNELS
#include <immintrin.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2")))

/* the weights of taps i and i + 1 (0 past the last), split into (high, low) 16-bit pairs */
AVX2 static inline void split_pair(const int32_t *k, int i, int ksize, __m256i *kh, __m256i *kl) {
    int32_t k0 = k[i], k1 = i + 1 < ksize ? k[i + 1] : 0;
    *kh = _mm256_set1_epi32((int32_t)((uint16_t)(k0 >> 11) | (uint32_t)(uint16_t)(k1 >> 11) << 16));
    *kl = _mm256_set1_epi32((int32_t)((k0 & 2047) | (uint32_t)(k1 & 2047) << 16));
}

/* 32 bytes of tap i (a) and tap i + 1 (b) into the accumulators. Interleaving a and b and widening to 16 bits
   leaves, per 128-bit half, lanes {0-3}, {4-7}, {8-11}, {12-15} in w[0..3]; finish() undoes that order. */
AVX2 static inline void madd32(__m256i a, __m256i b, __m256i kh, __m256i kl, __m256i *hi, __m256i *lo) {
    __m256i zero = _mm256_setzero_si256(), ab0 = _mm256_unpacklo_epi8(a, b), ab1 = _mm256_unpackhi_epi8(a, b);
    __m256i w[4] = {_mm256_unpacklo_epi8(ab0, zero), _mm256_unpackhi_epi8(ab0, zero),
                    _mm256_unpacklo_epi8(ab1, zero), _mm256_unpackhi_epi8(ab1, zero)};
    for (int q = 0; q < 4; q++) {
        hi[q] = _mm256_add_epi32(hi[q], _mm256_madd_epi16(w[q], kh));
        lo[q] = _mm256_add_epi32(lo[q], _mm256_madd_epi16(w[q], kl));
    }
}

/* (hi * 2^11 + lo + HALF) >> 22, clipped to bytes, back in lane order */
AVX2 static inline __m256i finish(const __m256i *hi, const __m256i *lo) {
    __m256i s[4];
    for (int q = 0; q < 4; q++) {
        __m256i sum = _mm256_add_epi32(_mm256_slli_epi32(hi[q], 11), lo[q]);
        s[q] = _mm256_srai_epi32(_mm256_add_epi32(sum, _mm256_set1_epi32(HALF)), PRECISION_BITS);
    }
    return _mm256_packus_epi16(_mm256_packs_epi32(s[0], s[1]), _mm256_packs_epi32(s[2], s[3]));
}

/* 32 bytes from ksize taps with weights k: tap i at rows[i] + offset, or at base + i * stride when rows is NULL
   (each caller passes one form, so inlining drops the other) */
AVX2 static inline __m256i run32(const uint8_t *const *rows, const uint8_t *base, size_t stride, size_t offset,
                                 const int32_t *k, int ksize) {
    __m256i hi[4], lo[4], kh, kl;
    for (int q = 0; q < 4; q++) hi[q] = lo[q] = _mm256_setzero_si256();
    for (int i = 0; i < ksize; i += 2) {
        int i1 = i + 1 < ksize ? i + 1 : i; /* an odd last tap pairs with itself, weight 0 */
        if (k[i] == 0 && (i1 == i || k[i1] == 0)) continue; /* padding */
        split_pair(k, i, ksize, &kh, &kl);
        const uint8_t *a = rows ? rows[i] : base + stride * i, *b = rows ? rows[i1] : base + stride * i1;
        madd32(_mm256_loadu_si256((const __m256i *)(a + offset)), _mm256_loadu_si256((const __m256i *)(b + offset)),
               kh, kl, hi, lo);
    }
    return finish(hi, lo);
}

AVX2 void vertical_avx2(const uint8_t *const *rows, const int32_t *k, int ksize, int n, uint8_t *out) {
    for (int j0 = 0; j0 < n; j0 += RUN) {
        int j = j0 + RUN <= n ? j0 : n - RUN; /* a short tail is redone as the last full run (same values) */
        _mm256_storeu_si256((__m256i *)(out + j), run32(rows, NULL, 0, (size_t)j, k, ksize));
    }
}

AVX2 void horizontal_avx2(const uint8_t *block, const Taps *t, int out_w, uint8_t *const *dst, int nrows) {
    uint8_t px[LANES + 1];
    for (int x = 0; x < out_w; x++) {
        const uint8_t *col = block + (size_t)t->start[x] * STRIDE;
        const int32_t *k = t->k + (size_t)x * t->ksize;
        for (int c = 0; c < LANES; c += 32)
            _mm256_storeu_si256((__m256i *)(px + c), run32(NULL, col, STRIDE, (size_t)c, k, t->ksize));
        for (int r = 0; r < nrows; r++) memcpy(dst[r] + 3 * x, px + 3 * r, 4);
    }
}
#endif
