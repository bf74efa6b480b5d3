// The work of a layer around its products, for a CPU parent: rms_norm, the per-head q/k norms
// with rope and the KV cache append, and the router's softmax and top-K (attention:
// attention.c). The same math as moerun/backends/numpy_ops.py, in float32, in few calls, in
// vectors of LANES floats (lanes.h).
//
// Shape legend: T tokens, S cached positions, n a row's values, NH/NKV heads, D/Dv head dims,
// E experts, K experts per token.
#include <stdlib.h>

#include "lanes.h"
#include "pool.h"
#include "work.h"

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

// Jobs of tokens in blocks, a block a task (rope_append's, the router's): where task `task` of
// blocks of `per_task` tokens ends, and the threads a job of `tasks` blocks and about `work`
// multiply-adds takes (at most one a block).
static int64_t block_end(int64_t task, int64_t per_task, int64_t n_tokens) {
    return (task + 1) * per_task < n_tokens ? (task + 1) * per_task : n_tokens;
}

static int block_threads(int threads, int64_t tasks, double work) {
    return threads_for(threads < tasks ? threads : (int)tasks, work, 0);
}

// A rope_append task: ROPE_TOKENS tokens, a thread's scratch for their heads.
#define ROPE_TOKENS 8

struct rope_job {
    const struct moe_attention* shape;
    int64_t n_tokens;
    const float *q, *k, *v;
    int64_t q_stride, k_stride, v_stride;
    const float *q_norm, *k_norm, *cos, *sin;
    uint8_t *k_cache, *v_cache;
    float* q_out;
    int key_type, value_type;
    int64_t key_bytes, value_bytes;
    float* scratch;            // [threads, NH + NKV, D]: a token's normed heads, then its rotated keys
};

static void rope_task(void* context, int64_t task, int64_t next, int thread) {
    (void)next;
    const struct rope_job* job = context;
    const struct moe_attention* shape = job->shape;
    int64_t nh = shape->n_heads, nkv = shape->n_kv_heads, dim = shape->head_dim_k, dim_v = shape->head_dim_v;
    float* normed = job->scratch + thread * (nh + nkv) * dim;               // [NH, D]
    float* rotated = normed + nh * dim;                                       // [NKV, D]
    for (int64_t t = task * ROPE_TOKENS; t < block_end(task, ROPE_TOKENS, job->n_tokens); t++) {
        const float* cos_t = job->cos + t * (dim / 2);
        const float* sin_t = job->sin + t * (dim / 2);
        norm_rotate(shape, job->k + t * job->k_stride, nkv, job->k_norm, cos_t, sin_t, normed, rotated);
        for (int64_t h = 0; h < nkv; h++) {
            quantize_row(job->key_type, rotated + h * dim, dim, job->k_cache + (t * nkv + h) * job->key_bytes);
            quantize_row(job->value_type, job->v + t * job->v_stride + h * dim_v, dim_v,
                         job->v_cache + (t * nkv + h) * job->value_bytes);
        }
        float* q_out = job->q_out + t * nh * dim;
        norm_rotate(shape, job->q + t * job->q_stride, nh, job->q_norm, cos_t, sin_t, normed, q_out);
    }
}

int moe_rope_append(const struct moe_attention* shape, int64_t n_tokens, const float* q, const float* k,
                    const float* v, int64_t q_stride, int64_t k_stride, int64_t v_stride, const float* q_norm,
                    const float* k_norm, const float* cos, const float* sin, uint8_t* k_cache, uint8_t* v_cache,
                    float* q_out, int threads) {
    int64_t nh = shape->n_heads, nkv = shape->n_kv_heads, dim = shape->head_dim_k, dim_v = shape->head_dim_v;
    int key_type = cache_type(shape->key_type), value_type = cache_type(shape->value_type);
    if (key_type < 0 || value_type < 0) return MOE_UNSUPPORTED_TYPE;
    if (dim % TYPES[key_type].block_values || dim_v % TYPES[value_type].block_values) return MOE_BAD_SHAPE;
    int64_t tasks = (n_tokens + ROPE_TOKENS - 1) / ROPE_TOKENS;
    threads = block_threads(threads, tasks, (double)n_tokens * (nh + 2 * nkv) * dim * 4);
    float* scratch = malloc((size_t)threads * (nh + nkv) * dim * sizeof(float));
    if (!scratch) return MOE_NO_MEMORY;
    struct rope_job job = {shape, n_tokens, q, k, v, q_stride, k_stride, v_stride, q_norm, k_norm, cos, sin,
                           k_cache, v_cache, q_out, key_type, value_type, bytes_of(key_type, dim),
                           bytes_of(value_type, dim_v), scratch};
    lock_kernels();
    pool_run(threads, tasks, rope_task, &job);
    unlock_kernels();
    free(scratch);
    return MOE_OK;
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

// A routing task: ROUTE_TOKENS tokens' rows normed (before the router's product) or their top
// experts chosen (after it), a thread's probabilities [E] as scratch.
#define ROUTE_TOKENS 16

struct route_job {
    const float* x;
    int64_t n_tokens, hidden, n_experts, k;
    const float* norm;
    float eps;
    int renormalize;
    float *h, *logits, *probs;     // h [T, H], logits [T, E], probs [threads, E]
    int64_t* ids;
    float* weights;
};

static void route_norm_task(void* context, int64_t task, int64_t next, int thread) {
    (void)next, (void)thread;
    const struct route_job* job = context;
    int64_t first = task * ROUTE_TOKENS, rows = block_end(task, ROUTE_TOKENS, job->n_tokens) - first;
    const float* x = job->x + first * job->hidden;
    norm_rows(x, job->hidden, rows, job->hidden, job->norm, job->eps, job->h + first * job->hidden);
}

static void route_top_task(void* context, int64_t task, int64_t next, int thread) {
    (void)next;
    const struct route_job* job = context;
    int64_t e = job->n_experts, k = job->k;
    for (int64_t t = task * ROUTE_TOKENS; t < block_end(task, ROUTE_TOKENS, job->n_tokens); t++)
        top_experts(job->logits + t * e, e, k, job->renormalize, job->probs + thread * e, job->ids + t * k,
                    job->weights + t * k);
}

int moe_route(const struct moe_matrix* router, const float* x, int64_t n_tokens, const float* norm, float eps,
              int64_t k, int renormalize, float* h, int64_t* ids, float* weights, int threads) {
    int64_t hidden = router->cols, n_experts = router->rows, tasks = (n_tokens + ROUTE_TOKENS - 1) / ROUTE_TOKENS;
    if (k < 1 || k > n_experts) return MOE_BAD_SHAPE;
    int task_threads = block_threads(threads, tasks, (double)n_tokens * (hidden + k * n_experts));
    float* logits = malloc((size_t)(n_tokens + task_threads) * n_experts * sizeof(float));   // and each thread's probs
    if (!logits) return MOE_NO_MEMORY;
    struct route_job job = {x, n_tokens, hidden, n_experts, k, norm, eps, renormalize, h, logits,
                            logits + n_tokens * n_experts, ids, weights};
    lock_kernels();
    pool_run(task_threads, tasks, route_norm_task, &job);
    unlock_kernels();
    int status = moe_matmul(router, 1, h, n_tokens, logits, threads);
    if (status == MOE_OK) {
        lock_kernels();
        pool_run(task_threads, tasks, route_top_task, &job);
        unlock_kernels();
    }
    free(logits);
    return status;
}
