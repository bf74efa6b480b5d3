// Plain C: every machine has it (what the compiler vectorizes by itself, it does).
#include "vectors.h"

typedef float vf;
#define VL 1
#define NT_MAX 1
#define NT_FUSED 1
#define ROW_MR 4
#define ROW_NV 4
#define FUSED_TOKENS 1
#define ISA_NAME "scalar"
#define ISA_TABLE isa_scalar
#define UNROLL_GROUPS

static inline vf vf_zero(void) { return 0.f; }
static inline vf vf_set1(float v) { return v; }
static inline vf vf_load(const float* p) { return *p; }
static inline void vf_store(float* p, vf v) { *p = v; }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_fma(vf acc, vf a, vf b) { return acc + a * b; }
static inline float vf_sum(vf v) { return v; }

static inline vf vf_bytes(u8x16 q, int part) { return (float)q[part]; }
static inline vf vf_signed_bytes(u8x16 q, int part) { return (float)(int8_t)q[part]; }
static inline float half_to_float(uint16_t h) { return half_bits_to_float(h); }
static inline vf vf_halves(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_bits_to_float(h);
}
static inline vf vf_bf16(const uint8_t* p) {
    uint32_t bits = (uint32_t)p[0] << 16 | (uint32_t)p[1] << 24;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

#include "tiles.h"
