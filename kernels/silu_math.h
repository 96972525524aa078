/* SiLU, silu(g) = g / (1 + e^-g), and the factor of SwiGLU's gate gradient, d silu / dg =
 * s (1 + g (1 - s)) with s = 1 / (1 + e^-g), in f32: the formulas of the CPU kernel
 * (src/model/ops/llama.rs, `SwiGlu`) for the GPU's (llama_ops.cu). C99 and CUDA C++ both
 * read it; tests/kernel_math.rs compiles it for the host and compares it with f64. */
#ifndef ZERODP_SILU_MATH_H
#define ZERODP_SILU_MATH_H

#ifdef __CUDACC__
#define ZDP_SILU_FN __device__ static inline
#else
#include <math.h>
#define ZDP_SILU_FN static inline
#endif

ZDP_SILU_FN float zdp_silu(float g) { return g / (1.0f + expf(-g)); }

ZDP_SILU_FN float zdp_silu_grad(float g) {
    float s = 1.0f / (1.0f + expf(-g));
    return s * (1.0f + g * (1.0f - s));
}

#endif
