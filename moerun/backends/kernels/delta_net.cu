// The gated DeltaNet of hybrid models (qwen35moe), two kernels a layer: the causal depthwise
// convolution of the q, k and v channels, then per value head the gated delta rule over the
// chunk's tokens in order, with the head's output RMS-normed and gated by silu(z).
// Shape legend: T tokens, C channels (2·HK·DK + HV·DV), W conv kernel, HK/HV key/value heads,
// DK/DV their dims.

#define MAX_CONV_WIDTH 8
#define MAX_KEY_DIM 128

// One thread per channel (grid ceil(C / blockDim)), over every token: out[t, c] =
// silu(Σ_i window[t + i, c] · weight[c, i]), window = the W-1 earlier inputs (state [W-1, C],
// replaced by the last W-1 inputs) then x [T, C].
extern "C" __global__ void delta_conv(const float* __restrict__ x, const float* __restrict__ weight,
                                      float* __restrict__ state, float* __restrict__ out, int n_tokens,
                                      int channels, int width) {
    wait_for_previous_grid();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float w[MAX_CONV_WIDTH], window[MAX_CONV_WIDTH];
    for (int i = 0; i < width; i++) w[i] = weight[c * width + i];
    for (int i = 0; i < width - 1; i++) window[i] = state[i * channels + c];
    for (int t = 0; t < n_tokens; t++) {
        window[width - 1] = x[(long long)t * channels + c];
        float sum = 0.f;
        for (int i = 0; i < width; i++) sum += window[i] * w[i];
        out[(long long)t * channels + c] = silu(sum);
        for (int i = 0; i < width - 1; i++) window[i] = window[i + 1];
    }
    for (int i = 0; i < width - 1; i++) state[i * channels + c] = window[i];
}

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// One block per value head h (grid HV), one thread per value column v (blockDim DV, a multiple
// of 32, >= DK), which keeps column v of the head's state S [DK, DV] in registers over the
// tokens: S <- e^g · S; S <- S + k (β (v - Sᵀk))ᵀ; o = Sᵀq / sqrt(DK), with q and k of key head
// h % HK L2-normed, g = softplus(alpha + dt[h]) · a[h] (<= 0), β = sigmoid(beta); then
// out[t, h, :] = rms_norm(o) · norm · silu(z[t, h, :]). mixed [T, C] (q, k, v after the
// convolution), z [T, HV·DV], alpha and beta [T, HV], state [HV, DK, DV] in/out, out [T, HV·DV].
extern "C" __global__ void delta_rule(const float* __restrict__ mixed, const float* __restrict__ z,
                                      const float* __restrict__ beta, const float* __restrict__ alpha,
                                      const float* __restrict__ a, const float* __restrict__ dt,
                                      const float* __restrict__ norm, float* __restrict__ state,
                                      float* __restrict__ out, int n_tokens, int key_heads, int value_heads,
                                      int key_dim, int value_dim, float eps) {
    wait_for_previous_grid();
    __shared__ float q[MAX_KEY_DIM], k[MAX_KEY_DIM], scratch[33];
    int h = blockIdx.x, v = threadIdx.x, key_head = h % key_heads;
    int channels = 2 * key_heads * key_dim + value_heads * value_dim;
    float scale = rsqrtf((float)key_dim);
    float s[MAX_KEY_DIM];
    float* head_state = state + (long long)h * key_dim * value_dim;
#pragma unroll
    for (int i = 0; i < MAX_KEY_DIM; i++) s[i] = i < key_dim ? head_state[(long long)i * value_dim + v] : 0.f;
    for (int t = 0; t < n_tokens; t++) {
        const float* row = mixed + (long long)t * channels;
        float qi = v < key_dim ? row[key_head * key_dim + v] : 0.f;
        float ki = v < key_dim ? row[(key_heads + key_head) * key_dim + v] : 0.f;
        float q_scale = rsqrtf(block_sum(qi * qi, scratch) + eps);
        float k_scale = rsqrtf(block_sum(ki * ki, scratch) + eps);
        if (v < key_dim) {
            q[v] = qi * q_scale;
            k[v] = ki * k_scale;
        }
        __syncthreads();
        float decay = expf(softplus(alpha[t * value_heads + h] + dt[h]) * a[h]);
        float strength = 1.f / (1.f + expf(-beta[t * value_heads + h]));
        float value = row[2 * key_heads * key_dim + h * value_dim + v];
        float kv = 0.f;
#pragma unroll
        for (int i = 0; i < MAX_KEY_DIM; i++) {
            s[i] *= decay;
            kv += i < key_dim ? k[i] * s[i] : 0.f;
        }
        float delta = strength * (value - kv);
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < MAX_KEY_DIM; i++) {
            if (i < key_dim) {
                s[i] += k[i] * delta;
                o += q[i] * s[i];
            }
        }
        o *= scale;
        float inv = rsqrtf(block_sum(o * o, scratch) / value_dim + eps);
        long long at = (long long)t * value_heads * value_dim + h * value_dim + v;
        out[at] = o * inv * norm[v] * silu(z[at]);
        __syncthreads();                                  // q and k are rewritten for the next token
    }
#pragma unroll
    for (int i = 0; i < MAX_KEY_DIM; i++)
        if (i < key_dim) head_state[(long long)i * value_dim + v] = s[i];
}
