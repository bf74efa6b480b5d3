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

int moe_rope_append(const struct moe_attention* shape, int64_t n_tokens, const float* q, const float* k,
                    const float* v, int64_t q_stride, int64_t k_stride, int64_t v_stride, const float* q_norm,
                    const float* k_norm, const float* cos, const float* sin, uint8_t* k_cache, uint8_t* v_cache,
                    float* q_out) {
    int64_t nh = shape->n_heads, nkv = shape->n_kv_heads, dim = shape->head_dim_k, dim_v = shape->head_dim_v;
    int key_type = cache_type(shape->key_type), value_type = cache_type(shape->value_type);
    if (key_type < 0 || value_type < 0) return MOE_UNSUPPORTED_TYPE;
    if (dim % TYPES[key_type].block_values || dim_v % TYPES[value_type].block_values) return MOE_BAD_SHAPE;
    int64_t key_bytes = bytes_of(key_type, dim), value_bytes = bytes_of(value_type, dim_v);
    float* normed = malloc((size_t)(nh + nkv) * dim * sizeof(float));      // [NH, D], then k rotated [NKV, D]
    if (!normed) return MOE_NO_MEMORY;
    float* rotated = normed + nh * dim;
    for (int64_t t = 0; t < n_tokens; t++) {
        const float* cos_t = cos + t * (dim / 2);
        const float* sin_t = sin + t * (dim / 2);
        norm_rotate(shape, k + t * k_stride, nkv, k_norm, cos_t, sin_t, normed, rotated);
        for (int64_t h = 0; h < nkv; h++) {
            quantize_row(key_type, rotated + h * dim, dim, k_cache + (t * nkv + h) * key_bytes);
            quantize_row(value_type, v + t * v_stride + h * dim_v, dim_v, v_cache + (t * nkv + h) * value_bytes);
        }
        norm_rotate(shape, q + t * q_stride, nh, q_norm, cos_t, sin_t, normed, q_out + t * nh * dim);
    }
    free(normed);
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
