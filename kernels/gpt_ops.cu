// The GPT's element-wise and row-wise operations on the GPU, each one kernel where candle's
// composite ops take several (and their autograd several more): GELU forward and backward, the
// causal softmax of attention forward and backward, LayerNorm forward and backward. Each computes
// in f32 from f32, bf16 or f16 tensors and rounds once on store (PyTorch's 16-bit kernels do the
// same); src/model/cuda/gpt_ops.rs launches them. Kernels are named zerodp_<op>_<dtype>.
//
// Row kernels give each row to one warp (blockDim (32, ROWS_PER_BLOCK)): lanes stride along the
// row, and warp shuffles reduce it.
#include <math.h>
#include <stddef.h>

#include "dtypes.cuh"
#include "gelu_math.h"
#include "rows.cuh"

template <typename T> __device__ static void gelu_fwd(const T *x, T *y, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = narrow<T>(zdp_gelu(widen(x[i])));
}

template <typename T> __device__ static void gelu_bwd(const T *x, const T *dy, T *dx, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dx[i] = narrow<T>(widen(dy[i]) * zdp_gelu_grad(widen(x[i])));
}

// Rows of `t` scores, row r at query position r % t: keys 0..=r % t are kept, the rest get 0
// (the causal mask's -inf). exp(x - max) / sum, as candle_nn's softmax.
template <typename T>
__device__ static void causal_softmax_fwd(const T *x, T *y, size_t rows, int t) {
    size_t row = warp_row(rows);
    if (row == rows) return;
    int lane = threadIdx.x;
    int last = (int)(row % (size_t)t);
    const T *xr = x + row * t;
    T *yr = y + row * t;
    float m = -INFINITY;
    for (int j = lane; j <= last; j += 32) m = fmaxf(m, widen(xr[j]));
    m = warp_max(m);
    float s = 0.0f;
    for (int j = lane; j <= last; j += 32) s += expf(widen(xr[j]) - m);
    s = warp_sum(s);
    for (int j = lane; j < t; j += 32) yr[j] = narrow<T>(j <= last ? expf(widen(xr[j]) - m) / s : 0.0f);
}

// dx = y (dy - sum(y dy)) per row.
template <typename T>
__device__ static void softmax_bwd(const T *y, const T *dy, T *dx, size_t rows, int t) {
    size_t row = warp_row(rows);
    if (row == rows) return;
    int lane = threadIdx.x;
    const T *yr = y + row * t;
    const T *dyr = dy + row * t;
    T *dxr = dx + row * t;
    float s = 0.0f;
    for (int j = lane; j < t; j += 32) s += widen(yr[j]) * widen(dyr[j]);
    s = warp_sum(s);
    for (int j = lane; j < t; j += 32) dxr[j] = narrow<T>(widen(yr[j]) * (widen(dyr[j]) - s));
}

// The row's mean and 1 / sqrt(var + eps), two passes as the CPU kernel's `ln_stats`.
template <typename T>
__device__ static inline void ln_stats(const T *xr, int c, float eps, float *mean, float *rstd) {
    int lane = threadIdx.x;
    float s = 0.0f;
    for (int j = lane; j < c; j += 32) s += widen(xr[j]);
    float mu = warp_sum(s) / c;
    float v = 0.0f;
    for (int j = lane; j < c; j += 32) {
        float d = widen(xr[j]) - mu;
        v += d * d;
    }
    *mean = mu;
    *rstd = 1.0f / sqrtf(warp_sum(v) / c + eps);
}

template <typename T>
__device__ static void layer_norm_fwd(const T *x, const T *w, const T *b, T *y, size_t rows, int c,
                                      float eps) {
    size_t row = warp_row(rows);
    if (row == rows) return;
    const T *xr = x + row * c;
    T *yr = y + row * c;
    float mean, rstd;
    ln_stats(xr, c, eps, &mean, &rstd);
    for (int j = threadIdx.x; j < c; j += 32)
        yr[j] = narrow<T>((widen(xr[j]) - mean) * rstd * widen(w[j]) + widen(b[j]));
}

// dx per row, rstd (g w - mean(g w) - xhat mean(g w xhat)) with g = dy, as the CPU kernel; each
// row's mean and rstd go to `stats` ([rows, 2], f32) for layer_norm_param_parts.
template <typename T>
__device__ static void layer_norm_bwd(const T *x, const T *w, const T *dy, T *dx, float *stats,
                                      size_t rows, int c, float eps) {
    size_t row = warp_row(rows);
    if (row == rows) return;
    int lane = threadIdx.x;
    const T *xr = x + row * c;
    const T *dyr = dy + row * c;
    T *dxr = dx + row * c;
    float mean, rstd;
    ln_stats(xr, c, eps, &mean, &rstd);
    float sg = 0.0f, sgx = 0.0f;
    for (int j = lane; j < c; j += 32) {
        float gw = widen(dyr[j]) * widen(w[j]);
        sg += gw;
        sgx += gw * ((widen(xr[j]) - mean) * rstd);
    }
    float mean_g = warp_sum(sg) / c;
    float mean_gx = warp_sum(sgx) / c;
    for (int j = lane; j < c; j += 32) {
        float xhat = (widen(xr[j]) - mean) * rstd;
        dxr[j] = narrow<T>(rstd * (widen(dyr[j]) * widen(w[j]) - mean_g - xhat * mean_gx));
    }
    if (lane == 0) {
        stats[2 * row] = mean;
        stats[2 * row + 1] = rstd;
    }
}

// The weight's and bias's gradients in parts: part p (blockIdx.y) sums rows
// [p * rows_per_part, (p + 1) * rows_per_part) of dy xhat and dy for column j into
// dw_parts[p * c + j] and db_parts[p * c + j] (f32); the caller sums the parts.
template <typename T>
__device__ static void layer_norm_param_parts(const T *x, const T *dy, const float *stats,
                                              float *dw_parts, float *db_parts, size_t rows, int c,
                                              size_t rows_per_part) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    size_t p = blockIdx.y;
    size_t start = p * rows_per_part;
    size_t end = start + rows_per_part < rows ? start + rows_per_part : rows;
    float dw = 0.0f, db = 0.0f;
    for (size_t r = start; r < end; r++) {
        float g = widen(dy[r * c + j]);
        float xhat = (widen(x[r * c + j]) - stats[2 * r]) * stats[2 * r + 1];
        dw += g * xhat;
        db += g;
    }
    dw_parts[p * c + j] = dw;
    db_parts[p * c + j] = db;
}

#define ZDP_OPS(name, T)                                                                          \
    extern "C" __global__ void zerodp_gelu_fwd_##name(const T *x, T *y, size_t n) {               \
        gelu_fwd<T>(x, y, n);                                                                     \
    }                                                                                             \
    extern "C" __global__ void zerodp_gelu_bwd_##name(const T *x, const T *dy, T *dx, size_t n) { \
        gelu_bwd<T>(x, dy, dx, n);                                                                \
    }                                                                                             \
    extern "C" __global__ void zerodp_causal_softmax_fwd_##name(const T *x, T *y, size_t rows,    \
                                                                int t) {                          \
        causal_softmax_fwd<T>(x, y, rows, t);                                                     \
    }                                                                                             \
    extern "C" __global__ void zerodp_softmax_bwd_##name(const T *y, const T *dy, T *dx,          \
                                                         size_t rows, int t) {                    \
        softmax_bwd<T>(y, dy, dx, rows, t);                                                       \
    }                                                                                             \
    extern "C" __global__ void zerodp_layer_norm_fwd_##name(const T *x, const T *w, const T *b,   \
                                                            T *y, size_t rows, int c, float eps) { \
        layer_norm_fwd<T>(x, w, b, y, rows, c, eps);                                              \
    }                                                                                             \
    extern "C" __global__ void zerodp_layer_norm_bwd_##name(const T *x, const T *w, const T *dy,  \
                                                            T *dx, float *stats, size_t rows,     \
                                                            int c, float eps) {                   \
        layer_norm_bwd<T>(x, w, dy, dx, stats, rows, c, eps);                                     \
    }                                                                                             \
    extern "C" __global__ void zerodp_layer_norm_param_parts_##name(                              \
        const T *x, const T *dy, const float *stats, float *dw_parts, float *db_parts,            \
        size_t rows, int c, size_t rows_per_part) {                                               \
        layer_norm_param_parts<T>(x, dy, stats, dw_parts, db_parts, rows, c, rows_per_part);      \
    }

ZDP_OPS(f32, float)
ZDP_OPS(bf16, __nv_bfloat16)
ZDP_OPS(f16, __half)
