// Sums in double over rows of float, bfloat16 or double, 64 elements of a row at a time
// in eight vectors of 8 doubles: for the AVX-512 kernels of the selector backward,
// whose sums run in double (csrc/selector_cpu.cpp says why). Held in registers, an
// accumulator costs a row one load, conversion, multiply and add per 8 elements; held
// in a [rank] array, as a run-time rank forces on a plain loop, it costs a load and a
// store more per 8 elements, and those extra instructions fill the window that
// should be holding the next rows' cache misses.
//
// Every element is its own sum, added in the same order as the scalar loops add it,
// and a product of two floats is exact in double: the same bits as those loops.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "cpu_row_kernel.h"

#if DFLASH2_HAS_AVX512_KERNELS
#include <immintrin.h>

// A helper of the AVX-512 kernels, inlined into them (an intrinsic needs its target on
// every function it is inlined through).
#define DFLASH2_AVX512_INLINE inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace dflash2 {
namespace {

typedef double Doubles8 __attribute__((vector_size(64)));
constexpr int64_t kDoubleChunk = 64;  // elements of a row per DoubleChunk

struct DoubleChunk {
  Doubles8 lanes[8];
};

DFLASH2_AVX512_INLINE DoubleChunk zero_chunk() { return DoubleChunk{}; }

// 8 floats as 8 doubles, exactly, in one instruction. (GCC 12 lowers
// __builtin_convertvector here to two 4-wide conversions and an insert; the masked
// form with every lane set is the plain instruction, without the unmasked intrinsic's
// false -Wuninitialized.)
DFLASH2_AVX512_INLINE Doubles8 widen8(FloatLanes<8>::floats v) {
  return reinterpret_cast<Doubles8>(_mm512_maskz_cvtps_pd(0xFF, reinterpret_cast<__m256>(v)));
}

// 8 doubles rounded to float, as static_cast<float> rounds each.
DFLASH2_AVX512_INLINE FloatLanes<8>::floats narrow8(Doubles8 v) {
  return reinterpret_cast<FloatLanes<8>::floats>(_mm512_maskz_cvtpd_ps(0xFF, reinterpret_cast<__m512d>(v)));
}

// 8 elements at p (float or bfloat16) as 8 doubles, exactly.
template <typename T>
DFLASH2_AVX512_INLINE Doubles8 load_doubles8(const T* p) {
  return widen8(load_floats<8>(p));
}

// sums[i] += weight * row[i] for i < 64, row float or bfloat16.
template <typename T>
DFLASH2_AVX512_INLINE void add_scaled_chunk(DoubleChunk& sums, double weight, const T* row) {
  for (int v = 0; v < 8; ++v) sums.lanes[v] += weight * load_doubles8(row + 8 * v);
}

DFLASH2_AVX512_INLINE void add_scaled_chunk(DoubleChunk& sums, double weight, const double* row) {
  for (int v = 0; v < 8; ++v) {
    Doubles8 x;
    std::memcpy(&x, row + 8 * v, sizeof(x));
    sums.lanes[v] += weight * x;
  }
}

// sums[i] += row[i] for i < 64.
DFLASH2_AVX512_INLINE void add_chunk(DoubleChunk& sums, const double* row) {
  for (int v = 0; v < 8; ++v) {
    Doubles8 x;
    std::memcpy(&x, row + 8 * v, sizeof(x));
    sums.lanes[v] += x;
  }
}

template <typename T>
DFLASH2_AVX512_INLINE void add_chunk(DoubleChunk& sums, const T* row) {
  add_scaled_chunk(sums, 1.0, row);  // 1 * x is x exactly
}

// 8 doubles rounded to float, then stored as T (float, or bfloat16 rounded from the
// float): as a scalar static_cast<T>(static_cast<float>(x)) rounds.
template <typename T>
DFLASH2_AVX512_INLINE void store_rounded8(T* p, Doubles8 x) {
  store_floats<8>(p, narrow8(x));
}

// Non-temporal stores, for tables written once and read much later (the gradients dA
// and dB, [V, r]: 8 MB at V = 32,000, r = 64): a plain store to a line not in cache
// first reads the line (read for ownership), doubling the traffic; these go to memory
// through the write-combining buffers, which fill whole lines from consecutive stores.
// p: aligned to the 8 elements' size (32 bytes of float, 16 of bfloat16). A kernel that
// uses them ends with _mm_sfence(), so that the stores are seen before the threads
// join.
DFLASH2_AVX512_INLINE void stream8(float* p, FloatLanes<8>::floats v) {
  _mm256_stream_ps(p, reinterpret_cast<__m256>(v));
}

DFLASH2_AVX512_INLINE void stream8(c10::BFloat16* p, FloatLanes<8>::floats v) {
  c10::BFloat16 narrowed[8];
  store_floats<8>(narrowed, v);
  __m128i bits;
  std::memcpy(&bits, narrowed, sizeof(bits));
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), bits);
}

}  // namespace
}  // namespace dflash2

#endif  // DFLASH2_HAS_AVX512_KERNELS
