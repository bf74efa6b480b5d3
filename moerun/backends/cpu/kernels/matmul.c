// moe_matmul: y [T, ΣN] = x [T, n] · [W_0; W_1; ...]ᵀ for matrices W_i [N_i, n] as stored
// (expert 0 of each struct moe_matrix), their products side by side in y: q, k and v in one
// job. Tasks of ROWS_PER_TASK rows of one matrix, with the tiles the experts use.
#include "pool.h"
#include "work.h"

struct matmul_job {
    const struct isa_kernels* isa;
    const struct moe_matrix* matrices;
    int types[MOE_MAX_MATRICES];
    int64_t first_task[MOE_MAX_MATRICES + 1];   // matrix i's tasks: first_task[i] .. first_task[i + 1] - 1
    int64_t first_column[MOE_MAX_MATRICES];     // its products' column in y
    int64_t width;                              // ΣN
    const float* x;
    const int64_t* tokens;                      // 0, 1, ..., T-1
    int64_t n_tokens;
    float* y;
    struct scratch* scratch;
};

// The matrix of a task (its index) and the first of its rows.
static int task_rows(const struct matmul_job* job, int64_t task, int64_t* first_row) {
    int i = 0;
    while (task >= job->first_task[i + 1]) i++;
    *first_row = (task - job->first_task[i]) * ROWS_PER_TASK;
    return i;
}

static void matmul_task(void* context, int64_t task, int64_t next_task, int thread) {
    const struct matmul_job* job = context;
    struct scratch* s = &job->scratch[thread];
    int64_t first, after;
    int i = task_rows(job, task, &first), j = next_task < 0 ? -1 : task_rows(job, next_task, &after);
    const struct moe_matrix* matrix = &job->matrices[i];
    int64_t end = first + ROWS_PER_TASK < matrix->rows ? first + ROWS_PER_TASK : matrix->rows;
    for (int64_t row = first; row < end; row += TILE_ROWS) {
        int count = end - row < TILE_ROWS ? (int)(end - row) : TILE_ROWS;
        const uint8_t* next = row + TILE_ROWS < end ? stored_row(matrix, 0, row + TILE_ROWS)
                              : j < 0                ? NULL
                                                     : stored_row(&job->matrices[j], 0, after);
        tile_product(job->isa, matrix, job->types[i], 0, row, count, next, job->x, job->tokens, job->n_tokens,
                     s->rows[0], s->outs[0]);
        float* y = job->y + job->first_column[i] + row;
        for (int64_t t = 0; t < job->n_tokens; t++)
            for (int r = 0; r < count; r++) y[t * job->width + r] = s->outs[0][t * TILE_ROWS + r];
    }
}

int moe_matmul(const struct moe_matrix* matrices, int64_t n_matrices, const float* x, int64_t n_tokens, float* y,
               int threads) {
    if (n_matrices < 1 || n_matrices > MOE_MAX_MATRICES) return MOE_BAD_SHAPE;
    struct matmul_job job = {.matrices = matrices, .x = x, .n_tokens = n_tokens, .y = y};
    int64_t cols = matrices[0].cols;
    for (int i = 0; i < n_matrices; i++) {
        int status = check_matrix(&matrices[i], matrices[i].rows, cols, &job.types[i]);
        if (status != MOE_OK) return status;
        job.first_column[i] = job.width;
        job.width += matrices[i].rows;
        job.first_task[i + 1] = job.first_task[i] + (matrices[i].rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    }
    if (n_tokens == 0) return MOE_OK;
    threads = threads_for(threads, (double)n_tokens * job.width * cols);
    lock_kernels();
    job.isa = current_isa();
    int64_t* tokens = workspace(SLOT_PAIRS, (size_t)n_tokens * sizeof(int64_t));
    job.scratch = thread_scratch(threads, 1, cols, 1, n_tokens);
    int status = MOE_OK;
    if (tokens && job.scratch) {
        for (int64_t t = 0; t < n_tokens; t++) tokens[t] = t;
        job.tokens = tokens;
        pool_run(threads, job.first_task[n_matrices], matmul_task, &job);
    } else {
        status = MOE_NO_MEMORY;
    }
    unlock_kernels();
    return status;
}
