// GGML blocks dequantized a row at a time to float32, each value computed as ggml computes it.
// Included by each isa_*.c: the loops are written in GCC/Clang vector types (16 values at a
// time), which each instruction set's build turns into its own instructions (compilers do
// not vectorize such bit unpacking well by themselves).
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
#include <string.h>
#include "moe_cpu.h"

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

static inline uint16_t load_u16(const uint8_t* p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t load_u32(const uint8_t* p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline u8x16 load_u8x16(const uint8_t* p) { u8x16 v; memcpy(&v, p, 16); return v; }
static inline void store(float* w, f32x16 v) { memcpy(w, &v, 64); }

// Bytes to floats through int32 (compilers turn a direct conversion, or one of signed bytes,
// into 16 scalar ones); signed bytes as unsigned ones offset by 128.
static inline f32x16 floats(u8x16 v) { return __builtin_convertvector(__builtin_convertvector(v, i32x16), f32x16); }
static inline f32x16 signed_floats(u8x16 v) { return floats(v ^ 0x80) - 128.f; }

// IEEE halves to floats: by the hardware where it converts them (F16C, AArch64), else with
// the exponent and mantissa moved into place and rescaled by 2^112 (which also makes the
// subnormals right), infinities and NaNs kept as such.
#if defined(__F16C__)
#include <immintrin.h>
static inline f32x16 halves_to_floats(u16x16 h) {
    __m256i bits;
    memcpy(&bits, &h, 32);
    __m256 low = _mm256_cvtph_ps(_mm256_castsi256_si128(bits)), high = _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1));
    f32x16 out;
    memcpy(&out, &low, 32);
    memcpy((float*)&out + 8, &high, 32);
    return out;
}
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#elif defined(__aarch64__)
typedef _Float16 f16x16 __attribute__((vector_size(32)));
static inline f32x16 halves_to_floats(u16x16 h) {
    f16x16 halves;
    memcpy(&halves, &h, 32);
    return __builtin_convertvector(halves, f32x16);
}
static inline float half_to_float(uint16_t h) {
    _Float16 half;
    memcpy(&half, &h, 2);
    return (float)half;
}
#else
static inline f32x16 halves_to_floats(u16x16 h) {
    u32x16 bits = __builtin_convertvector(h, u32x16);
    u32x16 moved = (bits & 0x7fff) << 13;
    f32x16 magnitude;
    memcpy(&magnitude, &moved, 64);
    magnitude *= 0x1p112f;
    u32x16 out;
    memcpy(&out, &magnitude, 64);
    out |= ((u32x16)((bits & 0x7c00) == 0x7c00) & 0x7f800000u) | (bits & 0x8000) << 16;
    f32x16 result;
    memcpy(&result, &out, 64);
    return result;
}

static inline float half_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)(h & 0x7fff) << 13, out;
    float magnitude;
    memcpy(&magnitude, &bits, 4);
    magnitude *= 0x1p112f;
    memcpy(&out, &magnitude, 4);
    out |= ((h & 0x7c00) == 0x7c00 ? 0x7f800000u : 0u) | (uint32_t)(h & 0x8000) << 16;
    memcpy(&magnitude, &out, 4);
    return magnitude;
}
#endif

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
    for (; i + 16 <= n; i += 16) {
        u16x16 h;
        memcpy(&h, row + 2 * i, 32);
        store(w + i, halves_to_floats(h));
    }
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
        store(w, (floats(qs & 15) - 8.f) * d);
        store(w + 16, (floats(qs >> 4) - 8.f) * d);
    }
}

static void dequantize_q4_1(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 32; b++, row += 20, w += 32) {
        float d = load_half(row), m = load_half(row + 2);
        u8x16 qs = load_u8x16(row + 4);
        store(w, floats(qs & 15) * d + m);
        store(w + 16, floats(qs >> 4) * d + m);
    }
}

// The 32 values 0..31 of a Q5_0/Q5_1 block: nibbles with their fifth bits.
static inline void five_bit_values(const uint8_t* qs, uint32_t high, f32x16* low_half, f32x16* high_half) {
    u8x16 bytes = load_u8x16(qs);
    *low_half = floats((bytes & 15) | bits_as_16(high));
    *high_half = floats(bytes >> 4 | bits_as_16(high >> 16));
}

static void dequantize_q5_0(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 32; b++, row += 22, w += 32) {
        float d = load_half(row);
        f32x16 low, high;
        five_bit_values(row + 6, load_u32(row + 2), &low, &high);
        store(w, (low - 16.f) * d);
        store(w + 16, (high - 16.f) * d);
    }
}

static void dequantize_q5_1(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 32; b++, row += 24, w += 32) {
        float d = load_half(row), m = load_half(row + 2);
        f32x16 low, high;
        five_bit_values(row + 8, load_u32(row + 4), &low, &high);
        store(w, low * d + m);
        store(w + 16, high * d + m);
    }
}

static void dequantize_q8_0(const uint8_t* row, int64_t n, float* w) {
    for (int64_t b = 0; b < n / 32; b++, row += 34, w += 32) {
        float d = load_half(row);
        store(w, signed_floats(load_u8x16(row + 2)) * d);
        store(w + 16, signed_floats(load_u8x16(row + 18)) * d);
    }
}

// ---- 256-value super-blocks ----------------------------------------------------------------------

// The 6-bit scale and min of unit j (0..7) from the 12 packed bytes, as ggml packs them.
static inline void k_scale_min(const uint8_t* packed, int j, int* scale, int* min) {
    if (j < 4) {
        *scale = packed[j] & 63;
        *min = packed[j + 4] & 63;
    } else {
        *scale = (packed[j + 4] & 15) | ((packed[j - 4] >> 6) << 4);
        *min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
}

// Q4_K (high == NULL) and Q5_K: one super-block's 256 values, units 2i and 2i+1 (the low and
// high nibbles of one 32-byte run) together, so every shift is by a constant.
static inline void k_block(const uint8_t* block, const uint8_t* high, const uint8_t* qs, float* w) {
    float d = load_half(block), dmin = load_half(block + 2);
    for (int j = 0; j < 8; j += 2) {
        int scale[2], min[2];
        k_scale_min(block + 4, j, &scale[0], &min[0]);
        k_scale_min(block + 4, j + 1, &scale[1], &min[1]);
        float d_low = d * (float)scale[0], m_low = dmin * (float)min[0];
        float d_high = d * (float)scale[1], m_high = dmin * (float)min[1];
        for (int half = 0; half < 2; half++) {
            u8x16 bytes = load_u8x16(qs + j * 16 + 16 * half);
            u8x16 low = bytes & 15, top = bytes >> 4;
            if (high) {
                u8x16 fifth = load_u8x16(high + 16 * half) >> j;
                low |= (fifth & 1) << 4;
                top |= (fifth & 2) << 3;
            }
            store(w + 32 * j + 16 * half, floats(low) * d_low - m_low);
            store(w + 32 * (j + 1) + 16 * half, floats(top) * d_high - m_high);
        }
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
                    store(w + 128 * h + 32 * k + 16 * part, (floats(quarters[k]) - 32.f) * scale);
                }
            }
    }
}

#define DEQUANTIZE_TABLE                                                                       \
    .dequantize = {[T_F32] = dequantize_f32, [T_F16] = dequantize_f16, [T_BF16] = dequantize_bf16, \
                   [T_Q4_0] = dequantize_q4_0, [T_Q4_1] = dequantize_q4_1, [T_Q5_0] = dequantize_q5_0, \
                   [T_Q5_1] = dequantize_q5_1, [T_Q8_0] = dequantize_q8_0, [T_Q4_K] = dequantize_q4_k, \
                   [T_Q5_K] = dequantize_q5_k, [T_Q6_K] = dequantize_q6_k}
