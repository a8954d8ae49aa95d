// Memory for the C++ ops' CPU results and temporaries of 64 KiB and up, kept for reuse
// after the tensor that held it is freed.
//
// Why: torch's CPU allocator hands such a request to glibc, which maps fresh pages for
// it from 128 KiB (or trims them off its heap's top once that much is free), so a call
// pays a page fault per page on first write. A training step allocates the same results
// every step (the selector's dense [N, V] dU: 500 MB at N = 4096, V = 32,000; its 8 MB
// dA and dB at r = 64, 4,488 fresh pages every backward call before these came from the
// cache too; the same backward's 5 MB of temporaries, 1,120-1,185 faults a call before
// they did). On this project's VMs, writing 500 MB took 17-20 ms into memory already
// mapped against 60 ms into fresh 2 MB pages, 236-364 ms into fresh 4 KB pages, and up
// to 1.2 s into fresh 2 MB pages right after other large allocations were freed (likely
// memory the VM had handed back to its host; docs/BENCHMARKS.md at 743a4f8). Blocks are mapped
// with huge pages requested (madvise; where THP is off or "always" that changes
// nothing).
//
// What it keeps: freed blocks, most recently freed first, up to DFLASH2_CPU_CACHE_MB
// (default 1024; 0 keeps nothing), read on every call. A request takes a kept block of
// exactly its mapped length (whole pages under 8 MiB, whole 2 MB huge pages from there,
// so that nearby sizes share blocks) or maps a new one; a block that would
// push the total past the limit evicts the least recently freed. A request the system
// refuses empties the cache and tries once more. Python:
// dflash2_kernels.cpu_cache_bytes() and empty_cpu_cache().
//
// Under AddressSanitizer blocks come from the instrumented allocator at their exact size
// and are poisoned while kept, so an overrun or a use after free still reports.
#pragma once

#include <torch/all.h>

#include <cstddef>

namespace dflash2::cpu_result_cache {

// The smallest request the cache serves (bytes).
constexpr size_t kMinBytes = size_t(64) << 10;

// An uninitialized contiguous CPU tensor of `sizes`: of kMinBytes and up, its memory
// from the cache, its storage resizable (a resize moves it to torch's allocator and
// frees the block); smaller (or sizes at::empty refuses, which it then reports),
// at::empty's.
at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options);

// `bytes` of uninitialized memory for a kernel's temporary, as empty() allocates it.
at::Tensor scratch(int64_t bytes);

// Bytes (mapped length) of the blocks kept for reuse now.
size_t retained_bytes();

// Unmaps every kept block. Blocks in use are not affected.
void release_all();

}  // namespace dflash2::cpu_result_cache
