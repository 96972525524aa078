// Row kernels give each row to one warp (blockDim (32, ROWS_PER_BLOCK) in src/model/cuda/launch.rs):
// lanes stride along the row, and warp shuffles reduce it.
#ifndef ZERODP_ROWS_CUH
#define ZERODP_ROWS_CUH

#include <stddef.h>

__device__ static inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ static inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// This warp's row, or `rows` (past the end) for a warp beyond the last row.
__device__ static inline size_t warp_row(size_t rows) {
    size_t row = (size_t)blockIdx.x * blockDim.y + threadIdx.y;
    return row < rows ? row : rows;
}

#endif
