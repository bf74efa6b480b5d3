// Decode-time products over quantized weights with activations in 8-bit planes (q8_dot.cuh):
// the activations are quantized once per input, every weight unit is read once and
// dotted with up to MAX_GEMV_TOKENS token rows through dp4a.
// Shape legend: T tokens (<= MAX_GEMV_TOKENS), K_in input features, N output rows,
// H hidden, F expert FFN width, P routed (token, expert) pairs = T * top_k, U units of 32.
#include "q8_dot.cuh"
#include "staging.cuh"

// x [n, 32·units] f32 -> q int8 [n, 64·units] (per unit: plane a, plane b), ds [n·units] = (d, sx).
// One thread per unit.
extern "C" __global__ void quantize_q8(const float* __restrict__ x, long long n_units, int4* __restrict__ q,
                                       float2* __restrict__ ds) {
    wait_for_previous_grid();
    long long unit = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= n_units) return;
    float v[UNIT];
    load_values<UNIT>(x + unit * UNIT, v);
    ds[unit] = quantize_unit(v, q + 4 * unit);
}

// acc[r][t] += Σ over this lane's units of rows[r] · x for t < n_tokens (at most T), where token
// t's activations start at unit first + t·token_units: each unit of activations is read once for
// the R rows (the loads of activations, not of weights, bound these kernels otherwise); U units of
// a lane in flight.
template <IntUnitLoader Load, int R, int T, int U>
__device__ __forceinline__ void accumulate_rows_q8(const u8* const* rows, int units, Q8Activations x,
                                                   long long first, int token_units, int n_tokens, int lane,
                                                   int group, float (*acc)[T]) {
#pragma unroll U
    for (int u = lane; u < units; u += group) {
        IntUnit w[R];
#pragma unroll
        for (int r = 0; r < R; r++) Load(rows[r], u, w[r]);
#pragma unroll
        for (int t = 0; t < T; t++) {
            if (t < n_tokens) {
                ActUnit a = load_act_unit(x, first + (long long)t * token_units + u);
#pragma unroll
                for (int r = 0; r < R; r++) acc[r][t] += unit_dot<JoinedPlanes<Load>::value>(w[r], a);
            }
        }
    }
}

// y[t, r] = W[r, :] · x[t, :] (+ residual[t, r]).  W: N rows of row_bytes; x [T, K_in] in planes;
// y, residual [T, N].  Block: groups of `group` threads, two consecutive rows per group, staged
// (stage_rows) when `stride` is not 0. NAME_TYPE carries up to T tokens with U units of a lane in
// flight: gemv_q8 a few tokens (T = MAX_GEMV_TOKENS), gemv_q8_one one (T = 1: a loop over tokens
// that are not there costs a third of the head's time at decode, docs/benchmarks.md).
#define DEFINE_GEMV_Q8(NAME, T, U, TYPE)                                                                   \
    extern "C" __global__ void NAME##_##TYPE(const u8* __restrict__ weight, long long row_bytes,          \
                                              const int4* __restrict__ xq, const float2* __restrict__ xds, \
                                              int in_features, float* __restrict__ y, int out_features,    \
                                              int n_tokens, const float* __restrict__ residual, int stride, \
                                              int group) {                                                 \
        int row = 2 * (blockIdx.x * (blockDim.x / group) + threadIdx.x / group);                           \
        int lane = threadIdx.x % group, units = in_features / UNIT;                                        \
        bool valid = row < out_features, pair = row + 1 < out_features;                                    \
        const u8* src = weight + row * row_bytes;                                                          \
        stage_rows(src, valid ? (pair ? 2 : 1) * row_bytes : 0, stride, threadIdx.x / group, lane, group); \
        wait_for_previous_grid();                                                                          \
        const u8* first = staged_rows(src, stride, threadIdx.x / group);                                   \
        float acc[2][T] = {{0.f}};                                                                         \
        if (valid) {                                                                                       \
            const u8* rows[2] = {first, first + (pair ? row_bytes : 0)};                                   \
            accumulate_rows_q8<int_unit_##TYPE, 2, T, U>(rows, units, {xq, xds}, 0, units, n_tokens, lane, group, acc); \
        }                                                                                                  \
        for (int t = 0; t < T; t++) {                                                                      \
            if (t >= n_tokens) break;                                                                      \
            for (int r = 0; r < 2; r++) {                                                                  \
                float total = group_sum(acc[r][t], group);                                                 \
                long long at = (long long)t * out_features + row + r;                                      \
                if (lane == 0 && row + r < out_features) y[at] = total + (residual ? residual[at] : 0.f);  \
            }                                                                                              \
        }                                                                                                  \
    }
#define DEFINE_GEMV_Q8_FEW(TYPE) DEFINE_GEMV_Q8(gemv_q8, MAX_GEMV_TOKENS, 2, TYPE)
#define DEFINE_GEMV_Q8_ONE(TYPE) DEFINE_GEMV_Q8(gemv_q8_one, 1, 4, TYPE)

// act[p, f] = silu(gate_e · x[t]) * (up_e · x[t]) for pair p = t*top_k + k, e = ids[p], written
// quantized (aq [P, 2F] int8, ads [P, F/32]) for the down product; pairs with ids[p] < 0 (not
// resident here) are skipped. gate/up: E experts of expert_bytes, rows of row_bytes; x [T, H] as q8.
// Grid (F / 32, P); a block holds the 32 rows of one unit of act, in groups of `group` threads
// that take RG consecutive rows of gate and the same of up each (U units of a lane in flight).
#define DEFINE_MOE_GATE_UP_Q8(TYPE, RG, U)                                                                 \
    extern "C" __global__ void moe_gate_up_q8_##TYPE##_r##RG(                                              \
            const u8* __restrict__ gate, const u8* __restrict__ up, long long expert_bytes, long long row_bytes, \
            const int4* __restrict__ xq, const float2* __restrict__ xds, int hidden,                       \
            const int* __restrict__ ids, int top_k, int4* __restrict__ aq, float2* __restrict__ ads, int ffn, \
            int group) {                                                                                   \
        wait_for_previous_grid();                                                                          \
        __shared__ float act[UNIT];                                                                        \
        int pair = blockIdx.y, expert = ids[pair];                                                         \
        if (expert < 0) return;                                                                            \
        int local_row = threadIdx.x / group * RG, lane = threadIdx.x % group, units = hidden / UNIT;        \
        long long offset = expert * expert_bytes + (blockIdx.x * UNIT + local_row) * row_bytes;            \
        const u8* rows[2 * RG];                                                                            \
        _Pragma("unroll")                                                                                  \
        for (int r = 0; r < RG; r++) {                                                                     \
            rows[r] = gate + offset + r * row_bytes;                                                       \
            rows[RG + r] = up + offset + r * row_bytes;                                                    \
        }                                                                                                  \
        float acc[2 * RG][1] = {{0.f}};                                                                    \
        accumulate_rows_q8<int_unit_##TYPE, 2 * RG, 1, U>(rows, units, {xq, xds}, (long long)(pair / top_k) * units, \
                                                          0, 1, lane, group, acc);                         \
        _Pragma("unroll")                                                                                  \
        for (int r = 0; r < RG; r++) {                                                                     \
            float gate_sum = group_sum(acc[r][0], group), up_sum = group_sum(acc[RG + r][0], group);       \
            if (lane == 0) act[local_row + r] = silu(gate_sum) * up_sum;                                   \
        }                                                                                                  \
        __syncthreads();                                                                                   \
        if (threadIdx.x < UNIT) quantize_unit_of_warp(act[threadIdx.x],                                    \
                                                      (long long)pair * (ffn / UNIT) + blockIdx.x, aq, ads); \
    }

// out[t, r] = (residual[t, r] +) Σ_k weights[p] · down_e[r, :] · act[p, :] over the token's pairs
// p = t*top_k + k with ids[p] >= 0, summed in k order (deterministic). down: E experts of
// expert_bytes, H rows of row_bytes; act [P, F] as q8; out, residual [T, H]. Grid (H / rows per
// warp, T); one warp per expert slot k (looping when top_k exceeds the warps), 32 / group · R rows
// per warp (at most 32: R <= group), R consecutive rows per group of `group` threads; each warp's
// rows of its first slot's expert staged (stage_rows, a slot per warp) when `stride` is not 0.
// The ids were written before the gate/up launch that precedes this one, which waited for them.
#define DEFINE_MOE_DOWN_Q8(TYPE, R)                                                                        \
    extern "C" __global__ void moe_down_q8_##TYPE##_r##R(                                                  \
            const u8* __restrict__ down, long long expert_bytes, long long row_bytes,                      \
            const int4* __restrict__ aq, const float2* __restrict__ ads, int ffn,                          \
            const int* __restrict__ ids, const float* __restrict__ weights, int top_k,                     \
            float* __restrict__ out, const float* __restrict__ residual, int hidden, int stride, int group) { \
        __shared__ float partial[MAX_TOP_K][32];                                                          \
        int rows = 32 / group * R, token = blockIdx.y, first_row = blockIdx.x * rows;                      \
        int warp = threadIdx.x / 32, local_row = (threadIdx.x % 32) / group * R, lane = threadIdx.x % group; \
        int units = ffn / UNIT, first_expert = warp < top_k ? load_from_l2(ids + token * top_k + warp) : -1; \
        const u8* first_rows = down + first_expert * expert_bytes + first_row * row_bytes;                 \
        int staged_count = first_expert < 0 ? 0 : max(0, min(rows, hidden - first_row));                   \
        stage_rows(first_rows, staged_count * row_bytes, stride, warp, threadIdx.x % 32, 32);              \
        wait_for_previous_grid();                                                                          \
        first_rows = staged_rows(first_rows, stride, warp);                                                \
        for (int k = warp; k < top_k; k += blockDim.x / 32) {                                              \
            int pair = token * top_k + k, expert = ids[pair];                                              \
            float acc[R][1] = {{0.f}};                                                                     \
            const u8* base = k == warp ? first_rows : down + expert * expert_bytes;                       \
            int origin = k == warp ? first_row : 0;                        /* the staged rows start there */ \
            const u8* rows_of[R];                                                                          \
            _Pragma("unroll")                                                                              \
            for (int r = 0; r < R; r++)                       /* rows past the last: read, not written */ \
                rows_of[r] = base + (min(first_row + local_row + r, hidden - 1) - origin) * row_bytes;     \
            if (expert >= 0 && first_row + local_row < hidden)                                             \
                accumulate_rows_q8<int_unit_##TYPE, R, 1, 2>(rows_of, units, {aq, ads}, (long long)pair * units, 0, 1, \
                                                             lane, group, acc);                            \
            _Pragma("unroll")                                                                              \
            for (int r = 0; r < R; r++) {                                                                  \
                float total = group_sum(acc[r][0], group);                                                 \
                if (lane == 0) partial[k][local_row + r] = expert >= 0 ? weights[pair] * total : 0.f;      \
            }                                                                                              \
        }                                                                                                  \
        __syncthreads();                                                                                   \
        int row = first_row + threadIdx.x;                                                                 \
        if (threadIdx.x < rows && row < hidden) {                                                          \
            float sum = 0.f;                                                                               \
            for (int k = 0; k < top_k; k++) sum += partial[k][threadIdx.x];                                \
            long long at = (long long)token * hidden + row;                                                \
            out[at] = residual ? residual[at] + sum : sum;                                                 \
        }                                                                                                  \
    }

// Gate/up: one row of gate and up per group, 2 units of a lane in flight, or two rows each with
// one (wide hidden sizes, experts.py); down: 1, 2 or 4 rows per group (R <= group).
#define DEFINE_MOE_Q8(TYPE) DEFINE_MOE_GATE_UP_Q8(TYPE, 1, 2) DEFINE_MOE_GATE_UP_Q8(TYPE, 2, 1)                \
    DEFINE_MOE_DOWN_Q8(TYPE, 1) DEFINE_MOE_DOWN_Q8(TYPE, 2) DEFINE_MOE_DOWN_Q8(TYPE, 4)

FOR_EACH_INT_TYPE(DEFINE_GEMV_Q8_FEW)
FOR_EACH_INT_TYPE(DEFINE_GEMV_Q8_ONE)
FOR_EACH_INT_TYPE(DEFINE_MOE_Q8)

// Up to three matrices over the same activations in one launch (q, k and v): matrix s (a, b, c)
// has rows_s rows of row_bytes_s in type kind_s (its place in FOR_EACH_INT_TYPE) and writes
// y_s [T, rows_s]. The rows of the three are numbered one after the other; a group of `group`
// threads per row, staged (stage_rows) when `stride` is not 0. The activations are xq, xds, or,
// with `norm`, rms_norm(x [T, K_in], norm) converted by every block into its own planes in shared
// memory after the staged rows (normed_planes; K_in <= 8 · blockDim.x): no norm kernel before this
// one. Unused matrices have 0 rows.
template <int T, int U>
__device__ __forceinline__ void accumulate_row_of_kind(int kind, const u8* const* row, int units, Q8Activations x,
                                                       int n_tokens, int lane, int group, float (*acc)[T]) {
    switch (kind) {
        case 0: accumulate_rows_q8<int_unit_q8_0, 1, T, U>(row, units, x, 0, units, n_tokens, lane, group, acc); break;
        case 1: accumulate_rows_q8<int_unit_q4_0, 1, T, U>(row, units, x, 0, units, n_tokens, lane, group, acc); break;
        case 2: accumulate_rows_q8<int_unit_q4_1, 1, T, U>(row, units, x, 0, units, n_tokens, lane, group, acc); break;
        case 3: accumulate_rows_q8<int_unit_q5_0, 1, T, U>(row, units, x, 0, units, n_tokens, lane, group, acc); break;
        case 4: accumulate_rows_q8<int_unit_q5_1, 1, T, U>(row, units, x, 0, units, n_tokens, lane, group, acc); break;
        case 5: accumulate_rows_q8<int_unit_q4_k, 1, T, U>(row, units, x, 0, units, n_tokens, lane, group, acc); break;
        case 6: accumulate_rows_q8<int_unit_q5_k, 1, T, U>(row, units, x, 0, units, n_tokens, lane, group, acc); break;
        case 7: accumulate_rows_q8<int_unit_q6_k, 1, T, U>(row, units, x, 0, units, n_tokens, lane, group, acc); break;
    }
}

#define DEFINE_GEMV_Q8_THREE(NAME, T, U)                                                                   \
    extern "C" __global__ void NAME(                                                                       \
            const u8* __restrict__ weight_a, long long row_bytes_a, int kind_a, int rows_a, float* __restrict__ y_a, \
            const u8* __restrict__ weight_b, long long row_bytes_b, int kind_b, int rows_b, float* __restrict__ y_b, \
            const u8* __restrict__ weight_c, long long row_bytes_c, int kind_c, int rows_c, float* __restrict__ y_c, \
            const int4* __restrict__ xq, const float2* __restrict__ xds, const float* __restrict__ x,      \
            const float* __restrict__ norm, float eps, int in_features, int n_tokens, int stride, int group) { \
        int row = blockIdx.x * (blockDim.x / group) + threadIdx.x / group;                                 \
        int lane = threadIdx.x % group, units = in_features / UNIT;                                        \
        const u8* weight = weight_a;                                                                       \
        long long row_bytes = row_bytes_a;                                                                 \
        int kind = kind_a, rows = rows_a;                                                                  \
        float* y = y_a;                                                                                    \
        if (row >= rows_a) {                                                                               \
            row -= rows_a;                                                                                 \
            weight = weight_b; row_bytes = row_bytes_b; kind = kind_b; rows = rows_b; y = y_b;             \
            if (row >= rows_b) {                                                                           \
                row -= rows_b;                                                                             \
                weight = weight_c; row_bytes = row_bytes_c; kind = kind_c; rows = rows_c; y = y_c;         \
            }                                                                                              \
        }                                                                                                  \
        bool valid = row < rows;                                                                           \
        stage_rows(weight + row * row_bytes, valid ? row_bytes : 0, stride, threadIdx.x / group, lane, group); \
        wait_for_previous_grid();                                                                          \
        Q8Activations acts = {xq, xds};                                                                    \
        if (norm) {                                                                                        \
            __shared__ float scratch[33];                                                                  \
            int4* planes = reinterpret_cast<int4*>(stage_slot(blockDim.x / group, stride));                \
            float2* scales = reinterpret_cast<float2*>(planes + 4 * n_tokens * units);                     \
            normed_planes(x, norm, in_features, n_tokens, eps, planes, scales, scratch);                   \
            acts = {planes, scales};                                                                       \
        }                                                                                                  \
        float acc[1][T] = {{0.f}};                                                                         \
        const u8* row_data[1] = {staged_rows(weight + row * row_bytes, stride, threadIdx.x / group)};      \
        if (valid) accumulate_row_of_kind<T, U>(kind, row_data, units, acts, n_tokens, lane, group, acc);  \
        for (int t = 0; t < T; t++) {                                                                      \
            if (t >= n_tokens) break;                                                                      \
            float total = group_sum(acc[0][t], group);                                                     \
            if (lane == 0 && valid) y[t * rows + row] = total;                                             \
        }                                                                                                  \
    }

// A few tokens, and one (as gemv_q8 and gemv_q8_one).
DEFINE_GEMV_Q8_THREE(gemv_q8_three, MAX_GEMV_TOKENS, 2)
DEFINE_GEMV_Q8_THREE(gemv_q8_three_one, 1, 4)
