// Weight rows staged in shared memory before a kernel waits for the one before it: weights are
// written by no kernel, so under programmatic dependent launches (the blocks resident while the
// kernel before still runs) their DRAM reads overlap that kernel's end.
//
// A block's dynamic shared memory is cut into slots of `stride` bytes (stride 0: no staging, the
// rows are read where they are). stage_rows copies `bytes` from `src` into a slot at the same
// offset mod 16 as `src` (the loaders' alignment assumptions keep holding): whole 16-byte pieces
// by asynchronous copies, the few bytes before the first and after the last by plain loads,
// `lanes` threads sharing the slot. After the wait, every thread of the block calls staged_rows,
// which returns where the rows are to be read from.
#pragma once
#include "common.cuh"

// 16 bytes from global to shared memory (both 16-byte aligned): asynchronously on CUDA GPUs
// of compute capability 8.0 and later (finished by wait_copies), else a plain copy.
__device__ __forceinline__ void copy_16_async(void* shared, const void* global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(__HIP_PLATFORM_AMD__)
    unsigned at = (unsigned)__cvta_generic_to_shared(shared);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(at), "l"(global) : "memory");
#else
    *reinterpret_cast<int4*>(shared) = *reinterpret_cast<const int4*>(global);
#endif
}

// This thread's copy_16_async copies have landed; a __syncthreads after makes the block's visible.
__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(__HIP_PLATFORM_AMD__)
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

__device__ __forceinline__ u8* stage_slot(int slot, int stride) {
    extern __shared__ int4 staged[];
    return reinterpret_cast<u8*>(staged) + (long long)slot * stride;
}

__device__ __forceinline__ void stage_rows(const u8* src, long long bytes, int stride, int slot, int lane, int lanes) {
    if (stride == 0) return;
    u8* dst = stage_slot(slot, stride) + ((size_t)src & 15);
    long long head = min(bytes, (long long)((16 - ((size_t)src & 15)) & 15)), pieces = (bytes - head) / 16;
    for (long long c = lane; c < pieces; c += lanes) copy_16_async(dst + head + 16 * c, src + head + 16 * c);
    for (long long b = lane; b < head; b += lanes) dst[b] = src[b];
    for (long long b = head + 16 * pieces + lane; b < bytes; b += lanes) dst[b] = src[b];
}

__device__ __forceinline__ const u8* staged_rows(const u8* src, int stride, int slot) {
    if (stride == 0) return src;
    wait_copies();
    __syncthreads();
    return stage_slot(slot, stride) + ((size_t)src & 15);
}

// A value written by another block, or by a kernel that finished before this one was scheduled
// and read before wait_for_previous_grid: from L2 (the point of coherence), never from a stale L1 line.
template <typename V>
__device__ __forceinline__ V load_from_l2(const V* p) {
#if defined(__CUDA_ARCH__) && !defined(__HIP_PLATFORM_AMD__)
    return __ldcg(p);
#else
    return *p;
#endif
}

// The 128-byte line at p into L2 (where CUDA can), without waiting for it.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__) && !defined(__HIP_PLATFORM_AMD__)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}
