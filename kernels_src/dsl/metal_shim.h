// Just enough Metal for libclang to parse generated MSL as C++17 (parse_check.py): the builtins the emitter uses,
// and what MLX's prelude (metal::utils(), compiled before every custom kernel) provides, such as float16_t and
// bfloat16_t. Address spaces are clang address_space attributes, so mixing them (a `constant` input bound to a
// `device` pointer, a write through an input) is an error here as in Metal. Declaring a threadgroup array in the
// kernel body is valid Metal that C++ rejects; the checker accepts exactly that diagnostic on such lines.
#pragma once
#define kernel
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef unsigned long size_t;
typedef _Float16 half;
typedef __bf16 bfloat;  // Metal 3.1's scalar bfloat, which MLX's bfloat16_t is on macOS 14 and later
typedef half float16_t;
typedef bfloat bfloat16_t;
struct uint2 { uint x, y; };
struct uint3 { uint x, y, z; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };

#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define MAXFLOAT (3.40282347e+38f)

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
template <typename T> T simd_sum(T);
template <typename T> T simd_max(T);
template <typename T> T simd_min(T);
template <typename T> T simd_shuffle_xor(T, ushort);
template <typename T> T simd_shuffle(T, ushort);
template <typename T> T simd_broadcast(T, ushort);
template <typename T, typename U> T as_type(U);
float exp(float);
float exp2(float);
float log(float);
float log2(float);
float sqrt(float);
float rsqrt(float);
float sin(float);
float cos(float);
float tanh(float);
float floor(float);
float ceil(float);
float fabs(float);
float fma(float, float, float);
float copysign(float, float);
bool isnan(float);
bool isinf(float);
template <typename T> T max(T, T);
template <typename T> T min(T, T);
template <typename T> T abs(T);
namespace precise {
float exp(float);
float tanh(float);
float sin(float);
float cos(float);
}  // namespace precise
template <typename T, int Rows, int Cols> struct simdgroup_matrix {
  simdgroup_matrix() = default;
  simdgroup_matrix(T);
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
template <typename T, int R, int C, typename P> void simdgroup_load(thread simdgroup_matrix<T, R, C>&, P, ulong = 0);
template <typename T, int R, int C, typename P> void simdgroup_store(simdgroup_matrix<T, R, C>, P, ulong = 0);
template <typename T, int R, int C, typename U>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, R, C>&, simdgroup_matrix<U, R, C>,
                                   simdgroup_matrix<U, R, C>, simdgroup_matrix<T, R, C>);
}  // namespace metal
