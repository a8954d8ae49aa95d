// Tensors the C++ ops allocate, outputs and scratch alike. With DFLASH2_POISON_OUTPUTS
// set (and not "0") each is filled before its kernels run: NaN for floating types, the
// type's lowest value for integers. An element a kernel forgets to write then fails the
// tests instead of passing with whatever the allocator left there (torch's caching
// allocator hands back recently freed, often correct-looking, memory).
//
// Large CPU results ask the kernel for transparent huge pages before anything touches
// them. A fresh 4 KB page costs a fault on its first write; under THP's common
// "madvise" mode (this project's VMs), a 500 MB dU took 135 ms in faults alone against
// 33 ms with 2 MB pages, 512 times fewer faults. Where THP is off or "always",
// madvise changes nothing.
#pragma once

#include <torch/all.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

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

// The 2 MB-aligned interior of a CPU tensor of at least kHugePageMinBytes, marked for
// huge pages. Best effort: a refusal (no THP, an old kernel) leaves 4 KB pages.
inline void request_huge_pages(const at::Tensor& tensor) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
  constexpr size_t kHugePageMinBytes = 4 * kHugePage;
  if (!tensor.device().is_cpu() || tensor.nbytes() < kHugePageMinBytes) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(tensor.data_ptr());
  const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = (begin + tensor.nbytes()) & ~(kHugePage - 1);
  if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)tensor;
#endif
}

inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor tensor = at::empty(sizes, options);
  request_huge_pages(tensor);
  if (poison_outputs()) poison(tensor);
  return tensor;
}

}  // namespace dflash2
