// Global-memory traffic counters of the SIMT runtime (the emulated build only; the
// kernels compiled by nvcc know nothing of them).
//
// The kernel files are compiled with AddressSanitizer's checks as calls
// (scripts/asan.py: --param asan-instrumentation-with-call-threshold=0), so every load
// and store a kernel makes goes through traffic.cpp's __asan_load* / __asan_store*
// hooks, which hand the check on to the sanitizer. Between traffic_start() and
// traffic_stop() the hooks also record each access a CUDA thread makes outside its
// own stack and outside the library's static storage (function-local statics stand
// for __shared__ memory): what a GPU would read from or write to global memory.
//
// At the end of each block, a warp's accesses are grouped into requests as a GPU
// issues them: the n-th execution of one instruction (one return address) by each of
// the warp's lanes is one request. Per launch: requests, the 32-byte sectors they
// touch against their ideal (a request whose lanes step by one constant, coalesced or
// strided, ideally fills whole sectors; a gather through indices needs what it
// touches), the bytes requested, and the unique bytes (and sectors) read and written
// by the whole grid and by each block.
//
// What is counted is what g++ makes of each access: a 16-byte vector access counts as
// one only where it is one on the host too (simt.h's __ldg, device_runtime.cuh's
// store_16_bytes); a struct copy the host compiler splits, or scalar accesses it merges,
// can differ from nvcc's code. A launch's accesses are kept until its block ends.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace dflash2 {
namespace emulation {
namespace traffic {

// From the registration (torch.ops.dflash2_emulated.traffic_start / traffic_stop):
// start clears the records and counts every launch from now on; stop ends counting
// and returns one JSON object per launch since start, as a JSON array.
void start();
std::string stop();

// From the scheduler (simt.cpp), on the launching OS thread. [state_begin, state_end)
// holds the runtime's per-thread records, which threadIdx, blockIdx, blockDim and
// gridDim read: registers on a GPU, not memory.
void launch_begin(const char* kernel, dim3 grid, dim3 block, uintptr_t state_begin, uintptr_t state_end);
void block_end(int threads);
void launch_end(bool ok);

}  // namespace traffic

// From simt.cpp: the CUDA thread running now (its linear index in the block and its
// fiber's stack), or false outside a kernel.
bool running_thread(int* linear, uintptr_t* stack_low, uintptr_t* stack_high);

}  // namespace emulation
}  // namespace dflash2
