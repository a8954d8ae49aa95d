// dflash2::cpu_cached_empty: the CPU result cache (cpu_result_cache.h) for tensors Python
// allocates: the draft head's per-chunk [R, V] logits and gradient planes (head/ops.py,
// head/grads.py, head/shard.py), up to the tile budget (256 MiB by default) every call.
// From torch.empty they are fresh pages every call (glibc maps blocks that large anew),
// about 30 ms of page faults per 128 MiB on this project's VMs.
#include <torch/all.h>
#include <torch/library.h>

#include <limits>

#include "output_alloc.h"

namespace dflash2 {
namespace {

at::Tensor cpu_cached_empty(at::IntArrayRef size, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(at::isFloatingType(dtype) || at::isIntegralType(dtype, /*includeBool=*/true),
                   "dtype must be a real (floating, integer or bool) dtype, got ", dtype, ".");
  int64_t elements = 1;
  for (const int64_t extent : size) {
    TORCH_CHECK_VALUE(extent >= 0, "size must hold non-negative extents, got ", size, ".");
    TORCH_CHECK_VALUE(extent == 0 || elements <= std::numeric_limits<int64_t>::max() / extent,
                      "size ", size, " holds more elements than int64 can count.");
    elements *= extent;
  }
  return empty_output(size, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace
}  // namespace dflash2

// No tensor argument to dispatch on: one kernel for every backend.
TORCH_LIBRARY_IMPL(dflash2, CompositeExplicitAutograd, m) {
  m.impl("cpu_cached_empty", &dflash2::cpu_cached_empty);
}
