// Dequantization to f16 for the prefill path's dense products, which run on the matrix
// units: out[r, :] = row r of W for r < n_rows. One thread per 32-weight unit.
#include "quant_blocks.cuh"

#define DEFINE_DEQUANT_F16(TYPE)                                                                           \
    extern "C" __global__ void dequant_f16_##TYPE(const u8* __restrict__ weight, long long row_bytes,      \
                                                  int units_per_row, long long n_rows,                     \
                                                  __half* __restrict__ out) {                              \
        wait_for_previous_grid();                                                                          \
        long long index = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                \
        if (index >= n_rows * units_per_row) return;                                                       \
        long long row = index / units_per_row;                                                             \
        int unit = (int)(index % units_per_row);                                                           \
        float v[UNIT];                                                                                     \
        dequant_unit_##TYPE(weight + row * row_bytes, unit, v);                                            \
        uint4* dst = reinterpret_cast<uint4*>(out + row * (long long)units_per_row * UNIT + unit * UNIT);  \
        for (int i = 0; i < UNIT / 8; i++) dst[i] = pack_halves(v + 8 * i);                               \
    }

FOR_EACH_TYPE(DEFINE_DEQUANT_F16)

// out[i, :] = row rows[i] of W in f32 (the embedding lookup). out [n_rows, K].
#define DEFINE_GATHER_F32(TYPE)                                                                            \
    extern "C" __global__ void gather_rows_f32_##TYPE(const u8* __restrict__ weight, long long row_bytes,  \
                                                      int units_per_row, int n_rows,                       \
                                                      const int* __restrict__ rows, float* __restrict__ out) { \
        wait_for_previous_grid();                                                                          \
        long long index = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                \
        if (index >= (long long)n_rows * units_per_row) return;                                            \
        int row = (int)(index / units_per_row), unit = (int)(index % units_per_row);                       \
        float v[UNIT];                                                                                     \
        dequant_unit_##TYPE(weight + rows[row] * row_bytes, unit, v);                                      \
        float4* dst = reinterpret_cast<float4*>(out + (long long)row * units_per_row * UNIT + unit * UNIT); \
        for (int i = 0; i < UNIT / 4; i++) dst[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]); \
    }

FOR_EACH_TYPE(DEFINE_GATHER_F32)
