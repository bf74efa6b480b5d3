// Attention and the KV cache: rope with the append, decode attention's two passes, prefill's
// head expansion and causal softmax. The cache's elements are f32 or f16 (--kv-dtype): the
// kernels that touch it come in one form per type (suffix _f32, _f16), and read and write it
// as floats. Shape legend: T tokens, S cache positions, NH/NKV query/KV heads, D/Dv head dims.
#include "q8_dot.cuh"
#include "staging.cuh"

#define MAX_HEAD_DIM 256
#define ATTENTION_CHUNK 256     // cache rows a split of the per-head decode attention scores at a time
#define ATTENTION_GRANULE 32    // a split's share of the rows is a multiple of this: one pass of 256 threads
#define L2_LINE 128             // bytes of one line prefetch_l2 fetches

typedef float kv_f32;
typedef __half kv_f16;
#define FOR_EACH_KV_TYPE(X) X(f32) X(f16)

__device__ __forceinline__ void store_kv(float* p, float value) { *p = value; }
__device__ __forceinline__ void store_kv(__half* p, float value) { *p = __float2half(value); }

// Four consecutive elements (16-byte aligned for f32, 8-byte for f16) as floats.
__device__ __forceinline__ float4 load_kv4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load_kv4(const __half* p) {
    uint2 bits = *reinterpret_cast<const uint2*>(p);
    return make_float4(half_bits_to_float((u16)bits.x), half_bits_to_float((u16)(bits.x >> 16)),
                       half_bits_to_float((u16)bits.y), half_bits_to_float((u16)(bits.y >> 16)));
}

// For one token t and one head (grid (T, NH + NKV), D/2 threads): apply the
// per-head RMS norm when given, rotate the first R (rotary_dims) of its D dims by the token's
// position, then store a query head back in q or a key head (with its value head) into the
// cache at row positions[t].  neox rotates pairs (i, i + R/2), otherwise (2i, 2i + 1); the dims
// past R pass through, two a thread.
// The angle is computed before the wait: the positions were written before the step's first
// kernel (read from L2), the norms and frequencies by none.
#define DEFINE_QK_NORM_ROPE_APPEND(KV)                                                                         \
    extern "C" __global__ void qk_norm_rope_append_##KV(                                                       \
            float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                   \
            const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,                     \
            const int* __restrict__ positions, const double* __restrict__ inv_freq, double inv_scale, int neox, \
            kv_##KV* __restrict__ k_cache, kv_##KV* __restrict__ v_cache,                                      \
            int n_heads, int n_kv_heads, int head_dim, int head_dim_v, int rotary_dims) {                      \
        __shared__ float scratch[MAX_HEAD_DIM / 2];                                                            \
        int t = blockIdx.x, head = blockIdx.y, i = threadIdx.x, half = rotary_dims / 2;                        \
        bool is_query = head < n_heads, rotates = i < half;                                                    \
        int kv_head = head - n_heads, position = load_from_l2(positions + t);                                  \
        const float* norm = is_query ? q_norm : k_norm;                                                        \
        int i1 = !neox ? 2 * i : rotates ? i : rotary_dims + 2 * (i - half);                                   \
        int i2 = !neox ? 2 * i + 1 : rotates ? i + half : i1 + 1;                                              \
        float norm1 = norm ? norm[i1] : 1.f, norm2 = norm ? norm[i2] : 1.f;                                    \
        double angle = rotates ? (double)position * inv_scale * inv_freq[i] : 0.0;                             \
        float c = (float)cos(angle), s = (float)sin(angle);                                                    \
        wait_for_previous_grid();                                                                              \
        const float* src = is_query ? q + ((long long)t * n_heads + head) * head_dim                           \
                                    : k + ((long long)t * n_kv_heads + kv_head) * head_dim;                    \
        float a = src[i1], b = src[i2];                                                                        \
        if (norm) {                                                                                            \
            float inv = 1.0f / sqrtf(block_sum(a * a + b * b, scratch) / head_dim + eps);                      \
            a = a * inv * norm1;                                                                               \
            b = b * inv * norm2;                                                                               \
        }                                                                                                      \
        float ra = a * c - b * s, rb = b * c + a * s;                                                          \
        if (is_query) {                                                                                        \
            float* dst = q + ((long long)t * n_heads + head) * head_dim;                                       \
            dst[i1] = ra; dst[i2] = rb;                                                                        \
            return;                                                                                            \
        }                                                                                                      \
        long long slot = (long long)position * n_kv_heads + kv_head;                                           \
        store_kv(k_cache + slot * head_dim + i1, ra);                                                          \
        store_kv(k_cache + slot * head_dim + i2, rb);                                                          \
        const float* v_src = v + ((long long)t * n_kv_heads + kv_head) * head_dim_v;                           \
        for (int j = i; j < head_dim_v; j += blockDim.x)                                                       \
            store_kv(v_cache + slot * head_dim_v + j, v_src[j]);                                               \
    }

FOR_EACH_KV_TYPE(DEFINE_QK_NORM_ROPE_APPEND)

// A split's rows: an equal share of a token's `length`, rounded up to whole ATTENTION_GRANULE rows.
// And the L2 prefetch of rows [begin, end) of one KV head.
__device__ __forceinline__ int2 split_rows(int length, int split, int splits) {
    int share = (length + splits - 1) / splits;
    share = (share + ATTENTION_GRANULE - 1) / ATTENTION_GRANULE * ATTENTION_GRANULE;
    int begin = split * share;
    return make_int2(begin, min(begin + share, length));
}

template <typename KV>
__device__ __forceinline__ void prefetch_rows(const KV* k_cache, const KV* v_cache, int kv_head, int n_kv_heads,
                                              int head_dim, int head_dim_v, int begin, int end) {
    const int per_line = L2_LINE / sizeof(KV);                       // elements of a line
    int lines = (head_dim + per_line - 1) / per_line, lines_v = (head_dim_v + per_line - 1) / per_line;
    for (int l = threadIdx.x; l < (end - begin) * (lines + lines_v); l += blockDim.x) {
        int s = begin + l / (lines + lines_v), line = l % (lines + lines_v);
        prefetch_l2(line < lines ? k_cache + ((long long)s * n_kv_heads + kv_head) * head_dim + per_line * line
                                 : v_cache + ((long long)s * n_kv_heads + kv_head) * head_dim_v
                                           + per_line * (line - lines));
    }
}

// Split-K causal attention of a few tokens over a short cache (backend.py: at most
// GROUPED_ATTENTION_CAPACITY rows), first pass, a block per query head: its many small blocks
// walk a short cache sooner than the grouped kernel below, which reads each row once for a tile
// of heads. Grid (T, NH, splits), blockDim <= 256 (scratch holds the [strides, Dv] partial sums:
// 4·blockDim floats; launched with 256).
// Token t attends to cache rows [0, positions[t]]; split c takes an equal share of them,
// rounded up to whole ATTENTION_GRANULE rows (so the last splits may get fewer, or none),
// and walks it ATTENTION_CHUNK rows at a time with a running max and sum. Writes the
// split's unnormalised output acc [T, NH, splits, Dv] and its (max, sum) [T, NH, splits, 2],
// (-inf, 0) for a split with no rows. Before the wait, the split's rows the steps before wrote
// (all but those of this step's tokens, from positions[0]) are fetched into L2.
#define DEFINE_ATTENTION_PARTIAL(KV)                                                                           \
    extern "C" __global__ void attention_partial_##KV(                                                         \
            const float* __restrict__ q, const kv_##KV* __restrict__ k_cache, const kv_##KV* __restrict__ v_cache, \
            const int* __restrict__ positions, int n_heads, int n_kv_heads, int head_dim, int head_dim_v,      \
            float scale, float* __restrict__ acc, float* __restrict__ max_sum) {                               \
        __shared__ float q_shared[MAX_HEAD_DIM];                                                               \
        __shared__ float probs[ATTENTION_CHUNK];                                                               \
        __shared__ float scratch[1024];                                                                        \
        int t = blockIdx.x, head = blockIdx.y, split = blockIdx.z, splits = gridDim.z;                         \
        int kv_head = head / (n_heads / n_kv_heads);                                                           \
        long long part = ((long long)t * n_heads + head) * splits + split;                                     \
        int2 rows = split_rows(load_from_l2(positions + t) + 1, split, splits);                                \
        int begin = rows.x, end = rows.y;                                                                      \
        prefetch_rows(k_cache, v_cache, kv_head, n_kv_heads, head_dim, head_dim_v, begin,                      \
                      min(end, load_from_l2(positions)));                 /* rows before this step's */        \
        wait_for_previous_grid();                                                                              \
        if (begin >= end) {                                                                                    \
            if (threadIdx.x == 0) { max_sum[2 * part] = NEG_INF; max_sum[2 * part + 1] = 0.f; }                \
            return;                                                                                            \
        }                                                                                                      \
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x)                                               \
            q_shared[d] = q[((long long)t * n_heads + head) * head_dim + d];                                   \
        __syncthreads();                                                                                       \
        /* Scores: each group of 8 threads takes one key at a time, 4 dims per load, so a block of             \
           256 has 32 keys' loads in flight per pass. Values: thread i takes 4 dims (column i % columns)       \
           of every strides-th key from i / columns, kept in registers across the chunks; the strides          \
           partial sums meet in shared memory at the end. Dv % 4 == 0, Dv / 4 <= blockDim. */                  \
        int lane = threadIdx.x % 8, groups = blockDim.x / 8;                                                   \
        int columns = head_dim_v / 4, strides = blockDim.x / columns, first = threadIdx.x / columns;           \
        const kv_##KV* values = v_cache + (long long)kv_head * head_dim_v + 4 * (threadIdx.x % columns);       \
        long long key_stride = (long long)n_kv_heads * head_dim_v;                                             \
        float best = NEG_INF, total = 0.f;                                                                     \
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);                                                          \
        for (int from = begin; from < end; from += ATTENTION_CHUNK) {                                          \
            int to = min(from + ATTENTION_CHUNK, end);                                                         \
            /* Every thread runs every pass (the shuffles need the whole warp); groups past the end add nothing. */ \
            float local_max = NEG_INF;                                                                         \
            for (int pass = from; pass < to; pass += groups) {                                                 \
                int s = pass + threadIdx.x / 8;                                                                \
                float dot = 0.f;                                                                               \
                if (s < to) {                                                                                  \
                    const kv_##KV* key = k_cache + ((long long)s * n_kv_heads + kv_head) * head_dim;           \
                    for (int d = 4 * lane; d < head_dim; d += 32) {                                            \
                        float4 kv = load_kv4(key + d);                                                         \
                        dot += q_shared[d] * kv.x + q_shared[d + 1] * kv.y + q_shared[d + 2] * kv.z            \
                               + q_shared[d + 3] * kv.w;                                                       \
                    }                                                                                          \
                }                                                                                              \
                dot = group_sum(dot, 8) * scale;                                                               \
                if (s < to) {                                                                                  \
                    if (lane == 0) probs[s - from] = dot;                                                      \
                    local_max = fmaxf(local_max, dot);                                                         \
                }                                                                                              \
            }                                                                                                  \
            /* The running max over the chunks so far; what was summed under the old one is rescaled           \
               (by e^(-inf) = 0 on the first chunk). */                                                        \
            float chunk_best = fmaxf(best, block_max(local_max, scratch));                                     \
            float rescale = expf(best - chunk_best);                                                           \
            best = chunk_best;                                                                                 \
            float local_sum = 0.f;                                                                             \
            for (int s = from + threadIdx.x; s < to; s += blockDim.x) {                                        \
                float p = expf(probs[s - from] - best);                                                        \
                probs[s - from] = p;                                                                           \
                local_sum += p;                                                                                \
            }                                                                                                  \
            total = total * rescale + block_sum(local_sum, scratch);                                           \
            sum.x *= rescale; sum.y *= rescale; sum.z *= rescale; sum.w *= rescale;                            \
            if (first < strides)                                                                               \
                for (int s = from + first; s < to; s += strides) {                                             \
                    float p = probs[s - from];                                                                 \
                    float4 v = load_kv4(values + s * key_stride);                                              \
                    sum.x += p * v.x; sum.y += p * v.y; sum.z += p * v.z; sum.w += p * v.w;                    \
                }                                                                                              \
            __syncthreads();                                             /* probs is rewritten by the next chunk */ \
        }                                                                                                      \
        if (first < strides) reinterpret_cast<float4*>(scratch)[threadIdx.x] = sum;   /* [strides, Dv] */      \
        __syncthreads();                                                                                       \
        for (int d = threadIdx.x; d < head_dim_v; d += blockDim.x) {                                           \
            float value = 0.f;                                                                                 \
            for (int r = 0; r < strides; r++) value += scratch[r * head_dim_v + d];                            \
            acc[part * head_dim_v + d] = value;                                                                \
        }                                                                                                      \
        if (threadIdx.x == 0) { max_sum[2 * part] = best; max_sum[2 * part + 1] = total; }                     \
    }

FOR_EACH_KV_TYPE(DEFINE_ATTENTION_PARTIAL)

// Split-K causal attention of a few tokens over a long cache, first pass (flash-decoding). Grid (T, NKV·tiles,
// splits), blockDim ATTENTION_THREADS: a block takes one token, TILE query heads of one KV
// head's group (GQA: the group's NH/NKV heads in `tiles` tiles, the last one short) and one
// split of the token's cache rows [0, positions[t]], an equal share of them rounded up to whole
// ATTENTION_GRANULE rows (so the last splits may get fewer, or none). Each group of 32 threads
// walks every groups-th run of KEYS rows, a lane holding DPL dims of the rows' keys and values
// and of each head's query, so one read of a row serves all TILE heads. A run's TILE·KEYS
// partial dot products meet in one transposing reduction (lane_sums), after which each lane
// holds one (head, row) score and keeps its head's running max and sum; every lane then takes
// each score's weight to update its dims of each head's output. The block's groups meet in
// shared memory at the end. Writes each head's unnormalised output acc [T, NH, splits, Dv] and
// its (max, sum) [T, NH, splits, 2], (-inf, 0) for a split with no rows.
// Before the wait, the split's rows the steps before wrote (all but those of this step's tokens,
// from positions[0]) are fetched into L2.
#define ATTENTION_RUN_BYTES 32      // bytes of f32 key each lane holds per run: KEYS = this / (4·DPL)

// The sums over a group of 32 lanes of N values each lane holds (N a power of two <= 32):
// lane l gets the sum of value l / (32 / N). Each level of the butterfly halves the values a lane
// still carries (it keeps one half, adds its partner's other half), so the reduction takes
// N - 1 + log2(32 / N) shuffles instead of 5·N.
template <int N> __device__ __forceinline__ float lane_sums(float (&values)[N], int lane) {
    int offset = 16;
#pragma unroll
    for (int half = N / 2; half >= 1; half /= 2, offset /= 2) {
        bool upper = lane & offset;
#pragma unroll
        for (int k = 0; k < half; k++) {
            float send = upper ? values[k] : values[k + half], keep = upper ? values[k + half] : values[k];
            values[k] = keep + SHFL_XOR(send, offset, 32);
        }
    }
    float sum = values[0];
    for (; offset >= 1; offset /= 2) sum += SHFL_XOR(sum, offset, 32);
    return sum;
}

// N (2, 4 or 8) consecutive cache elements, aligned to N of them, as floats; zeros where `live` is false.
template <int N> __device__ __forceinline__ void load_floats(const float* p, bool live, float (&out)[N]) {
    if constexpr (N == 2) {
        float2 a = live ? *reinterpret_cast<const float2*>(p) : make_float2(0.f, 0.f);
        out[0] = a.x; out[1] = a.y;
    } else {
#pragma unroll
        for (int j = 0; j < N; j += 4) {
            float4 a = live ? *reinterpret_cast<const float4*>(p + j) : make_float4(0.f, 0.f, 0.f, 0.f);
            out[j] = a.x; out[j + 1] = a.y; out[j + 2] = a.z; out[j + 3] = a.w;
        }
    }
}
template <int N> __device__ __forceinline__ void load_floats(const __half* p, bool live, float (&out)[N]) {
    u32 bits[N / 2];
    if constexpr (N == 2) {
        bits[0] = live ? *reinterpret_cast<const u32*>(p) : 0u;
    } else if constexpr (N == 4) {
        uint2 a = live ? *reinterpret_cast<const uint2*>(p) : make_uint2(0u, 0u);
        bits[0] = a.x; bits[1] = a.y;
    } else {
        uint4 a = live ? *reinterpret_cast<const uint4*>(p) : make_uint4(0u, 0u, 0u, 0u);
        bits[0] = a.x; bits[1] = a.y; bits[2] = a.z; bits[3] = a.w;
    }
#pragma unroll
    for (int j = 0; j < N / 2; j++) {
        out[2 * j] = half_bits_to_float((u16)bits[j]);
        out[2 * j + 1] = half_bits_to_float((u16)(bits[j] >> 16));
    }
}

template <typename KV, int TILE, int DPL>
__device__ __forceinline__ void attend_split(const float* __restrict__ q, const KV* __restrict__ k_cache,
                                             const KV* __restrict__ v_cache, int t, int kv_head, int first_head,
                                             int heads, int n_heads, int n_kv_heads, int head_dim, int head_dim_v,
                                             float scale, int begin, int end, float* __restrict__ acc,
                                             float* __restrict__ max_sum) {
    constexpr int KEYS = ATTENTION_RUN_BYTES / (4 * DPL) > 0 ? ATTENTION_RUN_BYTES / (4 * DPL) : 1;  // rows a run
    constexpr int SCORES = TILE * KEYS, SPREAD = 32 / SCORES;        // a run's scores, lanes holding each
    constexpr int HEAD_LANES = 32 / TILE;                            // lanes holding one head's scores
    constexpr int GROUPS = ATTENTION_THREADS / 32;
    static_assert(SCORES <= 32 && 32 % SCORES == 0, "a run's scores spread over the 32 lanes of a group");
    __shared__ float2 group_max_sum[GROUPS][TILE];                   // each group's (max, sum) per head
    __shared__ float partial[GROUPS][TILE][32 * DPL];                // each group's output per head
    int split = blockIdx.z, splits = gridDim.z;
    int lane = threadIdx.x % 32, group = threadIdx.x / 32, d0 = lane * DPL;
    int score_slot = lane / SPREAD, my_key = score_slot % KEYS;      // slot: head-major (head · KEYS + row)
    bool has_k = d0 < head_dim, has_v = d0 < head_dim_v;
    float query[TILE][DPL], out[TILE][DPL];
#pragma unroll
    for (int i = 0; i < TILE; i++)
#pragma unroll
        for (int j = 0; j < DPL; j++) {
            bool live = i < heads && has_k;
            query[i][j] = live ? q[((long long)t * n_heads + first_head + i) * head_dim + d0 + j] * scale : 0.f;
            out[i][j] = 0.f;
        }
    float best = NEG_INF, total = 0.f;                               // of this lane's head (its slot's sum)
    long long key_stride = (long long)n_kv_heads * head_dim, value_stride = (long long)n_kv_heads * head_dim_v;
    const KV* keys = k_cache + (long long)kv_head * head_dim + d0;
    const KV* values = v_cache + (long long)kv_head * head_dim_v + d0;
    for (int run = begin + group * KEYS; run < end; run += GROUPS * KEYS) {
        float key[KEYS][DPL], value[KEYS][DPL], dots[SCORES];
#pragma unroll
        for (int u = 0; u < KEYS; u++) {
            bool live = run + u < end;                               // rows past the end may be NaN: never read
            load_floats<DPL>(keys + (run + u) * key_stride, live && has_k, key[u]);
            load_floats<DPL>(values + (run + u) * value_stride, live && has_v, value[u]);
        }
#pragma unroll
        for (int i = 0; i < TILE; i++)
#pragma unroll
            for (int u = 0; u < KEYS; u++) {
                float dot = 0.f;
#pragma unroll
                for (int j = 0; j < DPL; j++) dot += query[i][j] * key[u][j];
                dots[i * KEYS + u] = dot;
            }
        float score = lane_sums<SCORES>(dots, lane);
        score = run + my_key < end ? score : NEG_INF;
        float run_best = fmaxf(best, group_max(score, HEAD_LANES));  // row u = 0 is live: finite
        float rescale = __expf(best - run_best), weight = __expf(score - run_best);   // e^-inf = 0
        best = run_best;
        total = total * rescale + weight;
#pragma unroll
        for (int i = 0; i < TILE; i++) {
            float head_rescale = SHFL(rescale, i * HEAD_LANES, 32);
#pragma unroll
            for (int j = 0; j < DPL; j++) out[i][j] *= head_rescale;
#pragma unroll
            for (int u = 0; u < KEYS; u++) {
                float p = SHFL(weight, (i * KEYS + u) * SPREAD, 32);
#pragma unroll
                for (int j = 0; j < DPL; j++) out[i][j] += p * value[u][j];
            }
        }
    }
    float head_total = group_sum(lane % SPREAD == 0 ? total : 0.f, HEAD_LANES);   // each slot once
    if (lane % HEAD_LANES == 0) group_max_sum[group][lane / HEAD_LANES] = make_float2(best, head_total);
#pragma unroll
    for (int i = 0; i < TILE; i++)
#pragma unroll
        for (int j = 0; j < DPL; j++) partial[group][i][d0 + j] = out[i][j];
    __syncthreads();
    for (int o = threadIdx.x; o < heads * head_dim_v; o += blockDim.x) {     // each (head, dim) of the tile
        int i = o / head_dim_v, d = o % head_dim_v;
        float block_best = NEG_INF, sum = 0.f;
        for (int g = 0; g < GROUPS; g++) block_best = fmaxf(block_best, group_max_sum[g][i].x);
        for (int g = 0; g < GROUPS; g++)                             // a group that saw no rows adds nothing
            if (group_max_sum[g][i].x > NEG_INF) sum += __expf(group_max_sum[g][i].x - block_best) * partial[g][i][d];
        acc[(((long long)t * n_heads + first_head + i) * splits + split) * head_dim_v + d] = sum;
    }
    for (int i = threadIdx.x; i < heads; i += blockDim.x) {
        float block_best = NEG_INF, block_total = 0.f;
        for (int g = 0; g < GROUPS; g++) block_best = fmaxf(block_best, group_max_sum[g][i].x);
        for (int g = 0; g < GROUPS; g++)
            if (group_max_sum[g][i].x > NEG_INF) block_total += __expf(group_max_sum[g][i].x - block_best) * group_max_sum[g][i].y;
        long long part = ((long long)t * n_heads + first_head + i) * splits + split;
        max_sum[2 * part] = block_best;
        max_sum[2 * part + 1] = block_total;
    }
}

// One kernel per cache type, head tile (1, 4 or 8 query heads) and dims per lane (2, 4 or 8:
// head dims up to 64, 128, 256), attention_decode_<KV>_<TILE>_<DPL>; no 8-head tile of 8 dims,
// whose registers would spill (backend.py's decode_attention_kernel picks among these).
#define DEFINE_ATTENTION_DECODE(KV, TILE, DPL)                                                                 \
    extern "C" __global__ void __launch_bounds__(ATTENTION_THREADS, 2)                                         \
    attention_decode_##KV##_##TILE##_##DPL(                                                                    \
            const float* __restrict__ q, const kv_##KV* __restrict__ k_cache, const kv_##KV* __restrict__ v_cache, \
            const int* __restrict__ positions, int n_heads, int n_kv_heads, int head_dim, int head_dim_v,      \
            float scale, float* __restrict__ acc, float* __restrict__ max_sum) {                               \
        int t = blockIdx.x, group_size = n_heads / n_kv_heads, tiles = (group_size + TILE - 1) / TILE;         \
        int kv_head = blockIdx.y / tiles, tile_start = (blockIdx.y % tiles) * TILE;                            \
        int first_head = kv_head * group_size + tile_start, heads = min(TILE, group_size - tile_start);        \
        int2 rows = split_rows(load_from_l2(positions + t) + 1, blockIdx.z, gridDim.z);                        \
        prefetch_rows(k_cache, v_cache, kv_head, n_kv_heads, head_dim, head_dim_v, rows.x,                     \
                      min(rows.y, load_from_l2(positions)));                /* rows before this step's */      \
        wait_for_previous_grid();                                                                              \
        if (rows.x >= rows.y) {                                                                                \
            long long part = ((long long)t * n_heads + first_head) * gridDim.z + blockIdx.z;                   \
            for (int i = threadIdx.x; i < heads; i += blockDim.x) {                                            \
                max_sum[2 * (part + i * gridDim.z)] = NEG_INF; max_sum[2 * (part + i * gridDim.z) + 1] = 0.f;  \
            }                                                                                                  \
            return;                                                                                            \
        }                                                                                                      \
        attend_split<kv_##KV, TILE, DPL>(q, k_cache, v_cache, t, kv_head, first_head, heads, n_heads,          \
                                         n_kv_heads, head_dim, head_dim_v, scale, rows.x, rows.y, acc, max_sum); \
    }

#define DEFINE_ATTENTION_DECODE_TILES(KV) \
    DEFINE_ATTENTION_DECODE(KV, 1, 2) DEFINE_ATTENTION_DECODE(KV, 1, 4) DEFINE_ATTENTION_DECODE(KV, 1, 8) \
    DEFINE_ATTENTION_DECODE(KV, 4, 2) DEFINE_ATTENTION_DECODE(KV, 4, 4) DEFINE_ATTENTION_DECODE(KV, 4, 8) \
    DEFINE_ATTENTION_DECODE(KV, 8, 2) DEFINE_ATTENTION_DECODE(KV, 8, 4)

FOR_EACH_KV_TYPE(DEFINE_ATTENTION_DECODE_TILES)

// Second pass: out[t, h*Dv + d] = Σ_c e^(m_c - M) acc_c[d] / Σ_c e^(m_c - M) l_c over the splits
// that saw rows (m_c > -inf), and in 8-bit planes into q, ds when q is given (Dv a multiple of 32).
// Grid (T, NH), blockDim a multiple of 32; each thread reads every split's (max, sum) (no block
// reduction: its barriers cost more than a few dozen loads that hit in L1).
extern "C" __global__ void attention_combine(const float* __restrict__ acc, const float* __restrict__ max_sum,
                                             int splits, int n_heads, int head_dim_v, float* __restrict__ out,
                                             int4* __restrict__ q, float2* __restrict__ ds) {
    wait_for_previous_grid();
    int t = blockIdx.x, head = blockIdx.y;
    const float2* parts = reinterpret_cast<const float2*>(max_sum) + ((long long)t * n_heads + head) * splits;
    float best = NEG_INF;      // every thread over all splits (at most a wave over the heads: a few dozen)
#pragma unroll 4
    for (int c = 0; c < splits; c++) best = fmaxf(best, parts[c].x);
    float denominator = 0.f;
#pragma unroll 4
    for (int c = 0; c < splits; c++)
        if (parts[c].x > NEG_INF) denominator += expf(parts[c].x - best) * parts[c].y;
    const float* head_acc = acc + ((long long)t * n_heads + head) * splits * head_dim_v;
    for (int start = 0; start < head_dim_v; start += blockDim.x) {
        int d = start + threadIdx.x;
        if (d - threadIdx.x % UNIT >= head_dim_v) break;      // the whole warp is past the head
        float sum = 0.f;
        for (int c = 0; c < splits && d < head_dim_v; c++)
            if (parts[c].x > NEG_INF) sum += expf(parts[c].x - best) * head_acc[(long long)c * head_dim_v + d];
        long long at = ((long long)t * n_heads + head) * head_dim_v + d;
        if (d < head_dim_v) out[at] = sum / denominator;
        if (q) quantize_unit_of_warp(sum / denominator, at / UNIT, q, ds);
    }
}

// K or V rows [first, first + S) of the cache [.., NKV, D] -> [NH, S, D] in f32, each query head
// getting its KV head's rows (GQA), for the batched products of prefill attention. One thread per
// 4 values.
#define DEFINE_EXPAND_KV_HEADS(KV)                                                                             \
    extern "C" __global__ void expand_kv_heads_##KV(const kv_##KV* __restrict__ cache, int first,              \
                                                    int n_positions, int n_kv_heads, int n_heads, int head_dim, \
                                                    float* __restrict__ out) {                                 \
        wait_for_previous_grid();                                                                              \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                        \
        int quads = head_dim / 4;                                                                              \
        if (i >= (long long)n_heads * n_positions * quads) return;                                             \
        int quad = (int)(i % quads);                                                                           \
        long long s = first + (i / quads) % n_positions;                                                       \
        int head = (int)(i / ((long long)quads * n_positions));                                                \
        int kv_head = head / (n_heads / n_kv_heads);                                                           \
        reinterpret_cast<float4*>(out)[i] = load_kv4(cache + (s * n_kv_heads + kv_head) * head_dim + 4 * quad); \
    }

FOR_EACH_KV_TYPE(DEFINE_EXPAND_KV_HEADS)

// A prefill chunk's scores over one block of the cache, [NH, T, W] in place, for attention's
// running softmax (flash attention by blocks): row (h, t) scaled and cut after position
// positions[t] (the block starts at position `first`), its exponentials e^(score - largest so far)
// left in place; the row's largest score and sum of exponentials so far (running [NH·T, 2]) brought
// up to date, and its output so far (out [T, NH·Dv], the sums of e^(score - largest) · v) rescaled
// to the new largest before the block's p·v adds to it.
extern "C" __global__ void causal_softmax_block(float* __restrict__ scores, const int* __restrict__ positions,
                                                int n_tokens, int first, int width, float scale,
                                                float* __restrict__ running, float* __restrict__ out, int n_heads,
                                                int head_dim_v) {
    wait_for_previous_grid();
    __shared__ float scratch[1024];
    int t = blockIdx.x % n_tokens, head = blockIdx.x / n_tokens;
    float* row = scores + (long long)blockIdx.x * width;
    int last = min(positions[t] - first, width - 1);       // the row sees the block's [0, last]
    float local_max = NEG_INF;
    for (int s = threadIdx.x; s <= last; s += blockDim.x) local_max = fmaxf(local_max, row[s] * scale);
    float earlier = running[2 * blockIdx.x], top = fmaxf(earlier, block_max(local_max, scratch));
    float local_sum = 0.f;
    for (int s = threadIdx.x; s < width; s += blockDim.x) {
        float p = s <= last ? expf(row[s] * scale - top) : 0.f;
        row[s] = p;
        local_sum += p;
    }
    float total = block_sum(local_sum, scratch);
    float correction = earlier == NEG_INF ? 0.f : expf(earlier - top);     // nothing seen before: nothing kept
    float* acc = out + ((long long)t * n_heads + head) * head_dim_v;
    for (int i = threadIdx.x; i < head_dim_v; i += blockDim.x) acc[i] *= correction;
    if (threadIdx.x == 0) {
        running[2 * blockIdx.x] = top;
        running[2 * blockIdx.x + 1] = running[2 * blockIdx.x + 1] * correction + total;
    }
}

// out [T, NH·Dv] /= each row's sum of exponentials (running [NH·T, 2]): the softmax's division,
// once the last block is in.
extern "C" __global__ void attention_divide(float* __restrict__ out, const float* __restrict__ running,
                                            int n_tokens, int n_heads, int head_dim_v, long long n) {
    wait_for_previous_grid();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int head = (int)(i / head_dim_v % n_heads), t = (int)(i / ((long long)head_dim_v * n_heads));
    out[i] /= running[2 * ((long long)head * n_tokens + t) + 1];
}
