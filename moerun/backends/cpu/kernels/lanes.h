// Vectors of LANES floats for the work around the products (decode.c, attention.c): GCC and
// Clang vector extensions, with the hot functions built for AVX-512 and AVX2 beside the
// baseline and chosen at load (x86-64, VECTORIZED), and the sums, maxima and e^x they share.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

// The helpers are inlined into each build of the functions that call them.
#define INLINE static inline __attribute__((always_inline))
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VECTORIZED __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTORIZED
#endif

// A vector of LANES floats (GCC and Clang vector extensions): one register in the AVX-512
// build, two or four in the others.
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(float))));
typedef float half_vf __attribute__((vector_size(LANES * sizeof(float) / 2)));

INLINE void load(vf* v, const float* p) { memcpy(v, p, sizeof *v); }

// The lanes' sum, folded in halves.
INLINE float fold(const vf* v) {
    half_vf low, high;
    memcpy(&low, v, sizeof low);
    memcpy(&high, (const char*)v + sizeof low, sizeof high);
    low += high;
    float lanes[LANES / 2], total = 0;
    memcpy(lanes, &low, sizeof lanes);
    for (int l = 0; l < LANES / 2; l++) total += lanes[l];
    return total;
}

INLINE float dot(const float* a, const float* b, int64_t n) {
    vf sums = {0}, x, y;
    float rest = 0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        load(&x, a + i);
        load(&y, b + i);
        sums += x * y;
    }
    for (; i < n; i++) rest += a[i] * b[i];
    return fold(&sums) + rest;
}

// The largest of x [n] (-inf for none).
INLINE float largest(const float* x, int64_t n) {
    vf tops, v;
    float top = -INFINITY, lanes[LANES];
    int64_t i = 0;
    for (int l = 0; l < LANES; l++) tops[l] = -INFINITY;
    for (; i + LANES <= n; i += LANES) {
        load(&v, x + i);
        vi above = v > tops;                                    // all bits set where v is larger
        tops = (vf)(((vi)v & above) | ((vi)tops & ~above));
    }
    memcpy(lanes, &tops, sizeof lanes);
    for (int l = 0; l < LANES; l++) top = lanes[l] > top ? lanes[l] : top;
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}

INLINE float sum(const float* x, int64_t n) {
    vf sums = {0}, v;
    float rest = 0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        load(&v, x + i);
        sums += v;
    }
    for (; i < n; i++) rest += x[i];
    return fold(&sums) + rest;
}

// e^x for x <= 0, within a few ulp (e^-87 below -87): x = n·ln2 + r with |r| <= ln2/2, e^r by
// its Taylor series to r^6, 2^n put into the exponent. Branch-free: its loops vectorize in the
// AVX-512 build; in the AVX2 one GCC keeps the float compare, and the loops, scalar.
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float round = 0x1.8p23f;                  // adding it rounds to an integer
    float shifted = x * 1.44269504f + round, n = shifted - round;
    float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;         // ln2 in two parts, the first exact
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    int32_t bits;
    memcpy(&bits, &shifted, 4);
    bits = (bits - 0x4b400000 + 127) << 23;         // 2^n
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}
