// x86-64 with AVX2, FMA and F16C (Haswell, Zen 1 and later): 8 floats, 16 registers.
#include <immintrin.h>
#include "vectors.h"

typedef __m256 vf;
#define VL 8
#define NT_MAX 2
#define NT_FUSED 2
#define ROW_MR 6
#define ROW_NV 2
#define FUSED_TOKENS 2
#define ISA_NAME "avx2"
#define ISA_TABLE isa_avx2

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float v) { return _mm256_set1_ps(v); }
static inline vf vf_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fma(vf acc, vf a, vf b) { return _mm256_fmadd_ps(a, b, acc); }
static inline float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Bytes 8·part .. 8·part + 7.
static inline __m128i byte_part(u8x16 q, int part) { return part ? _mm_srli_si128((__m128i)q, 8) : (__m128i)q; }
static inline vf vf_bytes(u8x16 q, int part) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(byte_part(q, part))); }
static inline vf vf_signed_bytes(u8x16 q, int part) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(byte_part(q, part)));
}
static inline vf vf_halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline vf vf_bf16(const uint8_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

#include "tiles.h"
