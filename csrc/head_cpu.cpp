// The draft head's row kernel on CPU (SPEC section 7): one chunk of rows of logits at a
// time, each row reduced to its losses, statistics and top-k without leaving cache.
//
// dflash2_kernels/head/ops.py fills the chunk: raw logits s = h W^T [R, V] (and the
// target's, t) by a GEMM, in float (or double for float64 inputs). Each row then takes
// four passes over its V entries, all over one row (a few hundred KB, in L2/L3) instead of
// over [N, V] in DRAM:
//   A. z = softcap * tanh(scale * s / softcap) (or scale * s), stored over s; the row's
//      maximum; the top-k and argmax of z rounded to logits_dtype (ties: lower id);
//   B. sum_v exp(z_v - max) (and the target's): the log-normalisers;
//   C. the losses' sums (they need both normalisers), in double;
//   D. (when asked) dL/ds per loss into grad planes [L, R, V] (the forward computes the
//      gradient w.r.t. hidden as dL/ds @ W per loss while the row chunk is at hand), or
//      the combined sum_l g_l dL_l/ds over s itself (the backward's recompute, when W
//      needs a gradient). The top-k and label logits' own gradients are a few entries per
//      row: the caller adds them through the W rows they came from (head/ops.py), outside
//      the GEMM over V, whose rounding would otherwise grow with V.
// Rows are independent: the result does not depend on the thread count.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/all.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "head_lanes.h"
#include "output_alloc.h"
#include "tensor_checks.h"

namespace dflash2 {
namespace {

// The losses in the order of every [L, ...] tensor: a loss's bit is 1 << its index.
enum HeadLoss : int { kKlDiv = 0, kRkl, kJsd, kTv, kCe, kLossCount };
constexpr int64_t kIgnoreIndex = -100;
constexpr double kInfinity = std::numeric_limits<double>::infinity();

bool wants(int64_t loss_mask, HeadLoss loss) { return (loss_mask >> loss) & 1; }

// The logit as logits_dtype holds it (round to nearest even, c10's conversions), as a double.
double rounded_logit(double z, at::ScalarType dtype) {
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
bool ranks_above(double a, double b) { return (std::isnan(a) && !std::isnan(b)) || a > b; }

// The k best (rounded logit, id) of a row offered in increasing id order: a later id
// never displaces an equal key (ties: the lower id first). Scratch of one thread.
template <typename E>
struct RowTopK {
  int64_t k = 0;
  int64_t count = 0;
  std::vector<double> keys;
  std::vector<int64_t> ids;
  std::vector<E> values;

  void reset(int64_t top_k) {
    k = top_k;
    count = 0;
    keys.resize(k);
    ids.resize(k);
    values.resize(k);
  }
  // What a logit must exceed (before rounding) to have a chance: the k-th key.
  double threshold() const { return count < k ? -kInfinity : keys[k - 1]; }
  void offer(double key, int64_t id, E value) {
    if (k == 0 || (count == k && !ranks_above(key, keys[k - 1]))) return;
    int64_t position = count < k ? count++ : k - 1;
    for (; position > 0 && ranks_above(key, keys[position - 1]); --position) {
      keys[position] = keys[position - 1];
      ids[position] = ids[position - 1];
      values[position] = values[position - 1];
    }
    keys[position] = key;
    ids[position] = id;
    values[position] = value;
  }
};

struct RowArgmax {
  double key = -kInfinity;
  int64_t id = -1;
  void offer(double candidate, int64_t index) {
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

template <typename E>
struct RowResult {
  double losses[kLossCount] = {};
  double draft_lse = 0, target_lse = 0, overlap = 0;
  int64_t draft_argmax = 0, target_argmax = 0, label = -1;
  double label_value = 0;
};

// The transform of raw logits, in E: scale, then the softcap's tanh.
template <typename E>
DFLASH2_INLINE Vec<E> transformed(Vec<E> s, const HeadConfig& config) {
  Vec<E> z = s * splat<E>(static_cast<E>(config.scale));
  if (config.softcap > 0) {
    const E cap = static_cast<E>(config.softcap);
    z = splat<E>(cap) * tanh_lanes(z / splat<E>(cap));
  }
  return z;
}

template <typename E>
DFLASH2_INLINE Vec<E> lane_ids(int64_t first) {
  Vec<E> ids;
  for (int i = 0; i < HeadLanes<E>::kWidth; ++i) ids[i] = static_cast<E>(first + i);
  return ids;
}

// log(sum_v exp(x_v)) given the row's maximum: torch.logsumexp's edges (NaN: NaN; a +inf:
// +inf; all -inf: -inf).
double row_lse(double maximum, bool has_nan, double sum_exp) {
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

// One row: the four passes of the header comment.
template <typename E>
DFLASH2_ROW_KERNEL void head_row(const RowTask<E>& task, const HeadConfig& config, RowTopK<E>& topk,
                                 RowResult<E>& result) {
  constexpr int kWidth = HeadLanes<E>::kWidth;
  constexpr int kHalves = kWidth / 4;
  constexpr E kNegInf = -std::numeric_limits<E>::infinity();
  const int64_t vocab = config.vocab;
  const bool backward = task.grad_weights != nullptr;
  const bool has_target = task.t != nullptr;

  // A: transform, maxima, top-k and argmaxes of the rounded logits.
  topk.reset(backward ? 0 : config.top_k);
  RowArgmax draft_best, target_best;
  Vec<E> z_max = splat<E>(kNegInf), t_max = splat<E>(kNegInf);
  Mask<E> z_nan{}, t_nan{};
  for (int64_t v = 0; v < vocab; v += kWidth) {
    const int64_t n = std::min<int64_t>(kWidth, vocab - v);
    const Mask<E> valid = lane_ids<E>(0) < splat<E>(static_cast<E>(n));
    Vec<E> z = transformed<E>(load_lanes(task.z + v, n, E(0)), config);
    store_lanes(task.z + v, z, n);
    z = valid ? z : splat<E>(kNegInf);
    z_max = z > z_max ? z : z_max;
    z_nan |= z != z;
    if (!backward) {
      // Until the list is full every logit gets in; then only one above the k-th key (a
      // logit at or below a key representable in logits_dtype rounds at or below it).
      const double bar = config.top_k > 0 ? topk.threshold() : draft_best.key;
      const bool open = topk.count < topk.k || draft_best.id < 0;
      const Mask<E> chance = open ? valid : (z > splat<E>(static_cast<E>(bar))) | (z != z);
      if (any_lane<E>(chance & valid)) {
        for (int64_t i = 0; i < n; ++i) {
          if (!chance[i]) continue;
          const double key = rounded_logit(static_cast<double>(z[i]), config.logits_dtype);
          draft_best.offer(key, v + i);
          topk.offer(key, v + i, z[i]);
        }
      }
    }
    if (has_target) {
      Vec<E> t = transformed<E>(load_lanes(task.t + v, n, E(0)), config);
      store_lanes(task.t + v, t, n);
      t = valid ? t : splat<E>(kNegInf);
      t_max = t > t_max ? t : t_max;
      t_nan |= t != t;
      const Mask<E> chance =
          (t > splat<E>(static_cast<E>(target_best.key))) | (t != t) | (target_best.id < 0 ? valid : Mask<E>{});
      if (any_lane<E>(chance & valid)) {
        for (int64_t i = 0; i < n; ++i) {
          if (chance[i]) target_best.offer(rounded_logit(static_cast<double>(t[i]), config.logits_dtype), v + i);
        }
      }
    }
  }
  double draft_max = -kInfinity, target_max = -kInfinity;
  for (int i = 0; i < kWidth; ++i) {
    draft_max = std::max<double>(draft_max, z_max[i]);
    target_max = std::max<double>(target_max, t_max[i]);
  }
  const bool draft_has_nan = any_lane<E>(z_nan), target_has_nan = any_lane<E>(t_nan);

  // B: the normalisers.
  double draft_sum = 0, target_sum = 0;
  {
    const bool draft_finite = std::isfinite(draft_max) && !draft_has_nan;
    const bool target_finite = has_target && std::isfinite(target_max) && !target_has_nan;
    DoubleSums draft_sums, target_sums;
    const Vec<E> draft_top = splat<E>(static_cast<E>(draft_max)), target_top = splat<E>(static_cast<E>(target_max));
    for (int64_t v = 0; (draft_finite || target_finite) && v < vocab; v += kWidth) {
      const int64_t n = std::min<int64_t>(kWidth, vocab - v);
      if (draft_finite) draft_sums.add(exp_lanes(load_lanes(task.z + v, n, kNegInf) - draft_top));
      if (target_finite) target_sums.add(exp_lanes(load_lanes(task.t + v, n, kNegInf) - target_top));
    }
    draft_sum = draft_sums.total();
    target_sum = target_sums.total();
  }
  const double draft_lse = row_lse(draft_max, draft_has_nan, draft_sum);
  const double target_lse = has_target ? row_lse(target_max, target_has_nan, target_sum) : 0.0;
  const Shift<E> draft_shift = shift_of<E>(draft_max, draft_has_nan, draft_lse);
  const Shift<E> target_shift = shift_of<E>(target_max, target_has_nan, target_lse);

  int64_t label = task.labels_given ? task.label : (has_target ? target_best.id : -1);
  const bool ignored = task.labels_given && label == kIgnoreIndex;
  const int64_t label_index = ignored || label < 0 ? 0 : label;

  // C: the losses' sums (entries in double, probabilities from E's exp).
  RowSums sums;
  double loss_sums[kLossCount] = {};
  const bool soft = has_target;
  // Rows asking for no soft loss (ce, or the serving form with a target) and ignored rows
  // take the overlap metric alone.
  constexpr int64_t kSoftMask = (1 << kKlDiv) | (1 << kRkl) | (1 << kJsd) | (1 << kTv);
  if (soft && !ignored && (config.loss_mask & kSoftMask)) {
    // Only the requested losses' sums (and the overlap metric): each is a few double
    // operations an entry, and log m (jsd's alone) two transcendentals more.
    const bool want_kl = wants(config.loss_mask, kKlDiv), want_rkl = wants(config.loss_mask, kRkl);
    const bool want_jsd = wants(config.loss_mask, kJsd), want_tv = wants(config.loss_mask, kTv);
    D4 kl = d4(0), rkl = d4(0), jsd = d4(0), overlap = d4(0), qb = d4(0), qc = d4(0);
    for (int64_t v = 0; v < vocab; v += kWidth) {
      const int64_t n = std::min<int64_t>(kWidth, vocab - v);
      Entry e[kHalves];
      row_entries<E>(task, v, n, draft_shift, target_shift, draft_lse, target_lse, want_jsd, e);
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
    result.overlap = d4_sum(overlap);
    loss_sums[kTv] = 1.0 - result.overlap;
    sums.jsd_qb = d4_sum(qb);
    sums.tv_qc = d4_sum(qc);
  } else if (soft) {
    // Its losses are 0 (ignored) or not asked for; its statistics are still the row's.
    DoubleSums overlap;
    for (int64_t v = 0; v < vocab; v += kWidth) {
      const int64_t n = std::min<int64_t>(kWidth, vocab - v);
      Entry e[kHalves];
      row_entries<E>(task, v, n, draft_shift, target_shift, draft_lse, target_lse, false, e);
      for (int h = 0; h < kHalves; ++h) overlap.add(nan_aware_min(e[h].p, e[h].q));
    }
    result.overlap = overlap.total();
  }
  const double label_value = static_cast<double>(task.z[label_index]);
  if (!ignored && label >= 0) loss_sums[kCe] = draft_lse - label_value;

  // D: gradients w.r.t. the raw logits s.
  const bool write_forward = !backward && !ignored && std::any_of(task.grads, task.grads + kLossCount,
                                                                  [](E* plane) { return plane != nullptr; });
  if (write_forward || backward) {
    const double cap = config.softcap;
    const bool jsd_slopes = backward ? wants(config.loss_mask, kJsd) : task.grads[kJsd] != nullptr;
    for (int64_t v = 0; v < vocab; v += kWidth) {
      const int64_t n = std::min<int64_t>(kWidth, vocab - v);
      Entry e[kHalves];
      D4 zs[kHalves];
      as_doubles<E>(load_lanes(task.z + v, n, kNegInf), zs);
      if (soft) {
        row_entries<E>(task, v, n, draft_shift, target_shift, draft_lse, target_lse, jsd_slopes, e);
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
  } else if (!backward) {
    for (int loss = 0; loss < kLossCount; ++loss) {
      if (task.grads[loss] != nullptr) std::fill(task.grads[loss], task.grads[loss] + vocab, E(0));
    }
  }

  for (int loss = 0; loss < kLossCount; ++loss) result.losses[loss] = ignored ? 0.0 : loss_sums[loss];
  result.draft_lse = draft_lse;
  result.target_lse = target_lse;
  result.draft_argmax = draft_best.id;
  result.target_argmax = has_target ? target_best.id : 0;
  result.label = label;
  result.label_value = label_value;
}

// --- the ops ----------------------------------------------------------------------------

void check_plane(const at::Tensor& plane, const char* name, int64_t rows, int64_t vocab, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(plane.device().is_cpu(), name, " must be a CPU tensor, got one on ", plane.device(), ".");
  TORCH_CHECK_TYPE(plane.scalar_type() == dtype, name, " must be ", dtype, ", got ", plane.scalar_type(), ".");
  TORCH_CHECK_VALUE(plane.dim() == 2 && plane.size(0) == rows && plane.size(1) == vocab, name, " must be [",
                    rows, ", ", vocab, "], got ", plane.sizes(), ".");
  TORCH_CHECK_VALUE(vocab <= 1 || plane.stride(1) == 1, name, " must have a unit last stride, got strides ",
                    plane.strides(), ".");
}

struct CheckedArgs {
  int64_t rows, vocab, losses;
  at::ScalarType dtype;
};

CheckedArgs check_head_args(const at::Tensor& logits, const c10::optional<at::Tensor>& target_logits,
                            const c10::optional<at::Tensor>& labels, int64_t loss_mask, int64_t top_k,
                            double logit_scale, double softcap, at::ScalarType logits_dtype) {
  check_defined({{logits, "logits"}});
  TORCH_CHECK_TYPE(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble,
                   "logits must be float32 or float64, got ", logits.scalar_type(), ".");
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be [rows, vocab], got shape ", logits.sizes(), ".");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_plane(logits, "logits", rows, vocab, logits.scalar_type());
  TORCH_CHECK_VALUE(vocab >= 1, "logits must have a vocabulary of at least 1, got shape ", logits.sizes(), ".");
  if (target_logits.has_value() && target_logits->defined()) {
    check_plane(*target_logits, "target_logits", rows, vocab, logits.scalar_type());
    TORCH_CHECK_VALUE(!target_logits->is_same(logits), "target_logits must not be logits itself.");
  }
  if (labels.has_value() && labels->defined()) {
    TORCH_CHECK_VALUE(labels->device().is_cpu(), "labels must be a CPU tensor, got one on ", labels->device(), ".");
    TORCH_CHECK_TYPE(labels->scalar_type() == at::kLong, "labels must be int64, got ", labels->scalar_type(), ".");
    TORCH_CHECK_VALUE(labels->dim() == 1 && labels->size(0) == rows, "labels must be [", rows, "], got shape ",
                      labels->sizes(), ".");
    const at::Tensor contiguous = labels->contiguous();
    const int64_t* ids = contiguous.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK_INDEX(ids[r] == kIgnoreIndex || (ids[r] >= 0 && ids[r] < vocab), "labels holds ", ids[r],
                        ", out of range for a vocabulary of ", vocab, " (-100 ignores a row).");
    }
  }
  TORCH_CHECK_VALUE(loss_mask >= 0 && loss_mask < (1 << kLossCount), "loss_mask must be in [0, ",
                    (1 << kLossCount) - 1, "], got ", loss_mask, ".");
  const bool soft = loss_mask & ((1 << kKlDiv) | (1 << kRkl) | (1 << kJsd) | (1 << kTv));
  const bool has_target = target_logits.has_value() && target_logits->defined();
  const bool has_labels = labels.has_value() && labels->defined();
  TORCH_CHECK_VALUE(!soft || has_target, "loss_mask asks for a soft loss (kl_div, rkl, jsd, tv), which needs "
                    "target_logits.");
  TORCH_CHECK_VALUE(!wants(loss_mask, kCe) || has_target || has_labels,
                    "loss_mask asks for ce, which needs labels or target_logits.");
  TORCH_CHECK_VALUE(top_k >= 0 && top_k <= vocab, "top_k must be in [0, ", vocab, "], got ", top_k, ".");
  TORCH_CHECK_VALUE(std::isfinite(logit_scale) && logit_scale != 0, "logit_scale must be finite and nonzero, got ",
                    logit_scale, ".");
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0, "softcap must be finite and >= 0 (0: none), got ",
                    softcap, ".");
  TORCH_CHECK_TYPE(logits_dtype == at::kHalf || logits_dtype == at::kBFloat16 || logits_dtype == at::kFloat ||
                       logits_dtype == at::kDouble,
                   "logits_dtype must be float16, bfloat16, float32 or float64, got ", logits_dtype, ".");
  int64_t losses = 0;
  for (int loss = 0; loss < kLossCount; ++loss) losses += wants(loss_mask, HeadLoss(loss));
  return {rows, vocab, losses, logits.scalar_type()};
}

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

// Forward: (losses [L, R], stats [R, 3] (draft_lse, target_lse, overlap), argmax [R, 2]
// (draft, target), topk_ids [R, k], topk_values [R, k] (z), target_at_topk [R, k] (t),
// label_values [R] (z at the label; at 0 on ignored rows)), floats in the logits' dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> head_rows_cpu(
    at::Tensor logits, c10::optional<at::Tensor> target_logits, c10::optional<at::Tensor> labels,
    int64_t loss_mask, int64_t top_k, double logit_scale, double softcap, at::ScalarType logits_dtype,
    c10::optional<at::Tensor> loss_grads) {
  const CheckedArgs args =
      check_head_args(logits, target_logits, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype);
  const bool has_grads = loss_grads.has_value() && loss_grads->defined();
  if (has_grads) {
    const at::Tensor& planes = *loss_grads;
    TORCH_CHECK_VALUE(planes.device().is_cpu() && planes.scalar_type() == args.dtype && planes.dim() == 3 &&
                          planes.size(0) == args.losses && planes.size(1) == args.rows &&
                          planes.size(2) == args.vocab && (args.vocab <= 1 || planes.stride(2) == 1),
                      "loss_grads must be a CPU ", args.dtype, " tensor [", args.losses, ", ", args.rows, ", ",
                      args.vocab, "] with a unit last stride, got ", planes.scalar_type(), " ", planes.sizes(), ".");
  }
  const auto float_options = logits.options();
  const auto long_options = logits.options().dtype(at::kLong);
  at::Tensor losses = empty_output({args.losses, args.rows}, float_options);
  at::Tensor stats = empty_output({args.rows, 3}, float_options);
  at::Tensor argmax = empty_output({args.rows, 2}, long_options);
  at::Tensor topk_ids = empty_output({args.rows, top_k}, long_options);
  at::Tensor topk_values = empty_output({args.rows, top_k}, float_options);
  at::Tensor target_at_topk = empty_output({args.rows, top_k}, float_options);
  at::Tensor label_values = empty_output({args.rows}, float_options);
  const at::Tensor label_ids = labels.has_value() && labels->defined() ? labels->contiguous() : at::Tensor();
  const HeadConfig config{args.vocab, top_k, loss_mask, logit_scale, softcap, logits_dtype};

  AT_DISPATCH_FLOATING_TYPES(args.dtype, "draft_head_rows_cpu", [&] {
    using E = scalar_t;
    const int64_t* label_data = label_ids.defined() ? label_ids.data_ptr<int64_t>() : nullptr;
    at::parallel_for(0, args.rows, 1, [&](int64_t begin, int64_t end) {
      RowTopK<E> topk;
      for (int64_t r = begin; r < end; ++r) {
        RowTask<E> task = row_task<E>(r, logits, target_logits, label_data);
        for (int loss = 0, plane = 0; loss < kLossCount; ++loss) {
          task.grads[loss] = nullptr;
          if (!wants(loss_mask, HeadLoss(loss))) continue;
          if (has_grads) task.grads[loss] = loss_grads->data_ptr<E>() + plane * loss_grads->stride(0) +
                                            r * loss_grads->stride(1);
          ++plane;
        }
        RowResult<E> result;
        head_row<E>(task, config, topk, result);
        for (int loss = 0, plane = 0; loss < kLossCount; ++loss) {
          if (wants(loss_mask, HeadLoss(loss))) losses.data_ptr<E>()[plane++ * args.rows + r] = result.losses[loss];
        }
        E* stat = stats.data_ptr<E>() + 3 * r;
        stat[0] = result.draft_lse;
        stat[1] = result.target_lse;
        stat[2] = result.overlap;
        argmax.data_ptr<int64_t>()[2 * r] = result.draft_argmax;
        argmax.data_ptr<int64_t>()[2 * r + 1] = result.target_argmax;
        for (int64_t j = 0; j < top_k; ++j) {
          topk_ids.data_ptr<int64_t>()[r * top_k + j] = topk.ids[j];
          topk_values.data_ptr<E>()[r * top_k + j] = topk.values[j];
          target_at_topk.data_ptr<E>()[r * top_k + j] = task.t != nullptr ? task.t[topk.ids[j]] : E(0);
        }
        label_values.data_ptr<E>()[r] = result.label_value;
      }
    });
  });
  return {losses, stats, argmax, topk_ids, topk_values, target_at_topk, label_values};
}

// Backward (the recompute): over logits (raw in, the combined sum_l grad_losses[l] dL_l/ds
// out, in place), grad_losses [L, R] the losses' upstream gradients. target_logits is
// overwritten with the transformed target logits.
void head_rows_backward_cpu(at::Tensor logits, c10::optional<at::Tensor> target_logits,
                            c10::optional<at::Tensor> labels, int64_t loss_mask, double logit_scale, double softcap,
                            at::ScalarType logits_dtype, at::Tensor grad_losses) {
  const CheckedArgs args =
      check_head_args(logits, target_logits, labels, loss_mask, 0, logit_scale, softcap, logits_dtype);
  check_defined({{grad_losses, "grad_losses"}});
  TORCH_CHECK_VALUE(grad_losses.device().is_cpu(), "grad_losses must be a CPU tensor, got one on ",
                    grad_losses.device(), ".");
  TORCH_CHECK_TYPE(grad_losses.scalar_type() == args.dtype, "grad_losses must be ", args.dtype, ", got ",
                   grad_losses.scalar_type(), ".");
  TORCH_CHECK_VALUE(grad_losses.dim() == 2 && grad_losses.size(0) == args.losses && grad_losses.size(1) == args.rows,
                    "grad_losses must have shape [", args.losses, ", ", args.rows, "], got ", grad_losses.sizes(), ".");
  const at::Tensor label_ids = labels.has_value() && labels->defined() ? labels->contiguous() : at::Tensor();
  const HeadConfig config{args.vocab, 0, loss_mask, logit_scale, softcap, logits_dtype};
  AT_DISPATCH_FLOATING_TYPES(args.dtype, "draft_head_rows_backward_cpu", [&] {
    using E = scalar_t;
    const at::Tensor weights = grad_losses.contiguous();
    const int64_t* label_data = label_ids.defined() ? label_ids.data_ptr<int64_t>() : nullptr;
    at::parallel_for(0, args.rows, 1, [&](int64_t begin, int64_t end) {
      RowTopK<E> topk;
      for (int64_t r = begin; r < end; ++r) {
        RowTask<E> task = row_task<E>(r, logits, target_logits, label_data);
        double per_loss[kLossCount] = {};
        for (int loss = 0, plane = 0; loss < kLossCount; ++loss) {
          task.grads[loss] = nullptr;
          if (wants(loss_mask, HeadLoss(loss))) per_loss[loss] = weights.data_ptr<E>()[plane++ * args.rows + r];
        }
        task.grad_weights = per_loss;
        RowResult<E> result;
        head_row<E>(task, config, topk, result);
      }
    });
  });
}

}  // namespace
}  // namespace dflash2

TORCH_LIBRARY_IMPL(dflash2, CPU, m) {
  m.impl("draft_head_rows_cpu", &dflash2::head_rows_cpu);
  m.impl("draft_head_rows_backward_cpu", &dflash2::head_rows_backward_cpu);
}
