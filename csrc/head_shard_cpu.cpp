// The draft head's row kernels on one rank's shard of the vocabulary (SPEC section 7, vocab
// parallel; dflash2_kernels/head/shard.py runs them): the passes of csrc/head_row_passes.h
// split where a row's sums must be merged across ranks.
//
//   draft_head_shard_stats_cpu: passes A and B over the shard: s -> z (and t) in place,
//     each side's local log-sum-exp, the local top-k of the rounded logits and the
//     target's local argmax. The ranks merge these into the row's global normalisers
//     (a logsumexp over the ranks, shifted by the largest top-1 logit) and candidates.
//   draft_head_shard_rows_cpu: passes C and D against the global normalisers (row_stats):
//     the shard's shares of the soft losses' sums and of sum min(p, q), and dL/ds into the
//     losses' planes (forward) or the combined gradient over s (backward, after the
//     transform of the recomputed raw logits). rkl, jsd and tv's gradients subtract a
//     row-global sum: the forward merges the shares first and passes the sums back in.
// Rows are independent: the result does not depend on the thread count.
#include <ATen/Parallel.h>
#include <torch/all.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "head_checks.h"
#include "head_row_passes.h"
#include "output_alloc.h"

namespace dflash2 {
namespace {

// The columns of row_stats: both sides' global normalisers (a shift near the row's maximum
// and the log-sum-exp), then the row-global sums the gradients of rkl, jsd and tv subtract.
enum RowStat : int { kDraftShift = 0, kDraftLse, kTargetShift, kTargetLse, kRklSum, kJsdSum, kTvSum, kRowStats };
// The columns of the shares: the losses' and metrics' sums over this shard's entries.
enum Share : int { kKlShare = 0, kRklShare, kJsdShare, kOverlapShare, kJsdQShare, kTvQShare, kShares };

// Passes A and B: the local normalisers and candidates.
template <typename E>
DFLASH2_ROW_KERNEL void shard_stats_row(const RowTask<E>& task, const HeadConfig& config, RowTopK& topk,
                                        double* stats, int64_t& target_argmax) {
  RowArgmax draft_best, target_best;
  Normaliser draft, target;
  transform_pass<E>(task, config, true, task.t != nullptr, topk, draft_best, target_best, draft, target);
  topk.finish();
  normalise_pass<E>(task, config.vocab, draft, target);
  const bool has_target = task.t != nullptr;
  target_argmax = has_target ? target_best.id : 0;
  stats[0] = draft.lse;
  stats[1] = has_target ? target.lse : 0.0;
  stats[2] = has_target ? static_cast<double>(task.t[target_argmax]) : 0.0;
}

// Normalisers from merged statistics: a NaN anywhere in a row makes its lse NaN. The shift
// need not be the row's maximum exactly, only close to it (the ranks take the largest of
// their top-1 logits): log p = (x - shift) - (lse - shift) then rounds no worse.
inline Normaliser merged(double shift, double lse) {
  Normaliser side;
  side.max = shift;
  side.has_nan = std::isnan(lse);
  side.lse = lse;
  return side;
}

// Passes C and D against the global normalisers.
template <typename E>
DFLASH2_ROW_KERNEL void shard_rows_row(const RowTask<E>& task, const HeadConfig& config, const double* stats,
                                       bool transform, bool shares, double* out) {
  if (transform) {
    RowTopK unused;
    RowArgmax draft_best, target_best;
    Normaliser draft, target;
    transform_pass<E>(task, config, false, false, unused, draft_best, target_best, draft, target);
  }
  const Normaliser draft = merged(stats[kDraftShift], stats[kDraftLse]);
  const Normaliser target = merged(stats[kTargetShift], stats[kTargetLse]);
  const bool ignored = task.label == kIgnoreIndex;
  RowSums sums;
  if (shares) {
    double loss_sums[kLossCount] = {};
    double overlap = 0;
    if (task.t != nullptr) loss_pass<E>(task, config, draft, target, ignored, loss_sums, overlap, sums);
    out[kKlShare] = ignored ? 0.0 : loss_sums[kKlDiv];
    out[kRklShare] = ignored ? 0.0 : loss_sums[kRkl];
    out[kJsdShare] = ignored ? 0.0 : loss_sums[kJsd];
    out[kOverlapShare] = overlap;
    out[kJsdQShare] = sums.jsd_qb;
    out[kTvQShare] = sums.tv_qc;
  }
  const bool planes = std::any_of(task.grads, task.grads + kLossCount, [](E* plane) { return plane != nullptr; });
  if (task.grad_weights != nullptr || planes) {
    sums.rkl = stats[kRklSum];
    sums.jsd_qb = stats[kJsdSum];
    sums.tv_qc = stats[kTvSum];
    gradient_pass<E>(task, config, draft, target, sums, task.label, ignored);
  }
}

// Forward, passes A and B. logits [R, V_local] (raw in, z out), target_logits likewise;
// -> (stats [R, 3] float64: the local log-sum-exp of z and of t, t at the target's local
// argmax (target columns 0 without a target); topk_ids [R, k] int64: the local ids of the
// k best logits rounded to logits_dtype (descending, ties to the lower id); topk_values
// [R, k] float64: z there, unrounded; target_argmax [R] int64 (local; 0 without a target)).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> shard_stats_cpu(
    at::Tensor logits, c10::optional<at::Tensor> target_logits, int64_t top_k, double logit_scale, double softcap,
    at::ScalarType logits_dtype) {
  const LogitPlanes planes = check_logit_planes(logits, target_logits);
  check_ranking(top_k, planes.vocab, logits_dtype);
  check_transform(logit_scale, softcap);
  const auto doubles = logits.options().dtype(at::kDouble);
  const auto longs = logits.options().dtype(at::kLong);
  at::Tensor stats = empty_output({planes.rows, 3}, doubles);
  at::Tensor topk_ids = empty_output({planes.rows, top_k}, longs);
  at::Tensor topk_values = empty_output({planes.rows, top_k}, doubles);
  at::Tensor target_argmax = empty_output({planes.rows}, longs);
  const HeadConfig config{planes.vocab, top_k, 0, logit_scale, softcap, logits_dtype};
  AT_DISPATCH_FLOATING_TYPES(planes.dtype, "draft_head_shard_stats_cpu", [&] {
    using E = scalar_t;
    // Raw pointers once: data_ptr() costs far more than a store (it checks the storage).
    double* const stats_out = stats.data_ptr<double>();
    int64_t* const ids_out = topk_ids.data_ptr<int64_t>();
    double* const values_out = topk_values.data_ptr<double>();
    int64_t* const argmax_out = target_argmax.data_ptr<int64_t>();
    at::parallel_for(0, planes.rows, 1, [&](int64_t begin, int64_t end) {
      RowTopK topk;
      for (int64_t r = begin; r < end; ++r) {
        const RowTask<E> task = row_task<E>(r, logits, target_logits, nullptr);
        shard_stats_row<E>(task, config, topk, stats_out + 3 * r, argmax_out[r]);
        for (int64_t j = 0; j < top_k; ++j) {
          const int64_t id = topk.id(j);
          ids_out[r * top_k + j] = id;
          values_out[r * top_k + j] = static_cast<double>(task.z[id]);
        }
      }
    });
  });
  return {stats, topk_ids, topk_values, target_argmax};
}

// Passes C and D. logits [R, V_local]: transformed z (raw s with `transform`, transformed in
// place first), target_logits likewise; labels [R] int64: the label's local id, -1 where it
// is on another shard (or there is none), -100 on ignored rows; row_stats [R, 7] float64
// (RowStat); shares: return the shard's sums [R, 6] float64 (Share), else [0, 6];
// loss_grads [L, R, V_local]: the losses' dL/ds (forward); grad_losses [L, R]: their
// upstream gradients, logits <- sum_l g_l dL_l/ds (backward). At most one of the two.
at::Tensor shard_rows_cpu(at::Tensor logits, c10::optional<at::Tensor> target_logits, at::Tensor labels,
                          int64_t loss_mask, double logit_scale, double softcap, at::Tensor row_stats, bool transform,
                          bool shares, c10::optional<at::Tensor> loss_grads, c10::optional<at::Tensor> grad_losses) {
  const LogitPlanes planes = check_logit_planes(logits, target_logits);
  check_defined({{labels, "labels"}, {row_stats, "row_stats"}});
  check_labels(labels, planes.rows, planes.vocab, true);
  const int64_t losses = check_loss_mask(loss_mask, planes.has_target, true);
  check_transform(logit_scale, softcap);
  TORCH_CHECK_VALUE(row_stats.device().is_cpu(), "row_stats must be a CPU tensor, got one on ", row_stats.device(),
                    ".");
  TORCH_CHECK_TYPE(row_stats.scalar_type() == at::kDouble, "row_stats must be float64, got ",
                   row_stats.scalar_type(), ".");
  TORCH_CHECK_VALUE(row_stats.dim() == 2 && row_stats.size(0) == planes.rows && row_stats.size(1) == kRowStats,
                    "row_stats must be [", planes.rows, ", ", int(kRowStats), "], got shape ", row_stats.sizes(), ".");
  const bool has_planes = loss_grads.has_value() && loss_grads->defined();
  const bool has_weights = grad_losses.has_value() && grad_losses->defined();
  TORCH_CHECK_VALUE(!(has_planes && has_weights), "loss_grads (forward) and grad_losses (backward) exclude each "
                    "other: pass one.");
  if (has_planes) check_loss_grads(*loss_grads, losses, planes.rows, planes.vocab, planes.dtype);
  if (has_weights) check_grad_losses(*grad_losses, losses, planes.rows, planes.dtype);
  constexpr int64_t kGlobalSums = (1 << kRkl) | (1 << kJsd) | (1 << kTv);
  TORCH_CHECK_VALUE(!(shares && has_planes && (loss_mask & kGlobalSums)),
                    "loss_grads with shares: rkl, jsd and tv's gradients need the row sums of every shard "
                    "(row_stats' last columns): merge the shares first, then pass loss_grads in a second call.");
  const auto doubles = logits.options().dtype(at::kDouble);
  at::Tensor out = empty_output({shares ? planes.rows : 0, kShares}, doubles);
  const at::Tensor label_ids = labels.contiguous();
  const at::Tensor stats = row_stats.contiguous();
  const HeadConfig config{planes.vocab, 0, loss_mask, logit_scale, softcap, at::kFloat};
  AT_DISPATCH_FLOATING_TYPES(planes.dtype, "draft_head_shard_rows_cpu", [&] {
    using E = scalar_t;
    const at::Tensor weights = has_weights ? grad_losses->contiguous() : at::Tensor();
    const int64_t* const label_data = label_ids.data_ptr<int64_t>();
    const double* const stats_in = stats.data_ptr<double>();
    double* const shares_out = shares ? out.data_ptr<double>() : nullptr;
    at::parallel_for(0, planes.rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        RowTask<E> task = row_task<E>(r, logits, target_logits, label_data);
        if (has_planes) attach_planes(task, loss_mask, *loss_grads, r);
        double per_loss[kLossCount] = {};
        if (has_weights) attach_grad_weights(task, loss_mask, weights, r, per_loss);
        shard_rows_row<E>(task, config, stats_in + kRowStats * r, transform, shares,
                          shares ? shares_out + kShares * r : nullptr);
      }
    });
  });
  return out;
}

}  // namespace
}  // namespace dflash2

TORCH_LIBRARY_IMPL(dflash2, CPU, m) {
  m.impl("draft_head_shard_stats_cpu", &dflash2::shard_stats_cpu);
  m.impl("draft_head_shard_rows_cpu", &dflash2::shard_rows_cpu);
}
