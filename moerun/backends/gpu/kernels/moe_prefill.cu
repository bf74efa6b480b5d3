// Prefill expert layout on the device, with no host round trip: count the pairs per
// expert, give each expert whole tiles of rows and place every pair in a row of its
// expert; moe_mm.cu multiplies the tiles.
// Shape legend: P routed pairs, E experts, R rows (each expert's pairs, padded to tiles).
#include "common.cuh"

// One block: count the pairs per expert (ids < 0 are empty slots), give expert e whole
// tiles of `tile` rows from row_start[e] (tile t belongs to tile_expert[t] from row
// tile_row[t]; tiles past the last are -1), then place pair p (token p / top_k) in the
// next row of its expert: token_rows[row] = token (-1 for padding rows), pair_rows[p] =
// row (-1 for an empty slot). Rows within an expert come in arrival order; each row's
// product is independent of the others, so results do not depend on it.
extern "C" __global__ void layout_pairs(const int* __restrict__ ids, int n_pairs, int top_k, int n_experts,
                                        int tile, int max_tiles, int max_rows, int* __restrict__ counts,
                                        int* __restrict__ tile_expert, int* __restrict__ tile_row,
                                        int* __restrict__ token_rows, int* __restrict__ pair_rows) {
    wait_for_previous_grid();
    __shared__ int count[MAX_EXPERTS], row_start[MAX_EXPERTS], cursor[MAX_EXPERTS];
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) { count[e] = 0; cursor[e] = 0; }
    for (int r = threadIdx.x; r < max_rows; r += blockDim.x) token_rows[r] = -1;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x)
        if (ids[p] >= 0) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int row = 0, t = 0;
        for (int e = 0; e < n_experts; e++) {
            row_start[e] = row;
            for (int first = 0; first < count[e]; first += tile) {
                tile_expert[t] = e;
                tile_row[t] = row + first;
                t++;
            }
            row += (count[e] + tile - 1) / tile * tile;
        }
        for (; t < max_tiles; t++) { tile_expert[t] = -1; tile_row[t] = 0; }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) counts[e] = count[e];
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        int expert = ids[p];
        if (expert < 0) {
            pair_rows[p] = -1;
            continue;
        }
        int row = row_start[expert] + atomicAdd(&cursor[expert], 1);
        token_rows[row] = p / top_k;
        pair_rows[p] = row;
    }
}
