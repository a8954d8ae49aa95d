// CUDA bindings of the serving ops: checks, allocations and the launches on the
// current stream. Kernels: kernels/serving_kernels.cu (top-k, edges, walk) and
// kernels/verify_kernels.cu (rejection sampling). Also compiled for CPU tensors and the
// SIMT emulator (device_binding.h).
#include <torch/all.h>

#include <cmath>

#include "device_binding.h"
#include "kernels/serving.cuh"
#include "output_alloc.h"
#include "selector_checks.h"
#include "tensor_checks.h"

namespace dflash2 {
namespace {

bool rows_aligned16(const at::Tensor& rows) {
  return reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0 && (rows.stride(0) * rows.element_size()) % 16 == 0;
}

// Top-k operands over logits viewed as [rows, V], with the partial buffers allocated.
struct TopkPlan {
  TopkParams params;
  at::Tensor partial_keys;
  at::Tensor partial_indices;
};

TopkPlan plan_topk(const at::Tensor& rows, int64_t top_k) {
  TORCH_CHECK_TYPE(is_serving_float(rows.scalar_type()), "logits must be float16, bfloat16 or float32, got ",
                   rows.scalar_type());
  check_unit_last_stride(rows, "logits");
  const int64_t vocab = rows.size(1);
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= std::min<int64_t>(vocab, kMaxServingTopK), "top_k must be in [1, min(V=",
                    vocab, ", ", kMaxServingTopK, ")], got ", top_k);
  TORCH_CHECK_VALUE(vocab < static_cast<int64_t>(kNoIndex), "logits' vocabulary is too large for 32-bit token ids: ",
                    vocab);
  const TopkSplit split = plan_topk_split(std::max<int64_t>(rows.size(0), 1), vocab, rows.get_device());
  const auto words = rows.options().dtype(at::kInt);
  TopkPlan plan;
  plan.partial_keys = empty_output({rows.size(0), split.slices, top_k}, words);
  plan.partial_indices = empty_output({rows.size(0), split.slices, top_k}, words);
  plan.params = TopkParams{rows.data_ptr(),
                           to_dtype(rows.scalar_type()),
                           rows.stride(0),
                           rows.size(0),
                           vocab,
                           static_cast<int32_t>(top_k),
                           rows_aligned16(rows),
                           TopkPartials{reinterpret_cast<uint32_t*>(plan.partial_keys.data_ptr<int32_t>()),
                                        reinterpret_cast<uint32_t*>(plan.partial_indices.data_ptr<int32_t>()),
                                        split.slices, split.slice_length},
                           nullptr,
                           0};
  return plan;
}

std::tuple<at::Tensor, at::Tensor> candidate_topk_cuda(const at::Tensor& logits, int64_t top_k) {
  check_defined({{logits, "logits"}});
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be [rows, V], got ", logits.sizes());
  const KernelDeviceGuard device_guard(logits.device());
  TopkPlan plan = plan_topk(logits, top_k);
  at::Tensor values = empty_output({logits.size(0), top_k}, logits.options());
  at::Tensor ids = empty_output({logits.size(0), top_k}, logits.options().dtype(at::kLong));
  check_launch(launch_candidate_topk(plan.params, TopkOutputs{values.data_ptr(), ids.data_ptr<int64_t>()},
                                       kernel_stream()));
  return {values, ids};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> select_path_cuda(
    const at::Tensor& logits, const at::Tensor& projected, const at::Tensor& predecessor_codebook,
    const at::Tensor& successor_codebook, const at::Tensor& anchor_ids, const at::Tensor& uniforms, int64_t top_k,
    double temperature, at::ScalarType score_dtype) {
  // uniforms too: the schema takes a tensor (read only when temperature > 0; the
  // Python wrapper passes an empty one when greedy).
  check_defined({{logits, "logits"}, {projected, "projected"}, {predecessor_codebook, "predecessor_codebook"},
                 {successor_codebook, "successor_codebook"}, {anchor_ids, "anchor_ids"}, {uniforms, "uniforms"}});
  TORCH_CHECK_VALUE(logits.dim() == 3, "logits must be [B, D, V], got ", logits.sizes());
  const int64_t batch = logits.size(0), draft = logits.size(1), vocab = logits.size(2);
  TORCH_CHECK_VALUE(predecessor_codebook.dim() == 2 && predecessor_codebook.size(0) == vocab,
                    "predecessor_codebook must be [V=", vocab, ", r], got ", predecessor_codebook.sizes());
  const int64_t rank = predecessor_codebook.size(1);
  TORCH_CHECK_VALUE(successor_codebook.sizes() == predecessor_codebook.sizes(),
                    "successor_codebook must have predecessor_codebook's shape ", predecessor_codebook.sizes(),
                    ", got ", successor_codebook.sizes());
  TORCH_CHECK_VALUE(projected.sizes() == at::IntArrayRef({batch, draft, rank}), "projected must be [", batch, ", ",
                    draft, ", ", rank, "], got ", projected.sizes());
  TORCH_CHECK_VALUE(anchor_ids.dim() == 1 && anchor_ids.size(0) == batch, "anchor_ids must be [", batch, "], got ",
                    anchor_ids.sizes());
  TORCH_CHECK_TYPE(anchor_ids.scalar_type() == at::kLong, "anchor_ids must be int64, got ", anchor_ids.scalar_type());
  const at::ScalarType codebook_type = predecessor_codebook.scalar_type();
  TORCH_CHECK_TYPE(is_serving_float(codebook_type), "predecessor_codebook must be float16, bfloat16 or float32, got ",
                   codebook_type);
  TORCH_CHECK_TYPE(successor_codebook.scalar_type() == codebook_type,
                   "successor_codebook must have predecessor_codebook's dtype ", codebook_type, ", got ",
                   successor_codebook.scalar_type());
  TORCH_CHECK_TYPE(projected.scalar_type() == codebook_type || projected.scalar_type() == at::kFloat,
                   "projected must have the codebooks' dtype (", codebook_type, ") or float32, got ",
                   projected.scalar_type());
  TORCH_CHECK_TYPE(is_serving_float(score_dtype), "score_dtype must be float16, bfloat16 or float32, got ",
                   score_dtype);
  const float kernel_temp = kernel_temperature(temperature);
  const bool sampled = kernel_temp > 0.0f;
  if (sampled) {
    TORCH_CHECK_VALUE(uniforms.sizes() == at::IntArrayRef({batch, draft}), "uniforms must be [", batch, ", ", draft,
                      "], got ", uniforms.sizes());
    TORCH_CHECK_TYPE(uniforms.scalar_type() == at::kFloat, "uniforms must be float32, got ", uniforms.scalar_type());
    check_same_device(logits, "logits", {{uniforms, "uniforms"}});
  }
  check_unit_last_stride(predecessor_codebook, "predecessor_codebook");
  check_unit_last_stride(successor_codebook, "successor_codebook");
  check_same_device(logits, "logits", {{projected, "projected"}, {predecessor_codebook, "predecessor_codebook"},
                                       {successor_codebook, "successor_codebook"}, {anchor_ids, "anchor_ids"}});
  const KernelDeviceGuard device_guard(logits.device());
  const at::Tensor rows = logits.reshape({batch * draft, vocab});
  TopkPlan plan = plan_topk(rows, top_k);
  const at::Tensor projected_rows = projected.contiguous();
  const at::Tensor anchors = anchor_ids.contiguous();
  const at::Tensor draws = sampled ? uniforms.contiguous() : uniforms;
  const auto options = logits.options();
  at::Tensor path = empty_output({batch, draft}, options.dtype(at::kLong));
  at::Tensor candidate_ids = empty_output({batch, draft, top_k}, options.dtype(at::kLong));
  at::Tensor draft_probs = empty_output({batch, draft, top_k}, options.dtype(at::kFloat));
  at::Tensor edges = empty_output({batch, draft, top_k, top_k}, options.dtype(score_dtype));
  at::Tensor counters = empty_output({batch}, options.dtype(at::kInt));
  plan.params.counters = counters.data_ptr<int32_t>();
  plan.params.counter_count = batch;

  const SelectPathParams params{projected_rows.data_ptr(),
                                to_dtype(projected_rows.scalar_type()),
                                predecessor_codebook.data_ptr(),
                                successor_codebook.data_ptr(),
                                to_dtype(codebook_type),
                                predecessor_codebook.stride(0),
                                successor_codebook.stride(0),
                                anchors.data_ptr<int64_t>(),
                                sampled ? draws.data_ptr<float>() : nullptr,
                                batch,
                                draft,
                                rank,
                                kernel_temp,
                                path.data_ptr<int64_t>(),
                                candidate_ids.data_ptr<int64_t>(),
                                draft_probs.data_ptr<float>(),
                                edges.data_ptr(),
                                to_dtype(score_dtype),
                                counters.data_ptr<int32_t>()};
  check_launch(launch_select_path(plan.params, params, kernel_stream()));
  return {path, candidate_ids, draft_probs, edges};
}

std::tuple<at::Tensor, at::Tensor> rejection_sample_cuda(const at::Tensor& draft_tokens,
                                                         const at::Tensor& target_probs,
                                                         const at::Tensor& draft_probs,
                                                         const at::Tensor& candidate_ids,
                                                         const at::Tensor& uniforms) {
  check_defined({{draft_tokens, "draft_tokens"}, {target_probs, "target_probs"}, {draft_probs, "draft_probs"},
                 {candidate_ids, "candidate_ids"}, {uniforms, "uniforms"}});
  TORCH_CHECK_VALUE(draft_tokens.dim() == 2, "draft_tokens must be [B, D], got ", draft_tokens.sizes());
  const int64_t batch = draft_tokens.size(0), draft = draft_tokens.size(1);
  TORCH_CHECK_VALUE(draft >= 1, "draft_tokens must have D >= 1 positions");
  TORCH_CHECK_VALUE(target_probs.dim() == 3 && target_probs.size(0) == batch && target_probs.size(1) == draft + 1,
                    "target_probs must be [", batch, ", ", draft + 1, ", V], got ", target_probs.sizes());
  const int64_t vocab = target_probs.size(2);
  TORCH_CHECK_VALUE(draft_probs.dim() == 3 && draft_probs.size(0) == batch && draft_probs.size(1) == draft,
                    "draft_probs must be [", batch, ", ", draft, ", k], got ", draft_probs.sizes());
  const int64_t top_k = draft_probs.size(2);
  TORCH_CHECK_VALUE(top_k >= 1, "draft_probs must be [B, D, k] with k >= 1, got ", draft_probs.sizes());
  TORCH_CHECK_VALUE(vocab >= 1 && vocab <= kMaxVerifyVocab, "target_probs must have a vocabulary of 1 to ",
                    kMaxVerifyVocab, " tokens, got ", vocab);
  TORCH_CHECK_VALUE(candidate_ids.sizes() == draft_probs.sizes(), "candidate_ids must have draft_probs' shape ",
                    draft_probs.sizes(), ", got ", candidate_ids.sizes());
  TORCH_CHECK_VALUE(uniforms.sizes() == at::IntArrayRef({batch, draft + 1}), "uniforms must be [", batch, ", ",
                    draft + 1, "], got ", uniforms.sizes());
  TORCH_CHECK_TYPE(draft_tokens.scalar_type() == at::kLong, "draft_tokens must be int64, got ",
                   draft_tokens.scalar_type());
  TORCH_CHECK_TYPE(candidate_ids.scalar_type() == at::kLong, "candidate_ids must be int64, got ",
                   candidate_ids.scalar_type());
  TORCH_CHECK_TYPE(draft_probs.scalar_type() == at::kFloat, "draft_probs must be float32, got ",
                   draft_probs.scalar_type());
  TORCH_CHECK_TYPE(uniforms.scalar_type() == at::kFloat, "uniforms must be float32, got ", uniforms.scalar_type());
  TORCH_CHECK_TYPE(is_serving_float(target_probs.scalar_type()),
                   "target_probs must be float16, bfloat16 or float32, got ", target_probs.scalar_type());
  check_unit_last_stride(target_probs, "target_probs");
  const int64_t slices = (vocab + kVerifySliceLength - 1) / kVerifySliceLength;
  check_same_device(draft_tokens, "draft_tokens", {{target_probs, "target_probs"}, {draft_probs, "draft_probs"},
                                                   {candidate_ids, "candidate_ids"}, {uniforms, "uniforms"}});
  const KernelDeviceGuard device_guard(draft_tokens.device());
  const at::Tensor tokens = draft_tokens.contiguous();
  const at::Tensor proposal = draft_probs.contiguous();
  const at::Tensor candidates = candidate_ids.contiguous();
  const at::Tensor draws = uniforms.contiguous();
  const auto options = draft_tokens.options();
  at::Tensor accepted = empty_output({batch}, options.dtype(at::kLong));
  at::Tensor bonus = empty_output({batch}, options.dtype(at::kLong));
  at::Tensor slice_mass = empty_output({batch, slices, 2}, options.dtype(at::kFloat));
  const RejectionParams params{tokens.data_ptr<int64_t>(),
                               target_probs.data_ptr(),
                               to_dtype(target_probs.scalar_type()),
                               target_probs.stride(0),
                               target_probs.stride(1),
                               proposal.data_ptr<float>(),
                               candidates.data_ptr<int64_t>(),
                               draws.data_ptr<float>(),
                               batch,
                               draft,
                               vocab,
                               top_k,
                               static_cast<int32_t>(slices),
                               kVerifySliceLength,
                               slice_mass.data_ptr<float>(),
                               accepted.data_ptr<int64_t>(),
                               bonus.data_ptr<int64_t>()};
  check_launch(launch_rejection_sample(params, kernel_stream()));
  return {accepted, bonus};
}

}  // namespace

DFLASH2_KERNEL_LIBRARY_IMPL(m) {
  m.impl("candidate_topk", &candidate_topk_cuda);
  m.impl("select_path", &select_path_cuda);
  m.impl("rejection_sample", &rejection_sample_cuda);
}

}  // namespace dflash2
