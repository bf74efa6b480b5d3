// Norms and the small elementwise steps (attention and the KV cache: attention.cu).
// Shape legend: T tokens, S cache positions, NH/NKV query/KV heads, D/Dv head dims,
// E experts, K experts per token, H hidden, N a row width.
#include "q8_dot.cuh"
#include "staging.cuh"

// out[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * weight, and in 8-bit planes (q8_dot.cuh)
// into q, ds when q is given (width a multiple of 32: each warp holds whole units).
// One block per row; each thread holds NORM_VALUES values of it (width <= NORM_VALUES · blockDim).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ weight,
                                    float* __restrict__ out, int width, float eps, int4* __restrict__ q,
                                    float2* __restrict__ ds) {
    // Read before the wait: the weight, which no kernel writes, comes in while the kernel before finishes.
    float w[NORM_VALUES];
#pragma unroll
    for (int j = 0; j < NORM_VALUES; j++) {
        int i = j * blockDim.x + threadIdx.x;
        w[j] = i < width ? weight[i] : 0.f;
    }
    wait_for_previous_grid();
    __shared__ float scratch[1024];
    const float* row = x + (long long)blockIdx.x * width;
    float v[NORM_VALUES], sum = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_VALUES; j++) {
        int i = j * blockDim.x + threadIdx.x;
        v[j] = i < width ? row[i] : 0.f;
        sum += v[j] * v[j];
    }
    float inv = 1.0f / sqrtf(block_sum(sum, scratch) / width + eps);
#pragma unroll
    for (int j = 0; j < NORM_VALUES; j++) {
        int i = j * blockDim.x + threadIdx.x;
        if (i - threadIdx.x % UNIT >= width) break;           // the whole warp is past the row
        float value = v[j] * inv * w[j];
        if (i < width) out[(long long)blockIdx.x * width + i] = value;
        if (q) quantize_unit_of_warp(value, ((long long)blockIdx.x * width + i) / UNIT, q, ds);
    }
}

// out[i] = silu(gate[i]) * up[i] over n values.
extern "C" __global__ void silu_mul(const float* __restrict__ gate, const float* __restrict__ up,
                                    float* __restrict__ out, long long n) {
    wait_for_previous_grid();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu(gate[i]) * up[i];
}

// out[r, :] = x[rows[r], :] as f16, zeros where rows[r] < 0.  x [T, N]; out [R, N]; N a
// multiple of 8: one thread per 8 values.
extern "C" __global__ void gather_rows_f16(const float* __restrict__ x, const int* __restrict__ rows, int width,
                                           long long n_out, __half* __restrict__ out) {
    wait_for_previous_grid();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int pieces = width / 8;
    if (i >= n_out * pieces) return;
    long long row = i / pieces;
    int source = rows[row], column = (int)(i % pieces) * 8;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (source >= 0) {
        const float4* src = reinterpret_cast<const float4*>(x + (long long)source * width + column);
        float4 a = src[0], b = src[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
    *reinterpret_cast<uint4*>(out + row * width + column) = pack_halves(v);
}

// out[t, :] = (residual[t, :] +) Σ_k weights[t*K + k] · y[slot[t*K + k], :] over slots >= 0.
extern "C" __global__ void combine_rows(const float* __restrict__ y, const int* __restrict__ slot,
                                        const float* __restrict__ weights, int top_k, int width,
                                        long long n_tokens, const float* __restrict__ residual,
                                        float* __restrict__ out) {
    wait_for_previous_grid();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_tokens * width) return;
    long long t = i / width;
    int column = (int)(i % width);
    float sum = 0.f;
    for (int k = 0; k < top_k; k++) {
        int s = slot[t * top_k + k];
        if (s >= 0) sum += weights[t * top_k + k] * y[(long long)s * width + column];
    }
    out[i] = residual ? residual[i] + sum : sum;
}

// out[t, :] = x[t, :] + sigmoid(gate_logit[t]) * y[t, :], or x + y without a gate.
extern "C" __global__ void add_gated(const float* __restrict__ x, const float* __restrict__ y,
                                     const float* __restrict__ gate_logit, int width, long long n,
                                     float* __restrict__ out) {
    wait_for_previous_grid();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float scale = gate_logit ? 1.0f / (1.0f + expf(-gate_logit[i / width])) : 1.0f;
    out[i] = x[i] + scale * y[i];
}

// out = x as f16.
extern "C" __global__ void to_f16(const float* __restrict__ x, __half* __restrict__ out, long long n) {
    wait_for_previous_grid();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2half(x[i]);
}


// out[i] = x[i] · sigmoid(gate[i]) over n values (gated attention's output gate).
extern "C" __global__ void sigmoid_gate(const float* __restrict__ x, const float* __restrict__ gate,
                                        float* __restrict__ out, long long n) {
    wait_for_previous_grid();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] / (1.0f + expf(-gate[i]));
}
