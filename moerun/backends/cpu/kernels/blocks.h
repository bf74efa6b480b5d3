// GGML blocks dequantized a row at a time to float32, each value computed as ggml computes it.
// Included by each isa_*.c (through tiles.h): the bits are unpacked 16 bytes at a time in a
// GCC/Clang vector type, then turned into floats by that file's conversions (vectors.h).
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
// A 16-byte nibble run holds values 0..15 in its low nibbles and 16..31 in its high ones; in
// Q4_K/Q5_K units 2i and 2i+1 share qs[32i..32i+31] (low and high nibbles).
#pragma once
#include "moe_cpu.h"
#include "vectors.h"

static inline uint16_t load_u16(const uint8_t* p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t load_u32(const uint8_t* p) { uint32_t v; memcpy(&v, p, 4); return v; }

static inline float load_half(const uint8_t* p) { return half_to_float(load_u16(p)); }

// Bit j of `bits` (j < 16) as the value 16 in byte j: the fifth bits of Q5_0/Q5_1.
static inline u8x16 bits_as_16(uint32_t bits) {
    const u8x16 lanes = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const u8x16 upper = {0, 0, 0, 0, 0, 0, 0, 0, 255, 255, 255, 255, 255, 255, 255, 255};
    u8x16 bytes = (((u8x16){0} + (uint8_t)bits) & ~upper) | (((u8x16){0} + (uint8_t)(bits >> 8)) & upper);
    return (u8x16)((bytes & lanes) != 0) & 16;
}

// ---- element types -----------------------------------------------------------------------------

static void dequantize_f32(const uint8_t* row, int64_t n, float* w) { memcpy(w, row, (size_t)n * 4); }

static void dequantize_f16(const uint8_t* row, int64_t n, float* w) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) halves_to_floats(row + 2 * i, w + i);
    for (; i < n; i++) w[i] = load_half(row + 2 * i);
}

static void dequantize_bf16(const uint8_t* row, int64_t n, float* w) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)load_u16(row + 2 * i) << 16;
        memcpy(w + i, &bits, 4);
    }
}

// ---- 32-value blocks ---------------------------------------------------------------------------

static void dequantize_q4_0(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 32; b++, row += 18, w += 32) {
        float d = load_half(row);
        u8x16 qs = load_u8x16(row + 2);
        scaled(qs & 15, -8.f, d, w);
        scaled(qs >> 4, -8.f, d, w + 16);
    }
}

static void dequantize_q4_1(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 32; b++, row += 20, w += 32) {
        float d = load_half(row), m = load_half(row + 2);
        u8x16 qs = load_u8x16(row + 4);
        scaled_plus(qs & 15, d, m, w);
        scaled_plus(qs >> 4, d, m, w + 16);
    }
}

// The 32 values of a Q5_0/Q5_1 block: nibbles with their fifth bits.
static inline void five_bit_values(const uint8_t* qs, uint32_t high, u8x16* low_half, u8x16* high_half) {
    u8x16 bytes = load_u8x16(qs);
    *low_half = (bytes & 15) | bits_as_16(high);
    *high_half = bytes >> 4 | bits_as_16(high >> 16);
}

static void dequantize_q5_0(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 32; b++, row += 22, w += 32) {
        float d = load_half(row);
        u8x16 low, high;
        five_bit_values(row + 6, load_u32(row + 2), &low, &high);
        scaled(low, -16.f, d, w);
        scaled(high, -16.f, d, w + 16);
    }
}

static void dequantize_q5_1(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 32; b++, row += 24, w += 32) {
        float d = load_half(row), m = load_half(row + 2);
        u8x16 low, high;
        five_bit_values(row + 8, load_u32(row + 4), &low, &high);
        scaled_plus(low, d, m, w);
        scaled_plus(high, d, m, w + 16);
    }
}

static void dequantize_q8_0(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 32; b++, row += 34, w += 32) {
        float d = load_half(row);
        scaled(load_u8x16(row + 2) ^ 0x80, -128.f, d, w);       // signed bytes, offset by 128
        scaled(load_u8x16(row + 18) ^ 0x80, -128.f, d, w + 16);
    }
}

// ---- 256-value super-blocks ----------------------------------------------------------------------

// The 8 six-bit scales (bytes 0..7) and mins (8..15) of a Q4_K/Q5_K super-block from their 12
// packed bytes: bytes 0-3 hold scale j (low 6 bits) and the top 2 bits of scale j+4, bytes 4-7
// the same for the mins, bytes 8-11 the low 4 bits of scale j+4 and of min j+4 (as ggml unpacks
// them, four bytes at a time).
static inline void k_scales_mins(const uint8_t* packed, uint8_t* scales_mins) {
    uint32_t words[4];
    memcpy(words, packed, 12);
    uint32_t mins_low = words[1] & 0x3f3f3f3f;
    words[3] = ((words[2] >> 4) & 0x0f0f0f0f) | (((words[1] >> 6) & 0x03030303) << 4);
    words[1] = (words[2] & 0x0f0f0f0f) | (((words[0] >> 6) & 0x03030303) << 4);
    words[2] = mins_low;
    words[0] &= 0x3f3f3f3f;
    memcpy(scales_mins, words, 16);
}

// Q4_K (high == NULL) and Q5_K: one super-block's 256 values, units 2i and 2i+1 (the low and
// high nibbles of one 32-byte run) together, so every shift is by a constant.
static inline void k_block(const uint8_t* block, const uint8_t* high, const uint8_t* qs, float* w) {
    float d = load_half(block), dmin = load_half(block + 2);
    uint8_t scales_mins[16];
    k_scales_mins(block + 4, scales_mins);
    float factors[16];                        // d·scale_j (0..7), dmin·min_j (8..15)
    for (int j = 0; j < 8; j++) {
        factors[j] = d * (float)scales_mins[j];
        factors[8 + j] = dmin * (float)scales_mins[8 + j];
    }
    for (int j = 0; j < 8; j += 2)
        for (int half = 0; half < 2; half++) {
            u8x16 bytes = load_u8x16(qs + j * 16 + 16 * half);
            u8x16 low = bytes & 15, top = bytes >> 4;
            if (high) {
                u8x16 fifth = load_u8x16(high + 16 * half) >> j;
                low |= (fifth & 1) << 4;
                top |= (fifth & 2) << 3;
            }
            scaled_plus(low, factors[j], -factors[8 + j], w + 32 * j + 16 * half);
            scaled_plus(top, factors[j + 1], -factors[9 + j], w + 32 * (j + 1) + 16 * half);
        }
}

static void dequantize_q4_k(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 256; b++, row += 144, w += 256) k_block(row, NULL, row + 16, w);
}

static void dequantize_q5_k(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 256; b++, row += 176, w += 256) k_block(row, row + 16, row + 48, w);
}

// Q6_K: a super-block is two halves of 128 values; in half h, values 32k + l (k < 4, l < 32)
// have their low 4 bits in the low (k < 2) or high (k >= 2) nibbles of ql[64h + 32(k % 2) + l]
// and their top 2 bits in bits 2k, 2k+1 of qh[32h + l]; values 16i..16i+15 of the half take
// scale 8h + i. The four quarters are done together, so every shift is by a constant.
static void dequantize_q6_k(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 256; b++, row += 210, w += 256) {
        float d = load_half(row + 208);
        for (int h = 0; h < 2; h++)
            for (int part = 0; part < 2; part++) {            // l in 16·part .. 16·part + 15
                const uint8_t* scales = row + 192 + 8 * h + part;
                u8x16 low_a = load_u8x16(row + 64 * h + 16 * part), low_b = load_u8x16(row + 64 * h + 32 + 16 * part);
                u8x16 top = load_u8x16(row + 128 + 32 * h + 16 * part);
                u8x16 quarters[4] = {(low_a & 15) | (top & 3) << 4, (low_b & 15) | (top >> 2 & 3) << 4,
                                     low_a >> 4 | (top >> 4 & 3) << 4, low_b >> 4 | (top >> 6) << 4};
                for (int k = 0; k < 4; k++) {
                    float scale = d * (float)(int8_t)scales[2 * k];
                    scaled(quarters[k], -32.f, scale, w + 128 * h + 32 * k + 16 * part);
                }
            }
    }
}

#define DEQUANTIZE_TABLE                                                                       \
    .dequantize = {[T_F32] = dequantize_f32, [T_F16] = dequantize_f16, [T_BF16] = dequantize_bf16, \
                   [T_Q4_0] = dequantize_q4_0, [T_Q4_1] = dequantize_q4_1, [T_Q5_0] = dequantize_q5_0, \
                   [T_Q5_1] = dequantize_q5_1, [T_Q8_0] = dequantize_q8_0, [T_Q4_K] = dequantize_q4_k, \
                   [T_Q5_K] = dequantize_q5_k, [T_Q6_K] = dequantize_q6_k}
