// Routing: softmax over a token's E router logits, its K most probable experts and their
// weights; and a decode step's whole router in one launch (norm, router product, top-K).
// Shape legend: T tokens (<= MAX_TOKENS), H hidden, E experts, K experts per token.
#include "matvec.cuh"
#include "q8_dot.cuh"
#include "staging.cuh"

#define MAX_EXPERTS 1024
#define MAX_TOP_K 32

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

// A decode step's router in one launch: h = rms_norm(x [T, H], norm), written f32 and, when hq
// is given (H a multiple of 32), in 8-bit planes (hq, hds) for the experts' products; logits
// [T, E] = h · routerᵀ; then ids, weights [T, K] as route_top_k. Grid (E), one block per router
// row (blockDim.x a multiple of 32, at most 1024), staged (stage_rows) when `stride` is not 0;
// the blocks share out h's units, a warp each.
// The last block to finish (counted in `done`, which it sets back to 0) ranks the experts.
#define DEFINE_ROUTE_NORMED(TYPE)                                                                          \
    extern "C" __global__ void route_normed_##TYPE(                                                        \
            const float* __restrict__ x, const float* __restrict__ norm, float eps, int hidden, int n_tokens, \
            const u8* __restrict__ router, long long row_bytes, int stride, float* __restrict__ logits,    \
            int n_experts, int top_k, int renormalize, float* __restrict__ h, int4* __restrict__ hq,       \
            float2* __restrict__ hds, unsigned* __restrict__ done, int* __restrict__ ids,                  \
            float* __restrict__ weights) {                                                                 \
        __shared__ float partial[MAX_TOKENS][32];          /* per token, per warp */                       \
        __shared__ float inv[MAX_TOKENS];                                                                  \
        __shared__ bool last;                                                                              \
        int expert = blockIdx.x, units = hidden / UNIT;                                                    \
        int warp = threadIdx.x / 32, warps = blockDim.x / 32, lane = threadIdx.x % 32;                     \
        stage_rows(router + expert * row_bytes, row_bytes, stride, 0, threadIdx.x, blockDim.x);            \
        wait_for_previous_grid();                                                                          \
        const u8* row = staged_rows(router + expert * row_bytes, stride, 0);                               \
        float acc[MAX_TOKENS];                                                                             \
        _Pragma("unroll") for (int t = 0; t < MAX_TOKENS; t++) {         /* each token's 1 / rms */        \
            acc[t] = 0.f;                                                                                  \
            for (int i = threadIdx.x; t < n_tokens && i < hidden; i += blockDim.x)                         \
                acc[t] += x[t * hidden + i] * x[t * hidden + i];                                           \
            acc[t] = group_sum(acc[t], 32);                                                                \
            if (lane == 0) partial[t][warp] = acc[t];                                                      \
            acc[t] = 0.f;                                                                                  \
        }                                                                                                  \
        __syncthreads();                                                                                   \
        if (threadIdx.x < n_tokens) {                                                                      \
            float sum = 0.f;                                                                               \
            for (int w = 0; w < warps; w++) sum += partial[threadIdx.x][w];                                \
            inv[threadIdx.x] = 1.0f / sqrtf(sum / hidden + eps);                                           \
        }                                                                                                  \
        __syncthreads();                                                                                   \
        for (int u = threadIdx.x; u < units; u += blockDim.x) {          /* Σ router · norm · x */         \
            float w[UNIT];                                                                                 \
            dequant_unit_##TYPE(row, u, w);                                                                \
            for (int i = 0; i < UNIT; i++) w[i] *= norm[u * UNIT + i];                                     \
            _Pragma("unroll") for (int t = 0; t < MAX_TOKENS; t++) {                                       \
                const float* xt = x + (long long)t * hidden + u * UNIT;                                    \
                for (int i = 0; t < n_tokens && i < UNIT; i++) acc[t] += w[i] * xt[i];                     \
            }                                                                                              \
        }                                                                                                  \
        _Pragma("unroll") for (int t = 0; t < MAX_TOKENS; t++) {                                           \
            acc[t] = group_sum(acc[t], 32);                                                                \
            if (lane == 0) partial[t][warp] = acc[t];                                                      \
        }                                                                                                  \
        __syncthreads();                                                                                   \
        if (threadIdx.x < n_tokens) {                                                                      \
            float sum = 0.f;                                                                               \
            for (int w = 0; w < warps; w++) sum += partial[threadIdx.x][w];                                \
            logits[threadIdx.x * n_experts + expert] = sum * inv[threadIdx.x];                             \
        }                                                                                                  \
        for (int u = expert * warps + warp; u < n_tokens * units; u += gridDim.x * warps) {  /* h's units */ \
            int t = u / units, i = (u % units) * UNIT + lane;                                              \
            float value = x[t * hidden + i] * inv[t] * norm[i];                                            \
            h[t * hidden + i] = value;                                                                     \
            if (hq) quantize_unit_of_warp(value, u, hq, hds);                                              \
        }                                                                                                  \
        __threadfence();                                                                                   \
        __syncthreads();                                                                                   \
        if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;                                 \
        __syncthreads();                                                                                   \
        if (!last) return;                                                                                 \
        __threadfence();                                                                                   \
        for (int t = 0; t < n_tokens; t++)                                                                 \
            top_k_of_token(logits + t * n_experts, n_experts, top_k, renormalize, ids + t * top_k,         \
                           weights + t * top_k);                                                           \
        if (threadIdx.x == 0) *done = 0u;                                                                  \
    }

FOR_EACH_FLOAT_TYPE(DEFINE_ROUTE_NORMED)
