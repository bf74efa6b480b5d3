// Integer dot products of quantized weight units with activations in 8-bit planes (the
// technique llama.cpp calls MMVQ, with a second plane for precision): a unit of 32 weights
// becomes 8 words of four int8 values plus its scales; a unit of 32 activations is
// x ≈ d·(a + b/254) with int8 planes a = rint(x/d), b = rint((x/d - a)·254), d = max|x|/127,
// and sx = d·Σ(a + b/254). Then Σ w·x = d·(s0·(a·q_w + b·q_w/254)[0..15] + s1·(...)[16..31])
// + m·sx: dp4a on packed bytes instead of 32 float conversions and multiplies; the second
// plane brings the activations' rounding from ~0.4% (llama.cpp's one plane) to ~2e-5.
#pragma once
#include "quant_blocks.cuh"

// One unit of weights as integers: w[i] = s0·q[i] (i < 16) or s1·q[i] (i >= 16), + m.
struct IntUnit {
    int q[8];          // 32 int8 values, little-endian in each word
    float s0, s1;      // scales of elements 0..15 and 16..31
    float m;           // offset added to every weight
};

// Activations x [T, K] in two 8-bit planes: per unit of 32, 64 bytes (a[0..31], b[0..31])
// [T, 2K], and (d, sx) [T, K/32].
struct Q8Activations {
    const int4* q;     // four int4 per unit
    const float2* ds;
};

__device__ __forceinline__ int dot4(int a, int b, int c) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#if defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || defined(__gfx942__) || \
    defined(__gfx1030__) || defined(__gfx1031__) || defined(__gfx1032__)
    return __builtin_amdgcn_sdot4(a, b, c, false);
#else
    const i8* x = reinterpret_cast<const i8*>(&a);
    const i8* y = reinterpret_cast<const i8*>(&b);
    return c + x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3];
#endif
#else
    return __dp4a(a, b, c);
#endif
}

// Four bytes from a 2-byte aligned address (Q4_0 and Q5_0 blocks: 18 and 22 bytes).
__device__ __forceinline__ int load_int_2aligned(const u8* p) {
    const u16* h = reinterpret_cast<const u16*>(p);
    return (int)((u32)h[0] | ((u32)h[1] << 16));
}

// Bit 4 of each byte from four consecutive bits of `bits` (Q5_0/Q5_1 high bits).
__device__ __forceinline__ int spread_high_bits(u32 bits) {
    return (int)(((bits & 1) << 4) | ((bits & 2) << 11) | ((bits & 4) << 18) | ((bits & 8) << 25));
}

// Each byte minus `b` (0 <= b <= 0x7f, bytes in 0..0x7f): no borrow crosses a byte.
__device__ __forceinline__ int sub_bytes(int v, u32 b) {
    return (int)((((u32)v | 0x80808080u) - b) ^ 0x80808080u);
}

__device__ __forceinline__ void int_unit_q8_0(const u8* row, int unit, IntUnit& w) {
    const u8* block = row + unit * 34;
    w.s0 = w.s1 = load_half_aligned(block);
    w.m = 0.f;
    load_32_bytes(block + 2, reinterpret_cast<u32*>(w.q));
}

// 16 bytes of nibbles at p: bytes 0..15 hold elements 0..15 (low) and 16..31 (high).
// Aligned4: p is 4-byte aligned (Q4_1, Q5_1), else 2-byte aligned (Q4_0, Q5_0).
template <bool Aligned4>
__device__ __forceinline__ void load_nibbles(const u8* p, int* q) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int bytes = Aligned4 ? reinterpret_cast<const int*>(p)[i] : load_int_2aligned(p + 4 * i);
        q[i] = bytes & 0x0F0F0F0F;
        q[i + 4] = (bytes >> 4) & 0x0F0F0F0F;
    }
}

__device__ __forceinline__ void add_fifth_bits(u32 high, int* q) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        q[i] |= spread_high_bits(high >> (4 * i));
        q[i + 4] |= spread_high_bits(high >> (16 + 4 * i));
    }
}

// Q4_0 / Q5_0: f16 d, (Q5_0: u32 high bits,) nibbles; w = d·(q - 8) or d·(q - 16).
__device__ __forceinline__ void int_unit_q4_0(const u8* row, int unit, IntUnit& w) {
    const u8* block = row + unit * 18;
    load_nibbles<false>(block + 2, w.q);
    w.s0 = w.s1 = load_half(block);
    w.m = -8.f * w.s0;
}

__device__ __forceinline__ void int_unit_q5_0(const u8* row, int unit, IntUnit& w) {
    const u8* block = row + unit * 22;
    load_nibbles<false>(block + 6, w.q);
    add_fifth_bits((u32)load_int_2aligned(block + 2), w.q);
    w.s0 = w.s1 = load_half(block);
    w.m = -16.f * w.s0;
}

// Q4_1 / Q5_1: f16 d, f16 m, (Q5_1: u32 high bits,) nibbles; w = d·q + m.
__device__ __forceinline__ void int_unit_q4_1(const u8* row, int unit, IntUnit& w) {
    const u8* block = row + unit * 20;
    load_nibbles<true>(block + 4, w.q);
    w.s0 = w.s1 = load_half(block);
    w.m = load_half(block + 2);
}

__device__ __forceinline__ void int_unit_q5_1(const u8* row, int unit, IntUnit& w) {
    const u8* block = row + unit * 24;
    load_nibbles<true>(block + 8, w.q);
    add_fifth_bits(*reinterpret_cast<const u32*>(block + 4), w.q);
    w.s0 = w.s1 = load_half(block);
    w.m = load_half(block + 2);
}

// Q4_K / Q5_K unit = sub-block `unit & 7` of super-block `unit >> 3` (layouts in quant_blocks.cuh).
__device__ __forceinline__ void k_unit_scales(const u8* block, int sub, IntUnit& w) {
    float scale, min;
    k_scale_min(block, sub, &scale, &min);
    w.s0 = w.s1 = scale;
    w.m = -min;
}

__device__ __forceinline__ void int_unit_q4_k(const u8* row, int unit, IntUnit& w) {
    const u8* block = row + (unit >> 3) * 144;
    int sub = unit & 7, shift = (sub & 1) * 4;
    k_unit_scales(block, sub, w);
    const int4* qs = reinterpret_cast<const int4*>(block + 16 + (sub >> 1) * 32);
    int4 a = qs[0], b = qs[1];
    int words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; i++) w.q[i] = (words[i] >> shift) & 0x0F0F0F0F;
}

__device__ __forceinline__ void int_unit_q5_k(const u8* row, int unit, IntUnit& w) {
    const u8* block = row + (unit >> 3) * 176;
    int sub = unit & 7, shift = (sub & 1) * 4;
    k_unit_scales(block, sub, w);
    const int4* high = reinterpret_cast<const int4*>(block + 16);
    const int4* qs = reinterpret_cast<const int4*>(block + 48 + (sub >> 1) * 32);
    int4 a = qs[0], b = qs[1], c = high[0], e = high[1];
    int words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    int highs[8] = {c.x, c.y, c.z, c.w, e.x, e.y, e.z, e.w};
#pragma unroll
    for (int i = 0; i < 8; i++)
        w.q[i] = ((words[i] >> shift) & 0x0F0F0F0F) | (((highs[i] >> sub) & 0x01010101) << 4);
}

// Q6_K unit: quarter `unit & 3` of half `(unit >> 2) & 1` of a 210-byte super-block;
// elements 0..15 and 16..31 have a scale each; values stored + 32.
__device__ __forceinline__ void int_unit_q6_k(const u8* row, int unit, IntUnit& w) {
    Q6KUnit q;
    load_q6_k_unit(row, unit, q);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int l = (int)q.low[i], h = (int)q.high[i];
        int value = ((l >> q.low_shift) & 0x0F0F0F0F) | (((h >> q.high_shift) & 0x03030303) << 4);
        w.q[i] = sub_bytes(value, 0x20202020u);
    }
    w.s0 = q.d0;
    w.s1 = q.d1;
    w.m = 0.f;
}

// The two planes of one value v (|v| <= 127 after scaling by 127 / max|x|).
__device__ __forceinline__ void split_planes(float scaled, int* a, int* b) {
    *a = __float2int_rn(scaled);
    *b = __float2int_rn((scaled - (float)*a) * 254.f);
}

// One unit of 32 values, value i held by lane i of a warp (all 32 lanes call this), into the
// two planes of unit `unit`, as quantize_q8 converts them.
__device__ __forceinline__ void quantize_unit_of_warp(float value, long long unit, int4* q, float2* ds) {
    float amax = group_max(fabsf(value), UNIT);
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    int a, b;
    split_planes(value * inv, &a, &b);
    float sum_a = group_sum((float)a, UNIT), sum_b = group_sum((float)b, UNIT);
    i8* planes = reinterpret_cast<i8*>(q + 4 * unit);
    int lane = threadIdx.x % UNIT;
    planes[lane] = (i8)a;
    planes[UNIT + lane] = (i8)b;
    float d = amax / 127.f;
    if (lane == 0) ds[unit] = make_float2(d, d * (sum_a + sum_b * (1.f / 254.f)));
}

// N values (a multiple of 4) times `scale` as their two planes (split_planes), each plane's bytes
// packed four to a word into words_a, words_b [N / 4], and each plane's sum.
template <int N>
__device__ __forceinline__ void pack_planes(const float* v, float scale, int* words_a, int* words_b, int& sum_a,
                                            int& sum_b) {
    sum_a = sum_b = 0;
#pragma unroll
    for (int i = 0; i < N / 4; i++) words_a[i] = words_b[i] = 0;
#pragma unroll
    for (int i = 0; i < N; i++) {
        int a, b;
        split_planes(v[i] * scale, &a, &b);
        sum_a += a;
        sum_b += b;
        words_a[i / 4] |= (a & 0xff) << (8 * (i % 4));
        words_b[i / 4] |= (b & 0xff) << (8 * (i % 4));
    }
}

// One unit of 32 values held by one thread into its two planes (four int4: plane a, plane b)
// at q; returns its (d, sx).
__device__ __forceinline__ float2 quantize_unit(const float* v, int4* q) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < UNIT; i++) amax = fmaxf(amax, fabsf(v[i]));
    int words_a[8], words_b[8], sum_a, sum_b;
    pack_planes<UNIT>(v, amax > 0.f ? 127.f / amax : 0.f, words_a, words_b, sum_a, sum_b);
    q[0] = make_int4(words_a[0], words_a[1], words_a[2], words_a[3]);
    q[1] = make_int4(words_a[4], words_a[5], words_a[6], words_a[7]);
    q[2] = make_int4(words_b[0], words_b[1], words_b[2], words_b[3]);
    q[3] = make_int4(words_b[4], words_b[5], words_b[6], words_b[7]);
    float d = amax / 127.f;
    return make_float2(d, d * ((float)sum_a + (float)sum_b * (1.f / 254.f)));
}

// N floats from p (16-byte aligned, N a multiple of 4) into v.
template <int N>
__device__ __forceinline__ void load_values(const float* p, float* v) {
#pragma unroll
    for (int i = 0; i < N / 4; i++) {
        float4 f = reinterpret_cast<const float4*>(p)[i];
        v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
    }
}

// rms_norm(x [T, N]) · weight in 8-bit planes into q, ds (shared or global memory), by the whole
// block, as rms_norm and quantize_q8 compute them: thread i holds values 8i..8i+7 of a row (N a
// multiple of UNIT, at most 8 · blockDim.x), all loaded at once; after a block sum of the squares,
// the four threads of a unit find its max and sums with two shuffles each (a warp converts 8 units
// at once). Every thread calls it; `scratch` holds blockDim.x / 32 + 1 floats. The planes are
// visible to the block on return.
__device__ void normed_planes(const float* __restrict__ x, const float* __restrict__ weight, int width,
                              int n_tokens, float eps, int4* q, float2* ds, float* scratch) {
    int units = width / UNIT, first = 8 * threadIdx.x, part = threadIdx.x % 4;
    bool holds = first < width;                         // the same for the four threads of a unit
    float g[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (holds) load_values<8>(weight + first, g);
    for (int t = 0; t < n_tokens; t++) {
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, squares = 0.f, amax = 0.f;
        if (holds) load_values<8>(x + (long long)t * width + first, v);
#pragma unroll
        for (int i = 0; i < 8; i++) squares += v[i] * v[i];
        float inv = 1.0f / sqrtf(block_sum(squares, scratch) / width + eps);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            v[i] = v[i] * inv * g[i];
            amax = fmaxf(amax, fabsf(v[i]));
        }
        amax = group_max(amax, 4);
        int words_a[2], words_b[2], sum_a, sum_b;
        pack_planes<8>(v, amax > 0.f ? 127.f / amax : 0.f, words_a, words_b, sum_a, sum_b);
        float sums_a = group_sum((float)sum_a, 4), sums_b = group_sum((float)sum_b, 4);
        long long unit = (long long)t * units + first / UNIT;
        if (holds) {
            int2* planes = reinterpret_cast<int2*>(q + 4 * unit);
            planes[part] = make_int2(words_a[0], words_a[1]);
            planes[4 + part] = make_int2(words_b[0], words_b[1]);
            float d = amax / 127.f;
            if (part == 0) ds[unit] = make_float2(d, d * (sums_a + sums_b * (1.f / 254.f)));
        }
    }
    __syncthreads();
}

__device__ __forceinline__ int dot16(const int* w, int4 x, int c = 0) {
    return dot4(w[3], x.w, dot4(w[2], x.z, dot4(w[1], x.y, dot4(w[0], x.x, c))));
}

// One unit of activations: both planes and (d, sx).
struct ActUnit {
    int4 q[4];
    float2 ds;
};

__device__ __forceinline__ ActUnit load_act_unit(Q8Activations x, long long unit) {
    const int4* q = x.q + 4 * unit;
    return {{q[0], q[1], q[2], q[3]}, x.ds[unit]};
}

// Σ over the unit of w·x. Joined (s0 == s1 only): the planes join in integers, 254·(q·a) + q·b
// (below 2^27 in size), converted to float once; else each half's two partial sums are
// converted. Which is faster depends on the loader's registers (JoinedPlanes).
template <bool Joined>
__device__ __forceinline__ float unit_dot(const IntUnit& w, const ActUnit& a) {
    if (Joined) {
        int plane_a = dot16(w.q + 4, a.q[1], dot16(w.q, a.q[0])), plane_b = dot16(w.q + 4, a.q[3], dot16(w.q, a.q[2]));
        return a.ds.x * (1.f / 254.f) * w.s0 * (float)(254 * plane_a + plane_b) + w.m * a.ds.y;
    }
    float lo = (float)dot16(w.q, a.q[0]) + (float)dot16(w.q, a.q[2]) * (1.f / 254.f);
    float hi = (float)dot16(w.q + 4, a.q[1]) + (float)dot16(w.q + 4, a.q[3]) * (1.f / 254.f);
    return a.ds.x * (w.s0 * lo + w.s1 * hi) + w.m * a.ds.y;
}

// A loader of one weight unit, and whether unit_dot joins its planes in integers: the K-quants
// with one scale a unit (Q4_K 12.1 -> 10.2 us for the 30B-A3B gate/up on the H100; Q8_0 and
// Q6_K 4% and 3% slower so, docs/benchmarks.md).
typedef void (*IntUnitLoader)(const u8*, int, IntUnit&);
template <IntUnitLoader Load>
struct JoinedPlanes { static constexpr bool value = false; };
template <>
struct JoinedPlanes<int_unit_q4_k> { static constexpr bool value = true; };
template <>
struct JoinedPlanes<int_unit_q5_k> { static constexpr bool value = true; };

// One line per type the integer path reads.
#define FOR_EACH_INT_TYPE(X) X(q8_0) X(q4_0) X(q4_1) X(q5_0) X(q5_1) X(q4_k) X(q5_k) X(q6_k)
