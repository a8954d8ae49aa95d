// Torch-free interface of the candidate selector's CUDA kernels: plain parameter
// structs filled by the bindings (selector_cuda.cpp) and the launchers that run the
// kernels on a given stream. Shapes below: N rows, V vocabulary, r rank, k candidates.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/selector_math.h"

namespace dflash2 {

// Operands shared by the forward and the backward.
struct SelectorOperands {
  const void* projected;  // P [N, r], row stride projected_row_stride, unit last stride
  DType projected_dtype;  // the codebook dtype or fp32
  int64_t projected_row_stride;
  const void* predecessor_codebook;  // A [V, r], row stride predecessor_row_stride
  const void* successor_codebook;    // B [V, r], row stride successor_row_stride
  DType codebook_dtype;
  int64_t predecessor_row_stride;
  int64_t successor_row_stride;
  const int64_t* predecessor_ids;  // [N] contiguous
  const int64_t* candidate_ids;    // [N, k] contiguous
  int64_t rows;
  int64_t vocab;
  int64_t rank;
  int64_t top_k;
  // 16-byte vector loads: every row start of P, A and B is 16-byte aligned and r is
  // a multiple of the vector width. The bindings check; otherwise scalar loads.
  bool vectorized;
};

struct SelectorForwardParams {
  SelectorOperands operands;
  const void* unary;  // U [N, V], or [N, k] when unary_gathered; unit last stride
  DType unary_dtype;
  int64_t unary_row_stride;
  bool unary_gathered;
  void* scores;  // S [N, k] contiguous
  DType scores_dtype;
};

struct SelectorBackwardParams {
  SelectorOperands operands;
  const void* grad_scores;  // dS [N, k] contiguous
  DType grad_scores_dtype;
  // dU [N, V], zero-filled by the caller: written only at the gathered entries.
  // Null when the unary logits came gathered (then dU = dS, a cast).
  void* grad_unary;
  DType grad_unary_dtype;
  int64_t grad_unary_row_stride;
  void* grad_projected;  // dP [N, r] contiguous, projected dtype
  // dA, dB [V, r] contiguous, codebook dtype, zero-filled: only used rows are written.
  void* grad_predecessor_codebook;
  void* grad_successor_codebook;
  // Scratch in the accumulator type (fp32, fp64 for fp64 codebooks):
  void* projected_times_g;  // [N, r]: P[n] * sum_j dS[n, j] B[cand[n, j]], dA's terms
  void* chunk_partials;     // [segment_chunks(N) + segment_chunks(N*k), 2, r]
  // Entries sorted by key (stable): predecessor ids [N] and flattened candidate ids
  // [N*k], with the permutation that sorted them.
  const int64_t* predecessor_sorted_ids;
  const int64_t* predecessor_order;
  const int64_t* candidate_sorted_ids;
  const int64_t* candidate_order;
};

// Entries per chunk of the sorted-key segmented sums.
constexpr int64_t kSegmentChunk = 64;
inline int64_t segment_chunks(int64_t entries) { return (entries + kSegmentChunk - 1) / kSegmentChunk; }

// Vector width (elements per 16-byte load) of a codebook dtype.
inline int vector_width(DType codebook_dtype) {
  switch (codebook_dtype) {
    case DType::kFloat64: return 2;
    case DType::kFloat32: return 4;
    default: return 8;
  }
}

cudaError_t launch_selector_forward(const SelectorForwardParams& params, cudaStream_t stream);
cudaError_t launch_selector_backward(const SelectorBackwardParams& params, cudaStream_t stream);

}  // namespace dflash2
