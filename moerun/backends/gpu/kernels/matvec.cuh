// Row-times-vector building block shared by the dense and expert GEMVs: a group of
// `group` threads walks one weight row unit by unit, dequantizing each unit once
// and dotting it with up to MAX_GEMV_TOKENS activation rows.
//
// Each lane reads its unit's 32 activations; read straight from global memory,
// a warp's lanes would touch 32 different cache lines per load. So the block first
// stages the activations in shared memory, unit by unit with 4 floats of padding
// (lanes then hit distinct banks), when they fit.
#pragma once
#include "quant_blocks.cuh"

#define STAGED_UNIT (UNIT + 4)
#define STAGE_FLOATS (256 * STAGED_UNIT)        // 8192 activations

typedef void (*DequantUnit)(const u8*, int, float*);

// Where activations x [rows, K] sit: global memory (row stride K, unit stride UNIT),
// or the block's staging buffer (row stride units * STAGED_UNIT, unit stride STAGED_UNIT).
struct Activations {
    const float* base;
    long long row_stride;
    int unit_stride;
};

// Stage x [n_rows, K] when it fits; every thread of the block must call this.
__device__ Activations stage_activations(const float* x, int n_rows, int in_features, float* stage) {
    int units = in_features / UNIT;
    if (n_rows * units * STAGED_UNIT > STAGE_FLOATS) return {x, in_features, UNIT};
    for (int i = threadIdx.x; i < n_rows * in_features; i += blockDim.x) {
        int row = i / in_features, e = i % in_features;
        stage[(row * units + e / UNIT) * STAGED_UNIT + e % UNIT] = x[i];
    }
    __syncthreads();
    return {stage, (long long)units * STAGED_UNIT, STAGED_UNIT};
}

// acc[t] += Σ over this lane's units of row · x[first_row + t] for t < n_tokens.
template <DequantUnit Dequant>
__device__ __forceinline__ void accumulate_row(const u8* row, int units, Activations x, int first_row,
                                               int n_tokens, int lane, int group, float* acc) {
#pragma unroll 2
    for (int u = lane; u < units; u += group) {
        float v[UNIT];
        Dequant(row, u, v);
#pragma unroll
        for (int t = 0; t < MAX_GEMV_TOKENS; t++) {
            if (t < n_tokens) {
                const float4* xs = reinterpret_cast<const float4*>(
                    x.base + (first_row + t) * x.row_stride + u * x.unit_stride);
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < UNIT / 4; i++) {
                    float4 xv = xs[i];
                    s += v[4 * i] * xv.x + v[4 * i + 1] * xv.y + v[4 * i + 2] * xv.z + v[4 * i + 3] * xv.w;
                }
                acc[t] += s;
            }
        }
    }
}
