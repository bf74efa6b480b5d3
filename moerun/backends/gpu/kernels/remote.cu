// Experts on other processes: the parent's split of the routed pairs, the requests it
// packs for a daemon (straight into the daemon's device buffers or the pinned arena),
// the daemon's unpacking of them, and the replies added back on the parent.
// Payload dtype codes as the slot headers number them: 0 f32, 1 f16, 2 bf16.
// Shape legend: T tokens, H hidden, K experts per token, E experts.
#include "common.cuh"

__device__ __forceinline__ u16 float_to_bf16_bits(float value) {   // round to nearest even
    u32 bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (u16)((bits >> 16) | 0x40u);   // NaN stays NaN
    return (u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// ids [T, K] global -> the parent's local ids (-1: the expert is on a daemon), counting into
// counters [5] the pairs not on the parent, the layer calls with some such pair, and where the
// layer has experts homed in host RAM (host_index non-null: >= 0 for those, [E]) the pairs
// routed to them and those of them the parent holds in its cache slots (local ids >= n_hot);
// routed_counts (non-null, [E]) counts every pair by expert. One block.
extern "C" __global__ void split_parent_ids(const int* __restrict__ ids, int n_pairs,
                                            const int* __restrict__ parent_local,
                                            int* __restrict__ local_ids,
                                            unsigned long long* __restrict__ counters,
                                            const int* __restrict__ host_index, int n_hot,
                                            unsigned int* __restrict__ routed_counts) {
    wait_for_previous_grid();
    __shared__ int sums[3];                                        // remote, host, cached
    if (threadIdx.x < 3) sums[threadIdx.x] = 0;
    __syncthreads();
    int remote = 0, host = 0, cached = 0;
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        int expert = ids[p];
        int local = parent_local[expert];
        local_ids[p] = local;
        remote += local < 0;
        if (host_index != nullptr && host_index[expert] >= 0) {
            host += 1;
            cached += local >= n_hot;
        }
        if (routed_counts != nullptr) atomicAdd(&routed_counts[expert], 1u);
    }
    if (remote) atomicAdd(&sums[0], remote);
    if (host) atomicAdd(&sums[1], host);
    if (cached) atomicAdd(&sums[2], cached);
    __syncthreads();
    if (threadIdx.x == 0) {
        counters[0] += (unsigned long long)sums[0];
        counters[1] += sums[0] != 0;
        counters[2] += (unsigned long long)sums[1];
        counters[3] += (unsigned long long)sums[2];
    }
}

// ids [T, K] global -> table[id] (-1: not in the table), counting the pairs found into
// *found. One block.
extern "C" __global__ void map_ids(const int* __restrict__ ids, int n_pairs, const int* __restrict__ table,
                                   int* __restrict__ mapped, unsigned long long* __restrict__ found) {
    wait_for_previous_grid();
    __shared__ int sum;
    if (threadIdx.x == 0) sum = 0;
    __syncthreads();
    int count = 0;
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        int value = table[ids[p]];
        mapped[p] = value;
        count += value >= 0;
    }
    if (count) atomicAdd(&sum, count);
    __syncthreads();
    if (threadIdx.x == 0) *found += (unsigned long long)sum;
}

// A daemon's request for rows [row0, row0 + T): x f32 [*, H] -> the payload dtype, ids [*, K]
// -> that daemon's local ids (-1: not there), weights [*, K]. One thread per element of x.
extern "C" __global__ void pack_remote(const float* __restrict__ x, const int* __restrict__ ids,
                                       const float* __restrict__ weights, int row0, int n_tokens,
                                       int hidden, int top_k, const int* __restrict__ daemon_local,
                                       int dtype, void* __restrict__ dst_x, int* __restrict__ dst_ids,
                                       float* __restrict__ dst_weights) {
    wait_for_previous_grid();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < (long long)n_tokens * hidden) {
        float value = x[(long long)row0 * hidden + i];
        if (dtype == 0) ((float*)dst_x)[i] = value;
        else if (dtype == 1) ((__half*)dst_x)[i] = __float2half_rn(value);
        else ((u16*)dst_x)[i] = float_to_bf16_bits(value);
    }
    if (i < (long long)n_tokens * top_k) {
        long long pair = (long long)row0 * top_k + i;
        dst_ids[i] = daemon_local[ids[pair]];
        dst_weights[i] = weights[pair];
    }
}

// The payload x [T, H] in its dtype -> f32. One thread per element.
extern "C" __global__ void unpack_payload(const void* __restrict__ src, int dtype, long long n,
                                          float* __restrict__ out) {
    wait_for_previous_grid();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (dtype == 0) out[i] = ((const float*)src)[i];
    else if (dtype == 1) out[i] = __half2float(((const __half*)src)[i]);
    else out[i] = bf16_bits_to_float(((const u16*)src)[i]);
}

// out[row0 + t] += reply[t] for a reply [T, H] (n = T * H), wherever the reply lives: the
// daemon's device buffer, the pinned arena, or a landing buffer here.
extern "C" __global__ void add_reply_rows(float* __restrict__ out, const float* __restrict__ reply,
                                          int row0, int hidden, long long n) {
    wait_for_previous_grid();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[(long long)row0 * hidden + i] += reply[i];
}

// -- requests rung from the device: a captured decode step reaches a daemon on this host
// through the pinned arena with no host action (ipc/shm.py has the slot layout). The slot
// words and headers are host memory mapped here; `words` is the parent's pinned array of its
// step: [0] abort (the host sets it when a daemon died, a wait when it ran out of time), then
// per daemon [request ids, failures, wait ns, daemon compute ns].
#define SLOT_REQUEST_SEQ 0
#define SLOT_REPLY_SEQ 64
#define SLOT_REQUEST_HEADER 256
#define SLOT_REPLY_HEADER 2048
#define OP_COMPUTE_PADDED 4
#define OP_RESULT 2

// One thread: the COMPUTE header of a padded request (its frames are in the slot already,
// written by pack_remote before this), then the slot's request sequence word, which the
// daemon watches.
extern "C" __global__ void ring_slot(u8* slot, unsigned long long* words, int daemon, int version,
                                     int layer, int dtype, int n_tokens, int top_k, int hidden) {
    wait_for_previous_grid();
    volatile u32* header = (volatile u32*)(slot + SLOT_REQUEST_HEADER);
    unsigned long long* ids = words + 1 + daemon * DAEMON_WORDS;
    unsigned long long request_id = (*ids += 1) | (1ull << 63);    // the host's own ids stay below 2^63
    header[0] = (u32)version;
    header[1] = OP_COMPUTE_PADDED;
    header[2] = (u32)request_id;
    header[3] = (u32)(request_id >> 32);
    header[4] = (u32)layer;
    header[5] = (u32)dtype;
    header[6] = (u32)n_tokens;
    header[7] = (u32)(n_tokens * top_k);
    header[8] = (u32)hidden;
    __threadfence_system();
    volatile u32* request_seq = (volatile u32*)(slot + SLOT_REQUEST_SEQ);
    *request_seq = *request_seq + 1;
    __threadfence_system();
}

// One thread: wait until the daemon answered the slot (its reply sequence word catches up
// with the request's), the step is aborted, or timeout_ns pass; a reply that is not the
// RESULT of this request and a timeout count as the daemon's failure (the host runs the step
// again without it). A timeout aborts the step, so that its later waits (of every daemon) give
// up at once: a step costs one timeout, not one per layer. Adds the wait and the daemon's
// compute time.
extern "C" __global__ void await_slot(const u8* slot, unsigned long long* words, int daemon,
                                      unsigned long long timeout_ns) {
    wait_for_previous_grid();
    volatile const u32* request_seq = (volatile const u32*)(slot + SLOT_REQUEST_SEQ);
    volatile const u32* reply_seq = (volatile const u32*)(slot + SLOT_REPLY_SEQ);
    volatile unsigned long long* abort = (volatile unsigned long long*)words;
    unsigned long long* mine = words + 1 + daemon * DAEMON_WORDS;
    unsigned long long start = device_clock_ns(), now = start;
    u32 expected = *request_seq;
    while (*reply_seq != expected) {
        now = device_clock_ns();
        if (*abort) { mine[2] += now - start; return; }
        if (now - start > timeout_ns) {
            mine[1] += 1;
            mine[2] += now - start;
            *abort = 1;
            __threadfence_system();
            return;
        }
        pause_briefly();
    }
    __threadfence_system();
    volatile const u32* request = (volatile const u32*)(slot + SLOT_REQUEST_HEADER);
    volatile const u32* reply = (volatile const u32*)(slot + SLOT_REPLY_HEADER);
    bool answered = reply[1] == OP_RESULT && reply[2] == request[2] && reply[3] == request[3];
    mine[1] += !answered;
    mine[2] += device_clock_ns() - start;
    if (answered) mine[3] += (unsigned long long)(*(volatile const double*)(slot + SLOT_REPLY_HEADER + 32) * 1e3);
}
