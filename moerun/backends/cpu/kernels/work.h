// What moe_ffn (ffn.c) and moe_matmul (matmul.c) share: checking a matrix, dequantizing a
// tile of its rows, one thread's scratch, and memory kept from call to call.
#pragma once
#include <stddef.h>
#include "moe_cpu.h"

#define ROWS_PER_TASK 32        // weight rows one task computes (a multiple of TILE_ROWS)

// At most `threads`, and fewer for small work (about MACS_PER_THREAD multiply-adds each at
// least): waking a thread costs more than a few microseconds of multiply-adds.
#define MACS_PER_THREAD (1 << 17)
int threads_for(int threads, double macs);

// Both calls hold this while they run: one job at a time in the pool and the buffers.
void lock_kernels(void);
void unlock_kernels(void);

// MOE_OK and the type's index in *type when m is rows x cols of a type with kernels.
int check_matrix(const struct moe_matrix* m, int64_t rows, int64_t cols, int* type);

// Where row `row` of expert `expert` of m is stored.
static inline const uint8_t* stored_row(const struct moe_matrix* m, int64_t expert, int64_t row) {
    return m->data + expert * m->expert_bytes + row * m->row_bytes;
}

// Rows row..row+count-1 (count <= TILE_ROWS) of expert `expert` of m, of type index `type`,
// times x [.., m->cols] of the tokens in tokens[]: out [n_tokens, TILE_ROWS] (the rows past
// `count` repeat the last). Few tokens: the fused tile, which fetches `next` (the first of
// TILE_ROWS rows of m the caller computes next, or NULL) into the caches as it goes; more: the
// rows dequantized into `buffer` [TILE_ROWS, m->cols] first.
void tile_product(const struct isa_kernels* isa, const struct moe_matrix* m, int type, int64_t expert, int64_t row,
                  int count, const uint8_t* next, const float* x, const int64_t* tokens, int64_t n_tokens,
                  float* buffer, float* out);

// One thread's scratch: `sets` row buffers [TILE_ROWS, n] and `outs` tile outputs
// [max_tokens, TILE_ROWS].
struct scratch {
    float* rows[3];
    float* outs[2];
};

// Scratch of each thread (indexed by thread), NULL if it cannot grow.
struct scratch* thread_scratch(int threads, int sets, int64_t n, int outs, int64_t max_tokens);

// A workspace buffer that keeps its memory between calls, grown as needed (64-byte aligned).
enum workspace_slot { SLOT_H, SLOT_PAIRS, SLOT_GROUPS, SLOT_SCRATCH, N_SLOTS };
void* workspace(int slot, size_t bytes);
