// A CPU expert daemon's arena slots served in a loop here, without a return to Python per
// request: the daemon's decode-step requests (one token, padded ids, f32 payload) come every
// few hundred microseconds, and Python's part around each was a sizable share of it.
// Anything else (another payload dtype, an op or field out of range, a layer without experts
// here, a kernel error) is left to Python, which serves it with its own checks and error
// replies. The arena layout and the headers are those of ipc/shm.py (docs/protocol.md §5),
// with the offsets passed in by Python.
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "moe_cpu.h"

#define OP_COMPUTE_PADDED 4
#define OP_RESULT 2
#define DTYPE_F32 0
#define YIELD_AFTER_S 50e-6          // spin this long before yielding the CPU now and then (as Python's doorbell)

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint32_t load_word(const uint8_t* at) {
    return atomic_load_explicit((const _Atomic uint32_t*)at, memory_order_acquire);
}

static uint32_t read_u32(const uint8_t* at) {
    uint32_t value;
    memcpy(&value, at, 4);
    return value;
}

static void wake_parent(uint8_t* word) {
#ifdef __linux__
    syscall(SYS_futex, word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
#else
    (void)word;                      // the parent's sleeps are sliced: it looks again soon
#endif
}

// The request in `slot` served: 1, or 0 when it is Python's to serve.
static int serve_one(const struct moe_slot_layout* s, const struct moe_served_layer* layers, int64_t n_layers,
                     uint8_t* slot, uint32_t sequence, int64_t* ids, float* out, int threads,
                     struct moe_serve_counts* counts) {
    const uint8_t* header = slot + s->request_header;
    uint32_t version = read_u32(header), op = read_u32(header + 4), dtype = read_u32(header + 20);
    int32_t layer = (int32_t)read_u32(header + 16);
    int64_t tokens = read_u32(header + 24), pairs = read_u32(header + 28), hidden = read_u32(header + 32);
    if (version != s->version || op != OP_COMPUTE_PADDED || dtype != DTYPE_F32 || hidden != s->hidden
            || tokens < 1 || tokens > s->capacity || pairs != tokens * s->per_token || layer < 0
            || layer >= n_layers || layers[layer].n_map == 0)
        return 0;
    const int32_t* stored_ids = (const int32_t*)(slot + s->ids);
    for (int64_t p = 0; p < pairs; p++) ids[p] = stored_ids[p];
    const struct moe_served_layer* served = &layers[layer];
    double started = now_s();
    if (moe_ffn_padded(&served->experts, (const float*)(slot + s->data), tokens, ids,
                       (const float*)(slot + s->weights), s->per_token, served->expert_map, served->n_map, out,
                       threads) != MOE_OK)
        return 0;
    double seconds = now_s() - started;
    memcpy(slot + s->data, out, (size_t)(tokens * hidden) * sizeof(float));
    // the RESULT header: version, op, request id, layer, T, H, error 0, compute µs, message bytes 0
    uint8_t* reply = slot + s->reply_header;
    uint32_t result = OP_RESULT, zero = 0, t32 = (uint32_t)tokens, h32 = (uint32_t)hidden;
    double compute_us = seconds * 1e6;
    memcpy(reply, header, 4);
    memcpy(reply + 4, &result, 4);
    memcpy(reply + 8, header + 8, 8);
    memcpy(reply + 16, header + 16, 4);
    memcpy(reply + 20, &t32, 4);
    memcpy(reply + 24, &h32, 4);
    memcpy(reply + 28, &zero, 4);
    memcpy(reply + 32, &compute_us, 8);
    memcpy(reply + 40, &zero, 4);
    atomic_store_explicit((_Atomic uint32_t*)(slot + s->reply_seq), sequence, memory_order_seq_cst);
    if (load_word(slot + s->parent_sleeping)) wake_parent(slot + s->reply_seq);
    counts->calls += 1;
    counts->tokens += tokens;
    counts->compute_seconds += seconds;
    return 1;
}

int moe_serve_slots(const struct moe_slot_layout* s, const struct moe_served_layer* layers, int64_t n_layers,
                    int64_t* ids, float* out, double spin_s, double max_s, int threads,
                    struct moe_serve_counts* counts) {
    const uint8_t* doorbell = s->arena + s->doorbell;
    uint32_t seen = load_word(doorbell);
    double start = now_s(), last_work = start;
    for (;;) {
        for (int64_t i = 0; i < s->slots; i++) {
            uint8_t* slot = s->arena + s->first_slot + i * s->slot_bytes;
            uint32_t sequence = load_word(slot + s->request_seq);
            if (sequence == load_word(slot + s->reply_seq)) continue;
            if (!serve_one(s, layers, n_layers, slot, sequence, ids, out, threads, counts)) return (int)i;
            last_work = now_s();
        }
        double now = now_s();
        if (load_word(doorbell) != seen || now - last_work >= spin_s || now - start >= max_s) return -1;
        if (now - last_work > YIELD_AFTER_S) sched_yield();
    }
}
