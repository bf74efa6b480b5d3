// Prefill experts straight from their stored blocks: for each tile of MM_ROWS rows of one
// expert's tokens (the layout of moe_prefill.cu), out[rows, n] = rows · W_eᵀ, the weights
// dequantized stage by stage into shared memory as f16 and multiplied there with f32
// accumulation — on the matrix units (PTX mma) from Ampere on, by plain FMAs on older
// NVIDIA GPUs and on AMD. Each expert's weights are read in their stored type once per tile,
// never written back dequantized. gate and up share the staged rows and end in SwiGLU.
// Shape legend: R rows of the tiles, K shared width, N output columns (weight rows).
#include "quant_blocks.cuh"

#define MM_ROWS 32                    // rows per tile (TILE_ROWS in gpu_experts.py)
#define MM_COLS 64                    // output columns per block
#define MM_DEPTH 128                  // k per stage: four units of every weight row
#define MM_THREADS 128                // MM_THREADS in gpu_experts.py
#define MM_LD (MM_DEPTH + 8)          // halves per staged row (padded against bank conflicts)
#define MM_LDC (MM_COLS + 4)          // floats per row of the staged results

#if !defined(__HIP_PLATFORM_AMD__) && !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// Warp w owns output columns 16w..16w+15 of the tile: 2 x 2 products of 16 rows by 8
// columns (mma m16n8k16; fragments as the PTX ISA lays them out: lane = 4 g + t).
struct TileAcc {
    float c[2][2][4];                 // [row half][column eighth][c0..c3]
};

__device__ __forceinline__ void acc_zero(TileAcc& acc) {
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            for (int v = 0; v < 4; v++) acc.c[i][j][v] = 0.f;
}

__device__ __forceinline__ u32 pair_at(const __half* p) { return *reinterpret_cast<const u32*>(p); }

// acc += a [MM_ROWS, MM_DEPTH] · w [MM_COLS, MM_DEPTH]ᵀ over one stage.
__device__ __forceinline__ void acc_stage(TileAcc& acc, const __half* a, const __half* w) {
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, column = (threadIdx.x / 32) * 16;
#pragma unroll
    for (int k = 0; k < MM_DEPTH; k += 16) {
        u32 b[2][2];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const __half* row = w + (column + 8 * j + g) * MM_LD + k + 2 * t;
            b[j][0] = pair_at(row);
            b[j][1] = pair_at(row + 8);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const __half* top = a + (16 * i + g) * MM_LD + k + 2 * t;
            const __half* bottom = top + 8 * MM_LD;
            u32 a0 = pair_at(top), a1 = pair_at(bottom), a2 = pair_at(top + 8), a3 = pair_at(bottom + 8);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                float* c = acc.c[i][j];
                asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b[j][0]), "r"(b[j][1]));
            }
        }
    }
}

__device__ __forceinline__ void acc_store(TileAcc& acc, float* c) {
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, column = (threadIdx.x / 32) * 16;
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            float* out = c + (16 * i + g) * MM_LDC + column + 8 * j + 2 * t;
            out[0] = acc.c[i][j][0];
            out[1] = acc.c[i][j][1];
            out[8 * MM_LDC] = acc.c[i][j][2];
            out[8 * MM_LDC + 1] = acc.c[i][j][3];
        }
}
#else
// Thread t owns row t / 4 of the tile, output columns 16 (t % 4)..16 (t % 4) + 15.
struct TileAcc {
    float v[16];
};

__device__ __forceinline__ void acc_zero(TileAcc& acc) {
    for (int j = 0; j < 16; j++) acc.v[j] = 0.f;
}

__device__ __forceinline__ void acc_stage(TileAcc& acc, const __half* a, const __half* w) {
    const __half* row = a + (threadIdx.x / 4) * MM_LD;
    const __half* columns = w + (threadIdx.x % 4) * 16 * MM_LD;
    for (int k = 0; k < MM_DEPTH; k++) {
        float x = __half2float(row[k]);
#pragma unroll
        for (int j = 0; j < 16; j++) acc.v[j] += x * __half2float(columns[j * MM_LD + k]);
    }
}

__device__ __forceinline__ void acc_store(TileAcc& acc, float* c) {
    float* out = c + (threadIdx.x / 4) * MM_LDC + (threadIdx.x % 4) * 16;
    for (int j = 0; j < 16; j++) out[j] = acc.v[j];
}
#endif

// Rows k0..k0+MM_DEPTH of the tile's MM_ROWS rows (f16 [MM_ROWS, k]) into a; zeros past k.
__device__ __forceinline__ void stage_rows(const __half* tile, int k, int k0, __half* a) {
    constexpr int chunks = MM_DEPTH / 8;                              // 16-byte pieces per row
    for (int i = threadIdx.x; i < MM_ROWS * chunks; i += MM_THREADS) {
        int row = i / chunks, column = (i % chunks) * 8;
        uint4 value = make_uint4(0, 0, 0, 0);
        if (k0 + column < k) value = *reinterpret_cast<const uint4*>(tile + (long long)row * k + k0 + column);
        *reinterpret_cast<uint4*>(a + row * MM_LD + column) = value;
    }
}

// Weight rows n0..n0+MM_COLS, units of stage k0, dequantized into w as f16; zeros past n
// and k. Consecutive threads take consecutive units of a row: fewer rows per load.
template <void (*Dequant)(const u8*, int, float*)>
__device__ __forceinline__ void stage_weights(const u8* stack, long long row_bytes, int n0, int n, int k0,
                                              int units_per_row, __half* w) {
    constexpr int units = MM_DEPTH / UNIT;
    for (int i = threadIdx.x; i < MM_COLS * units; i += MM_THREADS) {
        int row = i / units, part = i % units, unit = k0 / UNIT + part;
        float v[UNIT];
        if (n0 + row < n && unit < units_per_row) {
            Dequant(stack + (long long)(n0 + row) * row_bytes, unit, v);
        } else {
            for (int j = 0; j < UNIT; j++) v[j] = 0.f;
        }
        uint4* dst = reinterpret_cast<uint4*>(w + row * MM_LD + part * UNIT);
        for (int j = 0; j < UNIT / 8; j++) dst[j] = pack_halves(v + 8 * j);
    }
}

// Block (column block, tile): the tile's rows times expert tile_expert[tile]'s rows of
// `first` (and of `second`: gate and up, then act = silu(gate) · up as f16), written to
// the tile's rows of out (f32) or act (f16), [R, n] each. Tiles past the last (-1) stop.
template <void (*Dequant)(const u8*, int, float*), bool GateUp>
__device__ void moe_mm_tile(const u8* first, const u8* second, long long expert_bytes, long long row_bytes,
                            const __half* rows, int k, const int* tile_expert, const int* tile_row, int n,
                            float* out, __half* act) {
    constexpr int products = GateUp ? 2 : 1;
    __shared__ __align__(16) __half a[MM_ROWS * MM_LD];
    __shared__ __align__(16) __half w[products * MM_COLS * MM_LD];   // the weights, then the results
    static_assert(products * MM_ROWS * MM_LDC * sizeof(float) <= sizeof(w), "the results fit where the weights were");
    int expert = tile_expert[blockIdx.y];
    if (expert < 0) return;
    int n0 = blockIdx.x * MM_COLS, first_row = tile_row[blockIdx.y];
    const __half* tile = rows + (long long)first_row * k;
    const u8* stacks[2] = {first + expert * expert_bytes, second + expert * expert_bytes};
    TileAcc acc[products];
    for (TileAcc& part : acc) acc_zero(part);
    for (int k0 = 0; k0 < k; k0 += MM_DEPTH) {
        stage_rows(tile, k, k0, a);
#pragma unroll
        for (int p = 0; p < products; p++)
            stage_weights<Dequant>(stacks[p], row_bytes, n0, n, k0, k / UNIT, w + p * MM_COLS * MM_LD);
        __syncthreads();
#pragma unroll
        for (int p = 0; p < products; p++) acc_stage(acc[p], a, w + p * MM_COLS * MM_LD);
        __syncthreads();
    }
    float* c = reinterpret_cast<float*>(w);                          // [products][MM_ROWS, MM_LDC]
#pragma unroll
    for (int p = 0; p < products; p++) acc_store(acc[p], c + p * MM_ROWS * MM_LDC);
    __syncthreads();
    for (int i = threadIdx.x; i < MM_ROWS * MM_COLS; i += MM_THREADS) {
        int r = i / MM_COLS, column = i % MM_COLS;
        if (n0 + column >= n) continue;
        long long at = (long long)(first_row + r) * n + n0 + column;
        float value = c[r * MM_LDC + column];
        if (GateUp) act[at] = __float2half(silu(value) * c[(MM_ROWS + r) * MM_LDC + column]);
        else out[at] = value;
    }
}

// gate and up (expert e's rows at gate / up + e · expert_bytes) with SwiGLU: act [R, n] f16.
#define DEFINE_MOE_MM(TYPE)                                                                                    \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) moe_mm_gate_up_##TYPE(                            \
        const u8* __restrict__ gate, const u8* __restrict__ up, long long expert_bytes, long long row_bytes,   \
        const __half* __restrict__ rows, int k, const int* __restrict__ tile_expert,                           \
        const int* __restrict__ tile_row, int n, __half* __restrict__ act) {                                   \
        wait_for_previous_grid();                                                                             \
        moe_mm_tile<dequant_unit_##TYPE, true>(gate, up, expert_bytes, row_bytes, rows, k, tile_expert,       \
                                               tile_row, n, nullptr, act);                                     \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) moe_mm_down_##TYPE(                               \
        const u8* __restrict__ down, long long expert_bytes, long long row_bytes,                              \
        const __half* __restrict__ rows, int k, const int* __restrict__ tile_expert,                           \
        const int* __restrict__ tile_row, int n, float* __restrict__ out) {                                    \
        wait_for_previous_grid();                                                                             \
        moe_mm_tile<dequant_unit_##TYPE, false>(down, down, expert_bytes, row_bytes, rows, k, tile_expert,    \
                                                tile_row, n, out, nullptr);                                    \
    }

FOR_EACH_TYPE(DEFINE_MOE_MM)
