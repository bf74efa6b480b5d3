// moe_matmul: y [T, ΣN] = x [T, n] · [W_0; W_1; ...]ᵀ for matrices W_i [N_i, n] as stored
// (expert 0 of each struct moe_matrix), their products side by side in y: q, k and v in one
// job. A task is a panel of rows of one matrix times every token: for a few tokens through the
// fused tile, ROWS_PER_TASK rows or fewer where that would leave a thread under TASKS_PER_THREAD
// tasks (a router of 128 rows on 16 threads: tasks of 4 rows, not 4 tasks of 32); for more,
// panel_rows() rows dequantized once (work.h). With a matrix unit, many tokens go to it: the
// first tasks split the activations into planes, a tile of 16 tokens each, and every panel task
// waits for them (a counter) before it multiplies its rows' planes with them.
// moe_rows: rows of a matrix dequantized, one after the other on the calling thread.
#include "pool.h"
#include "work.h"

#define TASKS_PER_THREAD 2

struct matmul_job {
    const struct isa_kernels* isa;
    const struct moe_matrix* matrices;
    int types[MOE_MAX_MATRICES];
    int64_t task_rows;                          // rows a task computes
    int64_t first_task[MOE_MAX_MATRICES + 1];   // matrix i's tasks: first_task[i] .. first_task[i + 1] - 1
    int64_t first_column[MOE_MAX_MATRICES];     // its products' column in y
    int64_t width;                              // ΣN
    const float* x;
    const int64_t* tokens;                      // 0, 1, ..., T-1
    int64_t n_tokens;
    float* y;
    struct scratch* scratch;
    uint16_t* planes;                           // the unit's: the tokens' planes, else NULL
    int64_t split_tasks;                        // tiles of tokens split, numbered first
    atomic_int_fast64_t split_done;
};

// The matrix of a task (its index) and the first of its rows.
static int task_rows(const struct matmul_job* job, int64_t task, int64_t* first_row) {
    int i = 0;
    while (task >= job->first_task[i + 1]) i++;
    *first_row = (task - job->first_task[i]) * job->task_rows;
    return i;
}

// Tile `tile` of the tokens' planes.
static void split_task(struct matmul_job* job, int64_t tile) {
    int64_t n = job->matrices[0].cols, first = tile * UNIT_TOKENS;
    int64_t count = job->n_tokens - first < UNIT_TOKENS ? job->n_tokens - first : UNIT_TOKENS;
    job->isa->unit->split_tokens(job->x + first * n, NULL, count, n, job->planes + unit_token_values(first, n));
    atomic_fetch_add_explicit(&job->split_done, 1, memory_order_release);
}

static void matmul_task(void* context, int64_t task, int64_t next_task, int thread) {
    struct matmul_job* job = context;
    if (task < job->split_tasks) {
        split_task(job, task);
        return;
    }
    task -= job->split_tasks;
    next_task = next_task < 0 ? -1 : next_task - job->split_tasks;
    struct scratch* s = &job->scratch[thread];
    int64_t first, after;
    int i = task_rows(job, task, &first), j = next_task < 0 ? -1 : task_rows(job, next_task, &after);
    const struct moe_matrix* matrix = &job->matrices[i];
    int64_t count = matrix->rows - first < job->task_rows ? matrix->rows - first : job->task_rows;
    float* out = job->y + job->first_column[i] + first;
    if (job->planes) {
        pool_wait(&job->split_done, job->split_tasks);
        unit_product(job->isa, matrix, job->types[i], 0, first, count, job->planes, job->n_tokens, s->planes, out,
                     job->width);
        return;
    }
    const uint8_t* next = j < 0 ? NULL : stored_row(&job->matrices[j], 0, after);
    panel_product(job->isa, matrix, job->types[i], 0, first, count, next, job->x, job->tokens, job->n_tokens,
                  s->rows[0], s->sums, out, job->width);
}

int moe_matmul(const struct moe_matrix* matrices, int64_t n_matrices, const float* x, int64_t n_tokens, float* y,
               int threads) {
    if (n_matrices < 1 || n_matrices > MOE_MAX_MATRICES) return MOE_BAD_SHAPE;
    struct matmul_job job = {.matrices = matrices, .x = x, .n_tokens = n_tokens, .y = y};
    int64_t cols = matrices[0].cols;
    double weight_bytes = 0;
    for (int i = 0; i < n_matrices; i++) {
        int status = check_matrix(&matrices[i], matrices[i].rows, cols, &job.types[i]);
        if (status != MOE_OK) return status;
        job.first_column[i] = job.width;
        job.width += matrices[i].rows;
        weight_bytes += (double)matrices[i].rows * matrices[i].row_bytes;
    }
    if (n_tokens == 0) return MOE_OK;
    threads = threads_for(threads, (double)n_tokens * job.width * cols, weight_bytes);
    lock_kernels();
    job.isa = current_isa();
    int unit = unit_takes(job.isa, n_tokens, cols);
    if (n_tokens > job.isa->fused_tokens && !unit) measure_chunk(job.isa, cols);
    job.task_rows = n_tokens <= job.isa->fused_tokens ? split_rows(job.width, 1, threads, TASKS_PER_THREAD, TILE_ROWS)
                    : unit ? panel_rows(UNIT_PANEL_WIDTH(cols), job.width, threads)
                           : panel_rows(cols, job.width, threads);
    for (int i = 0; i < n_matrices; i++)
        job.first_task[i + 1] = job.first_task[i] + (matrices[i].rows + job.task_rows - 1) / job.task_rows;
    int64_t* tokens = workspace(SLOT_PAIRS, (size_t)n_tokens * sizeof(int64_t));
    job.scratch = panel_scratch(threads, 1, job.task_rows, cols, 0, 0, unit);
    if (unit) {
        job.planes = workspace(SLOT_PLANES, (size_t)unit_token_values(n_tokens, cols) * sizeof(uint16_t));
        job.split_tasks = unit_tiles(n_tokens);
        atomic_init(&job.split_done, 0);
    }
    int status = MOE_OK;
    if (tokens && job.scratch && (job.planes || !unit)) {
        for (int64_t t = 0; t < n_tokens; t++) tokens[t] = t;
        job.tokens = tokens;
        pool_run(threads, job.split_tasks + job.first_task[n_matrices], matmul_task, &job);
    } else {
        status = MOE_NO_MEMORY;
    }
    unlock_kernels();
    return status;
}

int moe_rows(const struct moe_matrix* m, const int64_t* ids, int64_t n, float* out) {
    int type, status = check_matrix(m, m->rows, m->cols, &type);
    if (status != MOE_OK) return status;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->rows) return MOE_BAD_ROW;
    const struct isa_kernels* isa = current_isa();
    for (int64_t i = 0; i < n; i++) isa->dequantize[type](stored_row(m, 0, ids[i]), m->cols, out + i * m->cols);
    return MOE_OK;
}
