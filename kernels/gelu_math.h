/* GELU with the tanh approximation (GPT-2's), y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
 * and its derivative, in f32: the formulas of the CPU kernels (src/model/ops.rs, `gelu` and
 * `gelu_grad`, tanh through one exp) for the GPU's (gpt_ops.cu). C99 and CUDA C++ both read it;
 * tests/kernel_math.rs compiles it for the host and compares it with the exact tanh-GELU. */
#ifndef ZERODP_GELU_MATH_H
#define ZERODP_GELU_MATH_H

#ifdef __CUDACC__
#define ZDP_GELU_FN __device__ static inline
#else
#include <math.h>
#define ZDP_GELU_FN static inline
#endif

#define ZDP_SQRT_2_OVER_PI 0.7978845608028654f
#define ZDP_GELU_C 0.044715f
#define ZDP_GELU_3C 0.134145f

/* tanh through one exp, 1 - 2 / (1 + e^(2u)): saturates correctly at both ends. */
ZDP_GELU_FN float zdp_tanh(float u) { return 1.0f - 2.0f / (1.0f + expf(u + u)); }

ZDP_GELU_FN float zdp_gelu(float x) {
    float inner = ZDP_SQRT_2_OVER_PI * (x + ZDP_GELU_C * x * x * x);
    return 0.5f * x * (1.0f + zdp_tanh(inner));
}

ZDP_GELU_FN float zdp_gelu_grad(float x) {
    float inner = ZDP_SQRT_2_OVER_PI * (x + ZDP_GELU_C * x * x * x);
    float t = zdp_tanh(inner);
    float d_inner = ZDP_SQRT_2_OVER_PI * (1.0f + ZDP_GELU_3C * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * d_inner;
}

#endif
