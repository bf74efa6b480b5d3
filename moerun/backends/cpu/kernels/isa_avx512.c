// x86-64 with AVX-512 F/BW/VL (Skylake-X, Zen 4 and later): 16 floats, 32 registers.
#include <immintrin.h>
#include "vectors.h"

typedef __m512 vf;
#define VL 16
#define NT_MAX 6
#define ISA_NAME "avx512"
#define ISA_TABLE isa_avx512

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vf_fma(vf acc, vf a, vf b) { return _mm512_fmadd_ps(a, b, acc); }
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }

static inline __m512 byte_floats(u8x16 q) {
    __m128i bytes;
    memcpy(&bytes, &q, 16);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}
static inline void scaled(u8x16 q, float add, float mul, float* out) {
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_add_ps(byte_floats(q), _mm512_set1_ps(add)), _mm512_set1_ps(mul)));
}
static inline void scaled_plus(u8x16 q, float mul, float plus, float* out) {
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(byte_floats(q), _mm512_set1_ps(mul)), _mm512_set1_ps(plus)));
}
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
static inline void halves_to_floats(const uint8_t* halves, float* out) {
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)halves)));
}

#include "tiles.h"
