// Routing: softmax over a token's E router logits, its K most probable experts and their
// weights; and a decode step's whole router in one launch (norm, router product, top-K).
// Shape legend: T tokens (<= MAX_GEMV_TOKENS), H hidden, E experts, K experts per token.
#include "matvec.cuh"
#include "q8_dot.cuh"
#include "staging.cuh"

// One token's logits [E] -> ids [K] (ties to the lower id) and their probabilities, renormalised
// to sum 1 when asked, by the whole block. An expert's rank is the number of experts more
// probable than it, or as probable with a lower id: the K of rank below K land in order at once,
// with no round of selection per k. The logits are read from L2 (other blocks may have written them).
__device__ void top_k_of_token(const float* logits, int n_experts, int top_k, int renormalize,
                               int* __restrict__ ids, float* __restrict__ weights) {
    __shared__ float probs[MAX_EXPERTS];
    __shared__ float chosen[MAX_TOP_K];
    __shared__ float scratch[33];
    float top = NEG_INF;
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) top = fmaxf(top, load_from_l2(logits + e));
    top = block_max(top, scratch);
    float sum = 0.f;
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) sum += expf(load_from_l2(logits + e) - top);
    sum = block_sum(sum, scratch);
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) probs[e] = expf(load_from_l2(logits + e) - top) / sum;
    __syncthreads();
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
        float p = probs[e];
        int rank = 0;
        for (int other = 0; other < n_experts; other++) {
            float o = probs[other];
            rank += o > p || (o == p && other < e);
        }
        if (rank < top_k) {
            ids[rank] = e;
            chosen[rank] = p;
        }
    }
    __syncthreads();
    if (threadIdx.x < top_k) {
        float chosen_sum = 0.f;
        for (int k = 0; k < top_k; k++) chosen_sum += chosen[k];
        float p = chosen[threadIdx.x];
        weights[threadIdx.x] = renormalize ? p / chosen_sum : p;
    }
    __syncthreads();                                     // probs and chosen are rewritten by the next token
}

// logits [T, E] -> ids, weights [T, K]. One block per token.
extern "C" __global__ void route_top_k(const float* __restrict__ logits, int n_experts, int top_k, int renormalize,
                                       int* __restrict__ ids, float* __restrict__ weights) {
    wait_for_previous_grid();
    int t = blockIdx.x;
    top_k_of_token(logits + (long long)t * n_experts, n_experts, top_k, renormalize, ids + t * top_k,
                   weights + t * top_k);
}

__device__ __forceinline__ float float_value_f32(const u8* row, int i) { return reinterpret_cast<const float*>(row)[i]; }
__device__ __forceinline__ float float_value_f16(const u8* row, int i) {
    return half_bits_to_float(reinterpret_cast<const u16*>(row)[i]);
}
__device__ __forceinline__ float float_value_bf16(const u8* row, int i) {
    return bf16_bits_to_float(reinterpret_cast<const u16*>(row)[i]);
}

// A decode step's router in one launch: h = rms_norm(x [T, H], norm), written f32 and, when hq
// is given (H a multiple of 32), in 8-bit planes (hq, hds) for the experts' products; logits
// [T, E] = h · routerᵀ; then ids, weights [T, K] as route_top_k. Grid (E), one block per router
// row (blockDim.x a multiple of 32, at most 1024, H <= ROUTE_VALUES · blockDim.x), the row staged
// (stage_rows) when `stride` is not 0 and the norm read before the wait (weights). Thread i takes
// values i, i + blockDim.x, ...: one pass sums both x² and router · norm · x, so a logit is
// (Σ router · norm · x) / rms after one block reduction. The last block to count itself in `done`
// (which it sets back to 0) ranks the experts; meanwhile the blocks write h's units, one a thread.
#define DEFINE_ROUTE_NORMED(TYPE)                                                                          \
    extern "C" __global__ void route_normed_##TYPE(                                                        \
            const float* __restrict__ x, const float* __restrict__ norm, float eps, int hidden, int n_tokens, \
            const u8* __restrict__ router, long long row_bytes, int stride, float* __restrict__ logits,    \
            int n_experts, int top_k, int renormalize, float* __restrict__ h, int4* __restrict__ hq,       \
            float2* __restrict__ hds, unsigned* __restrict__ done, int* __restrict__ ids,                  \
            float* __restrict__ weights) {                                                                 \
        __shared__ float partial[2][MAX_GEMV_TOKENS][32];       /* x², router · norm · x: per token, per warp */ \
        __shared__ float inv[MAX_GEMV_TOKENS];                                                                  \
        __shared__ bool last;                                                                              \
        int expert = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;                         \
        stage_rows(router + expert * row_bytes, row_bytes, stride, 0, threadIdx.x, blockDim.x);            \
        float w[ROUTE_VALUES];                                                                             \
        _Pragma("unroll") for (int j = 0; j < ROUTE_VALUES; j++) {                                         \
            int i = j * blockDim.x + threadIdx.x;                                                          \
            w[j] = i < hidden ? norm[i] : 0.f;                                                             \
        }                                                                                                  \
        wait_for_previous_grid();                                                                          \
        const u8* row = staged_rows(router + expert * row_bytes, stride, 0);                               \
        _Pragma("unroll") for (int j = 0; j < ROUTE_VALUES; j++) {                                         \
            int i = j * blockDim.x + threadIdx.x;                                                          \
            if (i < hidden) w[j] *= float_value_##TYPE(row, i);                                            \
        }                                                                                                  \
        for (int t = 0; t < n_tokens; t++) {                                                               \
            float squares = 0.f, dot = 0.f;                                                                \
            _Pragma("unroll") for (int j = 0; j < ROUTE_VALUES; j++) {                                     \
                int i = j * blockDim.x + threadIdx.x;                                                      \
                float value = i < hidden ? x[t * hidden + i] : 0.f;                                        \
                squares += value * value;                                                                  \
                dot += w[j] * value;                                                                       \
            }                                                                                              \
            squares = group_sum(squares, 32);                                                              \
            dot = group_sum(dot, 32);                                                                      \
            if (lane == 0) { partial[0][t][warp] = squares; partial[1][t][warp] = dot; }                   \
        }                                                                                                  \
        __syncthreads();                                                                                   \
        if (threadIdx.x < n_tokens) {                                                                      \
            float squares = 0.f, dot = 0.f;                                                                \
            for (int v = 0; v < blockDim.x / 32; v++) {                                                    \
                squares += partial[0][threadIdx.x][v];                                                     \
                dot += partial[1][threadIdx.x][v];                                                         \
            }                                                                                              \
            inv[threadIdx.x] = 1.0f / sqrtf(squares / hidden + eps);                                       \
            logits[threadIdx.x * n_experts + expert] = dot * inv[threadIdx.x];                             \
        }                                                                                                  \
        __threadfence();                                                                                   \
        __syncthreads();                                                                                   \
        if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;                                 \
        int units = hidden / UNIT;                                                                         \
        for (int u = expert * blockDim.x + threadIdx.x; u < n_tokens * units; u += gridDim.x * blockDim.x) { \
            int t = u / units;                                                                             \
            float v[UNIT], g[UNIT];                                                                        \
            load_values<UNIT>(x + (long long)u * UNIT, v);                                                         \
            load_values<UNIT>(norm + (u % units) * UNIT, g);                                                       \
            _Pragma("unroll") for (int i = 0; i < UNIT; i++) v[i] = v[i] * inv[t] * g[i];                  \
            _Pragma("unroll") for (int i = 0; i < UNIT / 4; i++)                                           \
                reinterpret_cast<float4*>(h + (long long)u * UNIT)[i] =                                    \
                    make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);                       \
            if (hq) hds[u] = quantize_unit(v, hq + 4 * u);                                                 \
        }                                                                                                  \
        __syncthreads();                                                                                   \
        if (!last) return;                                                                                 \
        __threadfence();                                                                                   \
        for (int t = 0; t < n_tokens; t++)                                                                 \
            top_k_of_token(logits + t * n_experts, n_experts, top_k, renormalize, ids + t * top_k,         \
                           weights + t * top_k);                                                           \
        if (threadIdx.x == 0) *done = 0u;                                                                  \
    }

FOR_EACH_FLOAT_TYPE(DEFINE_ROUTE_NORMED)
