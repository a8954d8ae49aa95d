// A copy kernel with planted traffic bugs, run by torch.ops.dflash2_emulated.traffic_probe
// (registration.cpp), so the tests can show that the traffic checks
// (benchmarks/traffic_minimum.py) catch what they are meant to catch in a CUDA kernel.
// Test build only, like the rest of csrc/emulation/; compiled as a kernel file (its
// accesses are counted).
#include "emulation/traffic_probe.h"

#include "kernels/launch.cuh"

namespace dflash2 {
namespace {

__global__ void traffic_probe_kernel(const float* x, float* out, int64_t n, int variant) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kTrafficProbeThreads;
  const int thread = static_cast<int>(threadIdx.x);
  if (variant == 2) {
    const int64_t source = base + (thread % 32) * (kTrafficProbeThreads / 32) + thread / 32;
    if (source < n) out[source] = 2.0f * x[source];
    return;
  }
  const int64_t i = base + thread;
  const float first = i < n ? x[i] : 0.0f;
  if (variant == 1) {
    __syncthreads();
    if (i < n) out[i] = first + x[i];
  } else if (i < n) {
    out[i] = first + first;
  }
}

}  // namespace

cudaError_t launch_traffic_probe(const float* x, float* out, int64_t n, int variant) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((n + kTrafficProbeThreads - 1) / kTrafficProbeThreads);
  return launch_kernel<traffic_probe_kernel>(blocks, kTrafficProbeThreads, 0, nullptr, x, out, n, variant);
}

}  // namespace dflash2
