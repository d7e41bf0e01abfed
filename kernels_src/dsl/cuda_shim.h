// Just enough CUDA for libclang to parse generated CUDA C as C++17 (parse_check.py), with no CUDA toolkit:
// execution-space qualifiers, the thread/block builtins, __syncthreads, warp shuffles, __half / __nv_bfloat16
// (conversions through float), the float math the emitter calls. `#include <cuda_fp16.h>` / <cuda_bf16.h>
// resolve to empty stand-ins.
#pragma once
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
struct float4 { float x, y, z, w; };
extern const uint3 threadIdx;
extern const uint3 blockIdx;
extern const dim3 blockDim;
extern const dim3 gridDim;
void __syncthreads();
template <typename T> T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32);
template <typename T> T __shfl_sync(unsigned mask, T var, int lane, int width = 32);
void* memcpy(void*, const void*, unsigned long);

struct __half {
  __half() = default;
  __half(float);
  operator float() const;
};
struct __nv_bfloat16 {
  __nv_bfloat16() = default;
  __nv_bfloat16(float);
  operator float() const;
};

float __int_as_float(int);
int __float_as_int(float);
float expf(float);
float exp2f(float);
float logf(float);
float log2f(float);
float sqrtf(float);
float rsqrtf(float);
float sinf(float);
float cosf(float);
float tanhf(float);
float erff(float);
float floorf(float);
float ceilf(float);
float fabsf(float);
float fmaf(float, float, float);
float copysignf(float, float);
