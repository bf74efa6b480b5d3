// The work of a layer around its products, for a CPU parent: rms_norm, the per-head q/k norms
// with rope and the KV cache append, causal attention over the cache, and the router's
// softmax and top-K. The same math as moerun/backends/numpy_ops.py, in float32, in few calls.
// The sums run in vectors of LANES floats, and the hot functions are built for AVX-512 and AVX2
// beside the baseline, chosen at load (x86-64).
//
// Shape legend: T tokens, S cached positions, n a row's values, NH/NKV heads, D/Dv head dims,
// E experts, K experts per token.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "work.h"

#define LANES 16

// The helpers are inlined into each build of the functions that call them.
#define INLINE static inline __attribute__((always_inline))
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VECTORIZED __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTORIZED
#endif

// A vector of LANES floats (GCC and Clang vector extensions): one register in the AVX-512
// build, two or four in the others.
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(float))));
typedef float half_vf __attribute__((vector_size(LANES * sizeof(float) / 2)));

INLINE void load(vf* v, const float* p) { memcpy(v, p, sizeof *v); }

// The lanes' sum, folded in halves.
INLINE float fold(const vf* v) {
    half_vf low, high;
    memcpy(&low, v, sizeof low);
    memcpy(&high, (const char*)v + sizeof low, sizeof high);
    low += high;
    float lanes[LANES / 2], total = 0;
    memcpy(lanes, &low, sizeof lanes);
    for (int l = 0; l < LANES / 2; l++) total += lanes[l];
    return total;
}

INLINE float dot(const float* a, const float* b, int64_t n) {
    vf sums = {0}, x, y;
    float rest = 0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        load(&x, a + i);
        load(&y, b + i);
        sums += x * y;
    }
    for (; i < n; i++) rest += a[i] * b[i];
    return fold(&sums) + rest;
}

// q [n] · each of 4 rows of b, `stride` apart, into out[4]: four independent sums at once.
INLINE void dot4(const float* q, const float* b, int64_t stride, int64_t n, float* out) {
    vf sums[4] = {{0}}, x, y;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        load(&x, q + i);
        for (int r = 0; r < 4; r++) {
            load(&y, b + r * stride + i);
            sums[r] += x * y;
        }
    }
    for (int r = 0; r < 4; r++) {
        float rest = 0;
        for (int64_t j = i; j < n; j++) rest += q[j] * b[r * stride + j];
        out[r] = fold(&sums[r]) + rest;
    }
}

// The largest of x [n] (-inf for none), and their sum.
INLINE float largest(const float* x, int64_t n) {
    vf tops, v;
    float top = -INFINITY, lanes[LANES];
    int64_t i = 0;
    for (int l = 0; l < LANES; l++) tops[l] = -INFINITY;
    for (; i + LANES <= n; i += LANES) {
        load(&v, x + i);
        vi above = v > tops;                                    // all bits set where v is larger
        tops = (vf)(((vi)v & above) | ((vi)tops & ~above));
    }
    memcpy(lanes, &tops, sizeof lanes);
    for (int l = 0; l < LANES; l++) top = lanes[l] > top ? lanes[l] : top;
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}

INLINE float sum(const float* x, int64_t n) {
    vf sums = {0}, v;
    float rest = 0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        load(&v, x + i);
        sums += v;
    }
    for (; i < n; i++) rest += x[i];
    return fold(&sums) + rest;
}

// e^x for x <= 0, within a few ulp (e^-87 below -87): x = n·ln2 + r with |r| <= ln2/2, e^r by
// its Taylor series to r^6, 2^n put into the exponent. Branch-free, so that its loops vectorize.
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float round = 0x1.8p23f;                  // adding it rounds to an integer
    float shifted = x * 1.44269504f + round, n = shifted - round;
    float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;         // ln2 in two parts, the first exact
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    int32_t bits;
    memcpy(&bits, &shifted, 4);
    bits = (bits - 0x4b400000 + 127) << 23;         // 2^n
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

// ---- rms_norm ---------------------------------------------------------------------------------

// out [T, n] = x / sqrt(mean(x²) + eps) · weight [n]; x's rows `stride` values apart.
VECTORIZED static void norm_rows(const float* x, int64_t stride, int64_t rows, int64_t n, const float* weight,
                                 float eps, float* out) {
    for (int64_t t = 0; t < rows; t++) {
        const float* row = x + t * stride;
        float root = sqrtf(dot(row, row, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) out[t * n + i] = row[i] / root * weight[i];
    }
}

void moe_rms_norm(const float* x, int64_t stride, int64_t rows, int64_t n, const float* weight, float eps,
                  float* out) {
    norm_rows(x, stride, rows, n, weight, eps, out);
}

// ---- q/k norms, rope, the cache append ------------------------------------------------------

// x [heads, D] rotated by cos, sin [D/2] into out: the two halves of D (neox) or adjacent pairs.
VECTORIZED static void rotate(const float* x, int64_t heads, int64_t dim, int neox, const float* cos,
                              const float* sin, float* out) {
    int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++, x += dim, out += dim) {
        if (neox) {
            for (int64_t i = 0; i < half; i++) {
                out[i] = x[i] * cos[i] - x[half + i] * sin[i];
                out[half + i] = x[half + i] * cos[i] + x[i] * sin[i];
            }
        } else {
            for (int64_t i = 0; i < half; i++) {
                out[2 * i] = x[2 * i] * cos[i] - x[2 * i + 1] * sin[i];
                out[2 * i + 1] = x[2 * i] * sin[i] + x[2 * i + 1] * cos[i];
            }
        }
    }
}

// One token's q or k [heads, D]: normed per head where `norm` is given (into `normed`), then
// rotated into out.
static void norm_rotate(const struct moe_attention* shape, const float* x, int64_t heads, const float* norm,
                        const float* cos, const float* sin, float* normed, float* out) {
    int64_t dim = shape->head_dim_k;
    if (norm) {
        norm_rows(x, dim, heads, dim, norm, shape->eps, normed);
        x = normed;
    }
    rotate(x, heads, dim, (int)shape->rope_neox, cos, sin, out);
}

int moe_rope_append(const struct moe_attention* shape, int64_t n_tokens, const float* q, const float* k,
                    const float* v, int64_t q_stride, int64_t k_stride, int64_t v_stride, const float* q_norm,
                    const float* k_norm, const float* cos, const float* sin, float* k_cache, float* v_cache,
                    float* q_out) {
    int64_t nh = shape->n_heads, nkv = shape->n_kv_heads, dim = shape->head_dim_k, dim_v = shape->head_dim_v;
    float* normed = malloc((size_t)nh * dim * sizeof(float));
    if (!normed) return MOE_NO_MEMORY;
    for (int64_t t = 0; t < n_tokens; t++) {
        const float* cos_t = cos + t * (dim / 2);
        const float* sin_t = sin + t * (dim / 2);
        norm_rotate(shape, k + t * k_stride, nkv, k_norm, cos_t, sin_t, normed, k_cache + t * nkv * dim);
        memcpy(v_cache + t * nkv * dim_v, v + t * v_stride, (size_t)nkv * dim_v * sizeof(float));
        norm_rotate(shape, q + t * q_stride, nh, q_norm, cos_t, sin_t, normed, q_out + t * nh * dim);
    }
    free(normed);
    return MOE_OK;
}

// ---- attention ----------------------------------------------------------------------------------

#define ATTENTION_BLOCK 16      // tokens of a prefill attention task
#define BLOCK_TOKENS_LEAST 16   // chunks of at least this many tokens go by blocks

// Floats of one thread's scratch for blocks over `seen` positions, in whole cache lines: ids
// [R] (int64, first), keys [S, D], values [Dv, S], scores [R, S], outs [R, Dv] for
// R = ATTENTION_BLOCK · G.
static int64_t block_scratch(const struct moe_attention* shape, int64_t seen) {
    int64_t rows = ATTENTION_BLOCK * shape->n_heads / shape->n_kv_heads;
    int64_t floats = 2 * rows + seen * (shape->head_dim_k + shape->head_dim_v + rows) + rows * shape->head_dim_v;
    return (floats + 15) / 16 * 16;
}

struct attention_job {
    const struct moe_attention* shape;
    const float* q;             // [T, NH, D]
    int64_t n_tokens, start;
    const float *keys, *values; // [S, NKV, D], [S, NKV, Dv]
    float* out;                 // [T, NH * Dv]
    float* scores;              // each thread's scratch: [G, S], or block_scratch floats
};

// One token's G = NH/NKV query heads that read kv head `kv`, over positions 0..n-1: each key
// and value row is read once for all of them. probs [G, `seen`] is this thread's.
INLINE void attend_group(const struct attention_job* job, int64_t t, int64_t kv, float* probs) {
    const struct moe_attention* shape = job->shape;
    int64_t nh = shape->n_heads, nkv = shape->n_kv_heads, dim = shape->head_dim_k, dim_v = shape->head_dim_v;
    int64_t group = nh / nkv, seen = job->start + job->n_tokens, n = job->start + t + 1;
    const float* q = job->q + (t * nh + kv * group) * dim;                       // [G, D]
    const float* keys = job->keys + kv * dim;                                     // rows nkv * dim apart
    const float* values = job->values + kv * dim_v;                               // rows nkv * dim_v apart
    float* out = job->out + (t * nh + kv * group) * dim_v;                        // [G, Dv]
    for (int64_t s = 0; s < n; s++) {
        const float* key = keys + s * nkv * dim;
        float four[4];
        int64_t g = 0;
        for (; g + 4 <= group; g += 4) {
            dot4(key, q + g * dim, dim, dim, four);
            for (int r = 0; r < 4; r++) probs[(g + r) * seen + s] = four[r];
        }
        for (; g < group; g++) probs[g * seen + s] = dot(key, q + g * dim, dim);
    }
    for (int64_t g = 0; g < group; g++) {
        float* p = probs + g * seen;
        for (int64_t s = 0; s < n; s++) p[s] *= shape->scale;
        float top = largest(p, n);
        for (int64_t s = 0; s < n; s++) p[s] = exp_nonpositive(p[s] - top);
        float total = sum(p, n);
        for (int64_t s = 0; s < n; s++) p[s] /= total;
    }
    memset(out, 0, (size_t)(group * dim_v) * sizeof(float));
    int64_t s = 0;
    for (; s + 4 <= n; s += 4) {
        const float* v0 = values + s * nkv * dim_v;
        const float *v1 = v0 + nkv * dim_v, *v2 = v1 + nkv * dim_v, *v3 = v2 + nkv * dim_v;
        for (int64_t g = 0; g < group; g++) {
            const float* p = probs + g * seen + s;
            float* o = out + g * dim_v;
            for (int64_t i = 0; i < dim_v; i++) o[i] += p[0] * v0[i] + p[1] * v1[i] + p[2] * v2[i] + p[3] * v3[i];
        }
    }
    for (; s < n; s++)
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < dim_v; i++) out[g * dim_v + i] += probs[g * seen + s] * values[s * nkv * dim_v + i];
}

// Task t · NKV + kv: token t's query heads over kv head kv.
VECTORIZED static void attend_task(void* context, int64_t task, int64_t next, int thread) {
    (void)next;
    const struct attention_job* job = context;
    int64_t nkv = job->shape->n_kv_heads, group = job->shape->n_heads / nkv;
    attend_group(job, task / nkv, task % nkv, job->scores + thread * group * (job->start + job->n_tokens));
}

// A prefill chunk: ATTENTION_BLOCK tokens' query heads of one kv head a task, q·kᵀ and p·v as
// products of float32 panels (the instruction set's `multiply`, as moe_matmul's): the keys the
// block sees copied [n, D], the values transposed [Dv, n], so that the queries and then the
// probabilities are the products' tokens. A token's scores past its position are computed
// (within its block) and weigh nothing. Rows are the block's (token t, query head g), t·G + g.
// Tasks take the last blocks first: they see the most positions.
VECTORIZED static void attend_block_task(void* context, int64_t task, int64_t next, int thread) {
    (void)next;
    const struct attention_job* job = context;
    const struct moe_attention* shape = job->shape;
    int64_t nh = shape->n_heads, nkv = shape->n_kv_heads, dim = shape->head_dim_k, dim_v = shape->head_dim_v;
    int64_t group = nh / nkv, kv = task % nkv, blocks = (job->n_tokens + ATTENTION_BLOCK - 1) / ATTENTION_BLOCK;
    int64_t first = (blocks - 1 - task / nkv) * ATTENTION_BLOCK;
    int64_t tokens = job->n_tokens - first < ATTENTION_BLOCK ? job->n_tokens - first : ATTENTION_BLOCK;
    int64_t rows = tokens * group, n = job->start + first + tokens;          // the block's last token's positions
    int64_t* ids = (int64_t*)(job->scores + thread * block_scratch(shape, job->start + job->n_tokens));
    float* keys = (float*)(ids + rows);                                      // [n, D]; ids [R]: q rows, then 0..R-1
    float* values = keys + n * dim;                                          // [Dv, n]
    float* scores = values + dim_v * n;                                      // [R, n]
    float* outs = scores + rows * n;                                         // [R, Dv]
    for (int64_t s = 0; s < n; s++) memcpy(keys + s * dim, job->keys + (s * nkv + kv) * dim, (size_t)dim * sizeof(float));
    for (int64_t from = 0; from < n; from += LANES)                          // LANES rows at a time stay in L1
        for (int64_t i = 0; i < dim_v; i++)
            for (int64_t s = from; s < from + LANES && s < n; s++) values[i * n + s] = job->values[(s * nkv + kv) * dim_v + i];
    for (int64_t r = 0; r < rows; r++) ids[r] = (first + r / group) * nh + kv * group + r % group;
    const struct isa_kernels* isa = current_isa();
    struct panel products = {.w = keys, .rows = n, .x = job->q, .n = dim, .chunk = dim, .out = scores, .stride = n};
    isa->multiply(&products, ids, rows);
    for (int64_t r = 0; r < rows; r++) {
        float* p = scores + r * n;
        int64_t seen = job->start + first + r / group + 1;                   // this row's token's positions
        for (int64_t s = 0; s < seen; s++) p[s] *= shape->scale;
        float top = largest(p, seen);
        for (int64_t s = 0; s < seen; s++) p[s] = exp_nonpositive(p[s] - top);
        float total = sum(p, seen);
        for (int64_t s = 0; s < seen; s++) p[s] /= total;
        for (int64_t s = seen; s < n; s++) p[s] = 0.f;
        ids[r] = r;
    }
    products = (struct panel){.w = values, .rows = dim_v, .x = scores, .n = n, .chunk = n, .out = outs, .stride = dim_v};
    isa->multiply(&products, ids, rows);
    for (int64_t r = 0; r < rows; r++)
        memcpy(job->out + ((first + r / group) * nh + kv * group + r % group) * dim_v, outs + r * dim_v,
               (size_t)dim_v * sizeof(float));
}

int moe_attention(const struct moe_attention* shape, const float* q, int64_t n_tokens, int64_t start,
                  const float* keys, const float* values, float* out, int threads) {
    static float* scores;       // grown as needed, under the kernels' lock
    static size_t scores_size;
    int64_t seen = start + n_tokens, group = shape->n_heads / shape->n_kv_heads;
    int blocks = n_tokens >= BLOCK_TOKENS_LEAST;
    threads = threads_for(threads, (double)n_tokens * seen * shape->n_heads * (shape->head_dim_k + shape->head_dim_v));
    size_t wanted = (size_t)threads * (blocks ? block_scratch(shape, seen) : group * seen) * sizeof(float);
    lock_kernels();
    if (wanted > scores_size) {
        free(scores);
        scores = malloc(wanted);
        scores_size = scores ? wanted : 0;
    }
    int status = scores ? MOE_OK : MOE_NO_MEMORY;
    if (scores) {
        struct attention_job job = {shape, q, n_tokens, start, keys, values, out, scores};
        if (blocks)
            pool_run(threads, (n_tokens + ATTENTION_BLOCK - 1) / ATTENTION_BLOCK * shape->n_kv_heads, attend_block_task,
                     &job);
        else
            pool_run(threads, n_tokens * shape->n_kv_heads, attend_task, &job);
    }
    unlock_kernels();
    return status;
}

// ---- routing -----------------------------------------------------------------------------------

// One token's logits [E] -> its K most probable experts (ties to the lower id) and their
// probabilities, rescaled to sum to 1 where `renormalize`.
static void top_experts(const float* logits, int64_t n_experts, int64_t k, int renormalize, float* probs,
                        int64_t* ids, float* weights) {
    float top = -INFINITY, total = 0, kept = 0;
    for (int64_t e = 0; e < n_experts; e++) top = logits[e] > top ? logits[e] : top;
    for (int64_t e = 0; e < n_experts; e++) total += probs[e] = expf(logits[e] - top);
    for (int64_t e = 0; e < n_experts; e++) probs[e] /= total;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n_experts; e++)
            if (probs[e] >= 0 && (best < 0 || probs[e] > probs[best])) best = e;
        ids[j] = best;
        kept += weights[j] = probs[best];
        probs[best] = -1;       // taken
    }
    if (renormalize)
        for (int64_t j = 0; j < k; j++) weights[j] /= kept;
}

int moe_route(const struct moe_matrix* router, const float* x, int64_t n_tokens, const float* norm, float eps,
              int64_t k, int renormalize, float* h, int64_t* ids, float* weights, int threads) {
    int64_t hidden = router->cols, n_experts = router->rows;
    if (k < 1 || k > n_experts) return MOE_BAD_SHAPE;
    float* logits = malloc((size_t)(n_tokens + 1) * n_experts * sizeof(float));     // and one token's probs
    if (!logits) return MOE_NO_MEMORY;
    norm_rows(x, hidden, n_tokens, hidden, norm, eps, h);
    int status = moe_matmul(router, 1, h, n_tokens, logits, threads);
    for (int64_t t = 0; status == MOE_OK && t < n_tokens; t++)
        top_experts(logits + t * n_experts, n_experts, k, renormalize, logits + n_tokens * n_experts, ids + t * k,
                    weights + t * k);
    free(logits);
    return status;
}
