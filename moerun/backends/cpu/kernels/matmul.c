// moe_matmul: y [T, N] = x [T, n] · Wᵀ for one matrix W [N, n] as stored (expert 0 of a
// struct moe_matrix), with the tiles the experts use; tasks of ROWS_PER_TASK rows.
#include "pool.h"
#include "work.h"

struct matmul_job {
    const struct isa_kernels* isa;
    const struct moe_matrix* matrix;
    int type;
    const float* x;
    const int64_t* tokens;      // 0, 1, ..., T-1
    int64_t n_tokens;
    float* y;
    struct scratch* scratch;
};

static void matmul_task(void* context, int64_t task, int thread) {
    const struct matmul_job* job = context;
    struct scratch* s = &job->scratch[thread];
    int64_t rows = job->matrix->rows, end = task * ROWS_PER_TASK + ROWS_PER_TASK;
    for (int64_t row = task * ROWS_PER_TASK; row < end && row < rows; row += TILE_ROWS) {
        int count = rows - row < TILE_ROWS ? (int)(rows - row) : TILE_ROWS;
        tile_product(job->isa, job->matrix, job->type, 0, row, count, job->x, job->tokens, job->n_tokens, s->rows[0],
                     s->outs[0]);
        for (int64_t t = 0; t < job->n_tokens; t++)
            for (int r = 0; r < count; r++) job->y[t * rows + row + r] = s->outs[0][t * TILE_ROWS + r];
    }
}

int moe_matmul(const struct moe_matrix* matrix, const float* x, int64_t n_tokens, float* y, int threads) {
    struct matmul_job job = {.matrix = matrix, .x = x, .n_tokens = n_tokens, .y = y};
    int status = check_matrix(matrix, matrix->rows, matrix->cols, &job.type);
    if (status != MOE_OK || n_tokens == 0) return status;
    threads = threads_for(threads, (double)n_tokens * matrix->rows * matrix->cols);
    lock_kernels();
    job.isa = current_isa();
    int64_t* tokens = workspace(SLOT_PAIRS, (size_t)n_tokens * sizeof(int64_t));
    job.scratch = thread_scratch(threads, 1, matrix->cols, 1, n_tokens);
    if (tokens && job.scratch) {
        for (int64_t t = 0; t < n_tokens; t++) tokens[t] = t;
        job.tokens = tokens;
        pool_run(threads, (matrix->rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK, matmul_task, &job);
    } else {
        status = MOE_NO_MEMORY;
    }
    unlock_kernels();
    return status;
}
