// moe_ffn: one layer's routed experts for a batch of tokens,
//   out[t] = Σ over t's pairs (t, e, weight) of weight · down_e(silu(gate_e x_t) · up_e x_t).
// The pairs are grouped by expert (ascending), so each expert's weights are read once per
// call whatever its number of tokens. One pool job of two kinds of tasks, taken in order:
//   gate/up: (expert, ffn_rows rows of F) write h [P, F], pairs in expert order;
//   down:    down_rows rows of H (output columns), each over every expert, so no two threads
//            write one output and each token's experts add up in ascending order. Before an
//            expert's rows a down task waits until that expert's gate/up tasks are done (a
//            counter per expert): no barrier between the kinds, and threads that finish
//            gate/up early go on with the first experts' down rows.
// A job with few tasks (a decode step's few experts) takes fewer rows a task, so that every
// thread has several and none waits long for the last.
// With a matrix unit, an expert with at least its least_tokens pairs goes to it, and two more
// kinds of tasks, one per expert, split its operands into planes: before the gate/up tasks,
// its tokens' x (which its gate/up tasks wait for); after them, its h (which down waits for).
#include <math.h>
#include <string.h>
#include "pool.h"
#include "work.h"

#define TASKS_PER_THREAD 8      // of each kind, where rows can be split that finely
#define FEWEST_TASK_ROWS 8

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
    atomic_int_fast64_t* group_done;     // [n_groups] gate/up tasks finished
    const int64_t* pair_token;           // [P] sorted by expert: the token row
    const float* pair_weight;            // [P]
    const int64_t* pair_index;           // [P] 0, 1, ..., P-1: rows of h
    float* h;                            // [P, F]
    float* out;                          // [T, H]
    int64_t ffn_rows, ffn_blocks;        // rows of F a gate/up task computes; tasks per expert
    int64_t down_rows;                   // rows of H a down task computes
    int64_t gate_up_tasks;               // n_groups · ffn_blocks
    struct scratch* scratch;
    // the matrix unit's
    int unit;                            // whether it takes the experts with enough pairs
    int64_t split_tasks;                 // n_groups with the unit, else 0; the order of tasks:
                                         // x splits, gate/up, h splits, down
    int64_t* group_tile;                 // [n_groups] the first tile of a group's planes
    atomic_int_fast64_t* group_split;    // [n_groups] x split (1), h split (2)
    uint16_t *x_planes, *h_planes;       // [tiles] of H values, of F values
};

// Whether the group's pairs go to the matrix unit.
static int on_unit(const struct ffn_job* job, int64_t group) {
    return job->unit && job->group_start[group + 1] - job->group_start[group] >= job->isa->unit->least_tokens;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The first rows of m that task `task` reads (NULL for -1): a gate/up task's of its expert
// (m gate or up), a down task's of the first expert (m down).
// (Tasks numbered as gate/up tasks first: the split tasks left out.)
static const uint8_t* first_rows(const struct ffn_job* job, const struct moe_matrix* m, int64_t task) {
    if (task < 0) return NULL;
    if (task < job->gate_up_tasks)
        return stored_row(m, job->group_expert[task / job->ffn_blocks], task % job->ffn_blocks * job->ffn_rows);
    return stored_row(&job->experts->down, job->group_expert[0], (task - job->gate_up_tasks) * job->down_rows);
}

// Where a group's planes of n values start in `planes` (x_planes, n = H; h_planes, n = F).
static uint16_t* group_planes(const struct ffn_job* job, uint16_t* planes, int64_t group, int64_t n) {
    return planes + unit_token_values(job->group_tile[group] * UNIT_TOKENS, n);
}

// h = silu(g) · u for the group's pairs from first_pair on, rows row .. row + count - 1 of F,
// from their products g and u [pairs, stride].
static void store_h(const struct ffn_job* job, int64_t first_pair, int64_t n, int64_t row, int64_t count,
                    const float* g, const float* u, int64_t stride) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = 0; r < count; r++) {
            float gate = g[i * stride + r], up = u[i * stride + r];
            job->h[(first_pair + i) * job->ffn + row + r] = gate / (1.f + expf(-gate)) * up;
        }
}

// Each pair's weight times its down products [pairs, stride] added into its token's rows
// row .. row + count - 1 of out.
static void add_down(const struct ffn_job* job, int64_t first_pair, int64_t n, int64_t row, int64_t count,
                     const float* products, int64_t stride) {
    for (int64_t i = 0; i < n; i++) {
        float weight = job->pair_weight[first_pair + i];
        float* out = job->out + job->pair_token[first_pair + i] * job->hidden + row;
        for (int64_t r = 0; r < count; r++) out[r] += weight * products[i * stride + r];
    }
}

// One group's operands into planes: its tokens' x (stage 1) or, once its gate/up tasks are
// done, its h (stage 2).
static void split_task(const struct ffn_job* job, int64_t group, int stage) {
    if (!on_unit(job, group)) return;
    int64_t first_pair = job->group_start[group], n = job->group_start[group + 1] - first_pair;
    const struct matrix_unit* unit = job->isa->unit;
    if (stage == 1) {
        unit->split_tokens(job->x, job->pair_token + first_pair, n, job->hidden,
                           group_planes(job, job->x_planes, group, job->hidden));
    } else {
        pool_wait(&job->group_done[group], job->ffn_blocks);
        unit->split_tokens(job->h + first_pair * job->ffn, NULL, n, job->ffn,
                           group_planes(job, job->h_planes, group, job->ffn));
    }
    atomic_store_explicit(&job->group_split[group], stage, memory_order_release);
}

// A gate/up task on the unit: its rows of gate and of up for all of the group's tokens at once.
static void unit_gate_up(const struct ffn_job* job, int64_t group, int64_t first_row, int64_t end_row,
                         struct scratch* s) {
    pool_wait(&job->group_split[group], 1);
    int64_t expert = job->group_expert[group], first_pair = job->group_start[group];
    int64_t n = job->group_start[group + 1] - first_pair, count = end_row - first_row;
    const uint16_t* planes = group_planes(job, job->x_planes, group, job->hidden);
    unit_product(job->isa, &job->experts->gate, job->gate_type, expert, first_row, count, planes, n, s->planes,
                 s->outs[0], count);
    unit_product(job->isa, &job->experts->up, job->up_type, expert, first_row, count, planes, n, s->planes,
                 s->outs[1], count);
    store_h(job, first_pair, n, first_row, count, s->outs[0], s->outs[1], count);
}

static void gate_up_task(const struct ffn_job* job, int64_t task, int64_t next_task, int thread) {
    struct scratch* s = &job->scratch[thread];
    int64_t group = task / job->ffn_blocks, first_row = task % job->ffn_blocks * job->ffn_rows;
    int64_t end_row = min64(job->ffn, first_row + job->ffn_rows);
    int64_t expert = job->group_expert[group], first_pair = job->group_start[group];
    int64_t n = job->group_start[group + 1] - first_pair;
    const int64_t* tokens = job->pair_token + first_pair;
    const struct moe_matrix *gate = &job->experts->gate, *up = &job->experts->up;
    if (on_unit(job, group)) unit_gate_up(job, group, first_row, end_row, s);
    else for (int64_t row = first_row; row < end_row; row += TILE_ROWS) {
        int count = (int)min64(TILE_ROWS, end_row - row);
        int last = row + TILE_ROWS >= end_row;
        tile_product(job->isa, gate, job->gate_type, expert, row, count,
                     last ? first_rows(job, gate, next_task) : stored_row(gate, expert, row + TILE_ROWS), job->x,
                     tokens, n, s->rows[0], s->outs[0]);
        tile_product(job->isa, up, job->up_type, expert, row, count,
                     last ? first_rows(job, up, next_task) : stored_row(up, expert, row + TILE_ROWS), job->x,
                     tokens, n, s->rows[1], s->outs[1]);
        store_h(job, first_pair, n, row, count, s->outs[0], s->outs[1], TILE_ROWS);
    }
    atomic_fetch_add_explicit(&job->group_done[group], 1, memory_order_release);
}

static void down_task(const struct ffn_job* job, int64_t task, int64_t next_task, int thread) {
    struct scratch* s = &job->scratch[thread];
    const struct moe_matrix* down = &job->experts->down;
    int64_t first_row = (task - job->gate_up_tasks) * job->down_rows;
    int64_t end_row = min64(job->hidden, first_row + job->down_rows);
    for (int64_t t = 0; t < job->n_tokens; t++)
        memset(job->out + t * job->hidden + first_row, 0, (size_t)(end_row - first_row) * sizeof(float));
    for (int64_t group = 0; group < job->n_groups; group++) {
        int64_t expert = job->group_expert[group], first_pair = job->group_start[group];
        int64_t n = job->group_start[group + 1] - first_pair;
        if (on_unit(job, group)) {
            pool_wait(&job->group_split[group], 2);
            int64_t count = end_row - first_row;
            unit_product(job->isa, down, job->down_type, expert, first_row, count,
                         group_planes(job, job->h_planes, group, job->ffn), n, s->planes, s->outs[0], count);
            add_down(job, first_pair, n, first_row, count, s->outs[0], count);
            continue;
        }
        pool_wait(&job->group_done[group], job->ffn_blocks);
        for (int64_t row = first_row; row < end_row; row += TILE_ROWS) {
            int count = (int)min64(TILE_ROWS, end_row - row);
            // after this expert's rows: the next expert's, or the next task's first expert's
            const uint8_t* next = row + TILE_ROWS < end_row    ? stored_row(down, expert, row + TILE_ROWS)
                                  : group + 1 < job->n_groups ? stored_row(down, job->group_expert[group + 1], first_row)
                                                              : first_rows(job, down, next_task);
            tile_product(job->isa, down, job->down_type, expert, row, count, next, job->h,
                         job->pair_index + first_pair, n, s->rows[2], s->outs[0]);
            add_down(job, first_pair, n, row, count, s->outs[0], TILE_ROWS);
        }
    }
}

// A task's number among the gate/up and down tasks (first_rows'), or -1: a split task, or none.
static int64_t product_task(const struct ffn_job* job, int64_t task) {
    int64_t splits = job->split_tasks;
    if (task < splits) return -1;
    task -= splits;
    if (task < job->gate_up_tasks) return task;
    return task < job->gate_up_tasks + splits ? -1 : task - splits;
}

static void ffn_task(void* context, int64_t task, int64_t next_task, int thread) {
    const struct ffn_job* job = context;
    int64_t product = product_task(job, task), next = product_task(job, next_task);
    if (task < job->split_tasks)
        split_task(job, task, 1);
    else if (product < 0)
        split_task(job, task - job->split_tasks - job->gate_up_tasks, 2);
    else if (product < job->gate_up_tasks)
        gate_up_task(job, product, next, thread);
    else
        down_task(job, product, next, thread);
}

// Pairs sorted by expert (stable: a token's order within an expert stays), the experts that
// have any, and where each one's pairs start.
static int group_pairs(struct ffn_job* job, const int64_t* rows, const int64_t* experts, const float* weights,
                       int64_t n_pairs) {
    int64_t n_experts = job->experts->n_experts;
    int64_t* sorted = workspace(SLOT_PAIRS, (size_t)n_pairs * (2 * sizeof(int64_t) + sizeof(float)));
    int64_t* groups = workspace(SLOT_GROUPS, (size_t)(4 * n_experts + 2) * sizeof(int64_t) +
                                                 (size_t)(2 * n_experts) * sizeof(atomic_int_fast64_t));
    if (!sorted || !groups) return MOE_NO_MEMORY;
    int64_t* pair_token = sorted;
    int64_t* pair_index = sorted + n_pairs;
    float* pair_weight = (float*)(sorted + 2 * n_pairs);
    int64_t* start = groups;                         // [E + 1] where each expert's pairs go
    int64_t* group_expert = groups + n_experts + 1;  // [E]
    int64_t* group_start = group_expert + n_experts; // [E + 1]
    int64_t* group_tile = group_start + n_experts + 1;                                      // [E]
    atomic_int_fast64_t* group_done = (atomic_int_fast64_t*)(group_tile + n_experts);       // [E]
    atomic_int_fast64_t* group_split = group_done + n_experts;                              // [E]
    memset(start, 0, (size_t)(n_experts + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < n_pairs; p++) start[experts[p] + 1]++;
    job->n_groups = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        if (start[e + 1]) {
            group_expert[job->n_groups] = e;
            atomic_init(&group_done[job->n_groups], 0);
            atomic_init(&group_split[job->n_groups], 0);
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
    job->group_done = group_done;
    job->group_tile = group_tile;
    job->group_split = group_split;
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
    job->unit = unit_takes(job->isa, most_pairs, job->hidden) && unit_takes(job->isa, most_pairs, job->ffn);
    job->scratch = job->unit ? panel_scratch(threads, 3, ROWS_PER_TASK, widest, 2, most_pairs, 1)
                             : thread_scratch(threads, 3, widest, 2, most_pairs);
    job->h = workspace(SLOT_H, (size_t)(n_pairs * job->ffn) * sizeof(float));
    if (!job->scratch || !job->h) return MOE_NO_MEMORY;
    if (job->unit) {
        int64_t tiles = 0;
        for (int64_t g = 0; g < job->n_groups; g++) {
            job->group_tile[g] = tiles;
            if (on_unit(job, g)) tiles += unit_tiles(job->group_start[g + 1] - job->group_start[g]);
        }
        job->x_planes = workspace(SLOT_PLANES, (size_t)unit_token_values(tiles * UNIT_TOKENS, job->hidden) * 2);
        job->h_planes = workspace(SLOT_H_PLANES, (size_t)unit_token_values(tiles * UNIT_TOKENS, job->ffn) * 2);
        if (!job->x_planes || !job->h_planes) return MOE_NO_MEMORY;
        job->split_tasks = job->n_groups;
    }
    job->ffn_rows = split_rows(job->ffn, job->n_groups, threads, TASKS_PER_THREAD, FEWEST_TASK_ROWS);
    job->ffn_blocks = (job->ffn + job->ffn_rows - 1) / job->ffn_rows;
    job->down_rows = split_rows(job->hidden, 1, threads, TASKS_PER_THREAD, FEWEST_TASK_ROWS);
    job->gate_up_tasks = job->n_groups * job->ffn_blocks;
    int64_t down_tasks = (job->hidden + job->down_rows - 1) / job->down_rows;
    pool_run(threads, 2 * job->split_tasks + job->gate_up_tasks + down_tasks, ffn_task, job);
    return MOE_OK;
}

// The pairs of ids and weights [T, K] (an id < 0: no expert; with a map, an index into it):
// rows, experts and weights [P] in the padded workspace. MOE_BAD_EXPERT for an id past the map.
static int unpad(const int64_t* ids, const float* weights, int64_t n_tokens, int64_t per_token,
                 const int64_t* expert_map, int64_t n_map, const int64_t** rows, const int64_t** experts,
                 const float** pair_weights, int64_t* n_pairs) {
    int64_t most = n_tokens * per_token;
    int64_t* memory = workspace(SLOT_PADDED, (size_t)most * (2 * sizeof(int64_t) + sizeof(float)));
    if (!memory) return MOE_NO_MEMORY;
    int64_t *row = memory, *expert = memory + most, n = 0;
    float* weight = (float*)(memory + 2 * most);
    for (int64_t i = 0; i < most; i++) {
        int64_t id = ids[i];
        if (id < 0) continue;
        if (expert_map && id >= n_map) return MOE_BAD_EXPERT;
        row[n] = i / per_token;
        expert[n] = expert_map ? expert_map[id] : id;
        weight[n++] = weights[i];
    }
    *rows = row, *experts = expert, *pair_weights = weight, *n_pairs = n;
    return MOE_OK;
}

// The checks of both entry points, then the job under the kernels' lock (`ids` given: the
// pairs padded, unpadded first).
static int ffn(const struct moe_experts* experts, const float* x, int64_t n_tokens, const int64_t* rows,
               const int64_t* pair_experts, const float* weights, int64_t n_pairs, const int64_t* ids,
               int64_t per_token, const int64_t* expert_map, int64_t n_map, float* out, int threads) {
    int64_t hidden = experts->down.rows, ffn = experts->gate.rows;
    struct ffn_job job = {.experts = experts, .hidden = hidden, .ffn = ffn, .x = x, .n_tokens = n_tokens,
                          .out = out};
    int status = check_matrix(&experts->gate, ffn, hidden, &job.gate_type);
    if (status == MOE_OK) status = check_matrix(&experts->up, ffn, hidden, &job.up_type);
    if (status == MOE_OK) status = check_matrix(&experts->down, hidden, ffn, &job.down_type);
    if (status != MOE_OK) return status;
    lock_kernels();
    if (ids) status = unpad(ids, weights, n_tokens, per_token, expert_map, n_map, &rows, &pair_experts, &weights,
                            &n_pairs);
    if (status == MOE_OK) status = check_pairs(rows, pair_experts, n_pairs, n_tokens, experts->n_experts);
    if (status == MOE_OK && n_tokens > 0) {
        job.isa = current_isa();
        status = run(&job, rows, pair_experts, weights, n_pairs,
                     threads_for(threads, 3.0 * n_pairs * hidden * ffn, 0));
    }
    unlock_kernels();
    return status;
}

int moe_ffn(const struct moe_experts* experts, const float* x, int64_t n_tokens, const int64_t* rows,
            const int64_t* pair_experts, const float* weights, int64_t n_pairs, float* out, int threads) {
    return ffn(experts, x, n_tokens, rows, pair_experts, weights, n_pairs, NULL, 0, NULL, 0, out, threads);
}

int moe_ffn_padded(const struct moe_experts* experts, const float* x, int64_t n_tokens, const int64_t* ids,
                   const float* weights, int64_t per_token, const int64_t* expert_map, int64_t n_map, float* out,
                   int threads) {
    return ffn(experts, x, n_tokens, NULL, NULL, weights, 0, ids, per_token, expert_map, n_map, out, threads);
}
