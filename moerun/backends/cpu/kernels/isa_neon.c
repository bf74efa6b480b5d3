// AArch64 (NEON is part of the base architecture): 4 floats, 32 registers.
#include <arm_neon.h>
#include "vectors.h"

typedef float32x4_t vf;
#define VL 4
#define NT_MAX 4
#define NT_FUSED 4
#define ROW_MR 6
#define ROW_NV 4
#define FUSED_TOKENS 8
#define ISA_NAME "neon"
#define ISA_TABLE isa_neon

static inline vf vf_zero(void) { return vdupq_n_f32(0.f); }
static inline vf vf_set1(float v) { return vdupq_n_f32(v); }
static inline vf vf_load(const float* p) { return vld1q_f32(p); }
static inline void vf_store(float* p, vf v) { vst1q_f32(p, v); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_fma(vf acc, vf a, vf b) { return vfmaq_f32(acc, a, b); }
static inline float vf_sum(vf v) { return vaddvq_f32(v); }

// Bytes 4·part .. 4·part + 3, widened to 32 bits.
static inline uint32x4_t byte_part(u8x16 q, int part) {
    uint16x8_t half = part < 2 ? vmovl_u8(vget_low_u8((uint8x16_t)q)) : vmovl_high_u8((uint8x16_t)q);
    return part % 2 ? vmovl_high_u16(half) : vmovl_u16(vget_low_u16(half));
}
static inline vf vf_bytes(u8x16 q, int part) { return vcvtq_f32_u32(byte_part(q, part)); }
static inline vf vf_signed_bytes(u8x16 q, int part) {
    int8x16_t s = vreinterpretq_s8_u8((uint8x16_t)q);
    int16x8_t half = part < 2 ? vmovl_s8(vget_low_s8(s)) : vmovl_high_s8(s);
    return vcvtq_f32_s32(part % 2 ? vmovl_high_s16(half) : vmovl_s16(vget_low_s16(half)));
}
static inline vf vf_halves(const uint8_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)p))); }
static inline vf vf_bf16(const uint8_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t*)p), 16)); }
static inline float half_to_float(uint16_t h) {
    __fp16 half;
    memcpy(&half, &h, 2);
    return (float)half;
}

#include "tiles.h"
