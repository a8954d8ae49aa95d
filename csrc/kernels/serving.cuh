// Torch-free interface of the serving path's CUDA kernels: plain parameter structs
// filled by the bindings (serving_cuda.cpp) and the launchers that run the kernels on a
// given stream. B sequences, D drafted positions, V vocabulary, r rank, k candidates.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/serving_math.h"

namespace dflash2 {

// Split-row top-k: each warp keeps the k best of one slice of one row; a second
// stage merges a row's slices. Keys are serving_math.h's ordered keys; ties go to the
// lower index, so the selected set and its order are unique.
struct TopkPartials {
  uint32_t* keys;     // [rows, slices, k]
  uint32_t* indices;  // [rows, slices, k]
  int32_t slices;
  int64_t slice_length;  // elements per slice, a multiple of 16
};

struct TopkParams {
  const void* logits;  // [rows, V], row stride logits_row_stride, unit last stride
  DType logits_dtype;  // float16, bfloat16 or float32
  int64_t logits_row_stride;
  int64_t rows;
  int64_t vocab;
  int32_t top_k;  // 1..kMaxServingTopK
  bool vectorized;  // every row start 16-byte aligned: 16-byte loads
  TopkPartials partials;
  // Zeroed by the partial pass for select_path's per-sequence completion counters.
  int32_t* counters;
  int64_t counter_count;
};

// candidate_topk: values [rows, k] (logits dtype) and ids [rows, k] int64.
struct TopkOutputs {
  void* values;
  int64_t* ids;
};

struct SelectPathParams {
  // logits are read through TopkParams; rows are (b, t) flattened, row = b * D + t.
  const void* projected;  // P [B, D, r] contiguous, codebook dtype or fp32
  DType projected_dtype;
  const void* predecessor_codebook;  // A [V, r], row stride predecessor_row_stride
  const void* successor_codebook;    // B [V, r], row stride successor_row_stride
  DType codebook_dtype;
  int64_t predecessor_row_stride;
  int64_t successor_row_stride;
  const int64_t* anchor_ids;  // [B]
  const float* uniforms;      // [B, D]; read only when temperature > 0
  int64_t batch;
  int64_t draft;
  int64_t rank;
  float temperature;
  int64_t* path;           // [B, D]
  int64_t* candidate_ids;  // [B, D, k]
  float* draft_probs;      // [B, D, k]
  void* edges;             // [B, D, k, k]
  DType score_dtype;
  int32_t* counters;  // [B], zeroed by the top-k partial pass
};

// rejection_sample.
struct RejectionParams {
  const int64_t* draft_tokens;  // [B, D] contiguous
  const void* target_probs;     // [B, D+1, V], strides below, unit last stride
  DType target_dtype;
  int64_t target_batch_stride;
  int64_t target_position_stride;
  const float* draft_probs;       // [B, D, k] contiguous
  const int64_t* candidate_ids;   // [B, D, k] contiguous
  const float* uniforms;          // [B, D+1]
  int64_t batch;
  int64_t draft;
  int64_t vocab;
  int64_t top_k;
  int32_t slices;        // vocabulary slices of the mass pass
  int64_t slice_length;  // elements per slice
  float* slice_mass;     // [B, slices, 2]: (residual mass, target mass) per slice, scratch
  int64_t* accepted;     // [B]
  int64_t* bonus;        // [B]
};

// Elements per slice of the rejection sampler's vocabulary split; the bonus draw scans
// one slice in shared memory.
constexpr int64_t kVerifySliceLength = 4096;
constexpr int64_t kMaxVerifySlices = kMaxVerifyVocab / kVerifySliceLength;

// How the launcher splits rows for the top-k; the bindings size the partial buffers.
struct TopkSplit {
  int32_t slices;
  int64_t slice_length;
};
TopkSplit plan_topk_split(int64_t rows, int64_t vocab, int device);

cudaError_t launch_candidate_topk(const TopkParams& params, const TopkOutputs& outputs, cudaStream_t stream);
cudaError_t launch_select_path(const TopkParams& topk, const SelectPathParams& params, cudaStream_t stream);
cudaError_t launch_rejection_sample(const RejectionParams& params, cudaStream_t stream);

}  // namespace dflash2
