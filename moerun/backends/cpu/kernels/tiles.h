// The kernels of one instruction set, written once over its vector primitives (vectors.h
// lists them). An isa_*.c file defines those, and
//   NT_MAX                 tokens a block multiplies at once (what the registers hold:
//                          TILE_ROWS·NT_MAX accumulators, NT_MAX activation vectors, one weight vector)
//   NT_FUSED               the same for the fused tile, whose weights take more registers
//   FUSED_TOKENS           up to how many tokens the fused tile is faster (measured)
//   ROW_MR, ROW_NV         rows and vectors of columns of row_products' tile (ROW_MR·ROW_NV sums,
//                          ROW_NV vectors of b and one broadcast value in registers)
//   ISA_NAME, ISA_TABLE    its name and the struct isa_kernels this file defines
//   MATRIX_UNIT            (optional) its struct matrix_unit
// then includes this file.
//
// A tile is TILE_ROWS weight rows times each of a list of tokens' activations, in float32:
// acc[r][t] = fma(w[r][i..], x[t][i..], acc[r][t]) for i = 0, VL, 2·VL, ... in order, the lanes
// added at the end, the values past the last full vector (element types) one by one. Either
// the rows are dequantized first into a panel of rows that every block of NT_MAX tokens reads
// (`multiply`), or, for a few tokens, each 16 values of a row are dequantized in registers and
// multiplied at once (`fused_T`): the same operations on the same values in the same order,
// so each output is the same whatever the number of tokens or threads, and whatever the
// panel's rows or chunks.
#include "blocks.h"

_Static_assert(NT_MAX <= MOST_TOKENS && NT_FUSED <= MOST_TOKENS && VL <= MOST_LANES, "sums do not fit");

// Tokens in blocks of `most` (a constant, NT_MAX or NT_FUSED), the rest in blocks of 4, 2 and 1:
// each block a call block_fn(tile, tokens, first, nt) for the tokens first .. first + nt - 1 of
// the list, nt a constant there. (A block size the registers do not hold is never reached: its
// condition is false, its constant made 1.)
#define BY_TOKEN_BLOCKS(block_fn, most, tile, tokens, n_tokens)                    \
    do {                                                                          \
        int64_t t = 0;                                                            \
        for (; t + most <= n_tokens; t += most) block_fn(tile, tokens, t, most);  \
        if (most > 4 && t + 4 <= n_tokens) {                                      \
            block_fn(tile, tokens, t, most > 4 ? 4 : 1);                          \
            t += 4;                                                               \
        }                                                                         \
        if (most > 2 && t + 2 <= n_tokens) {                                      \
            block_fn(tile, tokens, t, most > 2 ? 2 : 1);                          \
            t += 2;                                                               \
        }                                                                         \
        for (; t < n_tokens; t++) block_fn(tile, tokens, t, 1);                   \
    } while (0)

// Rows row .. row + TILE_ROWS - 1 of the panel (those past its last repeat the last) times the
// nt tokens whose activations are x[], over values [from, to) of the rows (from a multiple of
// VL; to one, or the rows' end n): the sums start from zero (from 0) or from `sums`
// [TILE_ROWS·nt vectors], and end there (to < n) or, the lanes added and the values past the
// last full vector with them, in out[t * stride + r].
ALWAYS_INLINE void tile_chunk(const struct panel* p, const float* const* x, const int nt, int64_t row, int64_t from,
                              int64_t to, float* sums, float* out) {
    const int64_t n = p->n;
    int rows = p->rows - row < TILE_ROWS ? (int)(p->rows - row) : TILE_ROWS;
    const float* w[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) w[r] = p->w + (row + (r < rows ? r : rows - 1)) * n;
    vf acc[TILE_ROWS][NT_MAX];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = from ? vf_load(sums + (t * TILE_ROWS + r) * VL) : vf_zero();
    int64_t i = from;
    for (; i + VL <= to; i += VL) {
        vf values[NT_MAX];
        for (int t = 0; t < nt; t++) values[t] = vf_load(x[t] + i);
        for (int r = 0; r < TILE_ROWS; r++) {
            vf weights = vf_load(w[r] + i);
            for (int t = 0; t < nt; t++) acc[r][t] = vf_fma(acc[r][t], weights, values[t]);
        }
    }
    if (to < n) {
        for (int r = 0; r < TILE_ROWS; r++)
            for (int t = 0; t < nt; t++) vf_store(sums + (t * TILE_ROWS + r) * VL, acc[r][t]);
        return;
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < nt; t++) {
            float sum = vf_sum(acc[r][t]);
            for (int64_t j = i; j < n; j++) sum += w[r][j] * x[t][j];
            out[t * p->stride + r] = sum;
        }
}

// A block of tokens times the whole panel, a chunk of the rows' values at a time: the block's
// activations of one chunk are read from L1 by every tile, each tile's chunk of weights once.
ALWAYS_INLINE void panel_block(const struct panel* p, const int64_t* tokens, int64_t first, const int nt) {
    const float* x[NT_MAX];
    for (int t = 0; t < nt; t++) x[t] = p->x + tokens[first + t] * p->n;
    for (int64_t from = 0; from < p->n; from += p->chunk) {
        int64_t to = p->n - from > p->chunk ? from + p->chunk : p->n;
        for (int64_t row = 0; row < p->rows; row += TILE_ROWS)
            tile_chunk(p, x, nt, row, from, to, p->sums + row / TILE_ROWS * TILE_SUMS,
                       p->out + first * p->stride + row);
    }
}

static void multiply(const struct panel* panel, const int64_t* tokens, int64_t n_tokens) {
    BY_TOKEN_BLOCKS(panel_block, NT_MAX, panel, tokens, n_tokens);
}

// The cache lines of bytes [start, start + size) of row r of the tile that comes next.
ALWAYS_INLINE void prefetch_block(const struct stored_tile* tile, int r, int64_t start, int64_t size) {
    if (!tile->next) return;
    const uint8_t* row = tile->next + r * tile->row_bytes;
    for (int64_t line = start & ~63; line < start + size; line += 64) __builtin_prefetch(row + line);
}

// fused_T: the stored rows' blocks read once per block of tokens, 16 values at a time.
#define FUSED_TILE(name, type, values, bytes)                                                        \
    ALWAYS_INLINE void fused_block_##name(const struct stored_tile* tile, const int64_t* tokens, int64_t first, \
                                          const int nt) {                                            \
        const float* x[NT_FUSED];                                                                    \
        for (int t = 0; t < nt; t++) x[t] = tile->x + tokens[first + t] * tile->n;                   \
        vf acc[TILE_ROWS][NT_FUSED];                                                                 \
        for (int r = 0; r < TILE_ROWS; r++)                                                          \
            for (int t = 0; t < nt; t++) acc[r][t] = vf_zero();                                      \
        for (int64_t b = 0; b < tile->n / values; b++) {                                             \
            struct block_state s[TILE_ROWS];                                                         \
            for (int r = 0; r < TILE_ROWS; r++) {                                                    \
                prefetch_block(tile, r, b * bytes, bytes);                                          \
                prepare_##name(tile->rows[r] + b * bytes, &s[r]);                                   \
            }                                                                                        \
            UNROLL_GROUPS for (int g = 0; g < values / 16; g++)                           \
                for (int r = 0; r < TILE_ROWS; r++) {                                                \
                    v16 w = group_##name(tile->rows[r] + b * bytes, &s[r], g);                       \
                    for (int p = 0; p < 16 / VL; p++)                                                \
                        for (int t = 0; t < nt; t++)                                                 \
                            acc[r][t] = vf_fma(acc[r][t], w.v[p], vf_load(x[t] + b * values + 16 * g + p * VL)); \
                }                                                                                    \
        }                                                                                            \
        float* out = tile->out + first * tile->stride;                                               \
        for (int r = 0; r < tile->count; r++)                                                        \
            for (int t = 0; t < nt; t++) out[t * tile->stride + r] = vf_sum(acc[r][t]);              \
    }                                                                                                \
    static void fused_##name(const struct stored_tile* tile, const int64_t* tokens, int64_t n_tokens) { \
        BY_TOKEN_BLOCKS(fused_block_##name, NT_FUSED, tile, tokens, n_tokens);                       \
    }
TYPES(FUSED_TILE)

// row_products: c[r][0 .. n) (+)= Σ_i a[r][i] · b[i · ldb + 0 .. n) for r < rows, the other way
// round from the tiles above: a's values broadcast, b's rows loaded VL values at a time, so that
// no lanes are added at the end (attention's q·kᵀ over keys transposed, and p·v). ROW_CHUNK rows
// of b at a time, each panel of them (ROW_NV vectors of columns) kept in L1 while every ROW_MR
// rows of a pass over it; then single vectors of columns, then the last columns one by one.
#define ROW_CHUNK 128
#define ROW_TILE(name, nv)                                                                          \
    ALWAYS_INLINE void name(const float* const* a, int mr, const float* b, int64_t ldb, int64_t k,  \
                            float* const* c, int64_t j, int adding) {                              \
        vf acc[ROW_MR][nv];                                                                         \
        for (int r = 0; r < ROW_MR; r++)                                                            \
            for (int v = 0; v < nv; v++) acc[r][v] = adding && r < mr ? vf_load(c[r] + j + v * VL) : vf_zero(); \
        for (int64_t i = 0; i < k; i++) {                                                           \
            vf w[nv];                                                                               \
            for (int v = 0; v < nv; v++) w[v] = vf_load(b + i * ldb + j + v * VL);                  \
            for (int r = 0; r < ROW_MR; r++) {                                                      \
                vf x = vf_set1(a[r][i]);                                                            \
                for (int v = 0; v < nv; v++) acc[r][v] = vf_fma(acc[r][v], x, w[v]);                \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < mr; r++)                                                                \
            for (int v = 0; v < nv; v++) vf_store(c[r] + j + v * VL, acc[r][v]);                    \
    }
ROW_TILE(wide_row_tile, ROW_NV)
ROW_TILE(narrow_row_tile, 1)

static void row_products(const float* const* a, int64_t rows, const float* b, int64_t ldb, int64_t k, int64_t n,
                         float* const* c, int accumulate) {
    for (int64_t i0 = 0; i0 < k; i0 += ROW_CHUNK) {
        int64_t depth = k - i0 < ROW_CHUNK ? k - i0 : ROW_CHUNK;
        int adding = accumulate || i0 > 0;
        const float* panel = b + i0 * ldb;
        for (int64_t j = 0; j < n; j += ROW_NV * VL) {
            int64_t end = n - j < ROW_NV * VL ? n : j + ROW_NV * VL;
            for (int64_t r0 = 0; r0 < rows; r0 += ROW_MR) {
                int mr = rows - r0 < ROW_MR ? (int)(rows - r0) : ROW_MR;
                const float* a_tile[ROW_MR];
                float* c_tile[ROW_MR];
                for (int r = 0; r < ROW_MR; r++) {
                    a_tile[r] = a[r0 + (r < mr ? r : mr - 1)] + i0;
                    c_tile[r] = c[r0 + (r < mr ? r : mr - 1)];
                }
                if (end == j + ROW_NV * VL) {
                    wide_row_tile(a_tile, mr, panel, ldb, depth, c_tile, j, adding);
                    continue;
                }
                int64_t at = j;
                for (; at + VL <= end; at += VL) narrow_row_tile(a_tile, mr, panel, ldb, depth, c_tile, at, adding);
                for (int r = 0; r < mr; r++)
                    for (int64_t column = at; column < end; column++) {
                        float total = adding ? c_tile[r][column] : 0.f;
                        for (int64_t i = 0; i < depth; i++) total += a_tile[r][i] * panel[i * ldb + column];
                        c_tile[r][column] = total;
                    }
            }
        }
    }
}

#define TABLE_ENTRY(name, type, values, bytes) [type] = dequantize_##name,
#define FUSED_ENTRY(name, type, values, bytes) [type] = fused_##name,

const struct isa_kernels ISA_TABLE = {
    .name = ISA_NAME,
    .dequantize = {TYPES(TABLE_ENTRY)},
    .fused = {TYPES(FUSED_ENTRY)},
    .fused_tokens = FUSED_TOKENS,
    .multiply = multiply,
    .row_products = row_products,
#ifdef MATRIX_UNIT
    .unit = &MATRIX_UNIT,
#endif
};
