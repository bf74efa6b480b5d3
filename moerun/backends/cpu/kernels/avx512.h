// The AVX-512 F/BW/VL primitives (16 floats, 32 registers) that isa_avx512.c and isa_amx.c
// build their kernels from (vectors.h lists them).
#pragma once
#include <immintrin.h>
#include "vectors.h"

typedef __m512 vf;
#define VL 16
#define NT_MAX 6
#define NT_FUSED 4
#define ROW_MR 6
#define ROW_NV 4
#define FUSED_TOKENS 12

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float v) { return _mm512_set1_ps(v); }
static inline vf vf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fma(vf acc, vf a, vf b) { return _mm512_fmadd_ps(a, b, acc); }
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }

static inline vf vf_bytes(u8x16 q, int part) {
    (void)part;
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)q));
}
static inline vf vf_signed_bytes(u8x16 q, int part) {
    (void)part;
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)q));
}
static inline vf vf_halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline vf vf_bf16(const uint8_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// Lanes of `table` picked by the low nibbles of q, or its high ones (vpermps reads the low 4 bits).
#define VF_LOOKUP16
static inline vf vf_lookup16(vf table, u8x16 q, int high) {
    __m512i index = _mm512_cvtepu8_epi32((__m128i)q);
    return _mm512_permutexvar_ps(high ? _mm512_srli_epi32(index, 4) : index, table);
}
// Bit j of `bits` as the value 16 in byte j.
#define VF_BITS_AS_16
static inline u8x16 vf_bits_as_16(uint32_t bits) { return (u8x16)_mm_maskz_set1_epi8((__mmask16)bits, 16); }
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

