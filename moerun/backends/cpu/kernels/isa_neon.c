// AArch64 (NEON is part of the base architecture): 4 floats, 32 registers.
#include <arm_neon.h>

typedef float32x4_t vf;
#define VL 4
#define NT_MAX 4
#define ISA_NAME "neon"
#define ISA_TABLE isa_neon

static inline vf vf_zero(void) { return vdupq_n_f32(0.f); }
static inline vf vf_load(const float* p) { return vld1q_f32(p); }
static inline vf vf_fma(vf acc, vf a, vf b) { return vfmaq_f32(acc, a, b); }
static inline float vf_sum(vf v) { return vaddvq_f32(v); }

#include "tiles.h"
