// Decode-time products: dense GEMV and the routed-expert GEMVs.
// Shape legend: T tokens (<= MAX_GEMV_TOKENS), K_in input features, N output rows,
// H hidden, F expert FFN width, P routed (token, expert) pairs = T * top_k.
#include "matvec.cuh"
#include "staging.cuh"

// y[t, r] = W[r, :] · x[t, :] (+ residual[t, r]).  W: N rows of row_bytes; x [T, K_in];
// y, residual [T, N].  Block: groups of `group` threads, one row per group.
#define DEFINE_GEMV(TYPE)                                                                                  \
    extern "C" __global__ void gemv_##TYPE(const u8* __restrict__ weight, long long row_bytes,            \
                                           const float* __restrict__ x, int in_features,                  \
                                           float* __restrict__ y, int out_features, int n_tokens,         \
                                           const float* __restrict__ residual, int group) {               \
        wait_for_previous_grid();                                                                          \
        __shared__ float stage[STAGE_FLOATS];                                                              \
        Activations xs = stage_activations(x, n_tokens, in_features, stage);                               \
        int row = blockIdx.x * (blockDim.x / group) + threadIdx.x / group;                                 \
        int lane = threadIdx.x % group;                                                                    \
        float acc[MAX_GEMV_TOKENS];                                                                             \
        for (int t = 0; t < MAX_GEMV_TOKENS; t++) acc[t] = 0.f;                                                 \
        if (row < out_features)                                                                            \
            accumulate_row<dequant_unit_##TYPE>(weight + row * row_bytes, in_features / UNIT, xs, 0,      \
                                                n_tokens, lane, group, acc);                              \
        for (int t = 0; t < MAX_GEMV_TOKENS; t++) {                                                             \
            if (t >= n_tokens) break;                                                                      \
            float total = group_sum(acc[t], group);                                                        \
            if (lane == 0 && row < out_features)                                                           \
                y[t * out_features + row] = total + (residual ? residual[t * out_features + row] : 0.f);   \
        }                                                                                                  \
    }

// The same product for a matrix of few rows (a router): one block per row, its threads taking
// the row's units in turn and reading x straight from global memory, so that the rows spread
// over as many multiprocessors as there are rows; the row staged (stage_rows) when `stride` is
// not 0. Grid (N).
#define DEFINE_GEMV_FEW_ROWS(TYPE)                                                                        \
    extern "C" __global__ void gemv_few_rows_##TYPE(const u8* __restrict__ weight, long long row_bytes,   \
                                                    const float* __restrict__ x, int in_features,         \
                                                    float* __restrict__ y, int out_features, int n_tokens, \
                                                    const float* __restrict__ residual, int stride) {     \
        __shared__ float scratch[32];                                                                     \
        int row = blockIdx.x;                                                                             \
        stage_rows(weight + row * row_bytes, row_bytes, stride, 0, threadIdx.x, blockDim.x);              \
        wait_for_previous_grid();                                                                         \
        const u8* staged = staged_rows(weight + row * row_bytes, stride, 0);                              \
        float acc[MAX_GEMV_TOKENS];                                                                            \
        for (int t = 0; t < MAX_GEMV_TOKENS; t++) acc[t] = 0.f;                                                \
        accumulate_row<dequant_unit_##TYPE>(staged, in_features / UNIT,                                   \
                                            {x, in_features, UNIT}, 0, n_tokens, threadIdx.x, blockDim.x, \
                                            acc);                                                         \
        for (int t = 0; t < n_tokens; t++) {                                                              \
            float total = block_sum(acc[t], scratch);                                                     \
            if (threadIdx.x == 0)                                                                         \
                y[t * out_features + row] = total + (residual ? residual[t * out_features + row] : 0.f);  \
        }                                                                                                 \
    }

// act[p, f] = silu(gate_e · x[t]) * (up_e · x[t]) for pair p = t*top_k + k, e = ids[p];
// pairs with ids[p] < 0 (not resident here) are skipped. gate/up: E experts of
// expert_bytes, rows of row_bytes; x [T, H]; act [P, F]. Grid: (F rows / groups, P).
#define DEFINE_MOE_GATE_UP(TYPE)                                                                           \
    extern "C" __global__ void moe_gate_up_##TYPE(const u8* __restrict__ gate, const u8* __restrict__ up,  \
                                                  long long expert_bytes, long long row_bytes,              \
                                                  const float* __restrict__ x, int hidden,                  \
                                                  const int* __restrict__ ids, int top_k,                   \
                                                  float* __restrict__ act, int ffn, int group) {            \
        wait_for_previous_grid();                                                                          \
        __shared__ float stage[STAGE_FLOATS];                                                              \
        int pair = blockIdx.y;                                                                             \
        int expert = ids[pair];                                                                            \
        if (expert < 0) return;                                                                            \
        Activations xt = stage_activations(x + (long long)(pair / top_k) * hidden, 1, hidden, stage);      \
        int row = blockIdx.x * (blockDim.x / group) + threadIdx.x / group;                                 \
        int lane = threadIdx.x % group;                                                                    \
        float g[MAX_GEMV_TOKENS] = {0.f}, u[MAX_GEMV_TOKENS] = {0.f};                                                \
        if (row < ffn) {                                                                                   \
            long long offset = expert * expert_bytes + row * row_bytes;                                    \
            accumulate_row<dequant_unit_##TYPE>(gate + offset, hidden / UNIT, xt, 0, 1, lane, group, g);  \
            accumulate_row<dequant_unit_##TYPE>(up + offset, hidden / UNIT, xt, 0, 1, lane, group, u);    \
        }                                                                                                  \
        float gate_sum = group_sum(g[0], group), up_sum = group_sum(u[0], group);                          \
        if (lane == 0 && row < ffn) act[(long long)pair * ffn + row] = silu(gate_sum) * up_sum;            \
    }

// out[t, r] = (residual[t, r] +) Σ_k weights[p] · down_e[r, :] · act[p, :] over the
// token's pairs p = t*top_k + k with ids[p] >= 0, summed in k order (deterministic).
// down: E experts of expert_bytes, H rows of row_bytes; act [P, F]; out, residual [T, H].
// Grid: (H rows / groups, T).
#define DEFINE_MOE_DOWN(TYPE)                                                                              \
    extern "C" __global__ void moe_down_##TYPE(const u8* __restrict__ down, long long expert_bytes,        \
                                               long long row_bytes, const float* __restrict__ act, int ffn, \
                                               const int* __restrict__ ids,                                 \
                                               const float* __restrict__ weights, int top_k,                \
                                               float* __restrict__ out, int hidden,                        \
                                               const float* __restrict__ residual, int group) {            \
        wait_for_previous_grid();                                                                          \
        __shared__ float stage[STAGE_FLOATS];                                                              \
        int token = blockIdx.y;                                                                            \
        Activations acts = stage_activations(act + (long long)token * top_k * ffn, top_k, ffn, stage);     \
        int row = blockIdx.x * (blockDim.x / group) + threadIdx.x / group;                                 \
        int lane = threadIdx.x % group;                                                                    \
        float acc = 0.f;                                                                                   \
        if (row < hidden) {                                                                                \
            for (int k = 0; k < top_k; k++) {                                                              \
                int pair = token * top_k + k;                                                              \
                int expert = ids[pair];                                                                    \
                if (expert < 0) continue;                                                                  \
                float part[MAX_GEMV_TOKENS] = {0.f};                                                            \
                accumulate_row<dequant_unit_##TYPE>(down + expert * expert_bytes + row * row_bytes,       \
                                                    ffn / UNIT, acts, k, 1, lane, group, part);            \
                acc += weights[pair] * part[0];                                                            \
            }                                                                                              \
        }                                                                                                  \
        float total = group_sum(acc, group);                                                               \
        long long at = (long long)token * hidden + row;                                                    \
        if (lane == 0 && row < hidden) out[at] = residual ? residual[at] + total : total;                  \
    }

FOR_EACH_FLOAT_TYPE(DEFINE_GEMV)
FOR_EACH_FLOAT_TYPE(DEFINE_GEMV_FEW_ROWS)
FOR_EACH_TYPE(DEFINE_MOE_GATE_UP)
FOR_EACH_TYPE(DEFINE_MOE_DOWN)
