// DFLASH2_ROW_KERNEL: a CPU inner-loop function also compiled for AVX2 and picked when
// the library loads (an ifunc) on x86-64 Linux. The default build targets SSE2, whose
// 4 float lanes leave these loops bound by instructions rather than by memory.
//
// A clone is a call through the ifunc, never inlined: a clone should own a whole row's
// (or a whole block's) loop, calling the inline helpers below, which inline into it and
// compile for its target.
#pragma once

// The inline helpers pass 32-byte vectors by value; they never cross a call boundary.
#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define DFLASH2_ROW_KERNEL __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef DFLASH2_ROW_KERNEL
#define DFLASH2_ROW_KERNEL
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace dflash2 {
namespace {  // each kernel file gets its own clones: no cross-file ifunc symbols

// DFLASH2_INLINE: a helper that must be inlined into the kernel calling it, to be
// compiled for that kernel's target (left out of line, it is the default target's code,
// and its vector arguments pass through memory).
#if defined(__GNUC__) || defined(__clang__)
#define DFLASH2_INLINE inline __attribute__((always_inline))
#else
#define DFLASH2_INLINE inline
#endif

// DFLASH2_AVX512_KERNEL: a function compiled for AVX-512 (F, BW, VL, DQ), to be called
// only where cpu_has_avx512(); its 16-float vectors halve the instructions of the
// 8-float AVX2 code in loops that are bound by instructions.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DFLASH2_HAS_AVX512_KERNELS 1
#define DFLASH2_AVX512_KERNEL __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
// DFLASH2_DISABLE_AVX512 set (and not "0") when the library loads keeps the AVX2 and
// default code: the sanitized half of `make test` sets it, so that on an AVX-512
// machine the suite executes both.
inline bool cpu_has_avx512() {
  static const bool has = [] {
    const char* disabled = std::getenv("DFLASH2_DISABLE_AVX512");
    if (disabled != nullptr && *disabled != '\0' && std::strcmp(disabled, "0") != 0) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return has;
}
#else
#define DFLASH2_HAS_AVX512_KERNELS 0
inline bool cpu_has_avx512() { return false; }
#endif

// kWidth floats as one GCC vector (with the 32-bit words and 16-bit halves of the same
// lanes): 8 fill one AVX2 register (two SSE registers in the default clone), 16 one
// AVX-512 register.
template <int kWidth>
struct FloatLanes {
  typedef float floats __attribute__((vector_size(4 * kWidth)));
  typedef uint32_t words __attribute__((vector_size(4 * kWidth)));
  typedef uint16_t halfwords __attribute__((vector_size(2 * kWidth)));
};
typedef FloatLanes<8>::floats Floats8;

// kWidth elements at p as floats, widened in registers: a bfloat16 is the top half of a
// float's bits (a shift, exact), so 16-bit rows need no converted copy.
template <int kWidth>
DFLASH2_INLINE typename FloatLanes<kWidth>::floats load_floats(const float* p) {
  typename FloatLanes<kWidth>::floats v;
  std::memcpy(&v, p, sizeof(v));  // an unaligned vector load
  return v;
}

template <int kWidth>
DFLASH2_INLINE typename FloatLanes<kWidth>::floats load_floats(const c10::BFloat16* p) {
  using Lanes = FloatLanes<kWidth>;
  typename Lanes::halfwords raw;
  std::memcpy(&raw, p, sizeof(raw));
  const typename Lanes::words bits = __builtin_convertvector(raw, typename Lanes::words) << 16;
  typename Lanes::floats v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

template <int kWidth>
DFLASH2_INLINE typename FloatLanes<kWidth>::floats load_floats(const c10::Half* p) {
  typename FloatLanes<kWidth>::floats v;
  for (int i = 0; i < kWidth; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

// v stored at p: as is for float; for bfloat16 rounded to nearest even in registers,
// NaN to 0x7FC0, exactly as c10's conversion rounds.
template <int kWidth>
DFLASH2_INLINE void store_floats(float* p, typename FloatLanes<kWidth>::floats v) {
  std::memcpy(p, &v, sizeof(v));
}

template <int kWidth>
DFLASH2_INLINE void store_floats(c10::BFloat16* p, typename FloatLanes<kWidth>::floats v) {
  using Words = typename FloatLanes<kWidth>::words;
  Words bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const Words rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const Words is_nan = (Words)(v != v);  // all ones where v is NaN
  const auto narrowed =
      __builtin_convertvector((is_nan & 0x7FC0u) | (~is_nan & rounded), typename FloatLanes<kWidth>::halfwords);
  std::memcpy(p, &narrowed, sizeof(narrowed));
}

// sum_rho x[rho] * y[rho] in 16 independent partial sums (lane i takes rho = i mod 16),
// folded by halves: the compiler keeps the lanes in vector registers (a single running
// sum is a serial dependency it may not reorder), and the pairwise fold loses less than
// one long chain. The order is fixed by the lanes, not by the target: both clones give
// the same bits.
template <typename Acc, typename T>
DFLASH2_INLINE Acc lane_dot(const Acc* x, const T* y, int64_t length) {
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

// The float accumulator: the same 16 lanes (lane i takes rho = i mod 16) as 16 / kWidth
// vectors, kept in registers (the generic version's lane array went through the stack,
// and its wide reloads of narrow stores stalled on every call), folded in the same
// order: the same bits at either width.
template <int kWidth, typename T>
DFLASH2_INLINE float lane_dot_in(const float* x, const T* y, int64_t length) {
  using Vector = typename FloatLanes<kWidth>::floats;
  constexpr int kVectors = 16 / kWidth;
  Vector sums[kVectors] = {};
  int64_t rho = 0;
  for (; rho + 16 <= length; rho += 16) {
    for (int v = 0; v < kVectors; ++v) {
      sums[v] += load_floats<kWidth>(x + rho + v * kWidth) * load_floats<kWidth>(y + rho + v * kWidth);
    }
  }
  if (rho < length) {
    float lanes[16];
    std::memcpy(lanes, sums, sizeof(lanes));
    for (int i = 0; rho < length; ++rho, ++i) lanes[i] += x[rho] * static_cast<float>(y[rho]);
    std::memcpy(sums, lanes, sizeof(lanes));
  }
  // The fold by halves in vector shuffles: eight[i] = lane i + lane i + 8, four[i] =
  // eight[i] + eight[i + 4], two[i] = four[i] + four[i + 2], then two[0] + two[1].
  Floats8 eight;
  if constexpr (kWidth == 16) {
    eight = __builtin_shufflevector(sums[0], sums[0], 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(sums[0], sums[0], 8, 9, 10, 11, 12, 13, 14, 15);
  } else {
    eight = sums[0] + sums[1];
  }
  typedef float Floats4 __attribute__((vector_size(16)));
  typedef float Floats2 __attribute__((vector_size(8)));
  const Floats4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  const Floats2 two = __builtin_shufflevector(four, four, 0, 1) + __builtin_shufflevector(four, four, 2, 3);
  return two[0] + two[1];
}

template <typename T>
DFLASH2_INLINE float lane_dot(const float* x, const T* y, int64_t length) {
  return lane_dot_in<8>(x, y, length);
}

// dots[j] = lane_dot(context, b_table + ids[j] * b_stride, rank) for j < count: a row's
// candidates in one call of the clone.
template <typename Acc, typename T>
DFLASH2_ROW_KERNEL void candidate_dots_clone(const Acc* context, const T* b_table, int64_t b_stride,
                                             const int64_t* ids, int64_t count, int64_t rank, Acc* dots) {
  for (int64_t j = 0; j < count; ++j) dots[j] = lane_dot(context, b_table + ids[j] * b_stride, rank);
}

#if DFLASH2_HAS_AVX512_KERNELS
template <typename T>
DFLASH2_AVX512_KERNEL void candidate_dots_avx512(const float* context, const T* b_table, int64_t b_stride,
                                                 const int64_t* ids, int64_t count, int64_t rank, float* dots) {
  for (int64_t j = 0; j < count; ++j) dots[j] = lane_dot_in<16>(context, b_table + ids[j] * b_stride, rank);
}
#endif

template <typename Acc, typename T>
inline void candidate_dots(const Acc* context, const T* b_table, int64_t b_stride, const int64_t* ids, int64_t count,
                           int64_t rank, Acc* dots) {
#if DFLASH2_HAS_AVX512_KERNELS
  if constexpr (std::is_same_v<Acc, float>) {
    if (cpu_has_avx512()) return candidate_dots_avx512(context, b_table, b_stride, ids, count, rank, dots);
  }
#endif
  candidate_dots_clone(context, b_table, b_stride, ids, count, rank, dots);
}

}  // namespace
}  // namespace dflash2
