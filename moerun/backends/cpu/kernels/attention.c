// Causal attention over the KV cache for a CPU parent: a prefill chunk by blocks of tokens
// through the instruction set's float32 products, over the cache a block of KEY_BLOCK positions
// at a time (the softmax kept running: no scores of the whole context in memory), a few tokens
// one task per token and kv head, their positions split over the threads where there are
// several. The same math as moerun/backends/numpy_ops.py's causal_attention, in float32, over
// a cache of any element type a cache may keep (its rows dequantized as they are read).
//
// Shape legend: T tokens, S cached positions, NH/NKV heads, G = NH/NKV, D/Dv head dims,
// R = a block's rows (its tokens' query heads of one kv head), B key positions of a block.
#include <stdlib.h>

#include "lanes.h"
#include "pool.h"
#include "work.h"

#define ATTENTION_BLOCK 16      // tokens of a prefill attention task
#define BLOCK_TOKENS_LEAST 16   // chunks of at least this many tokens go by blocks

#define KEY_BLOCK 256           // cache positions a prefill block's pass takes: its keys, values
                                // transposed and scores (R x B) stay in L2
#define PACK_ROWS 512           // cache rows a task of the prefill's packing copies (whole key blocks)

_Static_assert(PACK_ROWS % KEY_BLOCK == 0, "a packing task writes whole key blocks");

// Floats of one thread's scratch for a prefill block, in whole cache lines: row pointers [3, R]
// (first: q's rows, the scores', the sums'), scores [R, B], the running sums [R, Dv], and per row
// the largest score so far and the sum of e^(score - largest) [2, R].
static int64_t block_scratch(const struct moe_attention* shape) {
    int64_t rows = ATTENTION_BLOCK * shape->n_heads / shape->n_kv_heads;
    return (6 * rows + KEY_BLOCK * rows + rows * shape->head_dim_v + 2 * rows + 15) / 16 * 16;
}

INLINE int64_t round_up_lanes(int64_t n) { return (n + LANES - 1) / LANES * LANES; }

// Floats of a prefill chunk's packed cache, shared by its tasks: each kv head's keys a key block
// at a time transposed, [NKV, S / B, D, B] (the last block's width rounded up to whole vectors),
// then its values [NKV, S, Dv] (rows next to each other).
static int64_t packed_floats(const struct moe_attention* shape, int64_t seen) {
    return shape->n_kv_heads * (shape->head_dim_k * round_up_lanes(seen) + shape->head_dim_v * seen);
}

#define SPLIT_POSITIONS 256     // fewest positions a split of a few tokens' attention takes
#define KEY_CHUNK 256           // keys a few tokens' q·kᵀ copies into a panel at a time

#define PV_ROWS 32      // value rows a few tokens' p·v takes at a time (they stay in L1)

// Floats of one thread's scratch for a few tokens over shares of `width` positions, in whole
// cache lines: heads [G] (int64, first), probabilities [G, width], a panel of keys [KEY_CHUNK, D],
// value rows dequantized [PV_ROWS, Dv].
static int64_t few_scratch(const struct moe_attention* shape, int64_t width) {
    int64_t group = shape->n_heads / shape->n_kv_heads;
    return (2 * group + group * width + KEY_CHUNK * shape->head_dim_k + PV_ROWS * shape->head_dim_v + 15) / 16 * 16;
}

// Scores p [n] -> e^(p·scale - top) in place, top the largest of them and `floor` (-inf: of them
// alone); returns their sum, and top in *top.
INLINE float exponentiate(float* p, int64_t n, float scale, float floor, float* top) {
    for (int64_t s = 0; s < n; s++) p[s] *= scale;
    float here = largest(p, n);
    *top = here > floor ? here : floor;
    for (int64_t s = 0; s < n; s++) p[s] = exp_nonpositive(p[s] - *top);
    return sum(p, n);
}

struct attention_job {
    const struct moe_attention* shape;
    const float* q;             // [T, NH, D]
    int64_t n_tokens, start;
    const uint8_t *keys, *values;   // [S, NKV, D], [S, NKV, Dv] of the cache's types
    int key_type, value_type;       // their type indices
    int64_t key_bytes, value_bytes; // of one head's row
    float* out;                 // [T, NH * Dv]
    float* scores;              // each thread's scratch: few_scratch or block_scratch floats
    int64_t splits, width;      // per token and kv head (a few tokens), and the most positions of one
    float* parts;               // with splits: per task [G, 2] (max, sum), then [G, Dv] (Σ e^(s - max) · v)
    float* packed;              // a prefill chunk's: packed_floats, the cache's rows [0, start + T)
};

#define PV_HEADS 4      // query heads whose outputs one pass of a few tokens' p·v keeps in registers ...
#define PV_VECTORS 4    // ... PV_VECTORS · LANES dims of each

// out [G, Dv] += Σ_s probs[g · n + s] · values[s] over `rows` (at most PV_ROWS) value rows `stride`
// floats apart: each pass over them holds PV_HEADS heads' PV_VECTORS·LANES dims in registers and
// reads each row's dims once for them (the dims and heads left over go one at a time).
INLINE void weigh_values(const float* probs, int64_t n, int64_t rows, const float* values, int64_t stride,
                         int64_t group, int64_t dim_v, float* out) {
    const int64_t width = PV_VECTORS * LANES;
    for (int64_t g0 = 0; g0 < group; g0 += PV_HEADS)
        for (int64_t d0 = 0; d0 < dim_v; d0 += width) {
            if (g0 + PV_HEADS <= group && d0 + width <= dim_v) {
                vf acc[PV_HEADS][PV_VECTORS];
                for (int h = 0; h < PV_HEADS; h++) memcpy(acc[h], out + (g0 + h) * dim_v + d0, sizeof acc[h]);
                for (int64_t s = 0; s < rows; s++) {
                    vf x[PV_VECTORS];
                    for (int k = 0; k < PV_VECTORS; k++) load(&x[k], values + s * stride + d0 + k * LANES);
                    for (int h = 0; h < PV_HEADS; h++) {
                        vf weight = (vf){0} + probs[(g0 + h) * n + s];
                        for (int k = 0; k < PV_VECTORS; k++) acc[h][k] += weight * x[k];
                    }
                }
                for (int h = 0; h < PV_HEADS; h++) memcpy(out + (g0 + h) * dim_v + d0, acc[h], sizeof acc[h]);
                continue;
            }
            int64_t heads = group - g0 < PV_HEADS ? group - g0 : PV_HEADS;
            int64_t to = d0 + width < dim_v ? d0 + width : dim_v;
            for (int64_t h = g0; h < g0 + heads; h++)
                for (int64_t s = 0; s < rows; s++)
                    for (int64_t i = d0; i < to; i++) out[h * dim_v + i] += probs[h * n + s] * values[s * stride + i];
        }
}

// One token's G = NH/NKV query heads that read kv head `kv`, over positions [from, to): each key
// and value row is read once for all of them. With `part` NULL (the token's whole range) the
// softmax's output goes into out [G, Dv]; else each head's largest score and sum of e^(score -
// largest) into part [G, 2], and the sums of e^(score - largest) · v into out. `scratch` is this
// thread's few_scratch. q·kᵀ is the instruction set's float32 `multiply` over the keys
// dequantized KEY_CHUNK at a time into a panel [KEY_CHUNK, D], the query heads its tokens (as a
// prefill block's); p·v by weigh_values, PV_ROWS value rows at a time (dequantized first unless
// they are float32).
INLINE void attend_group(const struct attention_job* job, int64_t t, int64_t kv, int64_t from, int64_t to,
                         float* scratch, float* out, float* part) {
    const struct moe_attention* shape = job->shape;
    int64_t nh = shape->n_heads, nkv = shape->n_kv_heads, dim = shape->head_dim_k, dim_v = shape->head_dim_v;
    int64_t group = nh / nkv, n = to - from;
    int64_t* heads = (int64_t*)scratch;                                           // 0 .. G-1
    float* probs = scratch + 2 * group;                                           // [G, n]
    float* panel = probs + group * job->width;                                    // [KEY_CHUNK, D]
    float* value_rows = panel + KEY_CHUNK * dim;                                  // [PV_ROWS, Dv]
    const float* q = job->q + (t * nh + kv * group) * dim;                       // [G, D]
    const uint8_t* keys = job->keys + (from * nkv + kv) * job->key_bytes;         // rows nkv heads' apart
    const uint8_t* values = job->values + (from * nkv + kv) * job->value_bytes;
    const struct isa_kernels* isa = current_isa();
    for (int64_t g = 0; g < group; g++) heads[g] = g;
    for (int64_t first = 0; first < n; first += KEY_CHUNK) {
        int64_t rows = n - first < KEY_CHUNK ? n - first : KEY_CHUNK;
        for (int64_t s = 0; s < rows; s++)
            isa->dequantize[job->key_type](keys + (first + s) * nkv * job->key_bytes, dim, panel + s * dim);
        struct panel products = {.w = panel, .rows = rows, .x = q, .n = dim, .chunk = dim, .out = probs + first,
                                 .stride = n};
        isa->multiply(&products, heads, group);
    }
    for (int64_t g = 0; g < group; g++) {
        float* p = probs + g * n;
        float top, total = exponentiate(p, n, shape->scale, -INFINITY, &top);
        if (part) {
            part[2 * g] = top;
            part[2 * g + 1] = total;
        } else {
            for (int64_t s = 0; s < n; s++) p[s] /= total;
        }
    }
    memset(out, 0, (size_t)(group * dim_v) * sizeof(float));
    for (int64_t first = 0; first < n; first += PV_ROWS) {
        int64_t rows = n - first < PV_ROWS ? n - first : PV_ROWS;
        const uint8_t* row = values + first * nkv * job->value_bytes;
        if (job->value_type == T_F32) {
            weigh_values(probs + first, n, rows, (const float*)row, nkv * dim_v, group, dim_v, out);
            continue;
        }
        for (int64_t s = 0; s < rows; s++)
            isa->dequantize[job->value_type](row + s * nkv * job->value_bytes, dim_v, value_rows + s * dim_v);
        weigh_values(probs + first, n, rows, value_rows, dim_v, group, dim_v, out);
    }
}

// Task (t · NKV + kv) · splits + c: token t's query heads over kv head kv, the c-th equal share
// of the token's positions (all of them without splits).
VECTORIZED static void attend_task(void* context, int64_t task, int64_t next, int thread) {
    (void)next;
    const struct attention_job* job = context;
    int64_t nkv = job->shape->n_kv_heads, group = job->shape->n_heads / nkv, dim_v = job->shape->head_dim_v;
    int64_t pair = task / job->splits, t = pair / nkv, kv = pair % nkv, n = job->start + t + 1;
    float* scratch = job->scores + thread * few_scratch(job->shape, job->width);
    if (job->splits == 1) {
        attend_group(job, t, kv, 0, n, scratch, job->out + (t * job->shape->n_heads + kv * group) * dim_v, NULL);
        return;
    }
    int64_t share = (n + job->splits - 1) / job->splits, from = task % job->splits * share;
    int64_t to = from + share < n ? from + share : n;
    float* part = job->parts + task * group * (dim_v + 2);
    if (from < to) {
        attend_group(job, t, kv, from, to, scratch, part + 2 * group, part);
        return;
    }
    for (int64_t g = 0; g < group; g++) {        // a share past the token's position: nothing
        part[2 * g] = -INFINITY;
        part[2 * g + 1] = 0.f;
    }
}

// The splits' parts of each token and query head into out: Σ_c e^(m_c - M) acc_c / Σ_c e^(m_c - M) l_c
// over the splits that saw positions (M their largest score).
static void merge_splits(const struct attention_job* job) {
    const struct moe_attention* shape = job->shape;
    int64_t nkv = shape->n_kv_heads, group = shape->n_heads / nkv, dim_v = shape->head_dim_v;
    for (int64_t pair = 0; pair < job->n_tokens * nkv; pair++)
        for (int64_t g = 0; g < group; g++) {
            float top = -INFINITY, total = 0.f;
            for (int64_t c = 0; c < job->splits; c++) {
                const float* part = job->parts + (pair * job->splits + c) * group * (dim_v + 2);
                top = part[2 * g] > top ? part[2 * g] : top;
            }
            float* out = job->out + (pair * group + g) * dim_v;
            memset(out, 0, (size_t)dim_v * sizeof(float));
            for (int64_t c = 0; c < job->splits; c++) {
                const float* part = job->parts + (pair * job->splits + c) * group * (dim_v + 2);
                if (part[2 * g + 1] == 0.f) continue;
                float weight = expf(part[2 * g] - top);
                total += weight * part[2 * g + 1];
                for (int64_t i = 0; i < dim_v; i++) out[i] += weight * part[2 * group + g * dim_v + i];
            }
            for (int64_t i = 0; i < dim_v; i++) out[i] /= total;
        }
}

// Pack tasks a kv head's rows [0, seen) take.
static int64_t pack_pieces(int64_t seen) { return (seen + PACK_ROWS - 1) / PACK_ROWS; }

// The width of the key block at `first` for a chunk whose rows reach `seen`, and where kv head
// kv's keys of that block sit packed: [D, round_up_lanes(width)].
INLINE int64_t key_block_width(int64_t first, int64_t seen) {
    return seen - first < KEY_BLOCK ? seen - first : KEY_BLOCK;
}
INLINE float* packed_keys(const struct attention_job* job, int64_t kv, int64_t seen, int64_t first) {
    int64_t dim = job->shape->head_dim_k;
    return job->packed + kv * dim * round_up_lanes(seen) + first * dim;
}
INLINE float* packed_values(const struct attention_job* job, int64_t kv, int64_t seen) {
    const struct moe_attention* shape = job->shape;
    return job->packed + shape->n_kv_heads * shape->head_dim_k * round_up_lanes(seen) + kv * seen * shape->head_dim_v;
}

// A prefill chunk's cache rows [0, S) packed once for all its block tasks, as float32: task
// kv · pieces + c transposes rows [c · PACK_ROWS, ..) of kv head kv's keys a key block at a time
// into [D, width rounded up to whole vectors] (zeros past the block's last row) and writes its
// values' rows next to each other (in the cache they are NKV · Dv apart: rows 2 KiB apart fall on the same
// few sets of L1, and a block's values would not stay there).
VECTORIZED static void pack_task(void* context, int64_t task, int64_t next, int thread) {
    (void)next, (void)thread;
    const struct attention_job* job = context;
    const struct moe_attention* shape = job->shape;
    int64_t nkv = shape->n_kv_heads, dim = shape->head_dim_k, dim_v = shape->head_dim_v;
    int64_t seen = job->start + job->n_tokens, pieces = pack_pieces(seen);
    int64_t kv = task / pieces, from = task % pieces * PACK_ROWS, to = from + PACK_ROWS < seen ? from + PACK_ROWS : seen;
    const struct isa_kernels* isa = current_isa();
    float* values = packed_values(job, kv, seen);
    for (int64_t s = from; s < to; s++)
        isa->dequantize[job->value_type](job->values + (s * nkv + kv) * job->value_bytes, dim_v, values + s * dim_v);
    float row[dim];
    for (int64_t block = from; block < to; block += KEY_BLOCK) {
        int64_t width = key_block_width(block, seen), padded = round_up_lanes(width);
        float* keys = packed_keys(job, kv, seen, block);
        for (int64_t s = 0; s < width; s++) {
            isa->dequantize[job->key_type](job->keys + ((block + s) * nkv + kv) * job->key_bytes, dim, row);
            for (int64_t i = 0; i < dim; i++) keys[i * padded + s] = row[i];
        }
        for (int64_t i = 0; i < dim; i++)
            for (int64_t s = width; s < padded; s++) keys[i * padded + s] = 0.f;
    }
}

// One pass of a prefill block's row over a key block: its scores p [width] of which the first
// `valid` are positions its token sees -> e^(p·scale - largest) (0 past them), the largest and
// the sum kept running in *top and *total; returns the factor the row's earlier sums take
// (e^(old largest - new), 1 when nothing changes).
INLINE float running_exponentials(float* p, int64_t valid, int64_t width, float scale, float* top, float* total) {
    float correction = 1.f;
    if (valid > 0) {
        float now, here = exponentiate(p, valid, scale, *top, &now);
        correction = *top == -INFINITY ? 0.f : expf(*top - now);
        *total = *total * correction + here;
        *top = now;
    }
    for (int64_t s = valid > 0 ? valid : 0; s < width; s++) p[s] = 0.f;
    return correction;
}

// A prefill chunk: ATTENTION_BLOCK tokens' query heads of one kv head a task, over the cache
// KEY_BLOCK positions at a time: q·kᵀ over the block's keys packed transposed, p·v over its
// values (both packed by pack_task), by the instruction set's row_products (tiles.h); the softmax
// runs over the passes (each row's largest score so far and the sum of its exponentials; the
// sums of earlier passes rescaled when the largest grows), and the rows are divided by their
// sums at the end. Rows are the block's (token t, query head g), t·G + g. Tasks take the last
// blocks first: they see the most positions.
VECTORIZED static void attend_block_task(void* context, int64_t task, int64_t next, int thread) {
    (void)next;
    const struct attention_job* job = context;
    const struct moe_attention* shape = job->shape;
    int64_t nh = shape->n_heads, nkv = shape->n_kv_heads, dim = shape->head_dim_k, dim_v = shape->head_dim_v;
    int64_t group = nh / nkv, kv = task % nkv, blocks = (job->n_tokens + ATTENTION_BLOCK - 1) / ATTENTION_BLOCK;
    int64_t first = (blocks - 1 - task / nkv) * ATTENTION_BLOCK, seen = job->start + job->n_tokens;
    int64_t tokens = job->n_tokens - first < ATTENTION_BLOCK ? job->n_tokens - first : ATTENTION_BLOCK;
    int64_t rows = tokens * group, n = job->start + first + tokens;          // the block's last token's positions
    const float** q_rows = (const float**)(job->scores + thread * block_scratch(shape));   // [R]
    float** score_rows = (float**)(q_rows + rows);                           // [R]
    float** acc_rows = score_rows + rows;                                    // [R]
    float* scores = (float*)(acc_rows + rows);                               // [R, B]
    float* acc = scores + rows * KEY_BLOCK;                                  // [R, Dv]
    float* top = acc + rows * dim_v;                                         // [R]
    float* total = top + rows;                                               // [R]
    for (int64_t r = 0; r < rows; r++) {
        q_rows[r] = job->q + ((first + r / group) * nh + kv * group + r % group) * dim;
        acc_rows[r] = acc + r * dim_v;
        top[r] = -INFINITY;
        total[r] = 0.f;
    }
    memset(acc, 0, (size_t)(rows * dim_v) * sizeof(float));
    const struct isa_kernels* isa = current_isa();
    for (int64_t block = 0; block < n; block += KEY_BLOCK) {
        int64_t width = key_block_width(block, seen), padded = round_up_lanes(width);
        int64_t needed = n - block < width ? n - block : width;               // positions some row sees
        for (int64_t r = 0; r < rows; r++) score_rows[r] = scores + r * padded;
        isa->row_products(q_rows, rows, packed_keys(job, kv, seen, block), padded, dim, round_up_lanes(needed),
                          score_rows, 0);
        for (int64_t r = 0; r < rows; r++) {
            int64_t mine = job->start + first + r / group + 1;              // this row's token's positions
            float correction = running_exponentials(score_rows[r], mine - block < needed ? mine - block : needed,
                                                    width, shape->scale, &top[r], &total[r]);
            for (int64_t i = 0; i < dim_v; i++) acc_rows[r][i] *= correction;
        }
        isa->row_products((const float* const*)score_rows, rows, packed_values(job, kv, seen) + block * dim_v, dim_v,
                          width, dim_v, acc_rows, 1);
    }
    for (int64_t r = 0; r < rows; r++) {
        float* out = job->out + ((first + r / group) * nh + kv * group + r % group) * dim_v;
        for (int64_t i = 0; i < dim_v; i++) out[i] = acc_rows[r][i] / total[r];
    }
}

// Splits per token and kv head for a few tokens over `seen` positions: with several threads,
// enough tasks for about two a thread, each of at least SPLIT_POSITIONS positions.
static int64_t attention_splits(int64_t pairs, int64_t seen, int threads) {
    if (threads == 1) return 1;
    int64_t by_positions = seen / SPLIT_POSITIONS, by_threads = (2 * threads + pairs - 1) / pairs;
    int64_t splits = by_positions < by_threads ? by_positions : by_threads;
    return splits > 1 ? splits : 1;
}

int moe_attention(const struct moe_attention* shape, const float* q, int64_t n_tokens, int64_t start,
                  const uint8_t* keys, const uint8_t* values, float* out, int threads) {
    static float* scores;       // grown as needed, under the kernels' lock
    static size_t scores_size;
    int64_t seen = start + n_tokens, group = shape->n_heads / shape->n_kv_heads;
    int key_type = cache_type(shape->key_type), value_type = cache_type(shape->value_type);
    if (key_type < 0 || value_type < 0) return MOE_UNSUPPORTED_TYPE;
    if (shape->head_dim_k % TYPES[key_type].block_values || shape->head_dim_v % TYPES[value_type].block_values)
        return MOE_BAD_SHAPE;
    int blocks = n_tokens >= BLOCK_TOKENS_LEAST;
    double macs = (double)n_tokens * seen * shape->n_heads * (shape->head_dim_k + shape->head_dim_v);
    threads = threads_for(threads, macs, 0);
    int64_t pairs = n_tokens * shape->n_kv_heads, splits = blocks ? 1 : attention_splits(pairs, seen, threads);
    int64_t width = (seen + splits - 1) / splits;
    int64_t parts = splits > 1 ? pairs * splits * group * (shape->head_dim_v + 2) : 0;     // floats
    int64_t packed = blocks ? packed_floats(shape, seen) : 0;
    int64_t per_thread = blocks ? block_scratch(shape) : few_scratch(shape, width);
    size_t wanted = ((size_t)threads * per_thread + parts + packed) * sizeof(float);
    lock_kernels();
    if (wanted > scores_size) {
        free(scores);
        scores = malloc(wanted);
        scores_size = scores ? wanted : 0;
    }
    int status = scores ? MOE_OK : MOE_NO_MEMORY;
    if (scores) {
        struct attention_job job = {shape, q, n_tokens, start, keys, values, key_type, value_type,
                                    bytes_of(key_type, shape->head_dim_k), bytes_of(value_type, shape->head_dim_v),
                                    out, scores, splits, width, scores + threads * per_thread,
                                    scores + threads * per_thread + parts};
        if (blocks) {
            pool_run(threads, shape->n_kv_heads * pack_pieces(seen), pack_task, &job);
            pool_run(threads, (n_tokens + ATTENTION_BLOCK - 1) / ATTENTION_BLOCK * shape->n_kv_heads, attend_block_task,
                     &job);
        } else {
            pool_run(threads, pairs * splits, attend_task, &job);
            if (splits > 1) merge_splits(&job);
        }
    }
    unlock_kernels();
    return status;
}
