// x86-64 with AMX (Sapphire Rapids and later): the AVX-512 kernels, and the products of many
// tokens on the tile unit (struct matrix_unit in moe_cpu.h: three bfloat16 planes per operand).
// A tile product: C [16 rows, 16 tokens] += A [16 rows, 32 values] · B [32 values, 16 tokens]
// in float32, A the rows' planes as they lie, B a tile of the tokens' planes (pairs of values).
#define _GNU_SOURCE
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "avx512.h"
#include "moe_cpu.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ROW_BYTES 64                // of a tile

// The CPU has AMX-TILE, AMX-BF16 and AVX512-BF16, and Linux lets this process use the tiles.
int amx_usable(void) {
    unsigned eax, ebx, ecx, edx;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    int tiles = (edx >> 24 & 1) && (edx >> 22 & 1);
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    return tiles && (eax >> 5 & 1) && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// The tile configuration, loaded by each product (another library in the process may have
// loaded its own, or released the tiles): 8 tiles of 16 rows of 64 bytes.
static void configure(void) {
    struct __attribute__((packed)) {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int i = 0; i < 8; i++) config.bytes[i] = ROW_BYTES, config.rows[i] = UNIT_TOKENS;
    _tile_loadconfig(&config);
}

// 16 floats as three bfloat16 planes (each rounded to nearest even; the rests exact in float32).
static inline void split16(__m512 x, __m256i planes[UNIT_PLANES]) {
    __m256bh hi = _mm512_cvtneps_pbh(x);
    __m512 rest = _mm512_sub_ps(x, _mm512_cvtpbh_ps(hi));
    __m256bh mid = _mm512_cvtneps_pbh(rest);
    rest = _mm512_sub_ps(rest, _mm512_cvtpbh_ps(mid));
    planes[0] = (__m256i)hi, planes[1] = (__m256i)mid, planes[2] = (__m256i)_mm512_cvtneps_pbh(rest);
}

// 16 vectors of 16 32-bit lanes transposed: lane j of v[i] to lane i of v[j].
static inline void transpose16(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 2; j++) {
            v[4 * i + 2 * j] = _mm512_unpacklo_epi64(t[4 * i + j], t[4 * i + 2 + j]);
            v[4 * i + 2 * j + 1] = _mm512_unpackhi_epi64(t[4 * i + j], t[4 * i + 2 + j]);
        }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(v[8 * i + j], v[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(v[8 * i + j], v[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        v[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        v[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

// Each 32 values of 16 tokens: per plane, token t's 16 pairs as a vector of 32-bit lanes, then
// transposed into the tile's rows (row i: pair i of every token).
static void unit_split_tokens(const float* x, const int64_t* tokens, int64_t n_tokens, int64_t n, uint16_t* planes) {
    int64_t chunks = n / 32;
    for (int64_t tile = 0; tile < unit_tiles(n_tokens); tile++) {
        const float* row[UNIT_TOKENS];
        for (int t = 0; t < UNIT_TOKENS; t++) {
            int64_t i = tile * UNIT_TOKENS + t;
            row[t] = i >= n_tokens ? NULL : x + (tokens ? tokens[i] : i) * n;
        }
        uint16_t* out = planes + tile * UNIT_PLANES * chunks * UNIT_TILE;
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            __m512i pairs[UNIT_PLANES][UNIT_TOKENS];
            for (int t = 0; t < UNIT_TOKENS; t++) {
                __m256i low[UNIT_PLANES], high[UNIT_PLANES];
                split16(row[t] ? _mm512_loadu_ps(row[t] + chunk * 32) : _mm512_setzero_ps(), low);
                split16(row[t] ? _mm512_loadu_ps(row[t] + chunk * 32 + 16) : _mm512_setzero_ps(), high);
                for (int p = 0; p < UNIT_PLANES; p++)
                    pairs[p][t] = _mm512_inserti64x4(_mm512_castsi256_si512(low[p]), high[p], 1);
            }
            for (int p = 0; p < UNIT_PLANES; p++) {
                transpose16(pairs[p]);
                uint16_t* tile_out = out + (p * chunks + chunk) * UNIT_TILE;
                for (int i = 0; i < UNIT_TOKENS; i++) _mm512_storeu_si512(tile_out + i * 32, pairs[p][i]);
            }
        }
    }
}

// The six plane products of one chunk into C tile `c`: rows' planes a (A tiles 2, 3, 7),
// tokens' planes in tiles 4, 5, 6 (loaded by the caller). Tile numbers are constants.
#define CHUNK_PRODUCTS(c, a, plane)                                                                \
    do {                                                                                           \
        _tile_loadd(2, a, ROW_BYTES);                                                              \
        _tile_loadd(3, (a) + (plane), ROW_BYTES);                                                  \
        _tile_dpbf16ps(c, 2, 4);                                                                   \
        _tile_dpbf16ps(c, 2, 5);                                                                   \
        _tile_dpbf16ps(c, 3, 4);                                                                   \
        _tile_dpbf16ps(c, 2, 6);                                                                   \
        _tile_dpbf16ps(c, 3, 5);                                                                   \
        _tile_loadd(7, (a) + 2 * (plane), ROW_BYTES);                                              \
        _tile_dpbf16ps(c, 7, 4);                                                                   \
    } while (0)

// C [16 rows, 16 tokens] into out[t * stride + r] for the rows and tokens that exist.
static void store_products(const float c[UNIT_TOKENS][UNIT_TOKENS], int rows, int tokens, float* out, int64_t stride) {
    for (int t = 0; t < tokens; t++)
        for (int r = 0; r < rows; r++) out[t * stride + r] = c[r][t];
}

// Token tiles one by one, two row tiles at a time (C tiles 0 and 1) over every chunk of values.
static void unit_multiply(const uint16_t* rows, int64_t n_rows, int64_t n, const uint16_t* tokens, int64_t n_tokens,
                          float* out, int64_t stride) {
    configure();
    int64_t chunks = n / 32, row_tiles = unit_tiles(n_rows), plane = chunks * UNIT_TILE;
    float c[2][UNIT_TOKENS][UNIT_TOKENS] __attribute__((aligned(64)));
    for (int64_t tile = 0; tile < unit_tiles(n_tokens); tile++) {
        const uint16_t* b = tokens + tile * UNIT_PLANES * chunks * UNIT_TILE;
        int64_t left = n_tokens - tile * UNIT_TOKENS;
        int tile_tokens = left < UNIT_TOKENS ? (int)left : UNIT_TOKENS;
        for (int64_t row_tile = 0; row_tile < row_tiles; row_tile += 2) {
            int pair = row_tile + 1 < row_tiles;
            const uint16_t* a = rows + row_tile * UNIT_PLANES * plane;
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t chunk = 0; chunk < chunks; chunk++) {
                const uint16_t* bc = b + chunk * UNIT_TILE;
                _tile_loadd(4, bc, ROW_BYTES);
                _tile_loadd(5, bc + chunks * UNIT_TILE, ROW_BYTES);
                _tile_loadd(6, bc + 2 * chunks * UNIT_TILE, ROW_BYTES);
                CHUNK_PRODUCTS(0, a + chunk * UNIT_TILE, plane);
                if (pair) CHUNK_PRODUCTS(1, a + UNIT_PLANES * plane + chunk * UNIT_TILE, plane);
            }
            _tile_stored(0, c[0], ROW_BYTES);
            _tile_stored(1, c[1], ROW_BYTES);
            for (int h = 0; h <= pair; h++) {
                int64_t first = (row_tile + h) * UNIT_TOKENS;
                int count = n_rows - first < UNIT_TOKENS ? (int)(n_rows - first) : UNIT_TOKENS;
                store_products(c[h], count, tile_tokens, out + tile * UNIT_TOKENS * stride + first, stride);
            }
        }
    }
    _tile_release();        // no tile state left to save at a switch of threads
}

static const struct matrix_unit amx_unit;

#define ISA_NAME "amx"
#define ISA_TABLE isa_amx
#define MATRIX_UNIT amx_unit

#include "tiles.h"

// split_T: a tile of up to 16 stored rows of n values (row_bytes apart), dequantized 16 values
// at a time (the values dequantize_T gives) and split into its planes' tiles, 32 values (a
// line of a tile) a store; block by block (two of 16 values), so that the tiles a block writes
// (a K-quant's 8 chunks by 3 planes: 24 KB) stay in L1 while each of the 16 rows fills its line
// of every one. Rows past `rows` are zero.
#define SPLIT_TILE(name, type, values, bytes)                                                         \
    static void split_##name(const uint8_t* first, int64_t row_bytes, int rows, int64_t n, uint16_t* tiles) { \
        enum { STEP = values < 32 ? 32 : values, BLOCKS = STEP / values };                            \
        int64_t plane = n / 32 * UNIT_TILE;                                                           \
        for (int64_t at = 0; at < n; at += STEP)                                                      \
            for (int r = 0; r < UNIT_TOKENS; r++) {                                                   \
                const uint8_t* block = first + r * row_bytes + at / values * bytes;                  \
                struct block_state s[BLOCKS];                                                         \
                for (int j = 0; j < BLOCKS && r < rows; j++) prepare_##name(block + j * bytes, &s[j]); \
                UNROLL_GROUPS for (int c = 0; c < STEP / 32; c++) {                                   \
                    __m512 half[2];                                                                   \
                    for (int h = 0; h < 2; h++) {                                                     \
                        int v = 32 * c + 16 * h, j = v / values;                                      \
                        half[h] = r < rows ? group_##name(block + j * bytes, &s[j], v % values / 16).v[0] \
                                           : _mm512_setzero_ps();                                     \
                    }                                                                                 \
                    __m256i low[UNIT_PLANES], high[UNIT_PLANES];                                      \
                    split16(half[0], low);                                                            \
                    split16(half[1], high);                                                           \
                    uint16_t* line = tiles + (at + 32 * c) / 32 * UNIT_TILE + r * 32;                 \
                    for (int p = 0; p < UNIT_PLANES; p++)                                             \
                        _mm512_store_si512(line + p * plane,                                          \
                                           _mm512_inserti64x4(_mm512_castsi256_si512(low[p]), high[p], 1)); \
                }                                                                                     \
            }                                                                                         \
    }
TYPES(SPLIT_TILE)

#define SPLIT_ENTRY(name, type, values, bytes) [type] = split_##name,
static const struct matrix_unit amx_unit = {
    .least_tokens = 24,     // 768 x 2048 Q4_K on a Xeon core: 0.87x the vector tiles at 13 tokens, 1x at 24, 1.3x at 48
    .split_tokens = unit_split_tokens,
    .split_stored = {TYPES(SPLIT_ENTRY)},
    .multiply = unit_multiply,
};
