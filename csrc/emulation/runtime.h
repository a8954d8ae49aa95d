// The SIMT runtime's host-side interface: what launchers and bindings call (no
// kernel-side macros; kernels include simt.h). See simt.h for the execution model.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace dflash2 {
namespace emulation {

// Runs `body(closure)` once per thread of every block. Returns cudaSuccess, or an
// error whose message last_launch_error() gives (deadlock, divergent collective, bad
// launch configuration).
using KernelBody = void (*)(void* closure);
cudaError_t run_grid(const char* kernel, dim3 grid, dim3 block, size_t dynamic_shared_bytes, KernelBody body,
                     void* closure);
const char* last_launch_error();

// The seed of every schedule drawn from now on (blocks' order, threads' order between
// their synchronisation points). One seed, one schedule.
void set_schedule_seed(uint64_t seed);

// The compute capability the emulated GPU reports to the bindings' check that the build
// holds code for it (device_binding.h): 9.0 unless a test sets another, to see the error
// a GPU without code gets.
void set_device_capability(int major, int minor);
void device_capability(int* major, int* minor);

}  // namespace emulation
}  // namespace dflash2
