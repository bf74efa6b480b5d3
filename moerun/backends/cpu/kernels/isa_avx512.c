// x86-64 with AVX-512 F/BW/VL (Skylake-X, Zen 4 and later): 16 floats, 32 registers.
#include <immintrin.h>

typedef __m512 vf;
#define VL 16
#define NT_MAX 6
#define ISA_NAME "avx512"
#define ISA_TABLE isa_avx512

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vf_fma(vf acc, vf a, vf b) { return _mm512_fmadd_ps(a, b, acc); }
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }

#include "tiles.h"
