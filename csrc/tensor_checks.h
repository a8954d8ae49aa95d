// The first check of every C++ op (CPU and CUDA bindings alike, the emulated build
// included): each tensor argument is a tensor. torch's schema passes a Python None for a
// `Tensor` argument through as an undefined tensor, and anything read from it (device,
// dtype, sizes) fails with torch's own "tensor does not have a device", which names no
// argument. Called before any other check:
//
//   check_defined({{x, "x"}, {delta, "delta"}, {base, "base"}});
#pragma once

#include <torch/all.h>

#include <initializer_list>

namespace dflash2 {

// A tensor argument and its name in the op's schema.
struct TensorArgument {
  const at::Tensor& tensor;
  const char* name;
};

// TypeError "<name> must be a tensor, got None" for the first undefined one, in order.
inline void check_defined(std::initializer_list<TensorArgument> arguments) {
  for (const TensorArgument& argument : arguments) {
    TORCH_CHECK_TYPE(argument.tensor.defined(), argument.name, " must be a tensor, got None");
  }
}

}  // namespace dflash2
