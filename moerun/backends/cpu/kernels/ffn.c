// moe_ffn: one layer's routed experts for a batch of tokens,
//   out[t] = Σ over t's pairs (t, e, weight) of weight · down_e(silu(gate_e x_t) · up_e x_t).
// The pairs are grouped by expert (ascending), so each expert's weights are read once per
// call whatever its number of tokens. Two parallel phases:
//   gate/up: tasks of (expert, ROWS_PER_TASK rows of F) write h [P, F], pairs in expert order;
//   down:    tasks of ROWS_PER_TASK rows of H (output columns), each over every expert, so no
//            two threads write one output and each token's experts add up in ascending order.
#include <math.h>
#include <string.h>
#include "pool.h"
#include "work.h"

struct ffn_job {
    const struct isa_kernels* isa;
    const struct moe_experts* experts;
    int gate_type, up_type, down_type;
    int64_t hidden, ffn;                 // H, F
    const float* x;                      // [T, H]
    int64_t n_tokens;
    int64_t n_groups;                    // experts with pairs
    const int64_t* group_expert;         // [n_groups], ascending
    const int64_t* group_start;          // [n_groups + 1] into the sorted pairs
    const int64_t* pair_token;           // [P] sorted by expert: the token row
    const float* pair_weight;            // [P]
    const int64_t* pair_index;           // [P] 0, 1, ..., P-1: rows of h
    float* h;                            // [P, F]
    float* out;                          // [T, H]
    int64_t ffn_blocks;                  // tasks per expert of the gate/up phase
    struct scratch* scratch;
};

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Where the tile after rows `row` of expert `expert` of m starts, within a task's rows (up to
// `end`), else in the next task (expert `next_expert`, rows from `next_row`; -1: none).
static const uint8_t* next_tile(const struct moe_matrix* m, int64_t expert, int64_t row, int64_t end,
                                int64_t next_expert, int64_t next_row) {
    if (row + TILE_ROWS < end) return stored_row(m, expert, row + TILE_ROWS);
    return next_expert < 0 ? NULL : stored_row(m, next_expert, next_row);
}

static void gate_up_task(void* context, int64_t task, int64_t next_task, int thread) {
    const struct ffn_job* job = context;
    struct scratch* s = &job->scratch[thread];
    int64_t group = task / job->ffn_blocks, first_row = task % job->ffn_blocks * ROWS_PER_TASK;
    int64_t end_row = min64(job->ffn, first_row + ROWS_PER_TASK);
    int64_t expert = job->group_expert[group], first_pair = job->group_start[group];
    int64_t n = job->group_start[group + 1] - first_pair;
    int64_t next_expert = next_task < 0 ? -1 : job->group_expert[next_task / job->ffn_blocks];
    int64_t next_row = next_task % job->ffn_blocks * ROWS_PER_TASK;
    const int64_t* tokens = job->pair_token + first_pair;
    const struct moe_matrix *gate = &job->experts->gate, *up = &job->experts->up;
    for (int64_t row = first_row; row < end_row; row += TILE_ROWS) {
        int count = (int)min64(TILE_ROWS, end_row - row);
        tile_product(job->isa, gate, job->gate_type, expert, row, count,
                     next_tile(gate, expert, row, end_row, next_expert, next_row), job->x, tokens, n, s->rows[0],
                     s->outs[0]);
        tile_product(job->isa, up, job->up_type, expert, row, count,
                     next_tile(up, expert, row, end_row, next_expert, next_row), job->x, tokens, n, s->rows[1],
                     s->outs[1]);
        for (int64_t i = 0; i < n; i++)
            for (int r = 0; r < count; r++) {
                float g = s->outs[0][i * TILE_ROWS + r], u = s->outs[1][i * TILE_ROWS + r];
                job->h[(first_pair + i) * job->ffn + row + r] = g / (1.f + expf(-g)) * u;
            }
    }
}

static void down_task(void* context, int64_t task, int64_t next_task, int thread) {
    const struct ffn_job* job = context;
    struct scratch* s = &job->scratch[thread];
    const struct moe_matrix* down = &job->experts->down;
    int64_t first_row = task * ROWS_PER_TASK, end_row = min64(job->hidden, first_row + ROWS_PER_TASK);
    for (int64_t t = 0; t < job->n_tokens; t++)
        memset(job->out + t * job->hidden + first_row, 0, (size_t)(end_row - first_row) * sizeof(float));
    for (int64_t group = 0; group < job->n_groups; group++) {
        int64_t expert = job->group_expert[group], first_pair = job->group_start[group];
        int64_t n = job->group_start[group + 1] - first_pair;
        // after this expert's rows: the next expert's, or the next task's first expert's
        int64_t next_expert = group + 1 < job->n_groups ? job->group_expert[group + 1]
                              : next_task < 0          ? -1
                                                       : job->group_expert[0];
        int64_t next_row = group + 1 < job->n_groups ? first_row : next_task * ROWS_PER_TASK;
        for (int64_t row = first_row; row < end_row; row += TILE_ROWS) {
            int count = (int)min64(TILE_ROWS, end_row - row);
            tile_product(job->isa, down, job->down_type, expert, row, count,
                         next_tile(down, expert, row, end_row, next_expert, next_row), job->h,
                         job->pair_index + first_pair, n, s->rows[2], s->outs[0]);
            for (int64_t i = 0; i < n; i++) {
                float weight = job->pair_weight[first_pair + i];
                float* out = job->out + job->pair_token[first_pair + i] * job->hidden + row;
                for (int r = 0; r < count; r++) out[r] += weight * s->outs[0][i * TILE_ROWS + r];
            }
        }
    }
}

// Pairs sorted by expert (stable: a token's order within an expert stays), the experts that
// have any, and where each one's pairs start.
static int group_pairs(struct ffn_job* job, const int64_t* rows, const int64_t* experts, const float* weights,
                       int64_t n_pairs) {
    int64_t n_experts = job->experts->n_experts;
    int64_t* sorted = workspace(SLOT_PAIRS, (size_t)n_pairs * (2 * sizeof(int64_t) + sizeof(float)));
    int64_t* groups = workspace(SLOT_GROUPS, (size_t)(3 * n_experts + 2) * sizeof(int64_t));
    if (!sorted || !groups) return MOE_NO_MEMORY;
    int64_t* pair_token = sorted;
    int64_t* pair_index = sorted + n_pairs;
    float* pair_weight = (float*)(sorted + 2 * n_pairs);
    int64_t* start = groups;                         // [E + 1] where each expert's pairs go
    int64_t* group_expert = groups + n_experts + 1;  // [E]
    int64_t* group_start = group_expert + n_experts; // [E + 1]
    memset(start, 0, (size_t)(n_experts + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < n_pairs; p++) start[experts[p] + 1]++;
    job->n_groups = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        if (start[e + 1]) {
            group_expert[job->n_groups] = e;
            group_start[job->n_groups++] = start[e];
        }
        start[e + 1] += start[e];
    }
    group_start[job->n_groups] = n_pairs;
    for (int64_t p = 0; p < n_pairs; p++) {
        int64_t slot = start[experts[p]]++;
        pair_token[slot] = rows[p];
        pair_weight[slot] = weights[p];
        pair_index[p] = p;
    }
    job->pair_token = pair_token;
    job->pair_weight = pair_weight;
    job->pair_index = pair_index;
    job->group_expert = group_expert;
    job->group_start = group_start;
    return MOE_OK;
}

static int check_pairs(const int64_t* rows, const int64_t* experts, int64_t n_pairs, int64_t n_tokens,
                       int64_t n_experts) {
    for (int64_t p = 0; p < n_pairs; p++) {
        if (experts[p] < 0 || experts[p] >= n_experts) return MOE_BAD_EXPERT;
        if (rows[p] < 0 || rows[p] >= n_tokens) return MOE_BAD_ROW;
    }
    return MOE_OK;
}

static int run(struct ffn_job* job, const int64_t* rows, const int64_t* experts, const float* weights,
               int64_t n_pairs, int threads) {
    int status = group_pairs(job, rows, experts, weights, n_pairs);
    if (status != MOE_OK) return status;
    int64_t most_pairs = 0;                 // of one expert
    for (int64_t g = 0; g < job->n_groups; g++)
        if (job->group_start[g + 1] - job->group_start[g] > most_pairs)
            most_pairs = job->group_start[g + 1] - job->group_start[g];
    int64_t widest = job->hidden > job->ffn ? job->hidden : job->ffn;
    job->scratch = thread_scratch(threads, 3, widest, 2, most_pairs);
    job->h = workspace(SLOT_H, (size_t)(n_pairs * job->ffn) * sizeof(float));
    if (!job->scratch || !job->h) return MOE_NO_MEMORY;
    job->ffn_blocks = (job->ffn + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    pool_run(threads, job->n_groups * job->ffn_blocks, gate_up_task, job);
    pool_run(threads, (job->hidden + ROWS_PER_TASK - 1) / ROWS_PER_TASK, down_task, job);
    return MOE_OK;
}

int moe_ffn(const struct moe_experts* experts, const float* x, int64_t n_tokens, const int64_t* rows,
            const int64_t* pair_experts, const float* weights, int64_t n_pairs, float* out, int threads) {
    int64_t hidden = experts->down.rows, ffn = experts->gate.rows;
    struct ffn_job job = {.experts = experts, .hidden = hidden, .ffn = ffn, .x = x, .n_tokens = n_tokens,
                          .out = out};
    int status = check_matrix(&experts->gate, ffn, hidden, &job.gate_type);
    if (status == MOE_OK) status = check_matrix(&experts->up, ffn, hidden, &job.up_type);
    if (status == MOE_OK) status = check_matrix(&experts->down, hidden, ffn, &job.down_type);
    if (status == MOE_OK) status = check_pairs(rows, pair_experts, n_pairs, n_tokens, experts->n_experts);
    if (status != MOE_OK || n_tokens == 0) return status;
    lock_kernels();
    job.isa = current_isa();
    status = run(&job, rows, pair_experts, weights, n_pairs, threads_for(threads, 3.0 * n_pairs * hidden * ffn));
    unlock_kernels();
    return status;
}
