// What the bindings of the CUDA kernels (selector_cuda.cpp, serving_cuda.cpp) need from
// their device: a device guard (which also refuses a device this build has no code for:
// cuda_arch.h), the stream to launch on, the launch check, and the op library and dispatch
// key they register under. The CUDA build uses CUDA's; the
// emulated build (csrc/emulation/) compiles the same bindings for CPU tensors, runs the
// kernels on the CPU's SIMT runtime and registers them as torch.ops.dflash2_emulated.*.
#pragma once

#include <torch/all.h>

#include "cuda_arch.h"

namespace dflash2 {

// Raises, naming the device, its capability, what the build holds and how to rebuild,
// when none of this build's code runs on a device of compute capability major.minor:
// the first launch there fails with that, never with CUDA's "no kernel image".
inline void require_device_code(int device, int major, int minor) {
  TORCH_CHECK(!cuda_arch::code_for(cuda_arch::build_codes(), major, minor).empty(),
              cuda_arch::missing_code_message(cuda_arch::build_codes(), cuda_arch::build_arch_list(), device, major,
                                              minor));
}

}  // namespace dflash2

#if defined(DFLASH2_EMULATED)

#include "emulation/runtime.h"

#define DFLASH2_KERNEL_OPS dflash2_emulated
#define DFLASH2_KERNEL_DISPATCH_KEY CPU

namespace dflash2 {

constexpr c10::DeviceType kKernelDevice = c10::DeviceType::CPU;

// The emulated GPU's compute capability is set by the tests (emulation/runtime.h).
struct KernelDeviceGuard {
  explicit KernelDeviceGuard(const c10::Device&) {
    int major = 0, minor = 0;
    emulation::device_capability(&major, &minor);
    require_device_code(0, major, minor);
  }
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

#include <array>
#include <atomic>

#define DFLASH2_KERNEL_OPS dflash2
#define DFLASH2_KERNEL_DISPATCH_KEY CUDA

namespace dflash2 {

constexpr c10::DeviceType kKernelDevice = c10::DeviceType::CUDA;

// Makes the tensors' device current and, on the first launch there, checks that the
// build holds code it runs (a device that passed is not asked again).
class KernelDeviceGuard {
 public:
  explicit KernelDeviceGuard(const c10::Device& device) : guard_(device) {
    static std::array<std::atomic<bool>, 256> checked{};
    const int index = guard_.current_device().index();
    const bool cached = index >= 0 && index < static_cast<int>(checked.size());
    if (cached && checked[index].load(std::memory_order_acquire)) return;
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index));
    require_device_code(index, major, minor);
    if (cached) checked[index].store(true, std::memory_order_release);
  }

 private:
  c10::cuda::CUDAGuard guard_;
};

inline cudaStream_t kernel_stream() { return c10::cuda::getCurrentCUDAStream(); }

inline void check_launch(cudaError_t status) { C10_CUDA_CHECK(status); }

}  // namespace dflash2

#endif

// TORCH_LIBRARY_IMPL stringifies its arguments: expand the macros first.
#define DFLASH2_LIBRARY_IMPL_EXPANDED(ops, key, m) TORCH_LIBRARY_IMPL(ops, key, m)
#define DFLASH2_KERNEL_LIBRARY_IMPL(m) \
  DFLASH2_LIBRARY_IMPL_EXPANDED(DFLASH2_KERNEL_OPS, DFLASH2_KERNEL_DISPATCH_KEY, m)
