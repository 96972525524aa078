// The Llama's element-wise and row-wise operations on the GPU, each one kernel where candle's
// composite ops take several (and their autograd several more): RMSNorm forward and backward,
// rotary embeddings (forward, and backward as the opposite rotation), and SwiGLU's gate forward
// and backward. Each computes in f32 from f32, bf16 or f16 tensors and rounds as transformers'
// LlamaRMSNorm and LlamaMLP do in 16 bits (the normalised rows and silu(gate) rounded before the
// product with the weight or up, the rest once on store); src/model/cuda/llama_ops.rs launches
// them. Kernels are named zerodp_<op>_<dtype>.
#include <math.h>
#include <stddef.h>

#include "dtypes.cuh"
#include "rows.cuh"
#include "silu_math.h"

// Round through T and back: what a 16-bit tensor between two of transformers' ops holds.
template <typename T> __device__ static inline float through(float x) { return widen(narrow<T>(x)); }

// 1 / sqrt(mean(row^2) + eps), as the CPU kernel's `inv_rms`.
template <typename T> __device__ static inline float inv_rms(const T *xr, int c, float eps) {
    float s = 0.0f;
    for (int j = threadIdx.x; j < c; j += 32) {
        float v = widen(xr[j]);
        s += v * v;
    }
    return 1.0f / sqrtf(warp_sum(s) / c + eps);
}

// y = w * (x * inv_rms(x)), the normalised row rounded to T before the weight.
template <typename T>
__device__ static void rms_norm_fwd(const T *x, const T *w, T *y, size_t rows, int c, float eps) {
    size_t row = warp_row(rows);
    if (row == rows) return;
    const T *xr = x + row * c;
    T *yr = y + row * c;
    float inv = inv_rms(xr, c, eps);
    for (int j = threadIdx.x; j < c; j += 32)
        yr[j] = narrow<T>(through<T>(widen(xr[j]) * inv) * widen(w[j]));
}

// dx per row, inv (g w - u mean(g w u)) with u = x inv and g = dy, as the CPU kernel; each row's
// inv goes to `stats` ([rows], f32) for rms_norm_weight_parts.
template <typename T>
__device__ static void rms_norm_bwd(const T *x, const T *w, const T *dy, T *dx, float *stats,
                                    size_t rows, int c, float eps) {
    size_t row = warp_row(rows);
    if (row == rows) return;
    int lane = threadIdx.x;
    const T *xr = x + row * c;
    const T *dyr = dy + row * c;
    T *dxr = dx + row * c;
    float inv = inv_rms(xr, c, eps);
    float s = 0.0f;
    for (int j = lane; j < c; j += 32) s += widen(dyr[j]) * widen(w[j]) * (widen(xr[j]) * inv);
    float mean = warp_sum(s) / c;
    for (int j = lane; j < c; j += 32) {
        float u = widen(xr[j]) * inv;
        dxr[j] = narrow<T>(inv * (widen(dyr[j]) * widen(w[j]) - u * mean));
    }
    if (lane == 0) stats[row] = inv;
}

// The weight's gradient in parts: part p (blockIdx.y) sums rows [p * rows_per_part, ...) of
// dy u (u as the forward rounded it) for column j into dw_parts[p * c + j] (f32).
template <typename T>
__device__ static void rms_norm_weight_parts(const T *x, const T *dy, const float *stats,
                                             float *dw_parts, size_t rows, int c,
                                             size_t rows_per_part) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    size_t p = blockIdx.y;
    size_t start = p * rows_per_part;
    size_t end = start + rows_per_part < rows ? start + rows_per_part : rows;
    float dw = 0.0f;
    for (size_t r = start; r < end; r++)
        dw += widen(dy[r * c + j]) * through<T>(widen(x[r * c + j]) * stats[r]);
    dw_parts[p * c + j] = dw;
}

// Rows [rows, width] of heads of `d`, row r at position r % seq: each head's halves (x1, x2)
// rotated by the position's angles, (x1 c - x2 s, x2 c + x1 s) with s = sign * sin; sign -1 is
// the backward (the opposite rotation). cos and sin are [seq, d / 2] f32. One thread per pair.
template <typename T>
__device__ static void rope(const T *x, const float *cos_t, const float *sin_t, T *y, size_t rows,
                            int width, int d, int seq, float sign) {
    int half = d / 2;
    size_t pairs = rows * (size_t)(width / 2);
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < pairs; k += stride) {
        size_t row = k / (size_t)(width / 2);
        int in_row = (int)(k % (size_t)(width / 2));
        int head = in_row / half, i = in_row % half;
        int pos = (int)(row % (size_t)seq);
        float c = cos_t[pos * half + i], s = sign * sin_t[pos * half + i];
        size_t at = row * width + (size_t)head * d + i;
        float x1 = widen(x[at]), x2 = widen(x[at + half]);
        // Correctly rounded products and sums, as the CPU kernel's (nvcc would fuse them).
        y[at] = narrow<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
        y[at + half] = narrow<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
}

// y = silu(g) * u, silu(g) rounded to T before the product.
template <typename T> __device__ static void swiglu_fwd(const T *g, const T *u, T *y, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = narrow<T>(through<T>(zdp_silu(widen(g[i]))) * widen(u[i]));
}

// dg = dy u silu'(g), du = dy silu(g) (as the forward rounded it).
template <typename T>
__device__ static void swiglu_bwd(const T *g, const T *u, const T *dy, T *dg, T *du, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float gi = widen(g[i]), d = widen(dy[i]);
        dg[i] = narrow<T>(d * widen(u[i]) * zdp_silu_grad(gi));
        du[i] = narrow<T>(d * through<T>(zdp_silu(gi)));
    }
}

#define ZDP_LLAMA_OPS(name, T)                                                                    \
    extern "C" __global__ void zerodp_rms_norm_fwd_##name(const T *x, const T *w, T *y,          \
                                                          size_t rows, int c, float eps) {        \
        rms_norm_fwd<T>(x, w, y, rows, c, eps);                                                   \
    }                                                                                             \
    extern "C" __global__ void zerodp_rms_norm_bwd_##name(const T *x, const T *w, const T *dy,    \
                                                          T *dx, float *stats, size_t rows,       \
                                                          int c, float eps) {                     \
        rms_norm_bwd<T>(x, w, dy, dx, stats, rows, c, eps);                                       \
    }                                                                                             \
    extern "C" __global__ void zerodp_rms_norm_weight_parts_##name(                               \
        const T *x, const T *dy, const float *stats, float *dw_parts, size_t rows, int c,         \
        size_t rows_per_part) {                                                                   \
        rms_norm_weight_parts<T>(x, dy, stats, dw_parts, rows, c, rows_per_part);                 \
    }                                                                                             \
    extern "C" __global__ void zerodp_rope_##name(const T *x, const float *cos_t,                 \
                                                  const float *sin_t, T *y, size_t rows,          \
                                                  int width, int d, int seq, float sign) {        \
        rope<T>(x, cos_t, sin_t, y, rows, width, d, seq, sign);                                   \
    }                                                                                             \
    extern "C" __global__ void zerodp_swiglu_fwd_##name(const T *g, const T *u, T *y, size_t n) { \
        swiglu_fwd<T>(g, u, y, n);                                                                \
    }                                                                                             \
    extern "C" __global__ void zerodp_swiglu_bwd_##name(const T *g, const T *u, const T *dy,      \
                                                        T *dg, T *du, size_t n) {                 \
        swiglu_bwd<T>(g, u, dy, dg, du, n);                                                       \
    }

ZDP_LLAMA_OPS(f32, float)
ZDP_LLAMA_OPS(bf16, __nv_bfloat16)
ZDP_LLAMA_OPS(f16, __half)
