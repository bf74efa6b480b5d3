// The gated DeltaNet of hybrid models (qwen35moe), four kernels a layer: the causal depthwise
// convolution of the q, k and v channels; the L2 norms of q and k and the heads' gates, in
// parallel over the tokens; per value head the gated delta rule over the chunk's tokens in order
// (only the state's update on that sequential path); the heads' outputs RMS-normed and gated by
// silu(z), in parallel again.
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

// One block per (token t, key head j) for the first HK blocks of grid.y, blockDim >= DK: q and k of
// the head L2-normed in place in mixed [T, C]; the next HV blocks of grid.y, one thread: the
// value head's decay e^{softplus(alpha + dt) · a} and strength sigmoid(beta) into gates [T, HV, 2].
extern "C" __global__ void delta_prepare(float* __restrict__ mixed, const float* __restrict__ beta,
                                         const float* __restrict__ alpha, const float* __restrict__ a,
                                         const float* __restrict__ dt, float* __restrict__ gates, int key_heads,
                                         int value_heads, int key_dim, int value_dim, float eps) {
    wait_for_previous_grid();
    __shared__ float scratch[33];
    int t = blockIdx.x, head = blockIdx.y;
    if (head >= key_heads) {
        int h = head - key_heads, at = t * value_heads + h;
        if (threadIdx.x == 0) {
            gates[2 * at] = expf(softplus(alpha[at] + dt[h]) * a[h]);
            gates[2 * at + 1] = 1.f / (1.f + expf(-beta[at]));
        }
        return;
    }
    long long row = (long long)t * (2 * key_heads * key_dim + value_heads * value_dim);
    for (int part = 0; part < 2; part++) {                 // q, then k
        float* x = mixed + row + (part * key_heads + head) * key_dim;
        float value = threadIdx.x < key_dim ? x[threadIdx.x] : 0.f;
        float scale = rsqrtf(block_sum(value * value, scratch) + eps);
        if (threadIdx.x < key_dim) x[threadIdx.x] = value * scale;
    }
}

#define DELTA_TILE 16                                       // tokens whose q and k a block stages at once
#define DELTA_COLUMNS 32                                    // value columns a block keeps
#define DELTA_GROUPS 4                                      // groups of state rows over a column
#define DELTA_ROWS (MAX_KEY_DIM / DELTA_GROUPS)             // the most rows a thread keeps

// One block per value head h and DELTA_COLUMNS of its value columns (grid (HV, ceil(DV / 32)),
// blockDim (32, DELTA_GROUPS)): thread (c, g) keeps rows g·R .. g·R + R - 1 (R = ceil(DK / 4))
// of column c of the head's state S [DK, DV] in registers over the chunk's tokens in order:
// S <- g · S; S <- S + k (β (v - Sᵀk))ᵀ; o = Sᵀq / sqrt(DK), q and k those of key head h % HK
// (L2-normed by delta_prepare), g and β from gates [T, HV, 2]; the groups' shares of Sᵀk and of
// Sᵀq meet in shared memory, so a token's sequential chain is R long, not DK. The raw o goes
// to out [T, HV·DV]; delta_gate_norm finishes it. state [HV, DK, DV] in/out.
extern "C" __global__ void delta_rule(const float* __restrict__ mixed, const float* __restrict__ gates,
                                      float* __restrict__ state, float* __restrict__ out, int n_tokens,
                                      int key_heads, int value_heads, int key_dim, int value_dim) {
    wait_for_previous_grid();
    __shared__ float q[DELTA_TILE][MAX_KEY_DIM], k[DELTA_TILE][MAX_KEY_DIM];
    __shared__ float shares[2][DELTA_GROUPS][DELTA_COLUMNS];     // [Sᵀk, Sᵀq][group][column]
    int h = blockIdx.x, c = threadIdx.x, g = threadIdx.y, key_head = h % key_heads;
    int v = blockIdx.y * DELTA_COLUMNS + c;
    int rows = (key_dim + DELTA_GROUPS - 1) / DELTA_GROUPS, first = g * rows;
    int thread = g * DELTA_COLUMNS + c, threads = DELTA_COLUMNS * DELTA_GROUPS;
    bool column = v < value_dim;
    int channels = 2 * key_heads * key_dim + value_heads * value_dim;
    float scale = rsqrtf((float)key_dim);
    float s[DELTA_ROWS];
    float* head_state = state + (long long)h * key_dim * value_dim;
#pragma unroll
    for (int i = 0; i < DELTA_ROWS; i++)
        s[i] = column && i < rows && first + i < key_dim ? head_state[(long long)(first + i) * value_dim + v] : 0.f;
    for (int t0 = 0; t0 < n_tokens; t0 += DELTA_TILE) {
        int tile = min(DELTA_TILE, n_tokens - t0);
        __syncthreads();                                    // the last tile is done with q and k
        for (int j = thread; j < tile * key_dim; j += threads) {
            const float* row = mixed + (long long)(t0 + j / key_dim) * channels;
            q[j / key_dim][j % key_dim] = row[key_head * key_dim + j % key_dim];
            k[j / key_dim][j % key_dim] = row[(key_heads + key_head) * key_dim + j % key_dim];
        }
        __syncthreads();
        for (int u = 0; u < tile; u++) {
            int t = t0 + u;
            float decay = gates[2 * (t * value_heads + h)], strength = gates[2 * (t * value_heads + h) + 1];
            float kv = 0.f;
#pragma unroll
            for (int i = 0; i < DELTA_ROWS; i++) {
                s[i] *= decay;
                if (i < rows && first + i < key_dim) kv += k[u][first + i] * s[i];
            }
            shares[0][g][c] = kv;
            __syncthreads();
            kv = 0.f;
#pragma unroll
            for (int group = 0; group < DELTA_GROUPS; group++) kv += shares[0][group][c];
            float value = column ? mixed[(long long)t * channels + 2 * key_heads * key_dim + h * value_dim + v] : 0.f;
            float delta = strength * (value - kv);
            float o = 0.f;
#pragma unroll
            for (int i = 0; i < DELTA_ROWS; i++) {
                if (i < rows && first + i < key_dim) {
                    s[i] += k[u][first + i] * delta;
                    o += q[u][first + i] * s[i];
                }
            }
            shares[1][g][c] = o;
            __syncthreads();                                // (the next token's Sᵀk shares wait behind it too)
            if (g == 0 && column) {
                o = 0.f;
#pragma unroll
                for (int group = 0; group < DELTA_GROUPS; group++) o += shares[1][group][c];
                out[(long long)t * value_heads * value_dim + h * value_dim + v] = o * scale;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < DELTA_ROWS; i++)
        if (column && i < rows && first + i < key_dim) head_state[(long long)(first + i) * value_dim + v] = s[i];
}

// One block per (token, value head) (grid (T, HV)), blockDim >= DV: out = rms_norm(out) · norm ·
// silu(z), in place, out and z [T, HV·DV].
extern "C" __global__ void delta_gate_norm(float* __restrict__ out, const float* __restrict__ z,
                                           const float* __restrict__ norm, int value_heads, int value_dim,
                                           float eps) {
    wait_for_previous_grid();
    __shared__ float scratch[33];
    bool column = threadIdx.x < value_dim;
    long long at = ((long long)blockIdx.x * value_heads + blockIdx.y) * value_dim + threadIdx.x;
    float o = column ? out[at] : 0.f;
    float inv = rsqrtf(block_sum(o * o, scratch) / value_dim + eps);
    if (column) out[at] = o * inv * norm[threadIdx.x] * silu(z[at]);
}
