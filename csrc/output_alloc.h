// Tensors the C++ ops allocate, outputs and scratch alike. With DFLASH2_POISON_OUTPUTS
// set (and not "0") each is filled before its kernels run: NaN for floating types, the
// type's lowest value for integers. An element a kernel forgets to write then fails the
// tests instead of passing with whatever the allocator left there (torch's caching
// allocator hands back recently freed, often correct-looking, memory).
//
// CPU results of 64 KiB and up come from cpu_result_cache.h: memory kept from earlier
// calls, with huge pages requested, instead of fresh pages faulted in on first write.
// (Kernel temporaries take the same memory through cpu_result_cache::scratch.)
#pragma once

#include <torch/all.h>

#include "cpu_result_cache.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace dflash2 {

// Read on every call (a getenv is nothing next to a kernel), so tests can switch it.
inline bool poison_outputs() {
  const char* value = std::getenv("DFLASH2_POISON_OUTPUTS");
  return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
}

inline void poison(at::Tensor& tensor) {
  if (at::isFloatingType(tensor.scalar_type())) {
    tensor.fill_(std::numeric_limits<double>::quiet_NaN());
  } else if (tensor.scalar_type() == at::kLong) {
    tensor.fill_(std::numeric_limits<int64_t>::min());
  } else if (tensor.scalar_type() == at::kInt) {
    tensor.fill_(std::numeric_limits<int32_t>::min());
  }
}

inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor tensor = options.device().is_cpu() ? cpu_result_cache::empty(sizes, options) : at::empty(sizes, options);
  if (poison_outputs()) poison(tensor);
  return tensor;
}

}  // namespace dflash2
