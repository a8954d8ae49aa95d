// Element access for tensors whose dtype is known only at run time, in fp32: the
// serving kernels read a few values per row this way (scores, codebook rows of a
// gather), where a switch costs nothing next to the memory latency.
#pragma once

#include <cstdint>

#include "kernels/device_runtime.cuh"

#include "kernels/selector_math.h"

namespace dflash2 {

__device__ __forceinline__ float load_float(const void* base, int64_t index, DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(base)[index]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
    default: return static_cast<const float*>(base)[index];
  }
}

// As load_float, but through L2 only: for data another block of this grid wrote.
__device__ __forceinline__ float load_float_global(const void* base, int64_t index, DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return __half2float(__ushort_as_half(__ldcg(static_cast<const unsigned short*>(base) + index)));
    case DType::kBFloat16:
      return __uint_as_float(static_cast<uint32_t>(__ldcg(static_cast<const unsigned short*>(base) + index)) << 16);
    default: return __ldcg(static_cast<const float*>(base) + index);
  }
}

// Rounds once, to nearest even.
__device__ __forceinline__ void store_rounded(void* base, int64_t index, DType dtype, float value) {
  switch (dtype) {
    case DType::kFloat16: static_cast<__half*>(base)[index] = __float2half_rn(value); break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(value); break;
    default: static_cast<float*>(base)[index] = value; break;
  }
}

}  // namespace dflash2
