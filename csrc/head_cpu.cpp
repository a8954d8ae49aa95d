// The draft head's row kernel on CPU (SPEC section 7): one chunk of rows of logits at a
// time, each row reduced to its losses, statistics and top-k without leaving cache.
//
// dflash2_kernels/head/ops.py fills the chunk: raw logits s = h W^T [R, V] (and the
// target's, t) by a GEMM, in float (or double for float64 inputs). Each row then takes
// the four passes of csrc/head_row_passes.h over its V entries, all over one row (a few
// hundred KB, in L2/L3) instead of over [N, V] in DRAM. The top-k and label logits' own
// gradients are a few entries per row: the caller adds them through the W rows they came
// from (head/ops.py), outside the GEMM over V, whose rounding would otherwise grow with V.
// Rows are independent: the result does not depend on the thread count.
#include <ATen/Parallel.h>
#include <torch/all.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "head_checks.h"
#include "head_row_passes.h"
#include "output_alloc.h"
#include "tensor_checks.h"

namespace dflash2 {
namespace {

// One row: passes A to D (the backward, task.grad_weights set, ranks nothing and writes
// the combined gradient over z).
template <typename E>
DFLASH2_ROW_KERNEL void head_row(const RowTask<E>& task, const HeadConfig& config, RowTopK& topk,
                                 RowResult& result) {
  const bool backward = task.grad_weights != nullptr;
  const bool has_target = task.t != nullptr;
  RowArgmax draft_best, target_best;
  Normaliser draft, target;
  // The backward needs the target's argmax only as the label of a ce without labels.
  transform_pass<E>(task, config, !backward, has_target && (!backward || !task.labels_given), topk, draft_best,
                    target_best, draft, target);
  topk.finish();
  normalise_pass<E>(task, config.vocab, draft, target);

  const int64_t label = task.labels_given ? task.label : (has_target ? target_best.id : -1);
  const bool ignored = task.labels_given && label == kIgnoreIndex;
  const int64_t label_index = ignored || label < 0 ? 0 : label;
  RowSums sums;
  double loss_sums[kLossCount] = {};
  if (has_target) loss_pass<E>(task, config, draft, target, ignored, loss_sums, result.overlap, sums);
  const double label_value = static_cast<double>(task.z[label_index]);
  if (!ignored && label >= 0) loss_sums[kCe] = draft.lse - label_value;
  const bool planes = std::any_of(task.grads, task.grads + kLossCount, [](E* plane) { return plane != nullptr; });
  if (backward || planes) gradient_pass<E>(task, config, draft, target, sums, label, ignored);

  for (int loss = 0; loss < kLossCount; ++loss) result.losses[loss] = ignored ? 0.0 : loss_sums[loss];
  result.draft_lse = draft.lse;
  result.target_lse = target.lse;
  result.draft_argmax = config.top_k > 0 && !backward ? topk.id(0) : draft_best.id;
  result.target_argmax = has_target ? target_best.id : 0;
  result.label = label;
  result.label_value = label_value;
}

// --- the ops ----------------------------------------------------------------------------

struct CheckedArgs {
  int64_t rows, vocab, losses;
  at::ScalarType dtype;
};

CheckedArgs check_head_args(const at::Tensor& logits, const c10::optional<at::Tensor>& target_logits,
                            const c10::optional<at::Tensor>& labels, int64_t loss_mask, int64_t top_k,
                            double logit_scale, double softcap, at::ScalarType logits_dtype) {
  const LogitPlanes planes = check_logit_planes(logits, target_logits);
  const bool has_labels = labels.has_value() && labels->defined();
  if (has_labels) check_labels(*labels, planes.rows, planes.vocab, false);
  const int64_t losses = check_loss_mask(loss_mask, planes.has_target, has_labels);
  check_ranking(top_k, planes.vocab, logits_dtype);
  check_transform(logit_scale, softcap);
  return {planes.rows, planes.vocab, losses, planes.dtype};
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
  if (has_grads) check_loss_grads(*loss_grads, args.losses, args.rows, args.vocab, args.dtype);
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
    // Raw pointers once: data_ptr() costs far more than a store (it checks the storage).
    const int64_t* label_data = label_ids.defined() ? label_ids.data_ptr<int64_t>() : nullptr;
    E* const loss_out = losses.data_ptr<E>();
    E* const stat_out = stats.data_ptr<E>();
    int64_t* const argmax_out = argmax.data_ptr<int64_t>();
    int64_t* const ids_out = topk_ids.data_ptr<int64_t>();
    E* const values_out = topk_values.data_ptr<E>();
    E* const at_topk_out = target_at_topk.data_ptr<E>();
    E* const label_out = label_values.data_ptr<E>();
    at::parallel_for(0, args.rows, 1, [&](int64_t begin, int64_t end) {
      RowTopK topk;
      for (int64_t r = begin; r < end; ++r) {
        RowTask<E> task = row_task<E>(r, logits, target_logits, label_data);
        if (has_grads) attach_planes(task, loss_mask, *loss_grads, r);
        RowResult result;
        head_row<E>(task, config, topk, result);
        for (int loss = 0, plane = 0; loss < kLossCount; ++loss) {
          if (wants(loss_mask, HeadLoss(loss))) loss_out[plane++ * args.rows + r] = result.losses[loss];
        }
        E* stat = stat_out + 3 * r;
        stat[0] = result.draft_lse;
        stat[1] = result.target_lse;
        stat[2] = result.overlap;
        argmax_out[2 * r] = result.draft_argmax;
        argmax_out[2 * r + 1] = result.target_argmax;
        for (int64_t j = 0; j < top_k; ++j) {
          const int64_t id = topk.id(j);
          ids_out[r * top_k + j] = id;
          values_out[r * top_k + j] = task.z[id];
          at_topk_out[r * top_k + j] = task.t != nullptr ? task.t[id] : E(0);
        }
        label_out[r] = result.label_value;
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
  check_grad_losses(grad_losses, args.losses, args.rows, args.dtype);
  const at::Tensor label_ids = labels.has_value() && labels->defined() ? labels->contiguous() : at::Tensor();
  const HeadConfig config{args.vocab, 0, loss_mask, logit_scale, softcap, logits_dtype};
  AT_DISPATCH_FLOATING_TYPES(args.dtype, "draft_head_rows_backward_cpu", [&] {
    using E = scalar_t;
    const at::Tensor weights = grad_losses.contiguous();
    const int64_t* label_data = label_ids.defined() ? label_ids.data_ptr<int64_t>() : nullptr;
    at::parallel_for(0, args.rows, 1, [&](int64_t begin, int64_t end) {
      RowTopK topk;
      for (int64_t r = begin; r < end; ++r) {
        RowTask<E> task = row_task<E>(r, logits, target_logits, label_data);
        double per_loss[kLossCount] = {};
        attach_grad_weights(task, loss_mask, weights, r, per_loss);
        RowResult result;
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
