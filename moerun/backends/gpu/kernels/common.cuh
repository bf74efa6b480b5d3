// Platform prelude shared by every kernel: CUDA (NVRTC through CuPy, or nvcc) and
// HIP (hiprtc through CuPy for ROCm, or hipcc). Nothing here assumes 32 lanes:
// reductions shuffle within groups of at most 32 threads (valid on wave32 and
// wave64) or go through shared memory.
#pragma once

// The numbers the launching Python agrees on (UNIT, MAX_GEMV_TOKENS, MAX_EXPERTS, MAX_TOP_K, ...) come
// as -D defines from moerun/backends/gpu/constants.py, the one place they are written.
#if !defined(UNIT) || !defined(MAX_GEMV_TOKENS) || !defined(MAX_EXPERTS) || !defined(MAX_TOP_K) || \
    !defined(ROUTE_VALUES) || !defined(NORM_VALUES) || !defined(DAEMON_WORDS) || \
    !defined(MAX_KEY_DIM) || !defined(MAX_CONV_WIDTH) || !defined(DELTA_COLUMNS) || !defined(DELTA_GROUPS) || \
    !defined(ATTENTION_THREADS)
#error "build the kernels with the defines of moerun/backends/gpu/constants.py (defines())"
#endif

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#ifndef __HIPCC_RTC__
#include <hip/hip_runtime.h>
#endif
#include <hip/hip_fp16.h>
#define SHFL_XOR(value, mask, width) __shfl_xor((value), (mask), (width))
#define SHFL(value, source, width) __shfl((value), (source), (width))
#else
#include <cuda_fp16.h>
#define SHFL_XOR(value, mask, width) __shfl_xor_sync(0xffffffffu, (value), (mask), (width))
#define SHFL(value, source, width) __shfl_sync(0xffffffffu, (value), (source), (width))
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

// Programmatic dependent launch (sm_90 and later, kernels launched with the attribute, see
// library.py): a kernel may be scheduled while the one before it on the stream still runs.
// Every kernel calls this first: it waits until the previous kernel has finished and its
// writes are visible (so, transitively, every kernel before it), then lets the next kernel be
// scheduled. Elsewhere (HIP, older GPUs, plain launches) it does nothing.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(__HIP_PLATFORM_AMD__)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float half_bits_to_float(u16 bits) {
    __half h;
    *reinterpret_cast<u16*>(&h) = bits;
    return __half2float(h);
}

__device__ __forceinline__ float bf16_bits_to_float(u16 bits) {
    return __uint_as_float(((u32)bits) << 16);
}

__device__ __forceinline__ u16 load_u16(const u8* p) {      // unaligned-safe little-endian load
    return (u16)p[0] | ((u16)p[1] << 8);
}

__device__ __forceinline__ float load_half(const u8* p) { return half_bits_to_float(load_u16(p)); }

// Sum over a group of `width` consecutive threads (width a power of two <= 32);
// every thread of the group must call it.
__device__ __forceinline__ float group_sum(float value, int width) {
    for (int offset = width / 2; offset > 0; offset /= 2) value += SHFL_XOR(value, offset, width);
    return value;
}

__device__ __forceinline__ float group_max(float value, int width) {
    for (int offset = width / 2; offset > 0; offset /= 2) value = fmaxf(value, SHFL_XOR(value, offset, width));
    return value;
}

// Sum (max) over the whole block: shuffles within groups of 32 threads, then one pass
// over the group results in shared memory. blockDim.x a multiple of 32 (or below 32);
// `scratch` holds at least blockDim.x / 32 + 1 floats.
template <bool Max>
__device__ float block_reduce(float value, float* scratch) {
    int width = blockDim.x < 32 ? blockDim.x : 32;
    value = Max ? group_max(value, width) : group_sum(value, width);
    int groups = blockDim.x / width;
    if (threadIdx.x % width == 0) scratch[threadIdx.x / width] = value;
    __syncthreads();
    float result = scratch[0];
    for (int g = 1; g < groups; g++) result = Max ? fmaxf(result, scratch[g]) : result + scratch[g];
    __syncthreads();
    return result;
}

__device__ __forceinline__ float block_sum(float value, float* scratch) { return block_reduce<false>(value, scratch); }
__device__ __forceinline__ float block_max(float value, float* scratch) { return block_reduce<true>(value, scratch); }

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// Nanoseconds of a clock that runs while a kernel spins: the global timer on CUDA, the
// constant 100 MHz wall clock on HIP.
__device__ __forceinline__ unsigned long long device_clock_ns() {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
    return wall_clock64() * 10ull;
#else
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
#endif
}

__device__ __forceinline__ void pause_briefly() {         // between reads of a word another side writes
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
    __builtin_amdgcn_s_sleep(2);
#else
    __nanosleep(200);
#endif
}
