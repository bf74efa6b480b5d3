// Row-times-vector building block shared by the dense and expert GEMVs: a group of
// `group` threads walks one weight row unit by unit, dequantizing each unit once
// and dotting it with up to MAX_TOKENS activation rows.
#pragma once
#include "quant_blocks.cuh"

typedef void (*DequantUnit)(const u8*, int, float*);

// acc[t] += Σ over this lane's units of row · x[t]; x rows are `x_stride` floats apart.
template <DequantUnit Dequant>
__device__ __forceinline__ void accumulate_row(const u8* row, int units, const float* x, long long x_stride,
                                               int n_tokens, int lane, int group, float* acc) {
    for (int u = lane; u < units; u += group) {
        float v[UNIT];
        Dequant(row, u, v);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++) {
            if (t < n_tokens) {
                const float4* xs = reinterpret_cast<const float4*>(x + t * x_stride + u * UNIT);
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
