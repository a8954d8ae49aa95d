// What every kernel file includes first for CUDA's types and intrinsics: the toolkit's
// headers under nvcc, plus the CPU's SIMT runtime in the emulated build (which makes
// the same code a host program: csrc/emulation/simt.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#if defined(DFLASH2_EMULATED)
#include <cstring>

#include "emulation/simt.h"
#endif

namespace dflash2 {

// One 16-byte store to global memory, `target` 16-byte aligned. In PTX: nvcc splits a
// uint4 assignment into four 4-byte stores where it loses track of the alignment
// (seen in selector_kernels.cu's partial sums). In the emulated build one 16-byte
// access: the host compiler may split it too, and the traffic counters
// (emulation/traffic.h) would count four strided requests.
#if defined(DFLASH2_EMULATED)
inline void store_16_bytes(void* target, uint4 value, const char* file = __builtin_FILE(),
                           int line = __builtin_LINE()) {
  if (reinterpret_cast<uintptr_t>(target) % 16 != 0) {  // a GPU stops the kernel: "misaligned address"
    ::dflash2::emulation::device_fault("16-byte store to a misaligned address", file, line);
  }
  std::memcpy(target, &value, sizeof(value));
}
#else
__device__ __forceinline__ void store_16_bytes(void* target, uint4 value) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(target), "r"(value.x), "r"(value.y), "r"(value.z),
               "r"(value.w)
               : "memory");
}
#endif

}  // namespace dflash2
