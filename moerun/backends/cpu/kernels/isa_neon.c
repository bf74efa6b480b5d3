// AArch64 (NEON is part of the base architecture): 4 floats, 32 registers.
#include <arm_neon.h>
#include "vectors.h"

typedef float32x4_t vf;
#define VL 4
#define NT_MAX 4
#define ISA_NAME "neon"
#define ISA_TABLE isa_neon

static inline vf vf_zero(void) { return vdupq_n_f32(0.f); }
static inline vf vf_load(const float* p) { return vld1q_f32(p); }
static inline vf vf_fma(vf acc, vf a, vf b) { return vfmaq_f32(acc, a, b); }
static inline float vf_sum(vf v) { return vaddvq_f32(v); }

// The 16 bytes as floats, in four quarters of 4.
static inline void byte_floats(u8x16 q, float32x4_t quarters[4]) {
    uint8x16_t bytes = vld1q_u8((const uint8_t*)&q);
    uint16x8_t low = vmovl_u8(vget_low_u8(bytes)), high = vmovl_high_u8(bytes);
    quarters[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(low)));
    quarters[1] = vcvtq_f32_u32(vmovl_high_u16(low));
    quarters[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(high)));
    quarters[3] = vcvtq_f32_u32(vmovl_high_u16(high));
}
static inline void scaled(u8x16 q, float add, float mul, float* out) {
    float32x4_t quarters[4];
    byte_floats(q, quarters);
    for (int i = 0; i < 4; i++) vst1q_f32(out + 4 * i, vmulq_n_f32(vaddq_f32(quarters[i], vdupq_n_f32(add)), mul));
}
static inline void scaled_plus(u8x16 q, float mul, float plus, float* out) {
    float32x4_t quarters[4];
    byte_floats(q, quarters);
    for (int i = 0; i < 4; i++) vst1q_f32(out + 4 * i, vaddq_f32(vmulq_n_f32(quarters[i], mul), vdupq_n_f32(plus)));
}
static inline float half_to_float(uint16_t h) {
    __fp16 half;
    memcpy(&half, &h, 2);
    return (float)half;
}
static inline void halves_to_floats(const uint8_t* halves, float* out) {
    for (int i = 0; i < 16; i += 4) vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)(halves + 2 * i)))));
}

#include "tiles.h"
