// Dequantization of one "unit" — 32 consecutive weights of a row — for every
// stored type, following ggml's block layouts. Each function writes out[0..31]
// for elements [32*unit, 32*unit + 32) of the row that starts at `row`.
#pragma once
#include "common.cuh"

// The float of an integer 0 <= q < 2^23 minus `bias`, without the slow conversion
// unit: 2^23 + q has q in its mantissa bits, so one OR and one subtraction suffice.
__device__ __forceinline__ float biased_float(u32 q, float bias) {
    return __int_as_float(0x4B000000u | q) - (8388608.0f + bias);
}

__device__ __forceinline__ void dequant_unit_f32(const u8* row, int unit, float* out) {
    const float4* src = reinterpret_cast<const float4*>(row + unit * 128);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 v = src[i];
        out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
    }
}

// F16 and BF16: 32 stored 16-bit values, read 16 bytes at a time.
template <float (*Convert)(u16)>
__device__ __forceinline__ void dequant_unit_16bit(const u8* row, int unit, float* out) {
    const uint4* src = reinterpret_cast<const uint4*>(row + unit * 64);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 v = src[i];
        u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            out[8 * i + 2 * j] = Convert((u16)(words[j] & 0xffff));
            out[8 * i + 2 * j + 1] = Convert((u16)(words[j] >> 16));
        }
    }
}

__device__ __forceinline__ void dequant_unit_f16(const u8* row, int unit, float* out) {
    dequant_unit_16bit<half_bits_to_float>(row, unit, out);
}

__device__ __forceinline__ void dequant_unit_bf16(const u8* row, int unit, float* out) {
    dequant_unit_16bit<bf16_bits_to_float>(row, unit, out);
}

// 32 bytes at a 2-byte aligned address as eight little-endian words, by eight 4-byte loads
// and one 2-byte load (no branch, nothing read outside the 32 bytes).
__device__ __forceinline__ void load_32_bytes(const u8* p, u32* words) {
    const u32* aligned = reinterpret_cast<const u32*>(reinterpret_cast<size_t>(p) & ~(size_t)3);
    int shift = (int)(reinterpret_cast<size_t>(p) & 3) * 8;            // 0 or 16
    u32 w[8];
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = aligned[i];
    u32 tail = *reinterpret_cast<const u16*>(p + 30);
#pragma unroll
    for (int i = 0; i < 7; i++) words[i] = (u32)((((unsigned long long)w[i + 1] << 32) | w[i]) >> shift);
    words[7] = shift ? (w[7] >> 16) | (tail << 16) : w[7];
}

__device__ __forceinline__ float load_half_aligned(const u8* p) {    // p 2-byte aligned
    return half_bits_to_float(*reinterpret_cast<const u16*>(p));
}

// Q8_0: f16 d, int8 q[32]; w = d*q. 34 bytes (2-byte aligned).
__device__ __forceinline__ void dequant_unit_q8_0(const u8* row, int unit, float* out) {
    const u8* block = row + unit * 34;
    float d = load_half_aligned(block);
    u32 q[8];
    load_32_bytes(block + 2, q);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 bytes = q[i] ^ 0x80808080u;                  // int8 + 128, all four bytes
#pragma unroll
        for (int b = 0; b < 4; b++) out[4 * i + b] = d * biased_float((bytes >> (8 * b)) & 0xFF, 128.f);
    }
}

// Q4_0: f16 d, 16 bytes of nibbles (low = elements 0..15, high = 16..31); w = d*(q-8). 18 bytes.
__device__ __forceinline__ void dequant_unit_q4_0(const u8* row, int unit, float* out) {
    const u8* block = row + unit * 18;
    float d = load_half(block);
    const u16* q = reinterpret_cast<const u16*>(block + 2);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 pair = q[i];
        out[2 * i] = d * biased_float(pair & 0xF, 8.f);
        out[2 * i + 1] = d * biased_float((pair >> 8) & 0xF, 8.f);
        out[2 * i + 16] = d * biased_float((pair >> 4) & 0xF, 8.f);
        out[2 * i + 17] = d * biased_float(pair >> 12, 8.f);
    }
}

// Q4_1: f16 d, f16 m, 16 bytes of nibbles; w = d*q + m. 20 bytes.
__device__ __forceinline__ void dequant_unit_q4_1(const u8* row, int unit, float* out) {
    const u8* block = row + unit * 20;
    float d = load_half(block), m = load_half(block + 2);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u8 byte = block[4 + i];
        out[i] = d * (float)(byte & 0xF) + m;
        out[i + 16] = d * (float)(byte >> 4) + m;
    }
}

__device__ __forceinline__ u32 load_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// Q5_0: f16 d, u32 high bits, 16 bytes of nibbles; w = d*(q-16). 22 bytes.
__device__ __forceinline__ void dequant_unit_q5_0(const u8* row, int unit, float* out) {
    const u8* block = row + unit * 22;
    float d = load_half(block);
    u32 high = load_u32(block + 2);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u8 byte = block[6 + i];
        int lo = (byte & 0xF) | (((high >> i) & 1) << 4);
        int hi = (byte >> 4) | (((high >> (i + 16)) & 1) << 4);
        out[i] = d * (float)(lo - 16);
        out[i + 16] = d * (float)(hi - 16);
    }
}

// Q5_1: f16 d, f16 m, u32 high bits, 16 bytes of nibbles; w = d*q + m. 24 bytes.
__device__ __forceinline__ void dequant_unit_q5_1(const u8* row, int unit, float* out) {
    const u8* block = row + unit * 24;
    float d = load_half(block), m = load_half(block + 2);
    u32 high = load_u32(block + 4);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u8 byte = block[8 + i];
        int lo = (byte & 0xF) | (((high >> i) & 1) << 4);
        int hi = (byte >> 4) | (((high >> (i + 16)) & 1) << 4);
        out[i] = d * (float)lo + m;
        out[i + 16] = d * (float)hi + m;
    }
}

// Sub-block j's (0..7) scale d·scale_j and offset dmin·min_j of a Q4_K/Q5_K super-block, from
// its first 16 bytes read at once (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins; every
// super-block starts 16-byte aligned, their sizes being multiples of 16), without branches.
__device__ __forceinline__ void k_scale_min(const u8* block, int j, float* scale, float* min) {
    int4 head = *reinterpret_cast<const int4*>(block);
    int shift = 8 * (j & 3);
    u32 low = ((u32)head.y >> shift) & 0xFF, mid = ((u32)head.z >> shift) & 0xFF, high = ((u32)head.w >> shift) & 0xFF;
    bool first = j < 4;
    u32 scale_bits = first ? low & 63 : (high & 15) | ((low >> 6) << 4);
    u32 min_bits = first ? mid & 63 : (high >> 4) | ((mid >> 6) << 4);
    *scale = half_bits_to_float((u16)head.x) * (float)scale_bits;
    *min = half_bits_to_float((u16)((u32)head.x >> 16)) * (float)min_bits;
}

// Q4_K: super-blocks of 256 = 8 sub-blocks of 32. f16 d, f16 dmin, 12 bytes of
// scales/mins, 128 bytes of nibbles: sub-blocks 2j and 2j+1 share bytes 32j..32j+31,
// low nibbles first. w = d*scale*q - dmin*min. 144 bytes.
__device__ __forceinline__ void dequant_unit_q4_k(const u8* row, int unit, float* out) {
    const u8* block = row + (unit >> 3) * 144;
    int sub = unit & 7;
    float d, m;
    k_scale_min(block, sub, &d, &m);
    const uint4* qs = reinterpret_cast<const uint4*>(block + 16 + (sub >> 1) * 32);
    int shift = (sub & 1) * 4;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 v = qs[i];
        u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int w = 0; w < 4; w++)
#pragma unroll
            for (int b = 0; b < 4; b++)
                out[16 * i + 4 * w + b] = d * biased_float((words[w] >> (8 * b + shift)) & 0xF, 0.f) - m;
    }
}

// Q5_K: f16 d, f16 dmin, 12 bytes of scales/mins, 32 bytes of high bits (bit j of
// byte l belongs to sub-block j), 128 bytes of nibbles laid out as Q4_K. 176 bytes.
__device__ __forceinline__ void dequant_unit_q5_k(const u8* row, int unit, float* out) {
    const u8* block = row + (unit >> 3) * 176;
    int sub = unit & 7;
    float d, m;
    k_scale_min(block, sub, &d, &m);
    const uint4* high = reinterpret_cast<const uint4*>(block + 16);
    const uint4* qs = reinterpret_cast<const uint4*>(block + 48 + (sub >> 1) * 32);
    int shift = (sub & 1) * 4;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 q = qs[i], h = high[i];
        u32 q_words[4] = {q.x, q.y, q.z, q.w}, h_words[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
        for (int w = 0; w < 4; w++)
#pragma unroll
            for (int b = 0; b < 4; b++) {
                u32 value = ((q_words[w] >> (8 * b + shift)) & 0xF) | (((h_words[w] >> (8 * b + sub)) & 1) << 4);
                out[16 * i + 4 * w + b] = d * biased_float(value, 0.f) - m;
            }
    }
}

// Q6_K: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d.
// 256 weights in two halves of 128; within a half, quarter r (32 weights) takes low
// nibbles (r < 2) or high nibbles (r >= 2) of bytes (r%2)*32.., high bits 2r..2r+1,
// and scales 2r, 2r+1 (one per 16 weights). w = d*scale*(q-32). 210 bytes.
// One Q6_K unit's stored bits: its 32 bytes of low nibbles and 32 of high pairs, the shifts
// that pick its nibble and pair out of each byte, and its two scales (times d).
struct Q6KUnit {
    u32 low[8], high[8];
    int low_shift, high_shift;
    float d0, d1;
};

__device__ __forceinline__ void load_q6_k_unit(const u8* row, int unit, Q6KUnit& q) {
    const u8* block = row + (unit >> 3) * 210;
    int half_index = (unit >> 2) & 1, quarter = unit & 3;
    load_32_bytes(block + half_index * 64 + (quarter & 1) * 32, q.low);
    load_32_bytes(block + 128 + half_index * 32, q.high);
    const i8* scales = reinterpret_cast<const i8*>(block + 192) + half_index * 8 + quarter * 2;
    float d = load_half_aligned(block + 208);
    q.low_shift = (quarter >> 1) * 4;
    q.high_shift = 2 * quarter;
    q.d0 = d * (float)scales[0];
    q.d1 = d * (float)scales[1];
}

__device__ __forceinline__ void dequant_unit_q6_k(const u8* row, int unit, float* out) {
    Q6KUnit q;
    load_q6_k_unit(row, unit, q);
#pragma unroll
    for (int i = 0; i < 32; i++) {
        u32 l = q.low[i / 4] >> (8 * (i % 4)), h = q.high[i / 4] >> (8 * (i % 4));
        u32 value = ((l >> q.low_shift) & 0xF) | (((h >> q.high_shift) & 3) << 4);
        out[i] = (i < 16 ? q.d0 : q.d1) * biased_float(value, 32.f);
    }
}

// One line per stored type: X(name) expands a kernel family for every type.
#define FOR_EACH_TYPE(X) X(f32) X(f16) X(bf16) X(q8_0) X(q4_0) X(q4_1) X(q5_0) X(q5_1) X(q4_k) X(q5_k) X(q6_k)
// The float types: their decode GEMV multiplies in f32 (the others in gemv_q8.cu).
#define FOR_EACH_FLOAT_TYPE(X) X(f32) X(f16) X(bf16)

// Eight floats as eight f16 in one 16-byte store.
__device__ __forceinline__ uint4 pack_halves(const float* v) {
    u32 words[4];
    for (int i = 0; i < 4; i++) {
        __half lo = __float2half(v[2 * i]), hi = __float2half(v[2 * i + 1]);
        words[i] = (u32)*reinterpret_cast<u16*>(&lo) | ((u32)*reinterpret_cast<u16*>(&hi) << 16);
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
}
