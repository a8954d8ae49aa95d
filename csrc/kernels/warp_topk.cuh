// A warp's running top-k (k <= 32): lane i holds the i-th best (key, index) so far,
// in serving_math.h's order. Offering a candidate that beats entry k-1 shifts the
// lanes below its rank down by one. Once the list is full, almost every element of a
// long row fails a single float compare against entry k-1, so the scan runs at the
// speed of its loads; insertions (about k * ln(n / k) over n random elements) take the
// slow path.
#pragma once

#include <cstdint>

#include "kernels/serving_math.h"

namespace dflash2 {

constexpr unsigned kWarpMask = 0xffffffffu;

struct WarpTopk {
  int k;
  uint32_t key = kEmptyKey;  // this lane's entry; lanes >= k hold nothing of use
  uint32_t index = kNoIndex;
  uint32_t threshold_key = kEmptyKey;  // entry k-1: what a candidate must beat
  uint32_t threshold_index = kNoIndex;
  // The coarse filter: an element x can only enter when !(x < threshold_value). -inf
  // while the list has room; NaN (never < anything) once NaNs fill it.
  float threshold_value = bits_float(0xff800000u);

  __device__ explicit WarpTopk(int top_k) : k(top_k) {}

  __device__ __forceinline__ bool beats_threshold(uint32_t candidate_key, uint32_t candidate_index) const {
    return ranks_above(candidate_key, candidate_index, threshold_key, threshold_index);
  }

  // Every lane passes the same candidate, which beats the threshold.
  __device__ __forceinline__ void insert(uint32_t candidate_key, uint32_t candidate_index, int lane) {
    const bool stays_ahead = lane < k && ranks_above(key, index, candidate_key, candidate_index);
    const int position = __popc(__ballot_sync(kWarpMask, stays_ahead));
    const uint32_t previous_key = __shfl_up_sync(kWarpMask, key, 1);
    const uint32_t previous_index = __shfl_up_sync(kWarpMask, index, 1);
    if (lane == position) {
      key = candidate_key;
      index = candidate_index;
    } else if (lane > position) {
      key = previous_key;
      index = previous_index;
    }
    threshold_key = __shfl_sync(kWarpMask, key, k - 1);
    threshold_index = __shfl_sync(kWarpMask, index, k - 1);
    if (threshold_key != kEmptyKey) threshold_value = key_value(threshold_key);
  }

  // Offers each lane's candidates whose bit is set in `pending` (all lanes call this
  // together), one at a time, lowest lane first: the result depends only on the set
  // offered, since the order is total.
  template <int N>
  __device__ __forceinline__ void offer(const uint32_t (&keys)[N], const uint32_t (&indices)[N], uint32_t pending,
                                        int lane) {
    while (true) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        if (((pending >> e) & 1u) && !beats_threshold(keys[e], indices[e])) pending &= ~(1u << e);
      }
      const unsigned lanes = __ballot_sync(kWarpMask, pending != 0);
      if (lanes == 0) return;
      const int leader = __ffs(lanes) - 1;
      const int slot = __ffs(pending) - 1;
      uint32_t chosen_key = kEmptyKey;
      uint32_t chosen_index = kNoIndex;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        if (e == slot) {
          chosen_key = keys[e];
          chosen_index = indices[e];
        }
      }
      chosen_key = __shfl_sync(kWarpMask, chosen_key, leader);
      chosen_index = __shfl_sync(kWarpMask, chosen_index, leader);
      if (lane == leader) pending &= pending - 1;
      insert(chosen_key, chosen_index, lane);
    }
  }

  // Offers `count` (key, index) entries stored contiguously, 32 per step.
  __device__ __forceinline__ void offer_entries(const uint32_t* keys, const uint32_t* indices, int64_t count,
                                                int lane) {
    for (int64_t base = 0; base < count; base += 32) {
      const int64_t entry = base + lane;
      uint32_t entry_key[1] = {kEmptyKey};
      uint32_t entry_index[1] = {kNoIndex};
      if (entry < count) {
        entry_key[0] = keys[entry];
        entry_index[0] = indices[entry];
      }
      offer<1>(entry_key, entry_index, beats_threshold(entry_key[0], entry_index[0]) ? 1u : 0u, lane);
    }
  }
};

}  // namespace dflash2
