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
// counters [2] the remote pairs and the layer calls with some pair remote. One block.
extern "C" __global__ void split_parent_ids(const int* __restrict__ ids, int n_pairs,
                                            const int* __restrict__ parent_local,
                                            int* __restrict__ local_ids,
                                            unsigned long long* __restrict__ counters) {
    wait_for_previous_grid();
    __shared__ int remote_pairs;
    if (threadIdx.x == 0) remote_pairs = 0;
    __syncthreads();
    int remote = 0;
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        int local = parent_local[ids[p]];
        local_ids[p] = local;
        remote += local < 0;
    }
    if (remote) atomicAdd(&remote_pairs, remote);
    __syncthreads();
    if (threadIdx.x == 0) {
        counters[0] += (unsigned long long)remote_pairs;
        counters[1] += remote_pairs != 0;
    }
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
