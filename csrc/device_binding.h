// What the bindings of the CUDA kernels (selector_cuda.cpp, serving_cuda.cpp) need from
// their device: a device guard, the stream to launch on, the launch check, and the op
// library and dispatch key they register under. The CUDA build uses CUDA's; the
// emulated build (csrc/emulation/) compiles the same bindings for CPU tensors, runs the
// kernels on the CPU's SIMT runtime and registers them as torch.ops.dflash2_emulated.*.
#pragma once

#include <torch/all.h>

#if defined(DFLASH2_EMULATED)

#include "emulation/runtime.h"

#define DFLASH2_KERNEL_OPS dflash2_emulated
#define DFLASH2_KERNEL_DISPATCH_KEY CPU

namespace dflash2 {

constexpr c10::DeviceType kKernelDevice = c10::DeviceType::CPU;

struct KernelDeviceGuard {
  explicit KernelDeviceGuard(const c10::Device&) {}
};

inline cudaStream_t kernel_stream() { return nullptr; }

inline void check_launch(cudaError_t status) {
  TORCH_CHECK(status == cudaSuccess, emulation::last_launch_error());
}

}  // namespace dflash2

#else

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#define DFLASH2_KERNEL_OPS dflash2
#define DFLASH2_KERNEL_DISPATCH_KEY CUDA

namespace dflash2 {

constexpr c10::DeviceType kKernelDevice = c10::DeviceType::CUDA;

using KernelDeviceGuard = c10::cuda::CUDAGuard;

inline cudaStream_t kernel_stream() { return c10::cuda::getCurrentCUDAStream(); }

inline void check_launch(cudaError_t status) { C10_CUDA_CHECK(status); }

}  // namespace dflash2

#endif

// TORCH_LIBRARY_IMPL stringifies its arguments: expand the macros first.
#define DFLASH2_LIBRARY_IMPL_EXPANDED(ops, key, m) TORCH_LIBRARY_IMPL(ops, key, m)
#define DFLASH2_KERNEL_LIBRARY_IMPL(m) \
  DFLASH2_LIBRARY_IMPL_EXPANDED(DFLASH2_KERNEL_OPS, DFLASH2_KERNEL_DISPATCH_KEY, m)
