// Plain C: every machine has it (what the compiler vectorizes by itself, it does).
#include "vectors.h"

typedef float vf;
#define VL 1
#define NT_MAX 1
#define ISA_NAME "scalar"
#define ISA_TABLE isa_scalar

static inline vf vf_zero(void) { return 0.f; }
static inline vf vf_load(const float* p) { return *p; }
static inline vf vf_fma(vf acc, vf a, vf b) { return acc + a * b; }
static inline float vf_sum(vf v) { return v; }

static inline void scaled(u8x16 q, float add, float mul, float* out) {
    for (int i = 0; i < 16; i++) out[i] = ((float)q[i] + add) * mul;
}
static inline void scaled_plus(u8x16 q, float mul, float plus, float* out) {
    for (int i = 0; i < 16; i++) out[i] = (float)q[i] * mul + plus;
}
static inline float half_to_float(uint16_t h) { return half_bits_to_float(h); }
static inline void halves_to_floats(const uint8_t* halves, float* out) {
    for (int i = 0; i < 16; i++) {
        uint16_t h;
        memcpy(&h, halves + 2 * i, 2);
        out[i] = half_bits_to_float(h);
    }
}

#include "tiles.h"
