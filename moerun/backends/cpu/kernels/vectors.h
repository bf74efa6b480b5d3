// 16 bytes as one vector (a register on every target: SSE2, AVX, NEON), the unit the blocks
// are unpacked in, and the conversions each instruction set's file provides on top of it:
//   scaled(q, add, mul, out):       out[i] = ((float)q[i] + add) · mul      for i < 16
//   scaled_plus(q, mul, plus, out): out[i] = (float)q[i] · mul + plus
//   halves_to_floats(halves, out):  16 IEEE halves (unaligned) to floats
//   half_to_float(h):               one
#pragma once
#include <stdint.h>
#include <string.h>

typedef uint8_t u8x16 __attribute__((vector_size(16)));

static inline u8x16 load_u8x16(const uint8_t* p) {
    u8x16 v;
    memcpy(&v, p, 16);
    return v;
}

// IEEE half to float where the hardware has no conversion: exponent and mantissa moved into
// place and rescaled by 2^112 (which also makes the subnormals right), infinities and NaNs
// kept as such.
static inline float half_bits_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)(h & 0x7fff) << 13, out;
    float magnitude;
    memcpy(&magnitude, &bits, 4);
    magnitude *= 0x1p112f;
    memcpy(&out, &magnitude, 4);
    out |= ((h & 0x7c00) == 0x7c00 ? 0x7f800000u : 0u) | (uint32_t)(h & 0x8000) << 16;
    memcpy(&magnitude, &out, 4);
    return magnitude;
}
