// GGML blocks read 16 values at a time into registers, each value computed as ggml computes
// it. Included by each isa_*.c (through tiles.h), after its primitives (vectors.h): the bits are
// unpacked 16 bytes at a time in a GCC/Clang vector type, then turned into floats by those.
//
//   Q4_0  18 B / 32:  d f16 | qs[16] nibbles              w = d·(q - 8)
//   Q4_1  20 B / 32:  d | m f16 | qs[16]                  w = d·q + m
//   Q5_0  22 B / 32:  d | qh u32 (bit 4 of value j: bit j) | qs[16]     w = d·(q - 16)
//   Q5_1  24 B / 32:  d | m | qh | qs[16]                 w = d·q + m
//   Q8_0  34 B / 32:  d | qs int8[32]                     w = d·q
//   Q4_K 144 B / 256: d | dmin | 12 B of 6-bit scales and mins | qs[128]
//                     w = (d·sc_j)·q - dmin·m_j, in 8 units j of 32 values
//   Q5_K 176 B / 256: d | dmin | scales | qh[32] (bit j: unit j) | qs[128]     as Q4_K, 5-bit q
//   Q6_K 210 B / 256: ql[128] | qh[64] | int8 scales[16] (one per 16 values) | d
//                     w = (d·sc)·(q - 32)
//   F32, F16, BF16: one value per element, read 16 at a time (a row's last n % 16 one by one).
// A 16-byte nibble run holds values 0..15 in its low nibbles and 16..31 in its high ones; in
// Q4_K/Q5_K units 2i and 2i+1 share qs[32i..32i+31] (low and high nibbles).
//
// Every type gives, for a block at `b`: prepare_T(b, s), its scales as floats, once per block,
// and group_T(b, s, g), its values 16g .. 16g + 15 (g < VALUES / 16, a constant once unrolled).
// TYPES(X) lists them with the values and bytes of a block.
#pragma once
#include "moe_cpu.h"
#include "vectors.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

// A block's group loop, unrolled so that each group's shifts and offsets are constants (the
// scalar build, whose speed matters less than its build time, keeps the loop).
#ifndef UNROLL_GROUPS
#define UNROLL_GROUPS _Pragma("GCC unroll 16")
#endif

#define TYPES(X)                                                                                             \
    X(f32, T_F32, 16, 64) X(f16, T_F16, 16, 32) X(bf16, T_BF16, 16, 32) X(q4_0, T_Q4_0, 32, 18)            \
    X(q4_1, T_Q4_1, 32, 20) X(q5_0, T_Q5_0, 32, 22) X(q5_1, T_Q5_1, 32, 24) X(q8_0, T_Q8_0, 32, 34)        \
    X(q4_k, T_Q4_K, 256, 144) X(q5_k, T_Q5_K, 256, 176) X(q6_k, T_Q6_K, 256, 210)

typedef struct { vf v[16 / VL]; } v16;          // 16 consecutive values of a row

struct block_state {
    float mul[16], plus[16];
    uint8_t q[256];            // Q6_K: the block's values - 32 (int8), unpacked 32 bytes at a time
};

static inline uint32_t load_u32(const uint8_t* p) { uint32_t v; memcpy(&v, p, 4); return v; }

static inline float load_half(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

ALWAYS_INLINE void store16(float* w, v16 values) {
    for (int p = 0; p < 16 / VL; p++) vf_store(w + p * VL, values.v[p]);
}

// q - offset (as int8, in -128..127) · mul: d·(q - 8) and the like, computed as ggml does.
ALWAYS_INLINE v16 signed_scaled(u8x16 q, float mul) {
    v16 w;
    for (int p = 0; p < 16 / VL; p++) w.v[p] = vf_mul(vf_signed_bytes(q, p), vf_set1(mul));
    return w;
}

// q · mul, q read unsigned
ALWAYS_INLINE v16 unsigned_scaled(u8x16 q, float mul) {
    v16 w;
    for (int p = 0; p < 16 / VL; p++) w.v[p] = vf_mul(vf_bytes(q, p), vf_set1(mul));
    return w;
}

// q · mul + plus
ALWAYS_INLINE v16 scaled_plus(u8x16 q, float mul, float plus) {
    v16 w;
    for (int p = 0; p < 16 / VL; p++) w.v[p] = vf_add(vf_mul(vf_bytes(q, p), vf_set1(mul)), vf_set1(plus));
    return w;
}

// Each byte of q shifted left by `shift` (right if negative) and masked: shifts in 16-bit lanes
// (x86 has no byte shifts), the bits that crossed from the neighbouring byte masked away.
typedef uint16_t u16x8 __attribute__((vector_size(16)));
ALWAYS_INLINE u8x16 shift_mask(u8x16 q, int shift, uint8_t mask) {
    return (u8x16)(shift >= 0 ? (u16x8)q << shift : (u16x8)q >> -shift) & mask;
}
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
ALWAYS_INLINE u8x32 shift_mask32(u8x32 q, int shift, uint8_t mask) {
    return (u8x32)(shift >= 0 ? (u16x16)q << shift : (u16x16)q >> -shift) & mask;
}
static inline u8x32 load_u8x32(const uint8_t* p) {
    u8x32 v;
    memcpy(&v, p, 32);
    return v;
}

// The low nibbles of q (or its high ones) as floats: (k - offset)·mul and k·mul + plus. Through a
// table of the 16 values where the instruction set looks lanes up (VF_LOOKUP16): the same values.
static const u8x16 IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
ALWAYS_INLINE u8x16 nibble(u8x16 q, int high) { return high ? shift_mask(q, -4, 15) : q & 15; }

ALWAYS_INLINE v16 nibbles_signed_scaled(u8x16 q, int high, uint8_t offset, float mul) {
#ifdef VF_LOOKUP16
    return (v16){{vf_lookup16(signed_scaled(IOTA - offset, mul).v[0], q, high)}};
#else
    return signed_scaled(nibble(q, high) - offset, mul);
#endif
}

ALWAYS_INLINE v16 nibbles_scaled_plus(u8x16 q, int high, float mul, float plus) {
#ifdef VF_LOOKUP16
    return (v16){{vf_lookup16(scaled_plus(IOTA, mul, plus).v[0], q, high)}};
#else
    return scaled_plus(nibble(q, high), mul, plus);
#endif
}

// Bit j of `bits` (j < 16) as the value 16 in byte j: the fifth bits of Q5_0/Q5_1 (in one
// masked move where the instruction set has one, VF_BITS_AS_16).
static inline u8x16 bits_as_16(uint32_t bits) {
#ifdef VF_BITS_AS_16
    return vf_bits_as_16(bits);
#else
    const u8x16 lanes = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const u8x16 upper = {0, 0, 0, 0, 0, 0, 0, 0, 255, 255, 255, 255, 255, 255, 255, 255};
    u8x16 bytes = (((u8x16){0} + (uint8_t)bits) & ~upper) | (((u8x16){0} + (uint8_t)(bits >> 8)) & upper);
    return (u8x16)((bytes & lanes) != 0) & 16;
#endif
}

// ---- element types -----------------------------------------------------------------------------

ALWAYS_INLINE void prepare_f32(const uint8_t* b, struct block_state* s) { (void)b, (void)s; }
ALWAYS_INLINE void prepare_f16(const uint8_t* b, struct block_state* s) { (void)b, (void)s; }
ALWAYS_INLINE void prepare_bf16(const uint8_t* b, struct block_state* s) { (void)b, (void)s; }

ALWAYS_INLINE v16 group_f32(const uint8_t* b, const struct block_state* s, int g) {
    (void)s, (void)g;
    v16 w;
    for (int p = 0; p < 16 / VL; p++) w.v[p] = vf_load((const float*)b + p * VL);
    return w;
}

ALWAYS_INLINE v16 group_f16(const uint8_t* b, const struct block_state* s, int g) {
    (void)s, (void)g;
    v16 w;
    for (int p = 0; p < 16 / VL; p++) w.v[p] = vf_halves(b + 2 * p * VL);
    return w;
}

ALWAYS_INLINE v16 group_bf16(const uint8_t* b, const struct block_state* s, int g) {
    (void)s, (void)g;
    v16 w;
    for (int p = 0; p < 16 / VL; p++) w.v[p] = vf_bf16(b + 2 * p * VL);
    return w;
}

// Element i of a row of an element type (a row's values past the last 16).
static inline float element(int type, const uint8_t* row, int64_t i) {
    if (type == T_F16) return load_half(row + 2 * i);
    uint32_t bits = type == T_F32 ? load_u32(row + 4 * i) : (uint32_t)row[2 * i] << 16 | (uint32_t)row[2 * i + 1] << 24;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

// ---- 32-value blocks ---------------------------------------------------------------------------

ALWAYS_INLINE void prepare_q4_0(const uint8_t* b, struct block_state* s) { s->mul[0] = load_half(b); }
ALWAYS_INLINE void prepare_q5_0(const uint8_t* b, struct block_state* s) { s->mul[0] = load_half(b); }
ALWAYS_INLINE void prepare_q8_0(const uint8_t* b, struct block_state* s) { s->mul[0] = load_half(b); }

ALWAYS_INLINE void prepare_q4_1(const uint8_t* b, struct block_state* s) {
    s->mul[0] = load_half(b);
    s->plus[0] = load_half(b + 2);
}
ALWAYS_INLINE void prepare_q5_1(const uint8_t* b, struct block_state* s) { prepare_q4_1(b, s); }

// Values 16g .. 16g + 15 of a 32-value Q5_0/Q5_1 block: nibbles at qs, fifth bits in `high`.
ALWAYS_INLINE u8x16 five_bits(const uint8_t* qs, uint32_t high, int g) {
    return nibble(load_u8x16(qs), g) | bits_as_16(high >> 16 * g);
}

ALWAYS_INLINE v16 group_q4_0(const uint8_t* b, const struct block_state* s, int g) {
    return nibbles_signed_scaled(load_u8x16(b + 2), g, 8, s->mul[0]);
}
ALWAYS_INLINE v16 group_q4_1(const uint8_t* b, const struct block_state* s, int g) {
    return nibbles_scaled_plus(load_u8x16(b + 4), g, s->mul[0], s->plus[0]);
}
ALWAYS_INLINE v16 group_q5_0(const uint8_t* b, const struct block_state* s, int g) {
    return signed_scaled(five_bits(b + 6, load_u32(b + 2), g) - 16, s->mul[0]);
}
ALWAYS_INLINE v16 group_q5_1(const uint8_t* b, const struct block_state* s, int g) {
    return scaled_plus(five_bits(b + 8, load_u32(b + 4), g), s->mul[0], s->plus[0]);
}
ALWAYS_INLINE v16 group_q8_0(const uint8_t* b, const struct block_state* s, int g) {
    return signed_scaled(load_u8x16(b + 2 + 16 * g), s->mul[0]);
}

// ---- 256-value super-blocks ----------------------------------------------------------------------

// The 8 six-bit scales (bytes 0..7) and mins (8..15) of a Q4_K/Q5_K super-block from their 12
// packed bytes: bytes 0-3 hold scale j (low 6 bits) and the top 2 bits of scale j+4, bytes 4-7
// the same for the mins, bytes 8-11 the low 4 bits of scale j+4 and of min j+4 (as ggml unpacks
// them, four bytes at a time). Then unit j's factors: mul[j] = d·scale_j, plus[8 + j] = -dmin·min_j.
typedef uint32_t u32x4 __attribute__((vector_size(16)));
#if defined(__clang__)
#define SHUFFLE4(v, a, b, c, d) __builtin_shufflevector(v, v, a, b, c, d)
#else
#define SHUFFLE4(v, a, b, c, d) __builtin_shuffle(v, (u32x4){a, b, c, d})
#endif
ALWAYS_INLINE void prepare_q4_k(const uint8_t* b, struct block_state* s) {
    u32x4 words;                                          // the 12 bytes (and 4 of the quants)
    memcpy(&words, b + 4, 16);
    u32x4 low = SHUFFLE4(words, 0, 2, 1, 2) >> (u32x4){0, 0, 0, 4}, high = SHUFFLE4(words, 0, 0, 1, 1) >> 6;
    u32x4 unpacked = (low & (u32x4){0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f}) |
                     (high & (u32x4){0, 0x03030303, 0, 0x03030303}) << 4;
    float d = load_half(b), dmin = load_half(b + 2);
    store16(s->mul, unsigned_scaled((u8x16)unpacked, d));
    store16(s->plus, unsigned_scaled((u8x16)unpacked, -dmin));
}
ALWAYS_INLINE void prepare_q5_k(const uint8_t* b, struct block_state* s) { prepare_q4_k(b, s); }
// Group g: values 16·(g % 2) .. of unit j = g / 2, from the low (j even) or high nibbles of
// qs[32·(j / 2) + 16·(g % 2)..], the fifth bits (Q5_K) bit j of qh[16·(g % 2)..].
ALWAYS_INLINE u8x16 k_nibbles(const uint8_t* qs, int g) {
    return nibble(load_u8x16(qs + 32 * (g / 4) + 16 * (g % 2)), g / 2 % 2);
}
ALWAYS_INLINE v16 group_q4_k(const uint8_t* b, const struct block_state* s, int g) {
    return nibbles_scaled_plus(load_u8x16(b + 16 + 32 * (g / 4) + 16 * (g % 2)), g / 2 % 2, s->mul[g / 2],
                               s->plus[8 + g / 2]);
}
ALWAYS_INLINE v16 group_q5_k(const uint8_t* b, const struct block_state* s, int g) {
    u8x16 fifth = shift_mask(load_u8x16(b + 16 + 16 * (g % 2)), 4 - g / 2, 16);
    return scaled_plus(k_nibbles(b + 48, g) | fifth, s->mul[g / 2], s->plus[8 + g / 2]);
}

// Q6_K: a super-block is two halves of 128 values; in half h, values 32k + l (k < 4, l < 32)
// have their low 4 bits in the low (k < 2) or high (k >= 2) nibbles of ql[64h + 32(k % 2) + l]
// and their top 2 bits in bits 2k, 2k+1 of qh[32h + l]; values 16i..16i+15 of the super-block
// take scale i. Group g = 8h + 2k + part holds l in 16·part .. 16·part + 15.
// prepare_q6_k unpacks the block's 256 values once, 32 bytes at a time (a quarter of the
// operations of unpacking each group's 16 on its own), into s->q; a group reads its 16 from there.
ALWAYS_INLINE void prepare_q6_k(const uint8_t* b, struct block_state* s) {
    store16(s->mul, signed_scaled(load_u8x16(b + 192), load_half(b + 208)));
    for (int h = 0; h < 2; h++) {
        u8x32 first = load_u8x32(b + 64 * h), second = load_u8x32(b + 64 * h + 32);    // ql, k % 2 = 0, 1
        u8x32 top = load_u8x32(b + 128 + 32 * h);                                       // qh
        u8x32 values[4] = {(first & 15) | shift_mask32(top, 4, 0x30), (second & 15) | shift_mask32(top, 2, 0x30),
                           shift_mask32(first, -4, 15) | (top & 0x30),
                           shift_mask32(second, -4, 15) | shift_mask32(top, -2, 0x30)};
        for (int k = 0; k < 4; k++) {
            u8x32 centred = values[k] - 32;
            memcpy(s->q + 128 * h + 32 * k, &centred, 32);
        }
    }
}
ALWAYS_INLINE v16 group_q6_k(const uint8_t* b, const struct block_state* s, int g) {
    (void)b;
    return signed_scaled(load_u8x16(s->q + 16 * g), s->mul[g]);
}

// ---- whole rows -----------------------------------------------------------------------------------

// dequantize_T(row, n, w): a row of n values into w.
#define DEQUANTIZE_ROW(name, type, values, bytes)                                                  \
    static void dequantize_##name(const uint8_t* row, int64_t n, float* w) {                      \
        for (int64_t b = 0; b < n / values; b++) {                                               \
            struct block_state s;                                                                \
            prepare_##name(row + b * bytes, &s);                                                 \
            UNROLL_GROUPS for (int g = 0; g < values / 16; g++)                       \
                store16(w + b * values + 16 * g, group_##name(row + b * bytes, &s, g));          \
        }                                                                                        \
        for (int64_t i = n / values * values; i < n; i++) w[i] = element(type, row, i);         \
    }
TYPES(DEQUANTIZE_ROW)
