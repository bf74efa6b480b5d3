// The CPU expert kernels: the interface between their parts. The library computes straight
// from the GGUF blocks in the file's mapping; Python (moerun/backends/cpu/library.py) calls
// moe_ffn (ffn.c) and moe_matmul (matmul.c) through ctypes, with the structs below mirrored there.
//
// Shape legend: T tokens, H hidden, F expert FFN width, E experts, P routed pairs,
// N a matrix's rows, n the values of one row.
#pragma once
#include <stdint.h>

#define MOE_API __attribute__((visibility("default")))     // what Python calls; the rest is hidden

// ---- what Python passes ----------------------------------------------------------------------

// One matrix of every expert (or one plain matrix, with n_experts 1): expert e's row r starts
// at data + e * expert_bytes + r * row_bytes. `type` is the GGML type id.
struct moe_matrix {
    const uint8_t* data;
    int64_t type;
    int64_t rows;           // N
    int64_t cols;           // n
    int64_t row_bytes;
    int64_t expert_bytes;
};

// One layer's routed experts: gate and up [E, F, H] (two views of one fused gate_up tensor
// where the file fuses them), down [E, H, F].
struct moe_experts {
    struct moe_matrix gate, up, down;
    int64_t n_experts;      // E
};

// Both return a moe_status. moe_ffn: x [T, H] f32; pairs (rows[p] a token row, experts[p]
// an expert id, weights[p]); out [T, H] = Σ over each token's pairs of weight · FFN_expert(x).
// moe_matmul: y [T, ΣN] = x [T, n] · Wᵢᵀ for expert 0 of each of `n_matrices` matrices (at most
// MOE_MAX_MATRICES, all n columns wide), side by side. `threads` threads each.
#define MOE_MAX_MATRICES 8
MOE_API int moe_ffn(const struct moe_experts* experts, const float* x, int64_t n_tokens, const int64_t* rows,
                    const int64_t* pair_experts, const float* weights, int64_t n_pairs, float* out, int threads);
// moe_ffn_padded: the same with the pairs as a router leaves them, ids and weights [T, K]
// (`per_token` K; an id < 0 stands for no expert): each id the expert itself, or with
// expert_map [n_map], an index into it (a daemon's local ids, a parent's own experts).
MOE_API int moe_ffn_padded(const struct moe_experts* experts, const float* x, int64_t n_tokens, const int64_t* ids,
                           const float* weights, int64_t per_token, const int64_t* expert_map, int64_t n_map,
                           float* out, int threads);
MOE_API int moe_matmul(const struct moe_matrix* matrices, int64_t n_matrices, const float* x, int64_t n_tokens,
                       float* y, int threads);
// moe_rows: out [n, cols] = rows ids [n] of a matrix (expert 0) as float32, each value as ggml
// computes it (a step's token embeddings). MOE_BAD_ROW for an id outside [0, rows).
MOE_API int moe_rows(const struct moe_matrix* matrix, const int64_t* ids, int64_t n, float* out);

// serve.c: a CPU daemon's arena (ipc/shm.py) served here until it is idle for spin_s, its
// doorbell changes or max_s pass. The byte offsets of the arena's words, headers and frames:
struct moe_slot_layout {
    uint8_t* arena;
    int64_t slots, slot_bytes, first_slot, doorbell;            // first_slot, doorbell: in the arena
    int64_t request_seq, reply_seq, parent_sleeping;            // in a slot, as are the rest
    int64_t request_header, reply_header, data, ids, weights;   // data: x [C, H] in, the result out
    int64_t capacity, hidden, per_token, version;               // C, H, K; the protocol's version
};
// A layer's experts as the daemon holds them: local id i is expert expert_map[i] (n_map 0: none).
struct moe_served_layer {
    struct moe_experts experts;
    const int64_t* expert_map;
    int64_t n_map;
};
struct moe_serve_counts {
    int64_t calls, tokens;
    double compute_seconds;
};
// Serves the f32 padded requests of layers it holds, with ids [C*K] and out [C*H] as scratch;
// returns the index of a pending slot it leaves to the caller (any other request), or -1.
MOE_API int moe_serve_slots(const struct moe_slot_layout* layout, const struct moe_served_layer* layers,
                            int64_t n_layers, int64_t* ids, float* out, double spin_s, double max_s, int threads,
                            struct moe_serve_counts* counts);

// decode.c: the work of a layer around its products (numpy_backend.NumpyBackend), each as its
// numpy_ops reference computes it. One model's attention shapes, filled once:
struct moe_attention {
    int64_t n_heads, n_kv_heads;        // NH, NKV (NH a multiple of NKV)
    int64_t head_dim_k, head_dim_v;     // D, Dv
    int64_t rope_neox;                  // 1: rope rotates the two halves of D; 0: adjacent pairs
    float eps;                          // of the per-head q/k norms
    float scale;                        // of the attention scores
    int64_t key_type, value_type;       // the cache's element types (GGML ids: F32, F16, BF16, Q8_0,
                                        // Q4_0, Q4_1, Q5_0 or Q5_1; D and Dv whole blocks of them)
};
// moe_rms_norm: out [T, n] = x / sqrt(mean(x²) + eps) · weight [n], x's rows `stride` apart.
// moe_rope_append: for each token, k [NKV*D] and q [NH*D] normed per head (where q_norm and
// k_norm [D] are given) and rotated by cos, sin [T, D/2]; k into k_cache, v [NKV*Dv] into
// v_cache (the rows of the first position to write, each head's row in the cache's type), q
// into q_out [T, NH, D]; the strides are those of q, k and v's rows; tokens spread over `threads`.
// moe_attention: out [T, NH*Dv] = softmax(q·kᵀ · scale) · v for q [T, NH, D] at positions
// start.., over keys [S, NKV, D] and values [S, NKV, Dv] (in the cache's types) up to each
// position (S = start + T).
// moe_quantize_rows: rows [rows, n] of floats into a cache type (GGML id), as ggml rounds.
// moe_route: h [T, H] = rms_norm(x [T, H], norm), the router [E, H] product, softmax over E,
// the K most probable (ties to the lower id) -> ids [T, K], their probabilities [T, K]
// (rescaled to sum to 1 where `renormalize`). All but moe_rms_norm return a moe_status.
MOE_API void moe_rms_norm(const float* x, int64_t stride, int64_t rows, int64_t n, const float* weight, float eps,
                          float* out);
MOE_API int moe_rope_append(const struct moe_attention* shape, int64_t n_tokens, const float* q, const float* k,
                            const float* v, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                            const float* q_norm, const float* k_norm, const float* cos, const float* sin,
                            uint8_t* k_cache, uint8_t* v_cache, float* q_out, int threads);
MOE_API int moe_attention(const struct moe_attention* shape, const float* q, int64_t n_tokens, int64_t start,
                          const uint8_t* keys, const uint8_t* values, float* out, int threads);
MOE_API int moe_quantize_rows(int64_t ggml_id, const float* x, int64_t rows, int64_t n, uint8_t* out);
MOE_API int moe_route(const struct moe_matrix* router, const float* x, int64_t n_tokens, const float* norm,
                      float eps, int64_t k, int renormalize, float* h, int64_t* ids, float* weights, int threads);

enum moe_status {
    MOE_OK = 0,
    MOE_UNSUPPORTED_TYPE = 1,
    MOE_BAD_SHAPE = 2,
    MOE_BAD_EXPERT = 3,
    MOE_BAD_ROW = 4,
    MOE_NO_MEMORY = 5,
};

// ---- the stored types --------------------------------------------------------------------------

// Dense indices of the types with kernels (GGML ids in types.c).
enum moe_type { T_F32, T_F16, T_BF16, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_Q4_K, T_Q5_K, T_Q6_K, N_TYPES };

struct type_info {
    int ggml_id;
    int block_values;       // values per block
    int block_bytes;
};

extern const struct type_info TYPES[N_TYPES];
int type_index(int64_t ggml_id);            // -1 for a type without kernels
int cache_type(int64_t ggml_id);            // the index of a type a KV cache may keep, else -1
// quantize.c: a row of n floats into type index `type` (one cache_type gives).
void quantize_row(int type, const float* x, int64_t n, uint8_t* out);
MOE_API int moe_supports_type(int64_t ggml_id);

// ---- what each instruction set provides ----------------------------------------------------------

#define TILE_ROWS 4         // weight rows a tile multiplies at once
#define MOST_TOKENS 8       // at least the tokens any instruction set's tile multiplies at once (NT_MAX)
#define MOST_LANES 16       // at least the floats of any instruction set's vector (VL)
#define TILE_SUMS (TILE_ROWS * MOST_TOKENS * MOST_LANES)    // floats a tile's sums keep between chunks

// Weight rows of n values times each of a list of tokens' activations x [T, n] (float32, as
// given): out[t * stride + r] = w[r] · x[tokens[t]]. The rows are either dequantized to float32
// first (struct panel, any number of rows, for many tokens) or read as stored and dequantized
// in registers as they are multiplied (struct stored_tile, TILE_ROWS rows, for a few): the same
// operations in the same order, so the same results.
struct panel {
    const float* w;             // [rows, n]
    int64_t rows;
    const float* x;
    int64_t n;
    int64_t chunk;              // values of a row multiplied per pass over the panel's tiles (a multiple of 16)
    float* sums;                // [tiles, TILE_SUMS]: each tile's sums from one chunk to the next (chunk < n)
    float* out;
    int64_t stride;
};

struct stored_tile {
    const uint8_t* rows[TILE_ROWS];     // the rows past `count` repeat the last
    int count;                          // rows written to out
    const float* x;
    int64_t n;
    const uint8_t* next;        // the first row of the tile the caller computes next (NULL: none),
    int64_t row_bytes;          // its rows this far apart: fetched ahead as this one is read
    float* out;
    int64_t stride;
};

// A matrix unit (x86's AMX): the products of many tokens on tiles of bfloat16, float32-exact.
// Each float32 operand is split into three bfloat16 planes (x = hi + mid + lo, where
// hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid): all 24 bits of a float) and the
// plane products that reach 2^-18 of the product (6 of the 9) are summed in float32 by the
// tile unit: float32 products in another order of summation than the vector tiles', so a product
// of least_tokens tokens or more differs from the same product at fewer in its last bits
// (not by thread count, panel rows or which other tokens are in the call).
//   token planes: [ceil(T / 16)][UNIT_PLANES][n / 32][UNIT_TILE] bfloat16, a tile of 16
//                 tokens by 32 values as 16 rows of pairs (value 2i and 2i + 1 of each token)
//   row planes:   [ceil(rows / 16)][UNIT_PLANES][n / 32][UNIT_TILE] bfloat16, a tile of 16 rows
//                 by 32 values as they lie; rows past `rows` zero
// Rows must be a multiple of 32 values long (unit_takes).
#define UNIT_PLANES 3
#define UNIT_TOKENS 16              // tokens (and rows) of a tile
#define UNIT_TILE 512               // bfloat16s of a tile: 16 rows of 64 bytes
struct matrix_unit {
    int64_t least_tokens;
    // planes of tokens x[tokens[i]] (tokens NULL: rows 0 .. n_tokens - 1 of x) into `planes`
    void (*split_tokens)(const float* x, const int64_t* tokens, int64_t n_tokens, int64_t n, uint16_t* planes);
    // a tile of `rows` <= 16 stored rows of type index T (row_bytes apart), dequantized, into
    // one tile of row planes (UNIT_PLANES · n / 32 tiles)
    void (*split_stored[N_TYPES])(const uint8_t* first, int64_t row_bytes, int rows, int64_t n, uint16_t* tiles);
    // out[t * stride + r] = row r · token t for r < rows, t < n_tokens
    void (*multiply)(const uint16_t* rows, int64_t n_rows, int64_t n, const uint16_t* tokens, int64_t n_tokens,
                     float* out, int64_t stride);
};

static inline int64_t unit_tiles(int64_t n_tokens) { return (n_tokens + UNIT_TOKENS - 1) / UNIT_TOKENS; }
// bfloat16s of the planes of n_tokens tokens of n values, and of `rows` rows
static inline int64_t unit_token_values(int64_t n_tokens, int64_t n) {
    return unit_tiles(n_tokens) * UNIT_PLANES * n * UNIT_TOKENS;
}
static inline int64_t unit_row_values(int64_t rows, int64_t n) { return unit_token_values(rows, n); }

typedef void (*dequantize_fn)(const uint8_t* row, int64_t n, float* w);
typedef void (*fused_fn)(const struct stored_tile* tile, const int64_t* tokens, int64_t n_tokens);

// The kernels of one instruction set (isa_*.c, each built from tiles.h). `fused` takes at most
// `fused_tokens` tokens and rows whose length is a multiple of 16.
struct isa_kernels {
    const char* name;
    dequantize_fn dequantize[N_TYPES];
    fused_fn fused[N_TYPES];
    int fused_tokens;
    void (*multiply)(const struct panel* panel, const int64_t* tokens, int64_t n_tokens);
    void (*row_products)(const float* const* a, int64_t rows, const float* b, int64_t ldb, int64_t k, int64_t n,
                         float* const* c, int accumulate);     // tiles.h
    const struct matrix_unit* unit;     // NULL: none
};

// Whether the unit multiplies n_tokens tokens with rows of n values.
static inline int unit_takes(const struct isa_kernels* isa, int64_t n_tokens, int64_t n) {
    return isa->unit && n_tokens >= isa->unit->least_tokens && n % 32 == 0;
}

// isa.c: the kernels in use; for Python, the instruction sets usable here (best first), the
// one in use, and choosing one by name (0 if it is not usable here).
const struct isa_kernels* current_isa(void);
MOE_API int moe_isa_count(void);
MOE_API const char* moe_isa_name(int index);
MOE_API const char* moe_current_isa(void);
MOE_API int64_t moe_unit_tokens(void);      // the least tokens the current one's matrix unit takes, 0: none
MOE_API int moe_use_isa(const char* name);
