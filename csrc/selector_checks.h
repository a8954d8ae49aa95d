// Argument checks and dtype mapping shared by the selector's CPU and CUDA bindings.
// The Python wrappers validate first with friendlier messages; these keep a direct
// call of torch.ops.dflash2.* from ever reaching a kernel with bad operands.
#pragma once

#include <torch/all.h>

#include <cmath>
#include <initializer_list>

#include "kernels/selector_math.h"
#include "output_alloc.h"
#include "tensor_checks.h"

namespace dflash2 {

struct SelectorShape {
  int64_t rows;
  int64_t vocab;
  int64_t rank;
  int64_t top_k;
};

inline DType to_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble: return DType::kFloat64;
    default: TORCH_CHECK_TYPE(false, "unsupported dtype ", type, "; expected float16, bfloat16, float32 or float64");
  }
  return DType::kFloat32;
}

// The dtypes of the serving path's logits, codebooks and probabilities.
inline bool is_serving_float(at::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

// CPU only: reads every id (a device tensor would need a host sync).
inline void check_ids_in_range(const at::Tensor& ids, int64_t vocab, const char* name) {
  const int64_t* data = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK_INDEX(id_in_range(data[i], vocab), name, " holds ", data[i], " at flat index ", i,
                      ", out of range for a vocabulary of ", vocab);
  }
}

inline bool is_supported_float(at::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16 || type == at::kDouble;
}

// Rows are read contiguously: a tensor's last stride must be 1 (or its last dim <= 1).
inline void check_unit_last_stride(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, name, " must have a unit last stride, got strides ",
                    t.strides());
}

// Every tensor in `others` on `first`'s device (a host pointer read by a CUDA kernel is
// an illegal address that poisons the context), e.g. "grad_scores must be on cuda:0 like
// projected (all tensors on one device), got cpu".
inline void check_same_device(const at::Tensor& first, const char* first_name,
                              std::initializer_list<TensorArgument> others) {
  for (const TensorArgument& other : others) {
    TORCH_CHECK_VALUE(other.tensor.device() == first.device(), other.name, " must be on ", first.device(), " like ",
                      first_name, " (all tensors on one device), got ", other.tensor.device());
  }
}

inline SelectorShape check_selector_operands(const at::Tensor& projected, const at::Tensor& predecessor_codebook,
                                             const at::Tensor& successor_codebook, const at::Tensor& predecessor_ids,
                                             const at::Tensor& candidate_ids) {
  TORCH_CHECK_VALUE(projected.dim() == 2, "projected must be [N, r], got ", projected.sizes());
  TORCH_CHECK_VALUE(predecessor_codebook.dim() == 2, "predecessor_codebook must be [V, r], got ",
                    predecessor_codebook.sizes());
  TORCH_CHECK_VALUE(successor_codebook.sizes() == predecessor_codebook.sizes(),
                    "successor_codebook must have predecessor_codebook's shape ", predecessor_codebook.sizes(),
                    ", got ", successor_codebook.sizes());
  const SelectorShape shape{projected.size(0), predecessor_codebook.size(0), projected.size(1),
                            candidate_ids.dim() == 2 ? candidate_ids.size(1) : -1};
  // A bad id reads codebook row 0 (and discards it) on CUDA: the row must exist.
  TORCH_CHECK_VALUE(shape.vocab >= 1, "predecessor_codebook must have at least one row (V >= 1), got ",
                    predecessor_codebook.sizes());
  TORCH_CHECK_VALUE(predecessor_codebook.size(1) == shape.rank, "predecessor_codebook must be [V, ", shape.rank,
                    "] to match projected [N, r], got ", predecessor_codebook.sizes());
  TORCH_CHECK_VALUE(candidate_ids.dim() == 2 && candidate_ids.size(0) == shape.rows, "candidate_ids must be [",
                    shape.rows, ", k], got ", candidate_ids.sizes());
  TORCH_CHECK_VALUE(predecessor_ids.dim() == 1 && predecessor_ids.size(0) == shape.rows, "predecessor_ids must be [",
                    shape.rows, "], got ", predecessor_ids.sizes());
  TORCH_CHECK_TYPE(predecessor_ids.scalar_type() == at::kLong, "predecessor_ids must be int64, got ",
                   predecessor_ids.scalar_type());
  TORCH_CHECK_TYPE(candidate_ids.scalar_type() == at::kLong, "candidate_ids must be int64, got ",
                   candidate_ids.scalar_type());
  TORCH_CHECK_TYPE(is_supported_float(predecessor_codebook.scalar_type()),
                   "predecessor_codebook must be float16, bfloat16, float32 or float64, got ",
                   predecessor_codebook.scalar_type());
  TORCH_CHECK_TYPE(successor_codebook.scalar_type() == predecessor_codebook.scalar_type(),
                   "successor_codebook must have predecessor_codebook's dtype ", predecessor_codebook.scalar_type(),
                   ", got ", successor_codebook.scalar_type());
  TORCH_CHECK_TYPE(projected.scalar_type() == predecessor_codebook.scalar_type() ||
                       projected.scalar_type() == at::kFloat,
                   "projected must have the codebooks' dtype (", predecessor_codebook.scalar_type(),
                   ") or float32, got ", projected.scalar_type());
  check_unit_last_stride(projected, "projected");
  check_unit_last_stride(predecessor_codebook, "predecessor_codebook");
  check_unit_last_stride(successor_codebook, "successor_codebook");
  check_same_device(projected, "projected", {{predecessor_codebook, "predecessor_codebook"},
                                             {successor_codebook, "successor_codebook"},
                                             {predecessor_ids, "predecessor_ids"},
                                             {candidate_ids, "candidate_ids"}});
  return shape;
}

inline void check_unary(const at::Tensor& unary, bool unary_gathered, const SelectorShape& shape,
                        const at::Tensor& projected) {
  TORCH_CHECK_VALUE(unary.dim() == 2 && unary.size(0) == shape.rows, "unary must be [", shape.rows,
                    ", V or k], got ", unary.sizes());
  TORCH_CHECK_VALUE(!unary_gathered || unary.size(1) == shape.top_k, "gathered unary must be [", shape.rows, ", ",
                    shape.top_k, "], got ", unary.sizes());
  TORCH_CHECK_VALUE(unary_gathered || unary.size(1) == shape.vocab, "unary logits must be [", shape.rows, ", ",
                    shape.vocab, "], got ", unary.sizes());
  check_unit_last_stride(unary, "unary");
  TORCH_CHECK_TYPE(is_supported_float(unary.scalar_type()), "unary must be float16, bfloat16, float32 or float64, got ",
                   unary.scalar_type());
  check_same_device(projected, "projected", {{unary, "unary"}});
}

inline void check_grad_scores(const at::Tensor& grad_scores, const SelectorShape& shape,
                              const at::Tensor& projected) {
  TORCH_CHECK_VALUE(grad_scores.dim() == 2 && grad_scores.size(0) == shape.rows && grad_scores.size(1) == shape.top_k,
                    "grad_scores must be [", shape.rows, ", ", shape.top_k, "], got ", grad_scores.sizes());
  TORCH_CHECK_TYPE(is_supported_float(grad_scores.scalar_type()),
                   "grad_scores must be float16, bfloat16, float32 or float64, got ", grad_scores.scalar_type());
  check_same_device(projected, "projected", {{grad_scores, "grad_scores"}});
}

// What the ops are asked to write: only float types can be stored, and dU's width must
// be what the ids index (V for full logits, k when gathered).
inline void check_scores_dtype(at::ScalarType out_dtype) {
  TORCH_CHECK_TYPE(is_supported_float(out_dtype), "out_dtype must be float16, bfloat16, float32 or float64, got ",
                   out_dtype);
}

inline void check_unary_gradient_request(bool unary_gathered, int64_t unary_width, at::ScalarType unary_dtype,
                                         const SelectorShape& shape) {
  TORCH_CHECK_TYPE(is_supported_float(unary_dtype),
                   "unary_dtype must be float16, bfloat16, float32 or float64, got ", unary_dtype);
  const int64_t width = unary_gathered ? shape.top_k : shape.vocab;
  TORCH_CHECK_VALUE(unary_width == width, "unary_width must be ", width,
                    unary_gathered ? " (k: the unary scores came gathered)" : " (V: the codebooks' rows)", ", got ",
                    unary_width);
}

// The temperature the serving kernels use is a float32: greedy versus sampled is decided
// from that value, so a positive double that rounds to 0 is greedy on every backend.
inline float kernel_temperature(double temperature) {
  const float value = static_cast<float>(temperature);
  TORCH_CHECK_VALUE(std::isfinite(value) && value >= 0.0f, "temperature must be finite and >= 0 as a float32, got ",
                    temperature);
  return value;
}

// The backward's results. dU is dS cast when the logits came gathered, else [N, V]
// written only at the gathered entries; dA and dB are [V, r] written only at rows of ids
// in use. With zero_filled (the CUDA kernels) those are zero-filled here; without it
// (the CPU kernels) the kernel writes every element itself, in the same pass.
struct SelectorGradients {
  at::Tensor unary;
  at::Tensor projected;
  at::Tensor predecessor_codebook;
  at::Tensor successor_codebook;
};

inline SelectorGradients allocate_selector_gradients(const at::Tensor& grad, const at::Tensor& projected,
                                                     const at::Tensor& predecessor_codebook,
                                                     const SelectorShape& shape, bool unary_gathered,
                                                     int64_t unary_width, at::ScalarType unary_dtype,
                                                     bool zero_filled) {
  const auto options = projected.options();
  const auto table = [&](at::IntArrayRef sizes, const at::TensorOptions& table_options) {
    return zero_filled ? at::zeros(sizes, table_options) : empty_output(sizes, table_options);
  };
  return SelectorGradients{
      // A copy even in the same dtype: an output never aliases grad_scores.
      unary_gathered ? grad.to(unary_dtype, /*non_blocking=*/false, /*copy=*/true)
                     : table({shape.rows, unary_width}, options.dtype(unary_dtype)),
      empty_output({shape.rows, shape.rank}, options),
      table(predecessor_codebook.sizes(), predecessor_codebook.options()),
      table(predecessor_codebook.sizes(), predecessor_codebook.options()),
  };
}

}  // namespace dflash2
