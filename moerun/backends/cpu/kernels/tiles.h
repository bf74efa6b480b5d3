// The kernels of one instruction set, written once over its vector primitives. An isa_*.c
// file defines these, then includes this file:
//   vf, VL                 a vector of VL floats
//   vf_zero vf_load vf_fma(acc, a, b) = a·b + acc, vf_sum (all lanes added)
//   NT_MAX                 tokens a block multiplies at once (what the registers hold:
//                          TILE_ROWS·NT_MAX accumulators, NT_MAX activation vectors, one weight vector)
//   ISA_NAME, ISA_TABLE    its name and the struct isa_kernels this file defines
//   and the conversions vectors.h lists, which the blocks (blocks.h) are dequantized with.
//
// A tile is TILE_ROWS weight rows, dequantized to float32 (blocks.h), times each of a list of
// tokens' activations, in float32. Each output is computed by the same operations in the same
// order whatever the number of tokens or threads, so results do not depend on batching.
#include "blocks.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void block(const struct tile* tile, const int64_t* tokens, const int nt, float* out) {
    const int64_t n = tile->n;
    const float* x[NT_MAX];
    for (int t = 0; t < nt; t++) x[t] = tile->x + tokens[t] * n;
    vf acc[TILE_ROWS][NT_MAX];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = vf_zero();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf values[NT_MAX];
        for (int t = 0; t < nt; t++) values[t] = vf_load(x[t] + i);
        for (int r = 0; r < TILE_ROWS; r++) {
            vf weights = vf_load(tile->w[r] + i);
            for (int t = 0; t < nt; t++) acc[r][t] = vf_fma(acc[r][t], weights, values[t]);
        }
    }
    for (int r = 0; r < TILE_ROWS; r++)
        for (int t = 0; t < nt; t++) {
            float sum = vf_sum(acc[r][t]);
            for (int64_t j = i; j < n; j++) sum += tile->w[r][j] * x[t][j];
            out[t * TILE_ROWS + r] = sum;
        }
}

static void multiply(const struct tile* tile, const int64_t* tokens, int64_t n_tokens, float* out) {
    int64_t t = 0;
    for (; t + NT_MAX <= n_tokens; t += NT_MAX) block(tile, tokens + t, NT_MAX, out + t * TILE_ROWS);
#if NT_MAX > 4
    if (t + 4 <= n_tokens) {
        block(tile, tokens + t, 4, out + t * TILE_ROWS);
        t += 4;
    }
#endif
#if NT_MAX > 2
    if (t + 2 <= n_tokens) {
        block(tile, tokens + t, 2, out + t * TILE_ROWS);
        t += 2;
    }
#endif
    for (; t < n_tokens; t++) block(tile, tokens + t, 1, out + t * TILE_ROWS);
}

const struct isa_kernels ISA_TABLE = {
    .name = ISA_NAME,
    DEQUANTIZE_TABLE,
    .multiply = multiply,
};
