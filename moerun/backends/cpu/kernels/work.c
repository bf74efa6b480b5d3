#include "work.h"

#include <pthread.h>
#include <stdlib.h>
#include "pool.h"

#define ALIGN 64

static pthread_mutex_t kernels_lock = PTHREAD_MUTEX_INITIALIZER;

int threads_for(int threads, double macs) {
    double useful = macs / MACS_PER_THREAD;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    return useful < 1 ? 1 : useful < threads ? (int)useful : threads < 1 ? 1 : threads;
}

void lock_kernels(void) { pthread_mutex_lock(&kernels_lock); }
void unlock_kernels(void) { pthread_mutex_unlock(&kernels_lock); }

int check_matrix(const struct moe_matrix* m, int64_t rows, int64_t cols, int* type) {
    int index = type_index(m->type);
    if (index < 0) return MOE_UNSUPPORTED_TYPE;
    const struct type_info* info = &TYPES[index];
    if (m->rows != rows || m->cols != cols || cols <= 0 || cols % info->block_values ||
        m->row_bytes != cols / info->block_values * info->block_bytes)
        return MOE_BAD_SHAPE;
    *type = index;
    return MOE_OK;
}

void tile_product(const struct isa_kernels* isa, const struct moe_matrix* m, int type, int64_t expert, int64_t row,
                  int count, const uint8_t* next, const float* x, const int64_t* tokens, int64_t n_tokens,
                  float* buffer, float* out) {
    const uint8_t* first = stored_row(m, expert, row);
    if (n_tokens <= isa->fused_tokens && m->cols % 16 == 0) {
        struct stored_tile tile = {.x = x, .n = m->cols, .next = next, .row_bytes = m->row_bytes};
        for (int r = 0; r < TILE_ROWS; r++) tile.rows[r] = first + (r < count ? r : count - 1) * m->row_bytes;
        isa->fused[type](&tile, tokens, n_tokens, out);
        return;
    }
    struct tile tile = {.x = x, .n = m->cols};
    for (int r = 0; r < TILE_ROWS; r++) {
        if (r < count) isa->dequantize[type](first + r * m->row_bytes, m->cols, buffer + r * m->cols);
        tile.w[r] = buffer + (r < count ? r : count - 1) * m->cols;
    }
    isa->multiply(&tile, tokens, n_tokens, out);
}

// ---- memory -----------------------------------------------------------------------------------

static size_t round_up(size_t bytes) { return (bytes + ALIGN - 1) / ALIGN * ALIGN; }

void* workspace(int slot, size_t bytes) {
    static struct { void* data; size_t bytes; } buffers[N_SLOTS];
    bytes = round_up(bytes ? bytes : 1);
    if (bytes > buffers[slot].bytes) {
        free(buffers[slot].data);
        buffers[slot].data = aligned_alloc(ALIGN, bytes);
        buffers[slot].bytes = buffers[slot].data ? bytes : 0;
    }
    return buffers[slot].data;
}

struct scratch* thread_scratch(int threads, int sets, int64_t n, int outs, int64_t max_tokens) {
    size_t row_bytes = round_up(TILE_ROWS * n * sizeof(float));
    size_t out_bytes = round_up(max_tokens * TILE_ROWS * sizeof(float));
    size_t head = round_up(threads * sizeof(struct scratch));
    char* memory = workspace(SLOT_SCRATCH, head + threads * (sets * row_bytes + outs * out_bytes));
    if (!memory) return NULL;
    struct scratch* scratch = (struct scratch*)memory;
    char* cursor = memory + head;
    for (int thread = 0; thread < threads; thread++) {
        for (int i = 0; i < sets; i++, cursor += row_bytes) scratch[thread].rows[i] = (float*)cursor;
        for (int i = 0; i < outs; i++, cursor += out_bytes) scratch[thread].outs[i] = (float*)cursor;
    }
    return scratch;
}
