// Lanes of a row of the draft head's logits (csrc/head_cpu.cpp), with the elementwise
// math its passes need: exp, log and tanh over 8 floats at once, or over 4 doubles.
//
// The float versions are Cephes' single-precision polynomials (exp and log within about
// 1 ulp, tanh within about 2), written over GCC vectors so that each clone of the row
// kernel (cpu_row_kernel.h: AVX2 and the SSE2 default) vectorises them for its target:
// a row of 248k logits takes several exps per element, and a scalar expf would make
// those passes, not the GEMMs, the cost of the head. Doubles (float64 inputs) take the C
// library's functions lane by lane: that path is for accuracy, not speed.
//
// Edges follow IEEE and torch: exp(-inf) = 0 exactly (a masked logit has probability 0,
// and the losses' "0 log 0 = 0" rule tests for exactly 0), exp(+inf) = inf, log(0) =
// -inf, log(x < 0) = NaN, tanh(+-inf) = +-1, NaN in gives NaN out.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_row_kernel.h"

namespace dflash2 {
namespace {

// E lanes of width W: the vector, its comparison mask and its width.
template <typename E>
struct HeadLanes;

template <>
struct HeadLanes<float> {
  static constexpr int kWidth = 8;
  typedef float vec __attribute__((vector_size(32)));
  typedef int32_t mask __attribute__((vector_size(32)));
};

template <>
struct HeadLanes<double> {
  static constexpr int kWidth = 4;
  typedef double vec __attribute__((vector_size(32)));
  typedef int64_t mask __attribute__((vector_size(32)));
};

template <typename E>
using Vec = typename HeadLanes<E>::vec;
template <typename E>
using Mask = typename HeadLanes<E>::mask;

template <typename E>
DFLASH2_INLINE Vec<E> splat(E value) {
  Vec<E> v;
  for (int i = 0; i < HeadLanes<E>::kWidth; ++i) v[i] = value;
  return v;
}

// count (<= the width) elements at p, the other lanes `fill`.
template <typename E>
DFLASH2_INLINE Vec<E> load_lanes(const E* p, int64_t count, E fill) {
  constexpr int kWidth = HeadLanes<E>::kWidth;
  if (count >= kWidth) {
    Vec<E> v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  Vec<E> v = splat<E>(fill);
  for (int64_t i = 0; i < count; ++i) v[i] = p[i];
  return v;
}

template <typename E>
DFLASH2_INLINE void store_lanes(E* p, Vec<E> v, int64_t count) {
  if (count >= HeadLanes<E>::kWidth) {
    std::memcpy(p, &v, sizeof(v));
    return;
  }
  for (int64_t i = 0; i < count; ++i) p[i] = v[i];
}

template <typename E>
DFLASH2_INLINE bool any_lane(Mask<E> m) {
  bool any = false;
  for (int i = 0; i < HeadLanes<E>::kWidth; ++i) any |= m[i] != 0;
  return any;
}

// Running sums of lanes in double: a float row's 8 lanes as two vectors of 4 doubles
// (exact: a float is a double), so a row of 248k terms adds up without float's drift.
struct DoubleSums {
  typedef double d4 __attribute__((vector_size(32)));
  d4 low{}, high{};

  DFLASH2_INLINE void add(Vec<float> v) {
    low += __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), d4);
    high += __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), d4);
  }
  DFLASH2_INLINE void add(Vec<double> v) { low += v; }
  DFLASH2_INLINE double total() const {
    double sum = 0.0;
    for (int i = 0; i < 4; ++i) sum += low[i];
    for (int i = 0; i < 4; ++i) sum += high[i];
    return sum;
  }
};

// 2^n for integer-valued lanes n in [-252, 254], as two exact power-of-two factors (one
// alone would leave the normal range below 2^-126).
DFLASH2_INLINE Vec<float> exp2_int(Vec<float> n) {
  using Words = Mask<float>;
  const Words whole = __builtin_convertvector(n, Words);
  const Words half = whole >> 1;
  const Words rest = whole - half;
  Vec<float> first, second;
  const Words first_bits = (half + 127) << 23, second_bits = (rest + 127) << 23;
  std::memcpy(&first, &first_bits, sizeof(first));
  std::memcpy(&second, &second_bits, sizeof(second));
  return first * second;
}

DFLASH2_INLINE Vec<float> exp_lanes(Vec<float> x) {
  const Vec<float> hi = splat(88.7228391f), lo = splat(-103.972084f);
  const Mask<float> overflow = x > hi, underflow = x < lo;
  Vec<float> clamped = x > hi ? hi : x;
  clamped = clamped < lo ? lo : clamped;  // NaN compares false both times: it stays
  // n = round(x / ln 2) (to nearest, by the float magic number), r = x - n ln 2 in two parts.
  const Vec<float> magic = splat(12582912.0f);
  const Vec<float> n = (clamped * splat(1.44269504088896341f) + magic) - magic;
  const Vec<float> r = (clamped - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  Vec<float> p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  Vec<float> result = p * exp2_int(n);
  result = overflow ? splat(std::numeric_limits<float>::infinity()) : result;
  return underflow ? splat(0.0f) : result;
}

DFLASH2_INLINE Vec<float> log_lanes(Vec<float> x) {
  using Words = Mask<float>;
  const Mask<float> zero = x == splat(0.0f), negative = x < splat(0.0f);
  const Mask<float> infinite = x == splat(std::numeric_limits<float>::infinity());
  // Subnormals scaled into the normal range first (2^24), their exponent corrected.
  const Mask<float> tiny = x < splat(1.17549435e-38f);
  Vec<float> scaled = tiny ? x * splat(16777216.0f) : x;
  Words bits;
  std::memcpy(&bits, &scaled, sizeof(bits));
  Vec<float> e = __builtin_convertvector(((bits >> 23) & 0xFF) - 126, Vec<float>);
  e = tiny ? e - splat(24.0f) : e;
  const Words mantissa_bits = (bits & 0x007FFFFF) | 0x3F000000;  // m in [0.5, 1)
  Vec<float> m;
  std::memcpy(&m, &mantissa_bits, sizeof(m));
  const Mask<float> small = m < splat(0.707106781186547524f);
  e = small ? e - splat(1.0f) : e;
  m = small ? m + m - splat(1.0f) : m - splat(1.0f);
  const Vec<float> z = m * m;
  Vec<float> y = splat(7.0376836292e-2f);
  y = y * m + splat(-1.1514610310e-1f);
  y = y * m + splat(1.1676998740e-1f);
  y = y * m + splat(-1.2420140846e-1f);
  y = y * m + splat(1.4249322787e-1f);
  y = y * m + splat(-1.6668057665e-1f);
  y = y * m + splat(2.0000714765e-1f);
  y = y * m + splat(-2.4999993993e-1f);
  y = y * m + splat(3.3333331174e-1f);
  y = y * m * z;
  y = y + e * splat(-2.12194440e-4f);
  y = y - z * splat(0.5f);
  Vec<float> result = (m + y) + e * splat(0.693359375f);
  result = infinite ? x : result;
  result = zero ? splat(-std::numeric_limits<float>::infinity()) : result;
  result = negative ? splat(std::numeric_limits<float>::quiet_NaN()) : result;
  return x != x ? x : result;
}

DFLASH2_INLINE Vec<float> tanh_lanes(Vec<float> x) {
  const Vec<float> magnitude = x < splat(0.0f) ? -x : x;
  // Small |x|: the odd polynomial (1 - 2 / (e^2x + 1) would cancel there).
  const Vec<float> z = x * x;
  Vec<float> p = splat(-5.70498872745e-3f);
  p = p * z + splat(2.06390887954e-2f);
  p = p * z + splat(-5.37397155531e-2f);
  p = p * z + splat(1.33314422036e-1f);
  p = p * z + splat(-3.33332819422e-1f);
  const Vec<float> small = p * z * x + x;
  Vec<float> large = splat(1.0f) - splat(2.0f) / (exp_lanes(magnitude + magnitude) + splat(1.0f));
  large = x < splat(0.0f) ? -large : large;
  const Vec<float> result = magnitude < splat(0.625f) ? small : large;
  return x != x ? x : result;
}

// Doubles: the C library's, lane by lane.
DFLASH2_INLINE Vec<double> exp_lanes(Vec<double> x) {
  for (int i = 0; i < HeadLanes<double>::kWidth; ++i) x[i] = std::exp(x[i]);
  return x;
}

DFLASH2_INLINE Vec<double> log_lanes(Vec<double> x) {
  for (int i = 0; i < HeadLanes<double>::kWidth; ++i) x[i] = std::log(x[i]);
  return x;
}

DFLASH2_INLINE Vec<double> tanh_lanes(Vec<double> x) {
  for (int i = 0; i < HeadLanes<double>::kWidth; ++i) x[i] = std::tanh(x[i]);
  return x;
}

}  // namespace
}  // namespace dflash2
