/* One element of zerodp's Adam/AdamW step: the formula of the CPU kernel (src/optim/adam.rs,
 * `adam_block`) operation for operation, so that the GPU's fused step (adam.cu) gives the same
 * bits as the host tier's. Rust never contracts `a * b + c` into a fused multiply-add and its
 * `sqrt` and `/` are correctly rounded; here every operation is a correctly rounded intrinsic on
 * the GPU (nvcc would otherwise fuse them) and plain C on the host, where
 * tests/kernel_math.rs compiles this header with `-ffp-contract=off` and checks it against
 * the CPU kernel bit for bit. C99 and CUDA C++ both read it. */
#ifndef ZERODP_ADAM_MATH_H
#define ZERODP_ADAM_MATH_H

#ifdef __CUDACC__
#define ZDP_FN __device__ static inline
#define ZDP_ADD(a, b) __fadd_rn((a), (b))
#define ZDP_SUB(a, b) __fsub_rn((a), (b))
#define ZDP_MUL(a, b) __fmul_rn((a), (b))
#define ZDP_DIV(a, b) __fdiv_rn((a), (b))
#define ZDP_SQRT(a) __fsqrt_rn(a)
#else
#include <math.h>
#define ZDP_FN static inline
#define ZDP_ADD(a, b) ((a) + (b))
#define ZDP_SUB(a, b) ((a) - (b))
#define ZDP_MUL(a, b) ((a) * (b))
#define ZDP_DIV(a, b) ((a) / (b))
#define ZDP_SQRT(a) sqrtf(a)
#endif

/* The step's constants, laid out as `KernelConsts` in src/optim/adam.rs (all four
 * bytes wide, no padding). */
struct zdp_adam_consts {
    float grad_scale;
    float l2;
    float decay;
    float w1;
    float one_minus_w1;
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;
    float inv_bc2_sqrt;
    float eps;
    float neg_step_size;
    /* AdamW (decoupled decay) rather than classic Adam's L2. */
    int adamw;
    /* `w1 < 0.5`: the first moment moves by `m + w1 (g - m)`, else by `g - (1 - w1)(g - m)`
     * (PyTorch's lerp, exact at both ends). */
    int lerp_low;
    /* The moments are 16-bit: the CPU kernel multiplies by `1 / bc2_sqrt` there. */
    int moments_16;
};

struct zdp_adam_out {
    float param;
    float m;
    float v;
};

/* The update of one parameter `p` with gradient `g` (as stored, not yet scaled) and moments
 * `m`, `v` (widened to f32). */
ZDP_FN struct zdp_adam_out zdp_adam_element(float p, float g, float m, float v,
                                            const struct zdp_adam_consts *c) {
    struct zdp_adam_out out;
    float decayed, denom;
    g = ZDP_MUL(g, c->grad_scale);
    if (c->adamw) {
        decayed = ZDP_MUL(p, c->decay);
    } else {
        g = ZDP_ADD(g, ZDP_MUL(c->l2, p));
        decayed = p;
    }
    if (c->lerp_low) {
        out.m = ZDP_ADD(m, ZDP_MUL(c->w1, ZDP_SUB(g, m)));
    } else {
        out.m = ZDP_SUB(g, ZDP_MUL(ZDP_SUB(g, m), c->one_minus_w1));
    }
    out.v = ZDP_ADD(ZDP_MUL(v, c->beta2), ZDP_MUL(ZDP_MUL(c->one_minus_beta2, g), g));
    if (c->moments_16) {
        denom = ZDP_ADD(ZDP_MUL(ZDP_SQRT(out.v), c->inv_bc2_sqrt), c->eps);
    } else {
        denom = ZDP_ADD(ZDP_DIV(ZDP_SQRT(out.v), c->bc2_sqrt), c->eps);
    }
    out.param = ZDP_ADD(decayed, ZDP_DIV(ZDP_MUL(c->neg_step_size, out.m), denom));
    return out;
}

#endif
