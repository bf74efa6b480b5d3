// Prefill experts straight from their stored blocks: for each tile of Rows rows of one
// expert's tokens (the layout of moe_prefill.cu), out[rows, n] = rows · W_eᵀ, the weights
// dequantized stage by stage into shared memory as f16 and multiplied there with f32
// accumulation — on the matrix units (PTX mma) from Ampere on, by plain FMAs on older
// NVIDIA GPUs and on AMD. Each expert's weights are read in their stored type once per tile,
// never written back dequantized. gate and up share the staged rows and end in SwiGLU.
//
// Three tile shapes (TILE_SHAPES in experts.py): tiles of more rows dequantize each weight
// for more tokens (Mixtral's 8 experts get ~128 rows each of a 512-token chunk; Qwen3's 128
// experts ~32), and a shallower stage to stay in 48 KB of shared memory. Tiles of 128 rows take
// eight warps, two blocks a multiprocessor (in four warps gate and up's sums took 234 registers a
// thread: one block a multiprocessor); the others four. `blocks` bounds the registers so that
// that many blocks stay resident.
// Each stage's activations come by asynchronous copies while its weights are dequantized.
// Shape legend: R rows of the tiles, K shared width, N output columns (weight rows).
#include "quant_blocks.cuh"
#include "staging.cuh"

template <int Rows> struct TileShape;
template <> struct TileShape<32> { static constexpr int cols = 64, depth = 128, warps = 4, blocks = 5; };
template <> struct TileShape<64> { static constexpr int cols = 64, depth = 64, warps = 4, blocks = 3; };
template <> struct TileShape<128> { static constexpr int cols = 64, depth = 64, warps = 8, blocks = 2; };

template <int Rows> struct Tile {
    static constexpr int cols = TileShape<Rows>::cols;             // output columns per block
    static constexpr int depth = TileShape<Rows>::depth;           // k per stage, whole units
    static constexpr int warps = TileShape<Rows>::warps;
    static constexpr int threads = 32 * warps;
    static constexpr int blocks = TileShape<Rows>::blocks;         // resident a multiprocessor, at least
    static constexpr int ld = depth + 8;                           // halves per staged row (padded)
    static constexpr int row_warps = Rows / 32;                    // warps stacked over the rows
    static constexpr int warp_cols = cols * row_warps / warps;     // columns a warp owns
};

#if !defined(__HIP_PLATFORM_AMD__) && !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// Warp w owns 32 rows by warp_cols columns of the tile: 2 x (warp_cols / 8) products of 16
// rows by 8 columns (mma m16n8k16; fragments as the PTX ISA lays them out: lane = 4 g + t).
// v holds them as pairs of neighbouring columns: pair q = (2 (i · J + j) + h) at row
// 16 i + 8 h + g, column 8 j + 2 t of the warp's part.
template <int Rows> struct TileAcc {
    static constexpr int J = Tile<Rows>::warp_cols / 8;
    static constexpr int pairs = 4 * J;
    float v[2 * pairs];

    __device__ __forceinline__ static void origin(int& row, int& column) {
        int warp = threadIdx.x / 32, column_warps = Tile<Rows>::warps / Tile<Rows>::row_warps;
        row = (warp / column_warps) * 32;
        column = (warp % column_warps) * Tile<Rows>::warp_cols;
    }

    __device__ __forceinline__ void position(int q, int& row, int& column) const {
        int lane = threadIdx.x % 32, h = q % 2, j = (q / 2) % J, i = q / (2 * J);
        origin(row, column);
        row += 16 * i + 8 * h + lane / 4;
        column += 8 * j + 2 * (lane % 4);
    }
};

// Four 8x8 f16 matrices from shared memory, one row address per lane (lanes 8m..8m+7: matrix m).
__device__ __forceinline__ void load_matrices(const __half* row, u32& r0, u32& r1, u32& r2, u32& r3) {
    unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(address));
}

// acc += a [Rows, depth] · w [cols, depth]ᵀ over one stage. The fragments come by ldmatrix: a's
// four matrices of 16 rows by 16 k (rows l % 16, k 8 (l / 16) for lane l: a0..a3 as mma takes
// them), w's of two 8-column groups by 16 k (columns 8 (l / 16) + l % 8, k 8 ((l / 8) % 2): b0,
// b1 of group j, then of j + 1). Rows of ld halves (144 bytes) keep the eight rows of a matrix on
// distinct banks.
template <int Rows>
__device__ __forceinline__ void acc_stage(TileAcc<Rows>& acc, const __half* a, const __half* w) {
    using T = Tile<Rows>;
    constexpr int J = TileAcc<Rows>::J;
    static_assert(J % 2 == 0, "w's fragments come two column groups at a time");
    int lane = threadIdx.x % 32, row0, column0;
    TileAcc<Rows>::origin(row0, column0);
    const __half* a_lane = a + (row0 + lane % 16) * T::ld + 8 * (lane / 16);
    const __half* w_lane = w + (column0 + 8 * (lane / 16) + lane % 8) * T::ld + 8 * ((lane / 8) % 2);
#pragma unroll
    for (int k = 0; k < T::depth; k += 16) {
        u32 b[J][2];
#pragma unroll
        for (int j = 0; j < J; j += 2)
            load_matrices(w_lane + 8 * j * T::ld + k, b[j][0], b[j][1], b[j + 1][0], b[j + 1][1]);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u32 a0, a1, a2, a3;
            load_matrices(a_lane + 16 * i * T::ld + k, a0, a1, a2, a3);
#pragma unroll
            for (int j = 0; j < J; j++) {
                float* c = acc.v + 4 * (i * J + j);
                asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b[j][0]), "r"(b[j][1]));
            }
        }
    }
}
#else
// Thread t owns 16 columns of Rows / passes rows: column 16 (t % C) of row t / C + passes · r,
// C = cols / 16 threads per row, passes = threads / C. Pair q: row q / 8, columns 2 (q % 8).
template <int Rows> struct TileAcc {
    static constexpr int per_row = Tile<Rows>::cols / 16, passes = Tile<Rows>::threads / per_row;
    static constexpr int pairs = 8 * Rows / passes;
    float v[2 * pairs];

    __device__ __forceinline__ void position(int q, int& row, int& column) const {
        row = threadIdx.x / per_row + passes * (q / 8);
        column = (threadIdx.x % per_row) * 16 + 2 * (q % 8);
    }
};

template <int Rows>
__device__ __forceinline__ void acc_stage(TileAcc<Rows>& acc, const __half* a, const __half* w) {
    using T = Tile<Rows>;
    using A = TileAcc<Rows>;
    const __half* columns = w + (threadIdx.x % A::per_row) * 16 * T::ld;
    for (int r = 0; r < Rows / A::passes; r++) {
        const __half* row = a + (threadIdx.x / A::per_row + A::passes * r) * T::ld;
        for (int k = 0; k < T::depth; k++) {
            float x = __half2float(row[k]);
#pragma unroll
            for (int j = 0; j < 16; j++) acc.v[16 * r + j] += x * __half2float(columns[j * T::ld + k]);
        }
    }
}
#endif

// Rows k0..k0+depth of the tile's Rows rows (f16 [Rows, k]) into a by asynchronous copies
// (landed after wait_copies); zeros past k.
template <int Rows>
__device__ __forceinline__ void stage_tile_rows(const __half* tile, int k, int k0, __half* a) {
    using T = Tile<Rows>;
    constexpr int chunks = T::depth / 8;                              // 16-byte pieces per row
    for (int i = threadIdx.x; i < Rows * chunks; i += T::threads) {
        int row = i / chunks, column = (i % chunks) * 8;
        __half* dst = a + row * T::ld + column;
        if (k0 + column < k) copy_16_async(dst, tile + (long long)row * k + k0 + column);
        else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
}

// Weight rows n0..n0+cols of each of the `Products` stacks, units of stage k0, dequantized
// into w (one [cols, ld] part per stack) as f16; zeros past n and k. Consecutive threads take
// consecutive units of a row: fewer rows per load.
template <int Rows, int Products, void (*Dequant)(const u8*, int, float*)>
__device__ __forceinline__ void stage_weights(const u8* const* stacks, long long row_bytes, int n0, int n, int k0,
                                              int units_per_row, __half* w) {
    using T = Tile<Rows>;
    constexpr int units = T::depth / UNIT;
    for (int i = threadIdx.x; i < Products * T::cols * units; i += T::threads) {
        int product = i / (T::cols * units), row = (i / units) % T::cols, part = i % units;
        int unit = k0 / UNIT + part;
        float v[UNIT];
        if (n0 + row < n && unit < units_per_row) {
            Dequant(stacks[product] + (long long)(n0 + row) * row_bytes, unit, v);
        } else {
            for (int j = 0; j < UNIT; j++) v[j] = 0.f;
        }
        uint4* dst = reinterpret_cast<uint4*>(w + (product * T::cols + row) * T::ld + part * UNIT);
        for (int j = 0; j < UNIT / 8; j++) dst[j] = pack_halves(v + 8 * j);
    }
}

// Block (column block, tile): the tile's rows times expert tile_expert[tile]'s rows of
// `first` (and of `second`: gate and up, then act = silu(gate) · up as f16), written to
// the tile's rows of out (f32) or act (f16), [R, n] each. Tiles past the last (-1) stop.
template <int Rows, void (*Dequant)(const u8*, int, float*), bool GateUp>
__device__ void moe_mm_tile(const u8* first, const u8* second, long long expert_bytes, long long row_bytes,
                            const __half* rows, int k, const int* tile_expert, const int* tile_row, int n,
                            float* out, __half* act) {
    using T = Tile<Rows>;
    constexpr int products = GateUp ? 2 : 1;
    __shared__ __align__(16) __half a[Rows * T::ld];
    __shared__ __align__(16) __half w[products * T::cols * T::ld];
    int expert = tile_expert[blockIdx.y];
    if (expert < 0) return;
    int n0 = blockIdx.x * T::cols, first_row = tile_row[blockIdx.y];
    const __half* tile = rows + (long long)first_row * k;
    const u8* stacks[2] = {first + expert * expert_bytes, second + expert * expert_bytes};
    TileAcc<Rows> acc[products];
    for (TileAcc<Rows>& part : acc)
        for (float& value : part.v) value = 0.f;
    for (int k0 = 0; k0 < k; k0 += T::depth) {
        stage_tile_rows<Rows>(tile, k, k0, a);
        stage_weights<Rows, products, Dequant>(stacks, row_bytes, n0, n, k0, k / UNIT, w);
        wait_copies();
        __syncthreads();
#pragma unroll
        for (int p = 0; p < products; p++) acc_stage<Rows>(acc[p], a, w + p * T::cols * T::ld);
        __syncthreads();
    }
    // Each thread writes its own results: gate and up of one output sit in the same place of both.
#pragma unroll
    for (int q = 0; q < TileAcc<Rows>::pairs; q++) {
        int r, column;
        acc[0].position(q, r, column);
        long long at = (long long)(first_row + r) * n + n0 + column;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            if (n0 + column + e >= n) continue;
            float value = acc[0].v[2 * q + e];
            if (GateUp) act[at + e] = __float2half(silu(value) * acc[products - 1].v[2 * q + e]);
            else out[at + e] = value;
        }
    }
}

// gate and up (expert e's rows at gate / up + e · expert_bytes) with SwiGLU: act [R, n] f16;
// down: out [R, n] f32. One pair of kernels per tile shape and stored type.
#define DEFINE_MOE_MM_ROWS(TYPE, ROWS)                                                                         \
    extern "C" __global__ void __launch_bounds__(Tile<ROWS>::threads, Tile<ROWS>::blocks)                      \
    moe_mm_gate_up_##TYPE##_r##ROWS(                                                                           \
        const u8* __restrict__ gate, const u8* __restrict__ up, long long expert_bytes, long long row_bytes,   \
        const __half* __restrict__ rows, int k, const int* __restrict__ tile_expert,                           \
        const int* __restrict__ tile_row, int n, __half* __restrict__ act) {                                   \
        wait_for_previous_grid();                                                                             \
        moe_mm_tile<ROWS, dequant_unit_##TYPE, true>(gate, up, expert_bytes, row_bytes, rows, k, tile_expert,  \
                                                     tile_row, n, nullptr, act);                               \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(Tile<ROWS>::threads, Tile<ROWS>::blocks)                      \
    moe_mm_down_##TYPE##_r##ROWS(                                                                              \
        const u8* __restrict__ down, long long expert_bytes, long long row_bytes,                              \
        const __half* __restrict__ rows, int k, const int* __restrict__ tile_expert,                           \
        const int* __restrict__ tile_row, int n, float* __restrict__ out) {                                    \
        wait_for_previous_grid();                                                                             \
        moe_mm_tile<ROWS, dequant_unit_##TYPE, false>(down, down, expert_bytes, row_bytes, rows, k,            \
                                                      tile_expert, tile_row, n, out, nullptr);                 \
    }
#define DEFINE_MOE_MM(TYPE) DEFINE_MOE_MM_ROWS(TYPE, 32) DEFINE_MOE_MM_ROWS(TYPE, 64) DEFINE_MOE_MM_ROWS(TYPE, 128)

FOR_EACH_TYPE(DEFINE_MOE_MM)
