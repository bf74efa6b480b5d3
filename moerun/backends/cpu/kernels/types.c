// The stored types the kernels read, by their GGML ids.
#include "moe_cpu.h"

const struct type_info TYPES[N_TYPES] = {
    //            ggml  values bytes
    [T_F32]  = {  0,    1,    4},
    [T_F16]  = {  1,    1,    2},
    [T_BF16] = { 30,    1,    2},
    [T_Q4_0] = {  2,   32,   18},
    [T_Q4_1] = {  3,   32,   20},
    [T_Q5_0] = {  6,   32,   22},
    [T_Q5_1] = {  7,   32,   24},
    [T_Q8_0] = {  8,   32,   34},
    [T_Q4_K] = { 12,  256,  144},
    [T_Q5_K] = { 13,  256,  176},
    [T_Q6_K] = { 14,  256,  210},
};

int type_index(int64_t ggml_id) {
    for (int i = 0; i < N_TYPES; i++)
        if (TYPES[i].ggml_id == ggml_id) return i;
    return -1;
}

int moe_supports_type(int64_t ggml_id) { return type_index(ggml_id) >= 0; }
