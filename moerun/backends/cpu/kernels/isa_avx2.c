// x86-64 with AVX2, FMA and F16C (Haswell, Zen 1 and later): 8 floats, 16 registers.
#include <immintrin.h>

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

#include "tiles.h"
