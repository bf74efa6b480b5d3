// Float32 rows into the KV cache's element types: the inverse of blocks.h for the types a cache
// may keep (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), each block computed as ggml's
// reference quantizers (quantize_row_*_ref) and gguf-py's numpy ones compute it, to the bit.
//
// Shape legend: n a row's values, a multiple of the type's block (32 for the blocks).
#include <math.h>

#include "work.h"

static uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// Float to IEEE half, rounded to nearest even (infinities past the largest half, NaN to the
// quiet NaN): the value rescaled so that the float addition rounds its mantissa as a half's.
static uint16_t half_of(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = bits_of(f), twice = w + w, sign = w & 0x80000000u;
    uint32_t bias = twice & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    uint32_t rounded = bits_of(float_of((bias >> 1) + 0x07800000u) + base);
    uint32_t magnitude = ((rounded >> 13) & 0x7c00u) + (rounded & 0x0fffu);
    return (uint16_t)((sign >> 16) | (twice > 0xff000000u ? 0x7e00u : magnitude));
}

// Float to bfloat16, rounded to nearest even (NaN kept quiet).
static uint16_t bf16_of(float f) {
    uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
}

static void store_half(uint8_t* p, float f) {
    uint16_t h = half_of(f);
    memcpy(p, &h, 2);
}

// C's roundf: half away from zero, as ggml's q8_0 rounds.
static int8_t round_away(float x) { return (int8_t)roundf(x); }

// The value of largest magnitude of a block (the first of equals), with its sign.
static float signed_largest(const float* x) {
    float largest = 0.f, value = 0.f;
    for (int j = 0; j < 32; j++)
        if (fabsf(x[j]) > largest) largest = fabsf(x[j]), value = x[j];
    return value;
}

static void range_of(const float* x, float* lowest, float* highest) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < 32; j++) lo = x[j] < lo ? x[j] : lo, hi = x[j] > hi ? x[j] : hi;
    *lowest = lo, *highest = hi;
}

static void q8_0_block(const float* x, uint8_t* out) {
    float largest = 0.f;
    for (int j = 0; j < 32; j++) largest = fabsf(x[j]) > largest ? fabsf(x[j]) : largest;
    float d = largest / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
    store_half(out, d);
    for (int j = 0; j < 32; j++) out[2 + j] = (uint8_t)round_away(x[j] * inverse);
}

// Q4_0 and Q5_0: d = the signed largest / -levels, q = trunc(x / d + levels + 0.5) up to 2·levels - 1.
static void symmetric_codes(const float* x, float levels, uint8_t* q, float* scale) {
    float d = signed_largest(x) / -levels, inverse = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 32; j++) {
        int code = (int)(x[j] * inverse + (levels + 0.5f));
        q[j] = (uint8_t)(code < 2 * levels - 1 ? code : 2 * levels - 1);
    }
    *scale = d;
}

// Q4_1 and Q5_1: d = (max - min) / steps, q = trunc((x - min) / d + 0.5) up to steps.
static void offset_codes(const float* x, float steps, uint8_t* q, float* scale, float* offset) {
    float lowest, highest;
    range_of(x, &lowest, &highest);
    float d = (highest - lowest) / steps, inverse = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 32; j++) {
        int code = (int)((x[j] - lowest) * inverse + 0.5f);
        q[j] = (uint8_t)(code < steps ? code : steps);
    }
    *scale = d, *offset = lowest;
}

// Codes 0..15 (low nibbles: the first 16 values, high: the last 16), and for 5 bits the fifth
// bits of all 32 as a little-endian word.
static void pack_nibbles(const uint8_t* q, uint8_t* out) {
    for (int j = 0; j < 16; j++) out[j] = (uint8_t)((q[j] & 15) | (q[16 + j] & 15) << 4);
}
static void pack_fifth_bits(const uint8_t* q, uint8_t* out) {
    uint32_t high = 0;
    for (int j = 0; j < 32; j++) high |= (uint32_t)(q[j] >> 4) << j;
    memcpy(out, &high, 4);
}

static void quantize_block(int type, const float* x, uint8_t* out) {
    uint8_t q[32];
    float d, m;
    switch (type) {
    case T_Q8_0: q8_0_block(x, out); return;
    case T_Q4_0: symmetric_codes(x, 8.f, q, &d); store_half(out, d); pack_nibbles(q, out + 2); return;
    case T_Q5_0:
        symmetric_codes(x, 16.f, q, &d);
        store_half(out, d), pack_fifth_bits(q, out + 2), pack_nibbles(q, out + 6);
        return;
    case T_Q4_1:
        offset_codes(x, 15.f, q, &d, &m);
        store_half(out, d), store_half(out + 2, m), pack_nibbles(q, out + 4);
        return;
    case T_Q5_1:
        offset_codes(x, 31.f, q, &d, &m);
        store_half(out, d), store_half(out + 2, m), pack_fifth_bits(q, out + 4), pack_nibbles(q, out + 8);
        return;
    }
}

int cache_type(int64_t ggml_id) {
    int type = type_index(ggml_id);
    switch (type) {
    case T_F32: case T_F16: case T_BF16: case T_Q8_0: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1:
        return type;
    default:
        return -1;
    }
}

void quantize_row(int type, const float* x, int64_t n, uint8_t* out) {
    if (type == T_F32) {
        memcpy(out, x, (size_t)n * sizeof(float));
    } else if (type == T_F16 || type == T_BF16) {
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = type == T_F16 ? half_of(x[i]) : bf16_of(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
    } else {
        for (int64_t b = 0; b < n / 32; b++) quantize_block(type, x + 32 * b, out + b * TYPES[type].block_bytes);
    }
}

int moe_quantize_rows(int64_t ggml_id, const float* x, int64_t rows, int64_t n, uint8_t* out) {
    int type = cache_type(ggml_id);
    if (type < 0) return MOE_UNSUPPORTED_TYPE;
    if (n % TYPES[type].block_values) return MOE_BAD_SHAPE;
    for (int64_t r = 0; r < rows; r++) quantize_row(type, x + r * n, n, out + r * bytes_of(type, n));
    return MOE_OK;
}
