// What moe_ffn (ffn.c) and moe_matmul (matmul.c) share: checking a matrix, dequantizing a
// tile of its rows, one thread's scratch, and memory kept from call to call.
#pragma once
#include <stddef.h>
#include "moe_cpu.h"

#define ROWS_PER_TASK 32        // weight rows one task computes at a few tokens (a multiple of TILE_ROWS)

// Rows a task computes out of `rows`, each row range split for `units` tasks' owners (experts):
// ROWS_PER_TASK, halved down to `fewest` while that leaves fewer than `per_thread` tasks a
// thread, so that a call with little work still keeps every thread busy.
int64_t split_rows(int64_t rows, int64_t units, int threads, int per_thread, int64_t fewest);

// At most `threads`, and fewer for small work (about MACS_PER_THREAD multiply-adds or
// BYTES_PER_THREAD weight bytes read each at least, whichever gives more): waking a thread
// costs more than a few microseconds of work. (A float32 router at one token is 256K
// multiply-adds but 1 MiB to read: by multiply-adds alone it took 2 of 16 threads.)
#define MACS_PER_THREAD (1 << 17)
#define BYTES_PER_THREAD (1 << 15)
int threads_for(int threads, double macs, double weight_bytes);

// Both calls hold this while they run: one job at a time in the pool and the buffers.
void lock_kernels(void);
void unlock_kernels(void);

// MOE_OK and the type's index in *type when m is rows x cols of a type with kernels.
int check_matrix(const struct moe_matrix* m, int64_t rows, int64_t cols, int* type);

// Bytes of n values of type index `type` (n a multiple of its block).
static inline int64_t bytes_of(int type, int64_t n) { return n / TYPES[type].block_values * TYPES[type].block_bytes; }

// Where row `row` of expert `expert` of m is stored.
static inline const uint8_t* stored_row(const struct moe_matrix* m, int64_t expert, int64_t row) {
    return m->data + expert * m->expert_bytes + row * m->row_bytes;
}

// Rows row..row+count-1 of expert `expert` of m, of type index `type`, times x [.., m->cols] of
// the tokens in tokens[]: out[t * stride + r]. Few tokens: the fused tile, TILE_ROWS rows at a
// time, each fetching the next tile's rows into the caches as it goes (after the last, `next`:
// the first of TILE_ROWS rows of m the caller computes next, or NULL). More: the rows
// dequantized into `panel` [count, m->cols] first, then multiplied (struct panel) chunk by chunk
// where `sums` (TILE_SUMS floats per tile of the panel) is given, whole rows where it is NULL.
void panel_product(const struct isa_kernels* isa, const struct moe_matrix* m, int type, int64_t expert, int64_t row,
                   int64_t count, const uint8_t* next, const float* x, const int64_t* tokens, int64_t n_tokens,
                   float* panel, float* sums, float* out, int64_t stride);

// panel_product of count <= TILE_ROWS rows, whole, into out [n_tokens, TILE_ROWS] (the columns
// past `count` are not written), the rows dequantized into `buffer` [TILE_ROWS, m->cols].
void tile_product(const struct isa_kernels* isa, const struct moe_matrix* m, int type, int64_t expert, int64_t row,
                  int count, const uint8_t* next, const float* x, const int64_t* tokens, int64_t n_tokens,
                  float* buffer, float* out);

// The same product on the matrix unit (unit_takes): the rows dequantized into their planes,
// `row_planes` (unit_row_values(count, m->cols)), times the tokens' planes (split_tokens):
// out[t * stride + r].
void unit_product(const struct isa_kernels* isa, const struct moe_matrix* m, int type, int64_t expert, int64_t row,
                  int64_t count, const uint16_t* token_planes, int64_t n_tokens, uint16_t* row_planes, float* out,
                  int64_t stride);

// Blocking at many tokens. A task dequantizes a panel of rows once and multiplies it with
// every token, NT_MAX tokens at a time: the panel stays in L2, and the activations, read once
// per panel, come from L3 or memory rows / panel_rows times in all (rows / TILE_ROWS times
// for tiles alone). A block of tokens may go over the panel a chunk of values at a time, so
// that the block's activations of one chunk stay in L1 while every tile of the panel reads
// them; each tile then keeps its sums in memory between chunks. Panels come from this CPU's L2
// unless moe_set_blocking set their rows; the chunk is measured on this CPU for each row width
// (measure_chunk, under the kernels' lock, before a job's panels) unless it set one: on 2 Zen 4
// cores chunks only cost (about 100 cycles a tile's pass, -12% at 512 values, -25% at 256), on
// an AVX-512 Xeon VM 1024 values ran 23% faster. The results do not depend on either.
//   panel_rows(n, rows, threads): rows of n values a task dequantizes, out of `rows` (fewer
//                                 where there would be under PANELS_PER_THREAD tasks a thread)
//   measure_chunk(isa, n): times whole rows against chunks of 1024 and 512 values, once per n
//   chunk_values(n): values of a row of n per pass over a panel (n, or a multiple of 16)
#define PANELS_PER_THREAD 4
// A panel on the matrix unit keeps its rows as planes (6 bytes a value): the width panel_rows
// sizes it by.
#define UNIT_PANEL_WIDTH(n) ((n) * 3 / 2)
int64_t panel_rows(int64_t n, int64_t rows, int threads);
void measure_chunk(const struct isa_kernels* isa, int64_t n);
int64_t chunk_values(int64_t n);
// For benchmarks and tests: fixed sizes (0: from the caches), and the sizes a product of
// `rows` rows of n values on `threads` threads uses.
MOE_API void moe_set_blocking(int64_t rows, int64_t chunk);
MOE_API void moe_blocking(int64_t n, int64_t rows, int threads, int64_t* panel, int64_t* chunk);

// One thread's scratch: `sets` panels [rows, n], the sums of one panel's tiles, `outs`
// outputs [max_tokens, rows], and with a matrix unit the planes of a panel.
struct scratch {
    float* rows[3];
    float* sums;
    float* outs[2];
    uint16_t* planes;
};

// Scratch of each thread (indexed by thread), NULL if it cannot grow; `planes` whether it
// holds a panel's planes; thread_scratch's panels are TILE_ROWS rows, what tile_product takes.
struct scratch* panel_scratch(int threads, int sets, int64_t rows, int64_t n, int outs, int64_t max_tokens,
                              int planes);
static inline struct scratch* thread_scratch(int threads, int sets, int64_t n, int outs, int64_t max_tokens) {
    return panel_scratch(threads, sets, TILE_ROWS, n, outs, max_tokens, 0);
}

// A workspace buffer that keeps its memory between calls, grown as needed (64-byte aligned).
enum workspace_slot { SLOT_H, SLOT_PAIRS, SLOT_GROUPS, SLOT_SCRATCH, SLOT_PADDED, SLOT_PLANES, SLOT_H_PLANES,
                      N_SLOTS };
void* workspace(int slot, size_t bytes);
