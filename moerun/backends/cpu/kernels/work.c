#define _GNU_SOURCE
#include "work.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "pool.h"

#define ALIGN 64

static size_t round_up(size_t bytes) { return (bytes + ALIGN - 1) / ALIGN * ALIGN; }

static pthread_mutex_t kernels_lock = PTHREAD_MUTEX_INITIALIZER;

int threads_for(int threads, double macs, double weight_bytes) {
    double by_macs = macs / MACS_PER_THREAD, by_bytes = weight_bytes / BYTES_PER_THREAD;
    double useful = by_macs > by_bytes ? by_macs : by_bytes;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    return useful < 1 ? 1 : useful < threads ? (int)useful : threads < 1 ? 1 : threads;
}

int64_t split_rows(int64_t rows, int64_t units, int threads, int per_thread, int64_t fewest) {
    int64_t per_task = ROWS_PER_TASK;
    while (per_task > fewest && units * ((rows + per_task - 1) / per_task) < (int64_t)per_thread * threads)
        per_task /= 2;
    return per_task;
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

void panel_product(const struct isa_kernels* isa, const struct moe_matrix* m, int type, int64_t expert, int64_t row,
                   int64_t count, const uint8_t* next, const float* x, const int64_t* tokens, int64_t n_tokens,
                   float* panel, float* sums, float* out, int64_t stride) {
    const uint8_t* first = stored_row(m, expert, row);
    if (n_tokens <= isa->fused_tokens && m->cols % 16 == 0) {
        struct stored_tile tile = {.x = x, .n = m->cols, .row_bytes = m->row_bytes, .stride = stride};
        for (int64_t tile_row = 0; tile_row < count; tile_row += TILE_ROWS) {
            tile.count = count - tile_row < TILE_ROWS ? (int)(count - tile_row) : TILE_ROWS;
            for (int r = 0; r < TILE_ROWS; r++)
                tile.rows[r] = first + (tile_row + (r < tile.count ? r : tile.count - 1)) * m->row_bytes;
            tile.next = tile_row + TILE_ROWS < count ? first + (tile_row + TILE_ROWS) * m->row_bytes : next;
            tile.out = out + tile_row;
            isa->fused[type](&tile, tokens, n_tokens);
        }
        return;
    }
    for (int64_t r = 0; r < count; r++) isa->dequantize[type](first + r * m->row_bytes, m->cols, panel + r * m->cols);
    struct panel p = {.w = panel, .rows = count, .x = x, .n = m->cols, .sums = sums, .out = out, .stride = stride,
                      .chunk = sums ? chunk_values(m->cols) : m->cols};
    isa->multiply(&p, tokens, n_tokens);
}

void tile_product(const struct isa_kernels* isa, const struct moe_matrix* m, int type, int64_t expert, int64_t row,
                  int count, const uint8_t* next, const float* x, const int64_t* tokens, int64_t n_tokens,
                  float* buffer, float* out) {
    panel_product(isa, m, type, expert, row, count, next, x, tokens, n_tokens, buffer, NULL, out, TILE_ROWS);
}

void unit_product(const struct isa_kernels* isa, const struct moe_matrix* m, int type, int64_t expert, int64_t row,
                  int64_t count, const uint16_t* token_planes, int64_t n_tokens, uint16_t* row_planes, float* out,
                  int64_t stride) {
    const uint8_t* first = stored_row(m, expert, row);
    int64_t n = m->cols;
    for (int64_t r = 0; r < count; r += UNIT_TOKENS)
        isa->unit->split_stored[type](first + r * m->row_bytes, m->row_bytes,
                                      count - r < UNIT_TOKENS ? (int)(count - r) : UNIT_TOKENS, n,
                                      row_planes + unit_row_values(r, n));
    isa->unit->multiply(row_planes, count, n, token_planes, n_tokens, out, stride);
}

// ---- blocking ---------------------------------------------------------------------------------

#define FEWEST_PANEL_ROWS 16
#define MOST_PANEL_ROWS 256

static struct { int64_t panel_rows, chunk; } fixed;     // moe_set_blocking's sizes; 0: from the caches

// A cache's bytes as the C library reports them, else `otherwise`; at most `most` (a shared
// cache may be reported whole).
static int64_t cache_bytes(int name, int64_t otherwise, int64_t most) {
    long bytes = name ? sysconf(name) : 0;
    return bytes <= 0 ? otherwise : bytes < most ? bytes : most;
}

#ifdef _SC_LEVEL2_CACHE_SIZE
#define L2_NAME _SC_LEVEL2_CACHE_SIZE
#else
#define L2_NAME 0
#endif

// Half of L2 for the panel (the rest: a block of tokens' activations, the sums, the next rows).
int64_t panel_rows(int64_t n, int64_t rows, int threads) {
    if (fixed.panel_rows) return fixed.panel_rows;
    int64_t l2 = cache_bytes(L2_NAME, 1 << 20, 4 << 20);
    int64_t most = l2 / 2 / (n * (int64_t)sizeof(float)), balanced = rows / ((int64_t)threads * PANELS_PER_THREAD);
    int64_t panel = (most < balanced ? most : balanced) / FEWEST_PANEL_ROWS * FEWEST_PANEL_ROWS;
    return panel < FEWEST_PANEL_ROWS ? FEWEST_PANEL_ROWS : panel > MOST_PANEL_ROWS ? MOST_PANEL_ROWS : panel;
}

// The chunk of each row width, measured on this CPU the first time a product of that width
// runs as panels: whether a block of tokens' activations kept in L1 pays for the sums' loads and
// stores depends on the core (work.h). A panel of zeros of the rows panel_rows gives that width
// times CALIBRATION_TOKENS tokens, whole rows and each candidate chunk in turn for
// CALIBRATION_ROUNDS rounds after one untimed pass, the fastest pass of each; the fastest
// candidate is taken (a margin for whole rows, 5%, drew them in 4 of 16 processes on an AVX-512
// Xeon VM whose products run 22% faster in chunks of 1024: docs/benchmarks.md).
#define CHUNK_WIDTHS 16          // widths measured at most (past them: whole rows)
#define CALIBRATION_TOKENS 192
#define CALIBRATION_ROUNDS 5
static struct { int64_t n, chunk; } measured[CHUNK_WIDTHS];
static int n_measured;

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static double pass_seconds(const struct isa_kernels* isa, const struct panel* p, const int64_t* tokens) {
    double start = now_seconds();
    isa->multiply(p, tokens, CALIBRATION_TOKENS);
    return now_seconds() - start;
}

static int64_t fastest_chunk(const struct isa_kernels* isa, int64_t n) {
    int64_t rows = panel_rows(n, MOST_PANEL_ROWS * PANELS_PER_THREAD, 1);     // a large matrix's panel
    size_t panel = (size_t)rows * n, x = (size_t)CALIBRATION_TOKENS * n;
    size_t sums = rows / TILE_ROWS * TILE_SUMS, out = (size_t)CALIBRATION_TOKENS * rows;
    size_t bytes = round_up((panel + x + sums + out) * sizeof(float));
    float* memory = aligned_alloc(ALIGN, bytes);
    if (!memory) return n;
    memset(memory, 0, bytes);                            // written: pages of their own, not the zero page
    int64_t tokens[CALIBRATION_TOKENS];
    for (int t = 0; t < CALIBRATION_TOKENS; t++) tokens[t] = t;
    struct panel p = {.w = memory, .rows = rows, .x = memory + panel, .n = n, .chunk = n,
                      .sums = memory + panel + x, .out = memory + panel + x + sums, .stride = rows};
    enum { CANDIDATES = 3 };
    const int64_t chunks[CANDIDATES] = {n, 1024, 512};   // whole rows, then the chunks shorter than them
    double best[CANDIDATES] = {1e30, 1e30, 1e30};
    pass_seconds(isa, &p, tokens);                       // the caches and the clock warmed up
    for (int round = 0; round < CALIBRATION_ROUNDS; round++)       // the candidates in turn, each round
        for (int i = 0; i < CANDIDATES; i++) {
            if (i > 0 && chunks[i] >= n) continue;
            p.chunk = chunks[i];
            double took = pass_seconds(isa, &p, tokens);
            if (took < best[i]) best[i] = took;
        }
    free(memory);
    int64_t chunk = n;
    double fastest = best[0];
    for (int i = 1; i < CANDIDATES; i++)
        if (best[i] < fastest) fastest = best[i], chunk = chunks[i];
    return chunk;
}

// The entry of width n in `measured`, or -1.
static int measured_index(int64_t n) {
    for (int i = 0; i < n_measured; i++)
        if (measured[i].n == n) return i;
    return -1;
}

void measure_chunk(const struct isa_kernels* isa, int64_t n) {
    if (fixed.chunk || measured_index(n) >= 0 || n_measured == CHUNK_WIDTHS) return;
    measured[n_measured].chunk = fastest_chunk(isa, n);
    measured[n_measured++].n = n;
}

int64_t chunk_values(int64_t n) {
    if (fixed.chunk) return fixed.chunk < n ? fixed.chunk : n;
    int i = measured_index(n);
    return i < 0 ? n : measured[i].chunk;
}

void moe_set_blocking(int64_t rows, int64_t chunk) {
    fixed.panel_rows = rows > 0 ? (rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS : 0;
    fixed.chunk = chunk > 0 ? (chunk + 15) / 16 * 16 : 0;
}

void moe_blocking(int64_t n, int64_t rows, int threads, int64_t* panel, int64_t* chunk) {
    lock_kernels();
    measure_chunk(current_isa(), n);
    *panel = panel_rows(n, rows, threads);
    *chunk = chunk_values(n);
    unlock_kernels();
}

// ---- memory -----------------------------------------------------------------------------------

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

struct scratch* panel_scratch(int threads, int sets, int64_t rows, int64_t n, int outs, int64_t max_tokens,
                              int planes) {
    size_t panel_bytes = round_up(rows * n * sizeof(float));
    size_t planes_bytes = planes ? round_up(unit_row_values(rows, n) * sizeof(uint16_t)) : 0;
    size_t sums_bytes = round_up((rows + TILE_ROWS - 1) / TILE_ROWS * TILE_SUMS * sizeof(float));
    size_t out_bytes = round_up(max_tokens * rows * sizeof(float));
    size_t head = round_up(threads * sizeof(struct scratch));
    char* memory = workspace(SLOT_SCRATCH,
                             head + threads * (sets * panel_bytes + sums_bytes + outs * out_bytes + planes_bytes));
    if (!memory) return NULL;
    struct scratch* scratch = (struct scratch*)memory;
    char* cursor = memory + head;
    for (int thread = 0; thread < threads; thread++) {
        for (int i = 0; i < sets; i++, cursor += panel_bytes) scratch[thread].rows[i] = (float*)cursor;
        scratch[thread].sums = (float*)cursor;
        cursor += sums_bytes;
        for (int i = 0; i < outs; i++, cursor += out_bytes) scratch[thread].outs[i] = (float*)cursor;
        scratch[thread].planes = planes ? (uint16_t*)cursor : NULL;
        cursor += planes_bytes;
    }
    return scratch;
}
