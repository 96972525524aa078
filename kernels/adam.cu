// zerodp's fused Adam/AdamW step over one unit's flat tensors in GPU memory: one pass reads the
// gradient, the fp32 master and both moments and writes the master, the moments and the
// compute-dtype parameters, where candle's element-wise ops took about a dozen passes. The
// arithmetic is adam_math.h's, the CPU kernel's operation for operation.
//
// Kernels are named zerodp_adam_<gradient>_<moments>_<parameters> (f32, bf16 or f16;
// moments f32 or bf16); src/model/cuda/adam.rs picks one by the tensors' dtypes.
#include <stddef.h>

#include "adam_math.h"
#include "dtypes.cuh"

// The dtype the engine stores parameters in, through which the compute copy is rounded.
enum { STORED_F32 = 0, STORED_BF16 = 1, STORED_F16 = 2 };

__device__ static inline float through_stored(float x, int stored) {
    switch (stored) {
    case STORED_BF16: return __bfloat162float(__float2bfloat16_rn(x));
    case STORED_F16: return __half2float(__float2half_rn(x));
    default: return x;
    }
}

// In place over n elements, grid-stride. `params` is null where the compute parameters are the
// master itself (fp32 training).
template <typename G, typename M, typename P>
__device__ static void adam_unit(const G *grad, float *master, M *exp_avg, M *exp_avg_sq,
                                 P *params, int stored, zdp_adam_consts c, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        zdp_adam_out o = zdp_adam_element(master[i], widen(grad[i]), widen(exp_avg[i]),
                                          widen(exp_avg_sq[i]), &c);
        master[i] = o.param;
        exp_avg[i] = narrow<M>(o.m);
        exp_avg_sq[i] = narrow<M>(o.v);
        if (params != NULL) {
            params[i] = narrow<P>(through_stored(o.param, stored));
        }
    }
}

#define ZDP_ADAM(gn, G, mn, M, pn, P)                                                             \
    extern "C" __global__ void zerodp_adam_##gn##_##mn##_##pn(                                    \
        const G *grad, float *master, M *exp_avg, M *exp_avg_sq, P *params, int stored,           \
        zdp_adam_consts c, size_t n) {                                                            \
        adam_unit<G, M, P>(grad, master, exp_avg, exp_avg_sq, params, stored, c, n);              \
    }

#define ZDP_ADAM_PARAMS(gn, G, mn, M)                                                             \
    ZDP_ADAM(gn, G, mn, M, f32, float)                                                            \
    ZDP_ADAM(gn, G, mn, M, bf16, __nv_bfloat16)                                                   \
    ZDP_ADAM(gn, G, mn, M, f16, __half)

#define ZDP_ADAM_MOMENTS(gn, G)                                                                   \
    ZDP_ADAM_PARAMS(gn, G, f32, float)                                                            \
    ZDP_ADAM_PARAMS(gn, G, bf16, __nv_bfloat16)

ZDP_ADAM_MOMENTS(f32, float)
ZDP_ADAM_MOMENTS(bf16, __nv_bfloat16)
ZDP_ADAM_MOMENTS(f16, __half)
