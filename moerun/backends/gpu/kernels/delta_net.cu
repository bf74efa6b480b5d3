// The gated DeltaNet of hybrid models (qwen35moe), five kernels a layer: the causal depthwise
// convolution of the q, k and v channels in parallel over the tokens, then its state moved on;
// the L2 norms of q and k and the heads' gates, in parallel over the tokens; per value head the
// gated delta rule over the chunk's tokens in order (only the state's update on that sequential
// path); the heads' outputs RMS-normed and gated by silu(z), in parallel again.
// Shape legend: T tokens, C channels (2·HK·DK + HV·DV), W conv kernel, HK/HV key/value heads,
// DK/DV their dims.

// Channel c of the convolution's window at `row` of x [T, C]; rows before x (row < 0) are the
// state's [W-1, C] last ones.
__device__ __forceinline__ float window_value(const float* __restrict__ x, const float* __restrict__ state, int row,
                                              int c, int channels, int width) {
    return row >= 0 ? x[(long long)row * channels + c] : state[(row + width - 1) * channels + c];
}

// One thread per (token, channel) (grid ceil(T·C / blockDim)): out[t, c] =
// silu(Σ_i window[t + i, c] · weight[c, i]), window = the W-1 earlier inputs (state [W-1, C])
// then x [T, C]. The state is left as it was: delta_conv_state moves it on after.
extern "C" __global__ void delta_conv(const float* __restrict__ x, const float* __restrict__ weight,
                                      const float* __restrict__ state, float* __restrict__ out, int n_tokens,
                                      int channels, int width) {
    wait_for_previous_grid();
    long long at = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (at >= (long long)n_tokens * channels) return;
    int t = at / channels, c = at % channels;
    float sum = 0.f;
    for (int i = 0; i < width; i++)
        sum += window_value(x, state, t + i - (width - 1), c, channels, width) * weight[c * width + i];
    out[at] = silu(sum);
}

// One thread per channel (grid ceil(C / blockDim)): the state [W-1, C] becomes the last W-1 rows
// of the window (the old state, then x [T, C]), all read before any is written.
extern "C" __global__ void delta_conv_state(const float* __restrict__ x, float* __restrict__ state, int n_tokens,
                                            int channels, int width) {
    wait_for_previous_grid();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float rows[MAX_CONV_WIDTH];
    for (int r = 0; r < width - 1; r++) rows[r] = window_value(x, state, n_tokens + r - (width - 1), c, channels, width);
    for (int r = 0; r < width - 1; r++) state[r * channels + c] = rows[r];
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

#define DELTA_TILE 16                                       // tokens a block stages at once
#define DELTA_ROWS (MAX_KEY_DIM / DELTA_GROUPS)             // the most rows a thread keeps

// One block per value head h and DELTA_COLUMNS of its value columns (grid (HV, ceil(DV / 32)),
// blockDim (32, DELTA_GROUPS)): thread (c, g) keeps rows g·R .. g·R + R - 1 (R = ceil(DK / 8))
// of column c of the head's state S [DK, DV] in registers over the chunk's tokens in order:
// S <- g · S; S <- S + k (β (v - Sᵀk))ᵀ; o = Sᵀq / sqrt(DK), q and k those of key head h % HK
// (L2-normed by delta_prepare), g and β from gates [T, HV, 2]. A tile of tokens' q, k, v and
// gates is staged in shared memory first, so a token's sequential path reads no global memory:
// the groups' shares of Sᵀk meet in shared memory (double-buffered by token: one barrier a
// token), their shares of Sᵀq are kept per token and summed once the tile is done. The raw o
// goes to out [T, HV·DV]; delta_gate_norm finishes it. state [HV, DK, DV] in/out.
extern "C" __global__ void delta_rule(const float* __restrict__ mixed, const float* __restrict__ gates,
                                      float* __restrict__ state, float* __restrict__ out, int n_tokens,
                                      int key_heads, int value_heads, int key_dim, int value_dim) {
    wait_for_previous_grid();
    __shared__ float q[DELTA_TILE][MAX_KEY_DIM], k[DELTA_TILE][MAX_KEY_DIM];
    __shared__ float values[DELTA_TILE][DELTA_COLUMNS], tile_gates[DELTA_TILE][2];
    __shared__ float kv_shares[2][DELTA_GROUPS][DELTA_COLUMNS];           // Sᵀk by token parity
    __shared__ float o_shares[DELTA_TILE][DELTA_GROUPS][DELTA_COLUMNS];   // Sᵀq by token
    int h = blockIdx.x, c = threadIdx.x, g = threadIdx.y, key_head = h % key_heads;
    int v0 = blockIdx.y * DELTA_COLUMNS, v = v0 + c;
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
        __syncthreads();                                    // the last tile's stages are read
        for (int j = thread; j < tile * key_dim; j += threads) {
            const float* row = mixed + (long long)(t0 + j / key_dim) * channels;
            q[j / key_dim][j % key_dim] = row[key_head * key_dim + j % key_dim];
            k[j / key_dim][j % key_dim] = row[(key_heads + key_head) * key_dim + j % key_dim];
        }
        for (int j = thread; j < tile * DELTA_COLUMNS; j += threads) {
            int u = j / DELTA_COLUMNS, column_of = v0 + j % DELTA_COLUMNS;
            values[u][j % DELTA_COLUMNS] = column_of < value_dim
                ? mixed[(long long)(t0 + u) * channels + 2 * key_heads * key_dim + h * value_dim + column_of] : 0.f;
        }
        for (int j = thread; j < 2 * tile; j += threads)
            tile_gates[j / 2][j % 2] = gates[2 * ((t0 + j / 2) * value_heads + h) + j % 2];
        __syncthreads();
        for (int u = 0; u < tile; u++) {
            float decay = tile_gates[u][0], strength = tile_gates[u][1];
            float kv_even = 0.f, kv_odd = 0.f;              // two chains of R/2
#pragma unroll
            for (int i = 0; i < DELTA_ROWS; i += 2) {
                if (i < rows && first + i < key_dim) kv_even += k[u][first + i] * s[i];
                if (i + 1 < rows && first + i + 1 < key_dim) kv_odd += k[u][first + i + 1] * s[i + 1];
            }
            kv_shares[u & 1][g][c] = kv_even + kv_odd;
            __syncthreads();
            float kv = 0.f;
#pragma unroll
            for (int group = 0; group < DELTA_GROUPS; group++) kv += kv_shares[u & 1][group][c];
            float delta = strength * (values[u][c] - decay * kv);    // Sᵀk of the decayed state
            float o_even = 0.f, o_odd = 0.f;
#pragma unroll
            for (int i = 0; i < DELTA_ROWS; i += 2) {
                if (i < rows && first + i < key_dim) {
                    s[i] = s[i] * decay + k[u][first + i] * delta;
                    o_even += q[u][first + i] * s[i];
                }
                if (i + 1 < rows && first + i + 1 < key_dim) {
                    s[i + 1] = s[i + 1] * decay + k[u][first + i + 1] * delta;
                    o_odd += q[u][first + i + 1] * s[i + 1];
                }
            }
            o_shares[u][g][c] = o_even + o_odd;
        }
        __syncthreads();
        for (int j = thread; j < tile * DELTA_COLUMNS; j += threads) {
            int u = j / DELTA_COLUMNS, column_of = v0 + j % DELTA_COLUMNS;
            float o = 0.f;
#pragma unroll
            for (int group = 0; group < DELTA_GROUPS; group++) o += o_shares[u][group][j % DELTA_COLUMNS];
            if (column_of < value_dim) out[(long long)(t0 + u) * value_heads * value_dim + h * value_dim + column_of] = o * scale;
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
