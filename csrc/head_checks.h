// Argument checks of the draft head's C++ row ops (csrc/head_cpu.cpp, csrc/head_shard_cpu.cpp):
// each raises ValueError / TypeError / IndexError naming the argument, before any kernel
// touches memory.
#pragma once

#include <torch/all.h>

#include <cmath>
#include <cstdint>

#include "head_row_passes.h"
#include "tensor_checks.h"

namespace dflash2 {
namespace {

inline void check_plane(const at::Tensor& plane, const char* name, int64_t rows, int64_t vocab,
                        at::ScalarType dtype) {
  TORCH_CHECK_VALUE(plane.device().is_cpu(), name, " must be a CPU tensor, got one on ", plane.device(), ".");
  TORCH_CHECK_TYPE(plane.scalar_type() == dtype, name, " must be ", dtype, ", got ", plane.scalar_type(), ".");
  TORCH_CHECK_VALUE(plane.dim() == 2 && plane.size(0) == rows && plane.size(1) == vocab, name, " must be [",
                    rows, ", ", vocab, "], got ", plane.sizes(), ".");
  TORCH_CHECK_VALUE(vocab <= 1 || plane.stride(1) == 1, name, " must have a unit last stride, got strides ",
                    plane.strides(), ".");
}

struct LogitPlanes {
  int64_t rows, vocab;
  at::ScalarType dtype;
  bool has_target;
};

// logits: CPU float32 / float64 [R, V >= 1], unit last stride; target_logits like it, not it.
inline LogitPlanes check_logit_planes(const at::Tensor& logits, const c10::optional<at::Tensor>& target_logits) {
  check_defined({{logits, "logits"}});
  TORCH_CHECK_TYPE(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble,
                   "logits must be float32 or float64, got ", logits.scalar_type(), ".");
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be [rows, vocab], got shape ", logits.sizes(), ".");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_plane(logits, "logits", rows, vocab, logits.scalar_type());
  TORCH_CHECK_VALUE(vocab >= 1, "logits must have a vocabulary of at least 1, got shape ", logits.sizes(), ".");
  const bool has_target = target_logits.has_value() && target_logits->defined();
  if (has_target) {
    check_plane(*target_logits, "target_logits", rows, vocab, logits.scalar_type());
    TORCH_CHECK_VALUE(!target_logits->is_same(logits), "target_logits must not be logits itself.");
  }
  return {rows, vocab, logits.scalar_type(), has_target};
}

// labels: CPU int64 [R], each in [0, V), -100 (an ignored row) or, where `absent` is allowed,
// -1 (no label on this row or shard).
inline void check_labels(const at::Tensor& labels, int64_t rows, int64_t vocab, bool absent) {
  TORCH_CHECK_VALUE(labels.device().is_cpu(), "labels must be a CPU tensor, got one on ", labels.device(), ".");
  TORCH_CHECK_TYPE(labels.scalar_type() == at::kLong, "labels must be int64, got ", labels.scalar_type(), ".");
  TORCH_CHECK_VALUE(labels.dim() == 1 && labels.size(0) == rows, "labels must be [", rows, "], got shape ",
                    labels.sizes(), ".");
  const at::Tensor contiguous = labels.contiguous();
  const int64_t* ids = contiguous.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK_INDEX(ids[r] == kIgnoreIndex || (absent && ids[r] == -1) || (ids[r] >= 0 && ids[r] < vocab),
                      "labels holds ", ids[r], ", out of range for a vocabulary of ", vocab,
                      absent ? " (-100 ignores a row, -1 is no label here)." : " (-100 ignores a row).");
  }
}

// loss_mask in [0, 2^5); a soft loss needs target_logits, ce labels or target_logits. Returns
// how many losses it asks for.
inline int64_t check_loss_mask(int64_t loss_mask, bool has_target, bool has_labels) {
  TORCH_CHECK_VALUE(loss_mask >= 0 && loss_mask < (1 << kLossCount), "loss_mask must be in [0, ",
                    (1 << kLossCount) - 1, "], got ", loss_mask, ".");
  const bool soft = loss_mask & ((1 << kKlDiv) | (1 << kRkl) | (1 << kJsd) | (1 << kTv));
  TORCH_CHECK_VALUE(!soft || has_target, "loss_mask asks for a soft loss (kl_div, rkl, jsd, tv), which needs "
                    "target_logits.");
  TORCH_CHECK_VALUE(!wants(loss_mask, kCe) || has_target || has_labels,
                    "loss_mask asks for ce, which needs labels or target_logits.");
  int64_t losses = 0;
  for (int loss = 0; loss < kLossCount; ++loss) losses += wants(loss_mask, HeadLoss(loss));
  return losses;
}

inline void check_transform(double logit_scale, double softcap) {
  TORCH_CHECK_VALUE(std::isfinite(logit_scale) && logit_scale != 0, "logit_scale must be finite and nonzero, got ",
                    logit_scale, ".");
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0, "softcap must be finite and >= 0 (0: none), got ",
                    softcap, ".");
}

inline void check_ranking(int64_t top_k, int64_t vocab, at::ScalarType logits_dtype) {
  TORCH_CHECK_VALUE(top_k >= 0 && top_k <= vocab, "top_k must be in [0, ", vocab, "], got ", top_k, ".");
  TORCH_CHECK_TYPE(logits_dtype == at::kHalf || logits_dtype == at::kBFloat16 || logits_dtype == at::kFloat ||
                       logits_dtype == at::kDouble,
                   "logits_dtype must be float16, bfloat16, float32 or float64, got ", logits_dtype, ".");
}

// loss_grads: CPU [L, R, V] of the logits' dtype with a unit last stride.
inline void check_loss_grads(const at::Tensor& planes, int64_t losses, int64_t rows, int64_t vocab,
                             at::ScalarType dtype) {
  TORCH_CHECK_VALUE(planes.device().is_cpu() && planes.scalar_type() == dtype && planes.dim() == 3 &&
                        planes.size(0) == losses && planes.size(1) == rows && planes.size(2) == vocab &&
                        (vocab <= 1 || planes.stride(2) == 1),
                    "loss_grads must be a CPU ", dtype, " tensor [", losses, ", ", rows, ", ", vocab,
                    "] with a unit last stride, got ", planes.scalar_type(), " ", planes.sizes(), ".");
}

// grad_losses: CPU [L, R] of the logits' dtype.
inline void check_grad_losses(const at::Tensor& grad_losses, int64_t losses, int64_t rows, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(grad_losses.device().is_cpu(), "grad_losses must be a CPU tensor, got one on ",
                    grad_losses.device(), ".");
  TORCH_CHECK_TYPE(grad_losses.scalar_type() == dtype, "grad_losses must be ", dtype, ", got ",
                   grad_losses.scalar_type(), ".");
  TORCH_CHECK_VALUE(grad_losses.dim() == 2 && grad_losses.size(0) == losses && grad_losses.size(1) == rows,
                    "grad_losses must have shape [", losses, ", ", rows, "], got ", grad_losses.sizes(), ".");
}

}  // namespace
}  // namespace dflash2
