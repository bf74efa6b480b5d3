// The gated DeltaNet of hybrid models (qwen35moe), five or six kernels a layer: the causal
// depthwise convolution of the q, k and v channels in parallel over the tokens, then its state
// moved on; the L2 norms of q and k and the heads' gates, in parallel over the tokens; the gated
// delta rule, per value head over the tokens in order (a few tokens: only the state's update on
// that sequential path) or in chunks (prefill: the chunks' own parts in parallel, then the state
// over the chunks in order); the heads' outputs RMS-normed and gated by silu(z), in parallel again.
// Shape legend: T tokens, C channels (2·HK·DK + HV·DV), W conv kernel, HK/HV key/value heads,
// DK/DV their dims.

#define MAX_CONV_WIDTH 8
#define MAX_KEY_DIM 128

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
    for (int i = 0; i < width; i++) {
        int row = t + i - (width - 1);                      // of x; before it, the state's rows
        float value = row >= 0 ? x[(long long)row * channels + c] : state[(row + width - 1) * channels + c];
        sum += value * weight[c * width + i];
    }
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
    for (int r = 0; r < width - 1; r++) {
        int row = n_tokens + r - (width - 1);               // of x; before it, the state's rows
        rows[r] = row >= 0 ? x[(long long)row * channels + c] : state[(row + width - 1) * channels + c];
    }
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
#define DELTA_COLUMNS 32                                    // value columns a block keeps
#define DELTA_GROUPS 8                                      // groups of state rows over a column
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

#define DELTA_CHUNK 32                                      // tokens of a chunk of the chunked rule
#define CHUNK_GROUPS 4                                      // delta_chunk_state's groups of state rows
#define CHUNK_ROWS (MAX_KEY_DIM / CHUNK_GROUPS)             // the most rows a thread keeps there

// The chunked gated delta rule, for prefill (the WY form of flash-linear-attention's
// chunk_gated_delta_rule, as numpy_ops.delta_rule_chunk writes it): delta_chunk_prepare does the
// part of each chunk of C tokens that needs no state, all chunks at once; delta_chunk_state
// carries the state over the chunks in order, a few products a chunk instead of a step a token.
// Per value head, with f the tokens' decay factors and β their strengths (gates [T, HV, 2]),
// L the chunk's tokens: Γ[t, s] = f_{s+1}···f_t (s <= t), e_t = f_0···f_t,
// A[t, s] = β_t Γ[t, s] k_t·k_s (s < t), M = (I + A)⁻¹; then δ = M·diag(β)·(V - diag(e)·K·S)
// (S the state before the chunk), o_t = (e_t Sᵀq_t + Σ_{s<=t} Γ[t, s] (q_t·k_s) δ_s) / sqrt(DK),
// and S <- e_{L-1} S + Σ_t Γ[L-1, t] k_t δ_tᵀ.
//
// One block per (chunk c, value head h) (grid (ceil(T / C), HV), 256 threads), from mixed [T, C]
// (q and k L2-normed) and gates: into scratch at ch = c·HV + h, w = M·diag(β e)·K and
// qe = diag(e)·Q and kd = diag(Γ[L-1, ·])·K [C, DK], u = M·diag(β)·V [C, DV], p = Γ ∘ Q·Kᵀ
// (lower triangle, zeros above) [C, C], chunk_decay = e_{L-1}. M by forward substitution, a row
// of M - I at a time from the rows above it.
extern "C" __global__ void delta_chunk_prepare(const float* __restrict__ mixed, const float* __restrict__ gates,
                                               int n_tokens, int key_heads, int value_heads, int key_dim,
                                               int value_dim, float* __restrict__ w, float* __restrict__ u,
                                               float* __restrict__ qe, float* __restrict__ kd,
                                               float* __restrict__ p, float* __restrict__ chunk_decay) {
    wait_for_previous_grid();
    __shared__ float q[DELTA_CHUNK][MAX_KEY_DIM + 1], k[DELTA_CHUNK][MAX_KEY_DIM + 1];   // q stages v later
    __shared__ float gaps[DELTA_CHUNK][DELTA_CHUNK + 1], m[DELTA_CHUNK][DELTA_CHUNK + 1];  // Γ, M - I
    __shared__ float strength[DELTA_CHUNK], factor[DELTA_CHUNK], from_start[DELTA_CHUNK];
    int c = blockIdx.x, h = blockIdx.y, key_head = h % key_heads;
    int t0 = c * DELTA_CHUNK, length = min(DELTA_CHUNK, n_tokens - t0);
    int channels = 2 * key_heads * key_dim + value_heads * value_dim;
    long long ch = (long long)c * value_heads + h;
    for (int j = threadIdx.x; j < length * key_dim; j += blockDim.x) {
        const float* row = mixed + (long long)(t0 + j / key_dim) * channels;
        q[j / key_dim][j % key_dim] = row[key_head * key_dim + j % key_dim];
        k[j / key_dim][j % key_dim] = row[(key_heads + key_head) * key_dim + j % key_dim];
    }
    for (int t = threadIdx.x; t < length; t += blockDim.x) {
        factor[t] = gates[2 * ((t0 + t) * value_heads + h)];
        strength[t] = gates[2 * ((t0 + t) * value_heads + h) + 1];
    }
    __syncthreads();
    if (threadIdx.x < DELTA_CHUNK) {                        // Γ by columns: Γ[s, s] = 1, Γ[t, s] = Γ[t-1, s] f_t
        int s = threadIdx.x;
        float gap = 1.f;
        for (int t = 0; t < DELTA_CHUNK; t++) {
            if (t > s && t < length) gap *= factor[t];
            gaps[t][s] = t >= s && t < length ? gap : 0.f;
        }
    }
    if (threadIdx.x == DELTA_CHUNK) {
        float e = 1.f;
        for (int t = 0; t < length; t++) from_start[t] = e *= factor[t];
        chunk_decay[ch] = e;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < DELTA_CHUNK * DELTA_CHUNK; j += blockDim.x) {
        int t = j / DELTA_CHUNK, s = j % DELTA_CHUNK;
        float kk = 0.f, qk = 0.f;
        if (s <= t && t < length)
            for (int i = 0; i < key_dim; i++) {
                kk += k[t][i] * k[s][i];
                qk += q[t][i] * k[s][i];
            }
        m[t][s] = s < t ? -strength[t] * gaps[t][s] * kk : 0.f;       // -A
        p[ch * DELTA_CHUNK * DELTA_CHUNK + j] = gaps[t][s] * qk;
    }
    for (int j = threadIdx.x; j < length * key_dim; j += blockDim.x) {
        int t = j / key_dim, i = j % key_dim;
        qe[ch * DELTA_CHUNK * key_dim + j] = q[t][i] * from_start[t];
        kd[ch * DELTA_CHUNK * key_dim + j] = k[t][i] * gaps[length - 1][t];
    }
    __syncthreads();
    for (int r = 1; r < length; r++) {                      // row r of M - I: -A[r] (I + (M - I) above)
        float update = 0.f;
        int s = threadIdx.x;
        if (s < r)
            for (int j = s + 1; j < r; j++) update += m[r][j] * m[j][s];
        __syncthreads();
        if (s < r) m[r][s] += update;
        __syncthreads();
    }
    for (int j = threadIdx.x; j < length * key_dim; j += blockDim.x) {
        int t = j / key_dim, i = j % key_dim;
        float sum = strength[t] * from_start[t] * k[t][i];                   // M's unit diagonal
        for (int s = 0; s < t; s++) sum += m[t][s] * strength[s] * from_start[s] * k[s][i];
        w[ch * DELTA_CHUNK * key_dim + j] = sum;
    }
    for (int v0 = 0; v0 < value_dim; v0 += MAX_KEY_DIM) {    // u, by tiles of v's columns staged in q
        int width = min(MAX_KEY_DIM, value_dim - v0);
        __syncthreads();                                    // q (or the last tile) is read
        for (int j = threadIdx.x; j < length * width; j += blockDim.x) {
            int t = j / width;
            q[t][j % width] = mixed[(long long)(t0 + t) * channels + 2 * key_heads * key_dim + h * value_dim + v0 + j % width];
        }
        __syncthreads();
        for (int j = threadIdx.x; j < length * width; j += blockDim.x) {
            int t = j / width, v = j % width;
            float sum = strength[t] * q[t][v];
            for (int s = 0; s < t; s++) sum += m[t][s] * strength[s] * q[s][v];
            u[(ch * DELTA_CHUNK + t) * value_dim + v0 + v] = sum;
        }
    }
}

// One block per value head h and DELTA_COLUMNS of its value columns (grid (HV, ceil(DV / 32)),
// blockDim (32, CHUNK_GROUPS)): thread (c, g) keeps rows g·R .. g·R + R - 1 (R = ceil(DK / 4)) of
// column c of the state S in registers over the chunks in order; per chunk (delta_chunk_prepare's
// scratch): δ = u - w·S, o = (qe·S + p·δ) / sqrt(DK) into out [T, HV·DV] (S before the chunk),
// S <- chunk_decay · S + kdᵀ·δ. The groups' shares of w·S and qe·S meet in shared memory.
// state [HV, DK, DV] in/out.
extern "C" __global__ void delta_chunk_state(const float* __restrict__ w, const float* __restrict__ u,
                                             const float* __restrict__ qe, const float* __restrict__ kd,
                                             const float* __restrict__ p, const float* __restrict__ chunk_decay,
                                             float* __restrict__ state, float* __restrict__ out, int n_tokens,
                                             int value_heads, int key_dim, int value_dim) {
    wait_for_previous_grid();
    __shared__ float shares[DELTA_CHUNK][CHUNK_GROUPS][DELTA_COLUMNS];
    __shared__ float delta[DELTA_CHUNK][DELTA_COLUMNS];
    int h = blockIdx.x, c = threadIdx.x, g = threadIdx.y;
    int v = blockIdx.y * DELTA_COLUMNS + c;
    int rows = (key_dim + CHUNK_GROUPS - 1) / CHUNK_GROUPS, first = g * rows;
    bool column = v < value_dim;
    float scale = rsqrtf((float)key_dim);
    float s[CHUNK_ROWS];
    float* head_state = state + (long long)h * key_dim * value_dim;
#pragma unroll
    for (int i = 0; i < CHUNK_ROWS; i++)
        s[i] = column && i < rows && first + i < key_dim ? head_state[(long long)(first + i) * value_dim + v] : 0.f;
    for (int t0 = 0, chunk = 0; t0 < n_tokens; t0 += DELTA_CHUNK, chunk++) {
        int length = min(DELTA_CHUNK, n_tokens - t0);
        long long ch = (long long)chunk * value_heads + h;
        const float* w_rows = w + ch * DELTA_CHUNK * key_dim + first;       // row t at t·DK
        const float* qe_rows = qe + ch * DELTA_CHUNK * key_dim + first;
        const float* kd_rows = kd + ch * DELTA_CHUNK * key_dim + first;
        for (int t = 0; t < length; t++) {                  // this group's share of (w·S)[t]
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < CHUNK_ROWS; i++)
                if (i < rows && first + i < key_dim) sum += w_rows[t * key_dim + i] * s[i];
            shares[t][g][c] = sum;
        }
        __syncthreads();
        for (int t = g; t < length; t += CHUNK_GROUPS) {
            float sum = 0.f;
#pragma unroll
            for (int group = 0; group < CHUNK_GROUPS; group++) sum += shares[t][group][c];
            delta[t][c] = column ? u[(ch * DELTA_CHUNK + t) * value_dim + v] - sum : 0.f;
        }
        __syncthreads();
        for (int t = 0; t < length; t++) {                  // (qe·S)[t], S still the chunk's first
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < CHUNK_ROWS; i++)
                if (i < rows && first + i < key_dim) sum += qe_rows[t * key_dim + i] * s[i];
            shares[t][g][c] = sum;
        }
        __syncthreads();
        for (int t = g; t < length; t += CHUNK_GROUPS) {
            float o = 0.f;
#pragma unroll
            for (int group = 0; group < CHUNK_GROUPS; group++) o += shares[t][group][c];
            const float* p_row = p + (ch * DELTA_CHUNK + t) * DELTA_CHUNK;
            for (int j = 0; j <= t; j++) o += p_row[j] * delta[j][c];
            if (column) out[(long long)(t0 + t) * value_heads * value_dim + h * value_dim + v] = o * scale;
        }
        float decay = chunk_decay[ch];
#pragma unroll
        for (int i = 0; i < CHUNK_ROWS; i++) {
            if (i < rows && first + i < key_dim) {
                float sum = 0.f;
                for (int t = 0; t < length; t++) sum += kd_rows[t * key_dim + i] * delta[t][c];
                s[i] = s[i] * decay + sum;
            }
        }
        __syncthreads();                                    // shares and δ are the next chunk's
    }
#pragma unroll
    for (int i = 0; i < CHUNK_ROWS; i++)
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
