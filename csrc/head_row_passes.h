// The passes of the draft head's row kernels over one row of logits (SPEC section 7), shared
// by csrc/head_cpu.cpp (a whole row in one process) and csrc/head_shard_cpu.cpp (one rank's
// shard of the vocabulary, whose normalisers and sums the ranks merge between passes):
//   A. transform_pass: z = softcap * tanh(scale * s / softcap) (or scale * s) stored over s,
//      each side's maximum, the top-k and argmax of z rounded to logits_dtype (ties: lower id);
//   B. normalise_pass: sum_v exp(z_v - max) (and the target's), the log-normalisers;
//   C. loss_pass: the losses' sums (they need both normalisers), in double;
//   D. gradient_pass: dL/ds per loss into grad planes [L, R, V] (the forward computes the
//      gradient w.r.t. hidden as dL/ds @ W per loss while the row chunk is at hand), or
//      the combined sum_l g_l dL_l/ds over s itself (the backward's recompute).
// Each is an inline helper: it compiles into the row kernel (DFLASH2_ROW_KERNEL) calling it,
// for that kernel's target.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/all.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "head_lanes.h"

namespace dflash2 {
namespace {

// The losses in the order of every [L, ...] tensor: a loss's bit is 1 << its index.
enum HeadLoss : int { kKlDiv = 0, kRkl, kJsd, kTv, kCe, kLossCount };
constexpr int64_t kIgnoreIndex = -100;
constexpr double kInfinity = std::numeric_limits<double>::infinity();

DFLASH2_INLINE bool wants(int64_t loss_mask, HeadLoss loss) { return (loss_mask >> loss) & 1; }

// The logit as logits_dtype holds it (round to nearest even, c10's conversions), as a double.
// Inlined into the row kernels like every helper they call per entry: a default-target (SSE)
// function called from the AVX2 clone pays a transition on each of its SSE instructions.
DFLASH2_INLINE double rounded_logit(double z, at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return static_cast<float>(c10::BFloat16(static_cast<float>(z)));
    case at::kHalf:
      return static_cast<float>(c10::Half(static_cast<float>(z)));
    case at::kFloat:
      return static_cast<float>(z);
    default:
      return z;
  }
}

// a ranks above b: NaN above everything, as torch.sort and torch.argmax rank it.
DFLASH2_INLINE bool ranks_above(double a, double b) { return (std::isnan(a) && !std::isnan(b)) || a > b; }

// A key's place in ranks_above's order as an unsigned integer: NaN above everything, -0
// equal to +0, otherwise the double order (the sign bit flipped for positives, every bit
// inverted for negatives).
DFLASH2_INLINE uint64_t key_order(double key) {
  if (std::isnan(key)) return std::numeric_limits<uint64_t>::max();
  key += 0.0;  // -0 + 0 = +0
  uint64_t bits;
  std::memcpy(&bits, &key, sizeof(bits));
  return (bits >> 63) ? ~bits : bits | (uint64_t(1) << 63);
}

// The key back from its order (NaN for the top order).
DFLASH2_INLINE double key_of_order(uint64_t order) {
  if (order == std::numeric_limits<uint64_t>::max()) return std::numeric_limits<double>::quiet_NaN();
  const uint64_t bits = (order >> 63) ? order & ~(uint64_t(1) << 63) : ~order;
  double key;
  std::memcpy(&key, &bits, sizeof(key));
  return key;
}

// The k best (rounded logit, id) of a row offered in increasing id order, ties to the
// lower id. Candidates are appended unsorted; when 2k are held, nth_element keeps the
// best k and the bar rises to the k-th key, which every later candidate must rank above
// (a later id never beats an equal key). So a row costs O(V) compares in the vector
// pass, O(k log(V / k)) appends and O(k log k) for the final sort, whatever k is: no
// sorted insertion per candidate. Keys that a float holds (every logits_dtype but float64
// over float64 logits) and ids below 2^32 pack into one integer, (key order << 32) |
// ~id, so that the compares are integer compares, and a large set never compacted (still
// in id order) is sorted by a stable radix sort of the key half. A float row of at least
// 2k blocks starts from a bar its blocks' maxima give (bar_from_blocks): about k appends
// then, and rarely a compaction. Scratch of one thread.
struct RowTopK {
  struct Candidate {
    uint64_t order;  // key_order of the rounded logit
    int64_t id;
  };
  // Ranks above: a function object, so that nth_element and sort inline the compare.
  struct Before {
    bool operator()(const Candidate& a, const Candidate& b) const {
      return a.order > b.order || (a.order == b.order && a.id < b.id);
    }
  };
  static constexpr size_t kRadixFrom = 2048;  // below: a comparison sort is as fast
  int64_t k = 0;
  bool packed_keys = true;         // float keys and ids < 2^32: `packed`, else `kept`
  std::vector<uint64_t> packed;    // (float key order << 32) | (2^32 - 1 - id)
  std::vector<Candidate> kept;
  std::vector<uint64_t> scratch;   // the radix sort's other buffer
  size_t capacity = 0;
  bool has_bar = false, compacted = false;
  uint64_t bar_packed = 0, bar_order = 0;
  double bar = -kInfinity;  // the k-th best key at the last compaction (has_bar)

  // float_keys: every offered key is a float's value; vocab: the row's length.
  void reset(int64_t top_k, bool float_keys, int64_t vocab) {
    k = top_k;
    packed_keys = float_keys && vocab <= (int64_t(1) << 32);
    packed.clear();
    kept.clear();
    capacity = static_cast<size_t>(std::max<int64_t>(2 * k, 64));
    if (k > 0 && packed_keys) packed.reserve(std::min<size_t>(capacity, static_cast<size_t>(vocab)));
    if (k > 0 && !packed_keys) kept.reserve(std::min<size_t>(capacity, static_cast<size_t>(vocab)));
    has_bar = compacted = false;
    bar = -kInfinity;
  }
  // Until the first k are held every logit may get in; then only one above the bar.
  bool open() const { return !has_bar; }
  DFLASH2_INLINE static uint32_t float_order(double key) {
    if (std::isnan(key)) return 0xFFFFFFFFu;
    const float value = static_cast<float>(key) + 0.0f;  // -0 + 0 = +0
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return (bits >> 31) ? ~bits : bits | 0x80000000u;
  }
  DFLASH2_INLINE void offer(double key, int64_t id) {
    if (k == 0) return;
    if (packed_keys) {
      const uint64_t entry = (uint64_t(float_order(key)) << 32) | (0xFFFFFFFFu - static_cast<uint64_t>(id));
      if (has_bar && entry <= bar_packed) return;
      packed.push_back(entry);
      if (packed.size() >= capacity) keep_best();
      return;
    }
    const uint64_t order = key_order(key);
    if (has_bar && order <= bar_order) return;
    kept.push_back({order, id});
    if (kept.size() >= capacity) keep_best();
  }
  // packed <- its k largest entries (in no order), by a radix select from the top byte:
  // each step keeps what is surely in, and narrows to the byte value the k-th has (a few
  // passes over the set, no data-dependent branch per compare, as nth_element has);
  // returns the k-th largest.
  uint64_t select_packed() {
    scratch.clear();
    size_t begin = 0, end = packed.size(), need = static_cast<size_t>(k);
    uint64_t* data = packed.data();
    for (int shift = 56; shift >= 0 && end - begin > need; shift -= 8) {
      if (end - begin <= 64) {  // a handful left: a comparison sort's selection is as fast
        std::nth_element(data + begin, data + begin + (need - 1), data + end, std::greater<uint64_t>());
        end = begin + need;
        break;
      }
      size_t count[256] = {};
      for (size_t i = begin; i < end; ++i) ++count[(data[i] >> shift) & 0xFF];
      int digit = 255;
      size_t above = 0;
      for (; above + count[digit] < need; --digit) above += count[digit];
      // Those above the k-th's digit are in; those at it go on to the next byte.
      size_t equal = begin;
      for (size_t i = begin; i < end; ++i) {
        const int d = static_cast<int>((data[i] >> shift) & 0xFF);
        if (d > digit) {
          scratch.push_back(data[i]);
        } else if (d == digit) {
          data[equal++] = data[i];
        }
      }
      end = equal;
      need -= above;
    }
    // What is left of the k-th's bucket, [begin, end), holds exactly `need` of the best.
    scratch.insert(scratch.end(), data + begin, data + begin + need);
    uint64_t kth = data[begin];
    for (size_t i = begin; i < begin + need; ++i) kth = std::min(kth, data[i]);
    packed.swap(scratch);
    return kth;
  }
  void keep_best() {
    has_bar = compacted = true;
    if (packed_keys) {
      bar_packed = select_packed();
      uint32_t order = static_cast<uint32_t>(bar_packed >> 32);
      const uint32_t bits = (order >> 31) ? order & 0x7FFFFFFFu : ~order;
      float value;
      std::memcpy(&value, &bits, sizeof(value));
      bar = order == 0xFFFFFFFFu ? std::numeric_limits<double>::quiet_NaN() : value;
      return;
    }
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), Before());
    kept.resize(static_cast<size_t>(k));
    bar_order = kept[k - 1].order;
    bar = key_of_order(bar_order);
  }
  // packed, in id order, sorted best first by a stable LSD radix sort of the key half.
  void radix_sort_packed() {
    scratch.resize(packed.size());
    uint64_t* from = packed.data();
    uint64_t* to = scratch.data();
    const size_t n = packed.size();
    for (int shift = 32; shift < 64; shift += 8) {
      size_t count[257] = {};
      for (size_t i = 0; i < n; ++i) ++count[1 + (0xFF - ((from[i] >> shift) & 0xFF))];
      for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
      for (size_t i = 0; i < n; ++i) to[count[0xFF - ((from[i] >> shift) & 0xFF)]++] = from[i];
      std::swap(from, to);
    }
    // Four passes: the sorted set is back in `packed`.
  }
  // The k best, best first (every row offers at least k logits: k <= V).
  void finish() {
    if (k == 0) return;
    if (packed_keys) {
      if (!compacted && packed.size() >= kRadixFrom) {
        radix_sort_packed();
      } else {
        if (packed.size() > static_cast<size_t>(k)) select_packed();
        std::sort(packed.begin(), packed.end(), std::greater<uint64_t>());
      }
      return;
    }
    if (kept.size() > static_cast<size_t>(k)) {
      std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), Before());
      kept.resize(static_cast<size_t>(k));
    }
    std::sort(kept.begin(), kept.end(), Before());
  }
  int64_t id(int64_t j) const {
    return packed_keys ? static_cast<int64_t>(0xFFFFFFFFu - (packed[j] & 0xFFFFFFFFu)) : kept[j].id;
  }

  // A bar before the first offer, from the maxima of disjoint blocks of the row: the k-th
  // largest of them is k distinct logits' least, so no more than k - 1 logits rank above
  // it and the row's k-th best key is at least its rounded key b. Only a block whose
  // maximum rounds to b or more can hold one of the k best, and only a logit that does.
  // block_orders: the blocks' float_order of their maxima (NaN on top), at least k of them.
  std::vector<uint32_t> block_orders, orders_scratch;
  uint32_t block_floor = 0;  // a block whose maximum's order is below it holds none of the k best

  // After reset() with float keys: the bar from block_orders; a block qualifies when its
  // order is at least block_floor (every block does without a bar: all maxima -inf).
  void bar_from_blocks(at::ScalarType logits_dtype) {
    orders_scratch.assign(block_orders.begin(), block_orders.end());
    std::nth_element(orders_scratch.begin(), orders_scratch.begin() + (k - 1), orders_scratch.end(),
                     std::greater<uint32_t>());
    const uint32_t kth = orders_scratch[k - 1];
    block_floor = 0;
    if (kth == 0xFFFFFFFFu) {  // k blocks hold a NaN: the k best are NaNs
      set_floor(0xFFFFFFFFu, std::numeric_limits<double>::quiet_NaN());
      block_floor = kth;
      return;
    }
    const uint32_t key_floor = float_order(rounded_logit(float_of_order(kth), logits_dtype));
    // The least logit that rounds to the floor's key or above: rounding is monotone, so
    // a binary search over the orders from -inf's (below it lie the negative NaNs' bits).
    uint32_t low = kNegInfOrder, high = kth;
    if (key_floor <= kNegInfOrder) return;  // b = -inf: every logit may be among the k best
    while (low < high) {
      const uint32_t mid = low + (high - low) / 2;
      if (float_order(rounded_logit(float_of_order(mid), logits_dtype)) >= key_floor) {
        high = mid;
      } else {
        low = mid + 1;
      }
    }
    block_floor = low;
    // The vector prefilter tests z > bar: the float just below the least logit that may get in.
    set_floor(key_floor, float_of_order(low - 1));
  }

 private:
  static constexpr uint32_t kNegInfOrder = 0x007FFFFFu;  // float_order(-inf)
  static double float_of_order(uint32_t order) {
    const uint32_t bits = (order >> 31) ? order & 0x7FFFFFFFu : ~order;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
  // Every key of order >= key_order may get in, whatever its id (key_order > 0).
  void set_floor(uint32_t key_order, double prefilter) {
    has_bar = true;
    bar_packed = (uint64_t(key_order) << 32) - 1;
    bar = prefilter;
  }
};

struct RowArgmax {
  double key = -kInfinity;
  int64_t id = -1;
  DFLASH2_INLINE void offer(double candidate, int64_t index) {
    if (id < 0 || ranks_above(candidate, key)) {
      key = candidate;
      id = index;
    }
  }
};

struct HeadConfig {
  int64_t vocab;
  int64_t top_k;
  int64_t loss_mask;
  double scale;
  double softcap;  // <= 0: none
  at::ScalarType logits_dtype;
};

// One row's inputs and outputs. z/t: the raw logits, replaced by the transformed ones
// (and, in the backward, z by the combined gradient). grads[l]: dL_l/ds for the forward.
template <typename E>
struct RowTask {
  E* z;
  E* t;                     // nullptr: no target
  int64_t label;            // a label, kIgnoreIndex, or -1 (none given: the target argmax if any)
  bool labels_given;
  E* grads[kLossCount];     // forward: the requested losses' planes (nullptr elsewhere)
  const double* grad_weights;  // backward: [kLossCount] upstream gradient per loss, else nullptr
};

struct RowResult {
  double losses[kLossCount] = {};
  double draft_lse = 0, target_lse = 0, overlap = 0;
  int64_t draft_argmax = 0, target_argmax = 0, label = -1;
  double label_value = 0;
};

template <typename E>
DFLASH2_INLINE Vec<E> lane_ids(int64_t first) {
  Vec<E> ids;
  for (int i = 0; i < HeadLanes<E>::kWidth; ++i) ids[i] = static_cast<E>(first + i);
  return ids;
}

// log(sum_v exp(x_v)) given the row's maximum: torch.logsumexp's edges (NaN: NaN; a +inf:
// +inf; all -inf: -inf).
DFLASH2_INLINE double row_lse(double maximum, bool has_nan, double sum_exp) {
  if (has_nan) return std::numeric_limits<double>::quiet_NaN();
  if (std::isinf(maximum)) return maximum;
  return maximum + std::log(sum_exp);
}

typedef double D4 __attribute__((vector_size(32)));
typedef int64_t M4 __attribute__((vector_size(32)));

// E lanes as doubles, 4 at a time: a float vector's two halves, a double vector itself.
template <typename E>
DFLASH2_INLINE void as_doubles(Vec<E> v, D4 (&out)[HeadLanes<E>::kWidth / 4]) {
  if constexpr (std::is_same_v<E, float>) {
    out[0] = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), D4);
    out[1] = __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), D4);
  } else {
    out[0] = v;
  }
}

DFLASH2_INLINE D4 d4(double value) { return D4{value, value, value, value}; }

// weight * term, 0 where the weight is exactly 0 (0 log 0 = 0; NaN still propagates).
DFLASH2_INLINE D4 weighted(D4 weight, D4 term) { return weight == d4(0.0) ? d4(0.0) : weight * term; }

DFLASH2_INLINE double d4_sum(D4 v) { return ((v[0] + v[1]) + v[2]) + v[3]; }

// Per-entry quantities of a target row at lanes of 4, in double: probabilities p, q (computed
// in E), the log-probabilities from the logits exactly, log m in E.
struct Entry {
  D4 p, q, log_p, log_q, log_m;
};

// The per-row sums pass C leaves for pass D's gradients.
struct RowSums {
  double rkl = 0;      // sum q (log q - log p)
  double jsd_qb = 0;   // sum q * 0.5 (log q - log m)
  double tv_qc = 0;    // sum q * c, c = -[q < p] - [q == p] / 2 (torch.minimum's gradient)
};

DFLASH2_INLINE D4 tv_slope(const Entry& e) {
  return (e.q < e.p) ? d4(-1.0) : ((e.q == e.p) ? d4(-0.5) : d4(0.0));
}

DFLASH2_INLINE D4 nan_aware_min(D4 a, D4 b) {
  D4 smaller = a < b ? a : b;
  smaller = a != a ? a : smaller;
  return b != b ? b : smaller;
}

// dL/dz at one entry for each loss (the softcap's derivative comes after).
DFLASH2_INLINE D4 loss_slope(int loss, const Entry& e, const RowSums& sums, D4 one_hot) {
  switch (loss) {
    case kKlDiv:
      return e.q - e.p;
    case kRkl:
      return weighted(e.q, (e.log_q - e.log_p) - d4(sums.rkl));
    case kJsd:
      return weighted(e.q, d4(0.5) * (e.log_q - e.log_m) - d4(sums.jsd_qb));
    case kTv:
      return weighted(e.q, tv_slope(e) - d4(sums.tv_qc));
    default:  // kCe
      return e.q - one_hot;
  }
}

// A row's log-softmax shift, applied as torch's log_softmax applies it: (x - max) - log(sum),
// each step rounded in E. x - lse in one step would cost |lse| ulps of lse's rounding
// (1e-6 relative at lse = 40 in float); this way the error is the ulps of log(sum) <= log V.
// A row with a NaN or infinite maximum takes its lse whole (torch's NaN / 0 there).
template <typename E>
struct Shift {
  E max, log_sum;
};

template <typename E>
DFLASH2_INLINE Shift<E> shift_of(double maximum, bool has_nan, double lse) {
  if (!has_nan && std::isfinite(maximum)) return {static_cast<E>(maximum), static_cast<E>(lse - maximum)};
  return {static_cast<E>(lse), E(0)};
}

template <typename E>
DFLASH2_INLINE Vec<E> log_probs(Vec<E> x, Shift<E> shift) {
  return (x - splat<E>(shift.max)) - splat<E>(shift.log_sum);
}

// The entries of lanes [v, v + n) of a row with a target, in double (the helpers of the
// row kernel are inline functions, not lambdas: a lambda is compiled for the default
// target, not the AVX2 clone calling it, and its vector arguments would pass through
// memory). log m = log((p + q) / 2) from the log-probabilities, max + log(1 + e^(min - max))
// - log 2 (with_log_m; else 0): (p + q) / 2 itself underflows to 0 where both are below E's smallest
// subnormal, and jsd's q log(q / m) would become q * inf.
template <typename E>
DFLASH2_INLINE void row_entries(const RowTask<E>& task, int64_t v, int64_t n, Shift<E> draft_shift,
                                Shift<E> target_shift, double draft_lse, double target_lse, bool with_log_m,
                                Entry (&out)[HeadLanes<E>::kWidth / 4]) {
  constexpr int kHalves = HeadLanes<E>::kWidth / 4;
  constexpr E kNegInf = -std::numeric_limits<E>::infinity();
  const Vec<E> z = load_lanes(task.z + v, n, kNegInf), t = load_lanes(task.t + v, n, kNegInf);
  const Vec<E> log_q = log_probs(z, draft_shift), log_p = log_probs(t, target_shift);
  const Vec<E> q = exp_lanes(log_q), p = exp_lanes(log_p);
  const Vec<E> high = log_q > log_p ? log_q : log_p, low = log_q > log_p ? log_p : log_q;
  const Vec<E> log_m = with_log_m ? (high + log_lanes(splat<E>(E(1)) + exp_lanes(low - high))) -
                                        splat<E>(static_cast<E>(0.693147180559945309417232121458))
                                  : splat<E>(E(0));
  D4 zs[kHalves], ts[kHalves], ps[kHalves], qs[kHalves], ms[kHalves];
  as_doubles<E>(z, zs);
  as_doubles<E>(t, ts);
  as_doubles<E>(p, ps);
  as_doubles<E>(q, qs);
  as_doubles<E>(log_m, ms);
  for (int h = 0; h < kHalves; ++h) {
    out[h] = Entry{ps[h], qs[h], ts[h] - d4(target_lse), zs[h] - d4(draft_lse), ms[h]};
  }
}

// dz/ds at transformed logits z: the scale, times 1 - (z / softcap)^2 under a softcap (cap > 0).
DFLASH2_INLINE D4 logit_slope(D4 z, double scale, double cap) {
  if (cap <= 0) return d4(scale);
  const D4 ratio = z / d4(cap);
  return d4(scale) * (d4(1.0) - ratio * ratio);
}


// Row r of a chunk: its logits (and target's), its label (labels: [R], or nullptr for none given).
template <typename E>
RowTask<E> row_task(int64_t r, const at::Tensor& logits, const c10::optional<at::Tensor>& target_logits,
                    const int64_t* labels) {
  RowTask<E> task{};
  task.z = logits.data_ptr<E>() + r * logits.stride(0);
  task.t = target_logits.has_value() && target_logits->defined()
               ? target_logits->data_ptr<E>() + r * target_logits->stride(0)
               : nullptr;
  task.labels_given = labels != nullptr;
  task.label = labels != nullptr ? labels[r] : -1;
  return task;
}

// Row r's gradient planes: plane l of planes [L, R, V] for the l-th requested loss.
template <typename E>
void attach_planes(RowTask<E>& task, int64_t loss_mask, const at::Tensor& planes, int64_t r) {
  for (int loss = 0, plane = 0; loss < kLossCount; ++loss) {
    if (!wants(loss_mask, HeadLoss(loss))) continue;
    task.grads[loss] = planes.data_ptr<E>() + plane++ * planes.stride(0) + r * planes.stride(1);
  }
}

// Row r's upstream gradient per loss from a contiguous [L, R] (per_loss: [kLossCount], the task's).
template <typename E>
void attach_grad_weights(RowTask<E>& task, int64_t loss_mask, const at::Tensor& weights, int64_t r,
                         double (&per_loss)[kLossCount]) {
  const int64_t rows = weights.size(1);
  for (int loss = 0, plane = 0; loss < kLossCount; ++loss) {
    if (wants(loss_mask, HeadLoss(loss))) per_loss[loss] = weights.data_ptr<E>()[plane++ * rows + r];
  }
  task.grad_weights = per_loss;
}

// A row's normaliser on one side: its maximum, whether a NaN was seen, its log-sum-exp.
struct Normaliser {
  double max = -kInfinity;
  bool has_nan = false;
  double lse = 0;

  template <typename E>
  Shift<E> shift() const {
    return shift_of<E>(max, has_nan, lse);
  }
};

// The transform s -> z with its constants in registers: pass A's loop calls the top-k's
// out-of-line code now and then, after which the compiler would reload the constants
// from config on every vector.
template <typename E>
struct LaneTransform {
  Vec<E> scale, cap;
  bool softcap, identity;

  explicit LaneTransform(const HeadConfig& config)
      : scale(splat<E>(static_cast<E>(config.scale))),
        cap(splat<E>(static_cast<E>(config.softcap > 0 ? config.softcap : 1.0))),
        softcap(config.softcap > 0),
        identity(config.scale == 1.0 && config.softcap <= 0) {}

  DFLASH2_INLINE Vec<E> operator()(const Vec<E>& s) const {
    if (identity) return s;
    const Vec<E> z = s * scale;
    return softcap ? cap * tanh_lanes(z / cap) : z;
  }
};

// n (<= the width) lanes at p: s -> z, stored back unless the transform is the identity
// (z = s: a row's worth of write-back saved); the running maximum and NaN flag taken; z
// returned with the lanes past n at -inf.
template <typename E>
DFLASH2_INLINE Vec<E> transform_lanes(E* p, int64_t n, const LaneTransform<E>& transform, Vec<E>& maximum,
                                      Mask<E>& nan) {
  Vec<E> z = transform(load_lanes(p, n, E(0)));
  if (!transform.identity) store_lanes(p, z, n);
  if (n < HeadLanes<E>::kWidth) {
    z = lane_ids<E>(0) < splat<E>(static_cast<E>(n)) ? z : splat<E>(-std::numeric_limits<E>::infinity());
  }
  maximum = z > maximum ? z : maximum;
  nan |= z != z;
  return z;
}

// Offers the lanes of `count` vectors of z (ids first...) whose bit is set in `lanes` to the
// top-k (topk) or else the argmax (best). Out of line: a rare branch of pass A, scalar code
// that gains nothing from a vector target.
template <typename E>
__attribute__((noinline)) void offer_lanes(const Vec<E>* z, int count, uint64_t lanes, int64_t first,
                                           at::ScalarType logits_dtype, RowTopK* topk, RowArgmax* best) {
  E values[64];  // rank_vectors: at most 64 lanes
  std::memcpy(values, z, sizeof(Vec<E>) * count);
  for (; lanes != 0; lanes &= lanes - 1) {
    const int lane = __builtin_ctzll(lanes);
    const double key = rounded_logit(static_cast<double>(values[lane]), logits_dtype);
    if (topk != nullptr) {
      topk->offer(key, first + lane);
    } else {
      best->offer(key, first + lane);
    }
  }
}

// Ranks kVectors vectors of z, ids first...: only a logit above the bar can get in (one at
// or below a key representable in logits_dtype rounds at or below it, and loses the tie to
// the earlier id); until a bar exists every lane is offered. The lanes past the row
// (valid[b] false) never are. The bar test is folded over the vectors and taken once (a
// horizontal test of a mask costs about as much as the lanes' math); only a block with a
// chance pays for its lanes' bits.
template <typename E, int kVectors>
DFLASH2_INLINE void rank_vectors(const Vec<E> (&z)[kVectors], const Mask<E> (&valid)[kVectors], int64_t first,
                                 at::ScalarType logits_dtype, RowTopK* topk, RowArgmax* best) {
  constexpr int kWidth = HeadLanes<E>::kWidth;
  static_assert(kVectors * kWidth <= 64, "one bit a lane in a uint64_t");
  const bool open = topk != nullptr ? topk->open() : best->id < 0;
  Mask<E> chance[kVectors];
  Mask<E> any{};
  const Vec<E> bar = splat<E>(static_cast<E>(topk != nullptr ? topk->bar : best->key));
  for (int b = 0; b < kVectors; ++b) {
    chance[b] = (open ? valid[b] : ((z[b] > bar) | (z[b] != z[b]))) & valid[b];
    any |= chance[b];
  }
  if (!any_lane<E>(any)) return;
  uint64_t lanes = 0;
  for (int b = 0; b < kVectors; ++b) {
    for (int i = 0; i < kWidth; ++i) lanes |= static_cast<uint64_t>(chance[b][i] != 0) << (b * kWidth + i);
  }
  offer_lanes<E>(z, kVectors, lanes, first, logits_dtype, topk, best);
}

// Vectors per block of pass A's main loop.
constexpr int kRankVectors = 4;

// The float_order of the largest of a block's vectors, a NaN on top (RowTopK::float_order).
template <int kVectors>
DFLASH2_INLINE uint32_t block_max_order(const Vec<float> (&z)[kVectors]) {
  Vec<float> top = z[0];
  for (int b = 1; b < kVectors; ++b) top = (z[b] > top) | (z[b] != z[b]) ? z[b] : top;  // a NaN sticks
  top = (top != top) | (top > __builtin_shufflevector(top, top, 4, 5, 6, 7, 0, 1, 2, 3))
            ? top : __builtin_shufflevector(top, top, 4, 5, 6, 7, 0, 1, 2, 3);
  top = (top != top) | (top > __builtin_shufflevector(top, top, 2, 3, 0, 1, 6, 7, 4, 5))
            ? top : __builtin_shufflevector(top, top, 2, 3, 0, 1, 6, 7, 4, 5);
  const float a = top[0], b = top[1];
  return RowTopK::float_order(a != a || a > b ? a : b);
}

// Pass A: s -> z (and t) in place, each side's maximum and NaN flag; with `rank`, the
// rounded draft logits' top-k (config.top_k > 0, into topk: finish() it) or argmax
// (draft_best); with `rank_target`, the target's argmax (target_best). Blocks of whole
// vectors first, then the row's last few lanes.
//
// A float top-k over a row of at least 2k blocks takes its bar from the blocks' maxima
// (RowTopK::bar_from_blocks) and then ranks only the blocks that may hold one of the k
// best (about k of them, read again from L2): offered in the row's order, each logit once,
// as the running bar would see them, but only ~k offers a row where the running bar,
// rising from the first 2k logits, admits O(k log(V / k)).
template <typename E>
DFLASH2_INLINE void transform_pass(const RowTask<E>& task, const HeadConfig& config, bool rank, bool rank_target,
                                   RowTopK& topk, RowArgmax& draft_best, RowArgmax& target_best, Normaliser& draft,
                                   Normaliser& target) {
  constexpr int kWidth = HeadLanes<E>::kWidth;
  constexpr int kBlock = kRankVectors * kWidth;
  constexpr E kNegInf = -std::numeric_limits<E>::infinity();
  const int64_t vocab = config.vocab;
  const bool has_target = task.t != nullptr;
  const bool by_topk = rank && config.top_k > 0;
  const LaneTransform<E> transform(config);
  const at::ScalarType logits_dtype = config.logits_dtype;
  topk.reset(by_topk ? config.top_k : 0, std::is_same_v<E, float> || logits_dtype != at::kDouble, vocab);
  RowTopK* const draft_topk = by_topk ? &topk : nullptr;
  const int64_t blocks = vocab / kBlock;
  const bool by_blocks = std::is_same_v<E, float> && by_topk && config.top_k <= blocks / 2;
  if (by_blocks) topk.block_orders.resize(static_cast<size_t>(blocks));
  Vec<E> z_max = splat<E>(kNegInf), t_max = splat<E>(kNegInf);
  Mask<E> z_nan{}, t_nan{};
  Mask<E> all[kRankVectors];
  for (int b = 0; b < kRankVectors; ++b) all[b] = ~Mask<E>{};
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t v = block * kBlock;
    Vec<E> z[kRankVectors];
    for (int b = 0; b < kRankVectors; ++b) {
      z[b] = transform_lanes<E>(task.z + v + b * kWidth, kWidth, transform, z_max, z_nan);
    }
    if constexpr (std::is_same_v<E, float>) {
      if (by_blocks) topk.block_orders[block] = block_max_order<kRankVectors>(z);
    }
    if (rank && !by_blocks) rank_vectors<E, kRankVectors>(z, all, v, logits_dtype, draft_topk, &draft_best);
    if (has_target) {
      Vec<E> t[kRankVectors];
      for (int b = 0; b < kRankVectors; ++b) {
        t[b] = transform_lanes<E>(task.t + v + b * kWidth, kWidth, transform, t_max, t_nan);
      }
      if (rank_target) rank_vectors<E, kRankVectors>(t, all, v, logits_dtype, nullptr, &target_best);
    }
  }
  if (by_blocks) {
    topk.bar_from_blocks(logits_dtype);
    for (int64_t block = 0; block < blocks; ++block) {
      if (topk.block_orders[block] < topk.block_floor) continue;
      const int64_t v = block * kBlock;
      Vec<E> z[kRankVectors];
      for (int b = 0; b < kRankVectors; ++b) z[b] = load_lanes(task.z + v + b * kWidth, kWidth, E(0));
      rank_vectors<E, kRankVectors>(z, all, v, logits_dtype, draft_topk, &draft_best);
    }
  }
  for (int64_t v = blocks * kBlock; v < vocab; v += kWidth) {
    const int64_t n = std::min<int64_t>(kWidth, vocab - v);
    const Mask<E> valid[1] = {lane_ids<E>(0) < splat<E>(static_cast<E>(n))};
    const Vec<E> z[1] = {transform_lanes<E>(task.z + v, n, transform, z_max, z_nan)};
    if (rank) rank_vectors<E, 1>(z, valid, v, logits_dtype, draft_topk, &draft_best);
    if (has_target) {
      const Vec<E> t[1] = {transform_lanes<E>(task.t + v, n, transform, t_max, t_nan)};
      if (rank_target) rank_vectors<E, 1>(t, valid, v, logits_dtype, nullptr, &target_best);
    }
  }
  for (int i = 0; i < kWidth; ++i) {
    draft.max = std::max<double>(draft.max, z_max[i]);
    target.max = std::max<double>(target.max, t_max[i]);
  }
  draft.has_nan = any_lane<E>(z_nan);
  target.has_nan = any_lane<E>(t_nan);
}

// sum_v exp(x_v - maximum) over a row's n entries: blocks of four whole vectors, then the
// last few lanes (at -inf: exp gives exactly 0). A block's four vectors are added in E
// as a tree before its sum joins the double sums: two roundings of a sum of four terms
// <= 1, as small as exp's own, where a conversion per vector would cost a third of
// the exps' time.
template <typename E>
DFLASH2_INLINE double sum_exp(const E* x, int64_t n, double maximum) {
  constexpr int kWidth = HeadLanes<E>::kWidth;
  const Vec<E> top = splat<E>(static_cast<E>(maximum));
  DoubleSums sums;
  int64_t v = 0;
  for (; v + 4 * kWidth <= n; v += 4 * kWidth) {
    const Vec<E> e0 = exp_lanes(load_lanes(x + v, kWidth, E(0)) - top);
    const Vec<E> e1 = exp_lanes(load_lanes(x + v + kWidth, kWidth, E(0)) - top);
    const Vec<E> e2 = exp_lanes(load_lanes(x + v + 2 * kWidth, kWidth, E(0)) - top);
    const Vec<E> e3 = exp_lanes(load_lanes(x + v + 3 * kWidth, kWidth, E(0)) - top);
    sums.add((e0 + e1) + (e2 + e3));
  }
  for (; v + kWidth <= n; v += kWidth) sums.add(exp_lanes(load_lanes(x + v, kWidth, E(0)) - top));
  if (v < n) sums.add(exp_lanes(load_lanes(x + v, n - v, -std::numeric_limits<E>::infinity()) - top));
  return sums.total();
}

// Pass B: each side's log-sum-exp from its maximum (lse of a side without logits: 0).
template <typename E>
DFLASH2_INLINE void normalise_pass(const RowTask<E>& task, int64_t vocab, Normaliser& draft, Normaliser& target) {
  const bool has_target = task.t != nullptr;
  const bool draft_finite = std::isfinite(draft.max) && !draft.has_nan;
  const bool target_finite = has_target && std::isfinite(target.max) && !target.has_nan;
  draft.lse = row_lse(draft.max, draft.has_nan, draft_finite ? sum_exp(task.z, vocab, draft.max) : 0.0);
  const double target_sum = target_finite ? sum_exp(task.t, vocab, target.max) : 0.0;
  target.lse = has_target ? row_lse(target.max, target.has_nan, target_sum) : 0.0;
}

// Pass C, on a row with a target: the soft losses' sums against the normalisers (only the
// requested ones: each is a few double operations an entry, log m two transcendentals
// more), sum_v min(p, q) (overlap) and the sums pass D's gradients subtract. An ignored
// row, or one asking for no soft loss, takes the overlap alone (its losses are 0).
template <typename E>
DFLASH2_INLINE void loss_pass(const RowTask<E>& task, const HeadConfig& config, const Normaliser& draft,
                              const Normaliser& target, bool ignored, double (&loss_sums)[kLossCount],
                              double& overlap_sum, RowSums& sums) {
  constexpr int kWidth = HeadLanes<E>::kWidth;
  constexpr int kHalves = kWidth / 4;
  constexpr int64_t kSoftMask = (1 << kKlDiv) | (1 << kRkl) | (1 << kJsd) | (1 << kTv);
  const int64_t vocab = config.vocab;
  const Shift<E> draft_shift = draft.shift<E>(), target_shift = target.shift<E>();
  if (!ignored && (config.loss_mask & kSoftMask)) {
    const bool want_kl = wants(config.loss_mask, kKlDiv), want_rkl = wants(config.loss_mask, kRkl);
    const bool want_jsd = wants(config.loss_mask, kJsd), want_tv = wants(config.loss_mask, kTv);
    D4 kl = d4(0), rkl = d4(0), jsd = d4(0), overlap = d4(0), qb = d4(0), qc = d4(0);
    for (int64_t v = 0; v < vocab; v += kWidth) {
      const int64_t n = std::min<int64_t>(kWidth, vocab - v);
      Entry e[kHalves];
      row_entries<E>(task, v, n, draft_shift, target_shift, draft.lse, target.lse, want_jsd, e);
      for (int h = 0; h < kHalves; ++h) {
        if (want_kl) kl += weighted(e[h].p, e[h].log_p - e[h].log_q);
        if (want_rkl) rkl += weighted(e[h].q, e[h].log_q - e[h].log_p);
        if (want_jsd) {
          const D4 half_q = d4(0.5) * (e[h].log_q - e[h].log_m);
          jsd += d4(0.5) * weighted(e[h].p, e[h].log_p - e[h].log_m) + weighted(e[h].q, half_q);
          qb += weighted(e[h].q, half_q);
        }
        overlap += nan_aware_min(e[h].p, e[h].q);
        if (want_tv) qc += weighted(e[h].q, tv_slope(e[h]));
      }
    }
    loss_sums[kKlDiv] = d4_sum(kl);
    loss_sums[kRkl] = sums.rkl = d4_sum(rkl);
    loss_sums[kJsd] = d4_sum(jsd);
    overlap_sum = d4_sum(overlap);
    loss_sums[kTv] = 1.0 - overlap_sum;
    sums.jsd_qb = d4_sum(qb);
    sums.tv_qc = d4_sum(qc);
  } else {
    DoubleSums overlap;
    for (int64_t v = 0; v < vocab; v += kWidth) {
      const int64_t n = std::min<int64_t>(kWidth, vocab - v);
      Entry e[kHalves];
      row_entries<E>(task, v, n, draft_shift, target_shift, draft.lse, target.lse, false, e);
      for (int h = 0; h < kHalves; ++h) overlap.add(nan_aware_min(e[h].p, e[h].q));
    }
    overlap_sum = overlap.total();
  }
}

// Pass D: dL/ds of the transformed row, label one-hot at `label` (none if < 0): into the
// requested losses' planes task.grads (forward), or sum_l grad_weights[l] dL_l/ds over z
// itself (task.grad_weights: the backward). Ignored rows get zeros.
template <typename E>
DFLASH2_INLINE void gradient_pass(const RowTask<E>& task, const HeadConfig& config, const Normaliser& draft,
                                  const Normaliser& target, const RowSums& sums, int64_t label, bool ignored) {
  constexpr int kWidth = HeadLanes<E>::kWidth;
  constexpr int kHalves = kWidth / 4;
  constexpr E kNegInf = -std::numeric_limits<E>::infinity();
  const int64_t vocab = config.vocab;
  const bool backward = task.grad_weights != nullptr;
  if (!backward && ignored) {
    for (int loss = 0; loss < kLossCount; ++loss) {
      if (task.grads[loss] != nullptr) std::fill(task.grads[loss], task.grads[loss] + vocab, E(0));
    }
    return;
  }
  const bool soft = task.t != nullptr;
  const Shift<E> draft_shift = draft.shift<E>(), target_shift = target.shift<E>();
  const double cap = config.softcap;
  const bool jsd_slopes = backward ? wants(config.loss_mask, kJsd) : task.grads[kJsd] != nullptr;
  for (int64_t v = 0; v < vocab; v += kWidth) {
    const int64_t n = std::min<int64_t>(kWidth, vocab - v);
    Entry e[kHalves];
    D4 zs[kHalves];
    as_doubles<E>(load_lanes(task.z + v, n, kNegInf), zs);
    if (soft) {
      row_entries<E>(task, v, n, draft_shift, target_shift, draft.lse, target.lse, jsd_slopes, e);
    } else {
      const Vec<E> q = exp_lanes(log_probs(load_lanes(task.z + v, n, kNegInf), draft_shift));
      D4 qs[kHalves];
      as_doubles<E>(q, qs);
      for (int h = 0; h < kHalves; ++h) e[h] = Entry{d4(0), qs[h], d4(0), d4(0), d4(0)};
    }
    Vec<E> out[kLossCount + 1];
    for (int h = 0; h < kHalves; ++h) {
      D4 ids{};
      for (int i = 0; i < 4; ++i) ids[i] = static_cast<double>(v + 4 * h + i);
      const D4 one_hot = ids == d4(static_cast<double>(label)) ? d4(1.0) : d4(0.0);
      const D4 ds = logit_slope(zs[h], config.scale, cap);
      D4 combined = d4(0);
      for (int loss = 0; loss < kLossCount; ++loss) {
        const bool needed = backward ? (wants(config.loss_mask, HeadLoss(loss)) && !ignored)
                                     : task.grads[loss] != nullptr;
        if (!needed) continue;
        const D4 slope = loss_slope(loss, e[h], sums, one_hot) * ds;
        if (backward) {
          combined += d4(task.grad_weights[loss]) * slope;
        } else {
          for (int i = 0; i < 4; ++i) out[loss][4 * h + i] = static_cast<E>(slope[i]);
        }
      }
      if (backward) {
        for (int i = 0; i < 4; ++i) out[kLossCount][4 * h + i] = static_cast<E>(combined[i]);
      }
    }
    if (backward) {
      store_lanes(task.z + v, out[kLossCount], n);
    } else {
      for (int loss = 0; loss < kLossCount; ++loss) {
        if (task.grads[loss] != nullptr) store_lanes(task.grads[loss] + v, out[loss], n);
      }
    }
  }
}

}  // namespace
}  // namespace dflash2
