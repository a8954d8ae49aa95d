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
