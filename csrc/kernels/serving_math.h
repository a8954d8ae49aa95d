// Per-element rules of the serving path (top-k, walk, verification), shared by the CPU
// twin and the CUDA kernels so both order, break ties and draw identically.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/selector_math.h"

namespace dflash2 {

// Candidates per position the fused path supports: one warp lane per candidate.
constexpr int kMaxServingTopK = 32;

// The largest vocabulary rejection_sample takes, on every device (the CUDA bonus pass
// keeps one mass per 4,096-token slice in shared memory).
constexpr int64_t kMaxVerifyVocab = int64_t{1} << 22;

// A float as an unsigned key whose integer order is torch.topk's order: every NaN
// above +inf, then the reals ascending. Key 0 is below every real and NaN key, so it
// marks an empty top-k slot.
constexpr uint32_t kEmptyKey = 0u;

DFLASH2_HD uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

DFLASH2_HD float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

DFLASH2_HD uint32_t ordered_key(float value) {
  if (value != value) return 0xFFFFFFFFu;
  const uint32_t bits = float_bits(value);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

DFLASH2_HD float key_value(uint32_t key) {
  if (key == 0xFFFFFFFFu) return bits_float(0x7FC00000u);
  return bits_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// An index no real element has: marks an empty top-k slot together with kEmptyKey.
constexpr uint32_t kNoIndex = 0xFFFFFFFFu;

// The top-k's total order: the larger key first, and on equal keys the lower index, so
// the k selected elements and their order are unique whatever the split of the row.
DFLASH2_HD bool ranks_above(uint32_t key, uint32_t index, uint32_t other_key, uint32_t other_index) {
  return key > other_key || (key == other_key && index < other_index);
}

// torch.argmax's choice between two scores: NaN beats everything, then the larger
// value, and on a tie the lower index.
DFLASH2_HD bool argmax_prefers(float a, int a_index, float b, int b_index) {
  const bool a_nan = a != a;
  const bool b_nan = b != b;
  if (a_nan || b_nan) return a_nan && (!b_nan || a_index < b_index);
  return a > b || (a == b && a_index < b_index);
}

}  // namespace dflash2
