// CUDA bindings of the selector ops: checks, allocations, the sorts that make dA and
// dB deterministic, and the launch on the current stream. Kernels: kernels/selector_kernels.cu.
// Also compiled for CPU tensors and the SIMT emulator (device_binding.h).
#include <torch/all.h>

#include "device_binding.h"
#include "kernels/selector.cuh"
#include "output_alloc.h"
#include "selector_checks.h"
#include "tensor_checks.h"

namespace dflash2 {
namespace {

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * t.element_size()) % 16 == 0;
}

SelectorOperands make_operands(const at::Tensor& projected, const at::Tensor& predecessor_codebook,
                               const at::Tensor& successor_codebook, const at::Tensor& predecessor_ids,
                               const at::Tensor& candidate_ids, const SelectorShape& shape) {
  const DType codebook_dtype = to_dtype(predecessor_codebook.scalar_type());
  const bool vectorized = shape.rank % vector_width(codebook_dtype) == 0 && aligned16(projected) &&
                          aligned16(predecessor_codebook) && aligned16(successor_codebook);
  return SelectorOperands{projected.data_ptr(),
                          to_dtype(projected.scalar_type()),
                          projected.stride(0),
                          predecessor_codebook.data_ptr(),
                          successor_codebook.data_ptr(),
                          codebook_dtype,
                          predecessor_codebook.stride(0),
                          successor_codebook.stride(0),
                          predecessor_ids.data_ptr<int64_t>(),
                          candidate_ids.data_ptr<int64_t>(),
                          shape.rows,
                          shape.vocab,
                          shape.rank,
                          shape.top_k,
                          vectorized};
}

at::Tensor selector_scores_cuda(const at::Tensor& unary, const at::Tensor& projected,
                                const at::Tensor& predecessor_codebook, const at::Tensor& successor_codebook,
                                const at::Tensor& predecessor_ids, const at::Tensor& candidate_ids,
                                bool unary_gathered, at::ScalarType out_dtype) {
  check_defined({{unary, "unary"}, {projected, "projected"}, {predecessor_codebook, "predecessor_codebook"},
                 {successor_codebook, "successor_codebook"}, {predecessor_ids, "predecessor_ids"},
                 {candidate_ids, "candidate_ids"}});
  const SelectorShape shape =
      check_selector_operands(projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids);
  check_unary(unary, unary_gathered, shape, projected);
  check_scores_dtype(out_dtype);
  const KernelDeviceGuard device_guard(projected.device());
  const at::Tensor predecessors = predecessor_ids.contiguous();
  const at::Tensor candidates = candidate_ids.contiguous();
  at::Tensor scores = empty_output({shape.rows, shape.top_k}, projected.options().dtype(out_dtype));

  const SelectorForwardParams params{
      make_operands(projected, predecessor_codebook, successor_codebook, predecessors, candidates, shape),
      unary.data_ptr(),
      to_dtype(unary.scalar_type()),
      unary.stride(0),
      unary_gathered,
      scores.data_ptr(),
      to_dtype(out_dtype)};
  check_launch(launch_selector_forward(params, kernel_stream()));
  return scores;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> selector_scores_backward_cuda(
    const at::Tensor& grad_scores, const at::Tensor& projected, const at::Tensor& predecessor_codebook,
    const at::Tensor& successor_codebook, const at::Tensor& predecessor_ids, const at::Tensor& candidate_ids,
    bool unary_gathered, int64_t unary_width, at::ScalarType unary_dtype) {
  check_defined({{grad_scores, "grad_scores"}, {projected, "projected"},
                 {predecessor_codebook, "predecessor_codebook"}, {successor_codebook, "successor_codebook"},
                 {predecessor_ids, "predecessor_ids"}, {candidate_ids, "candidate_ids"}});
  const SelectorShape shape =
      check_selector_operands(projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids);
  check_grad_scores(grad_scores, shape, projected);
  check_unary_gradient_request(unary_gathered, unary_width, unary_dtype, shape);
  const KernelDeviceGuard device_guard(projected.device());
  const at::Tensor grad = grad_scores.contiguous();
  const at::Tensor predecessors = predecessor_ids.contiguous();
  const at::Tensor candidates = candidate_ids.contiguous();
  const auto options = projected.options();
  const auto accumulator = predecessor_codebook.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;

  SelectorGradients grads = allocate_selector_gradients(grad, projected, predecessor_codebook, shape, unary_gathered,
                                                        unary_width, unary_dtype, /*zero_filled=*/true);
  at::Tensor projected_times_g = empty_output({shape.rows, shape.rank}, options.dtype(accumulator));
  at::Tensor partials = empty_output(
      {segment_chunks(shape.rows) + segment_chunks(shape.rows * shape.top_k), 2, shape.rank}, options.dtype(accumulator));
  // Stable sorts group equal ids in row order: the segmented sums then add each id's
  // terms in one fixed order, so dA and dB are bitwise reproducible without atomics.
  const auto [predecessor_sorted, predecessor_order] = at::sort(predecessors, /*stable=*/true, 0, false);
  const auto [candidate_sorted, candidate_order] = at::sort(candidates.view(-1), /*stable=*/true, 0, false);

  const SelectorBackwardParams params{
      make_operands(projected, predecessor_codebook, successor_codebook, predecessors, candidates, shape),
      grad.data_ptr(),
      to_dtype(grad.scalar_type()),
      unary_gathered ? nullptr : grads.unary.data_ptr(),
      to_dtype(unary_dtype),
      unary_width,
      grads.projected.data_ptr(),
      grads.predecessor_codebook.data_ptr(),
      grads.successor_codebook.data_ptr(),
      projected_times_g.data_ptr(),
      partials.data_ptr(),
      predecessor_sorted.data_ptr<int64_t>(),
      predecessor_order.data_ptr<int64_t>(),
      candidate_sorted.data_ptr<int64_t>(),
      candidate_order.data_ptr<int64_t>()};
  check_launch(launch_selector_backward(params, kernel_stream()));
  return {grads.unary, grads.projected, grads.predecessor_codebook, grads.successor_codebook};
}

}  // namespace

DFLASH2_KERNEL_LIBRARY_IMPL(m) {
  m.impl("selector_scores", &selector_scores_cuda);
  m.impl("selector_scores_backward", &selector_scores_backward_cuda);
}

}  // namespace dflash2
