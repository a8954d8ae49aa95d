// The traffic counters' probe (traffic_probe_kernels.cpp): out = 2 x over n floats, one
// thread an element, blocks of kTrafficProbeThreads.
//   variant 0: one coalesced read and write per element;
//   variant 1: the same sum, but x[i] read a second time after a barrier;
//   variant 2: a warp reads a column of a 32 x 8 tile (stride 8 elements): strided
//              reads (n a multiple of kTrafficProbeThreads).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dflash2 {

constexpr int kTrafficProbeThreads = 256;

cudaError_t launch_traffic_probe(const float* x, float* out, int64_t n, int variant);

}  // namespace dflash2
