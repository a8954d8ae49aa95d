// The one launch form of the kernel files: launch_kernel<kernel>(grid, block, shared
// bytes, stream, arguments...) is `kernel<<<...>>>(arguments...)` under nvcc, and a run
// on the CPU's SIMT emulator (csrc/emulation/simt.h) in the emulated build. Either way
// it returns the launch's status.
#pragma once

#include <cstddef>

#include "kernels/device_runtime.cuh"

namespace dflash2 {

#if defined(DFLASH2_EMULATED)

template <auto Kernel, typename... Args>
cudaError_t launch_kernel(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, const Args&... args) {
  (void)stream;  // one CPU thread runs the whole launch, in order with the caller
  auto call = [&] { Kernel(args...); };
  using Call = decltype(call);
  return emulation::run_grid(
      emulation::kernel_name<Kernel>(), grid, block, shared_bytes,
      [](void* closure) { (*static_cast<Call*>(closure))(); }, &call);
}

#else

template <auto Kernel, typename... Args>
cudaError_t launch_kernel(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, const Args&... args) {
  Kernel<<<grid, block, shared_bytes, stream>>>(args...);
  return cudaGetLastError();
}

#endif

}  // namespace dflash2
