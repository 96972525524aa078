// The element types zerodp's kernels read and write: f32, bf16 and f16, computed in f32.
#ifndef ZERODP_DTYPES_CUH
#define ZERODP_DTYPES_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ static inline float widen(float x) { return x; }
__device__ static inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ static inline float widen(__half x) { return __half2float(x); }

// Round to nearest even into T.
template <typename T> __device__ static inline T narrow(float x);
template <> __device__ inline float narrow<float>(float x) { return x; }
template <> __device__ inline __nv_bfloat16 narrow<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ inline __half narrow<__half>(float x) { return __float2half_rn(x); }

#endif
