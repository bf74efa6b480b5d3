// x86-64 with AVX2, FMA and F16C (Haswell, Zen 1 and later): 8 floats, 16 registers.
#include <immintrin.h>
#include "vectors.h"

typedef __m256 vf;
#define VL 8
#define NT_MAX 2
#define ISA_NAME "avx2"
#define ISA_TABLE isa_avx2

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vf_fma(vf acc, vf a, vf b) { return _mm256_fmadd_ps(a, b, acc); }
static inline float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The 16 bytes as floats, in two halves of 8.
static inline void byte_floats(u8x16 q, __m256* low, __m256* high) {
    __m128i bytes;
    memcpy(&bytes, &q, 16);
    *low = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    *high = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
}
static inline void scaled(u8x16 q, float add, float mul, float* out) {
    __m256 low, high, a = _mm256_set1_ps(add), m = _mm256_set1_ps(mul);
    byte_floats(q, &low, &high);
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_add_ps(low, a), m));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_add_ps(high, a), m));
}
static inline void scaled_plus(u8x16 q, float mul, float plus, float* out) {
    __m256 low, high, m = _mm256_set1_ps(mul), p = _mm256_set1_ps(plus);
    byte_floats(q, &low, &high);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(low, m), p));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_mul_ps(high, m), p));
}
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
static inline void halves_to_floats(const uint8_t* halves, float* out) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)halves)));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(halves + 16))));
}

#include "tiles.h"
