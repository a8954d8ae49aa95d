// DFLASH2_ROW_KERNEL: a CPU inner-loop function also compiled for AVX2 and picked when
// the library loads (an ifunc) on x86-64 Linux. The default build targets SSE2, whose
// 4 float lanes leave these loops bound by instructions rather than by memory.
#pragma once

#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define DFLASH2_ROW_KERNEL __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef DFLASH2_ROW_KERNEL
#define DFLASH2_ROW_KERNEL
#endif

#include <cstdint>

namespace dflash2 {
namespace {  // each kernel file gets its own clones: no cross-file ifunc symbols

// sum_rho x[rho] * y[rho] in kLanes independent partial sums: the compiler turns the
// lanes into vector registers (a single running sum is a serial dependency it may not
// reorder), and the lanes' pairwise combination loses less than one long chain.
template <typename Acc, typename T>
DFLASH2_ROW_KERNEL Acc lane_dot(const Acc* x, const T* y, int64_t length) {
  constexpr int kLanes = 16;
  Acc lanes[kLanes] = {};
  int64_t rho = 0;
  for (; rho + kLanes <= length; rho += kLanes) {
    for (int i = 0; i < kLanes; ++i) lanes[i] += x[rho + i] * static_cast<Acc>(y[rho + i]);
  }
  for (int i = 0; rho < length; ++rho, ++i) lanes[i] += x[rho] * static_cast<Acc>(y[rho]);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  return lanes[0];
}

}  // namespace
}  // namespace dflash2
