// 16 bytes as one vector (a register on every target: SSE2, AVX, NEON), the unit the blocks
// are unpacked in. Each instruction set's file (isa_*.c) then defines a float vector of VL
// lanes and its primitives, which the blocks (blocks.h) and the tiles (tiles.h) are written in:
//   vf, VL                          the vector and its lanes
//   vf_zero vf_set1 vf_load vf_store vf_add vf_mul
//   vf_fma(acc, a, b)               a·b + acc, one rounding (two on scalar)
//   vf_sum(v)                       the lanes added
//   vf_bytes(q, part)               bytes VL·part .. VL·part + VL-1 of q as floats, unsigned
//   vf_signed_bytes(q, part)        the same, the bytes read as int8
//   vf_halves(p), vf_bf16(p)        VL IEEE halves / bfloat16s (unaligned) as floats
//   half_to_float(h)                one half
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
