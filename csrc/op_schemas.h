// The schema of every C++ op: one place, read by registration.cpp (torch.ops.dflash2.*)
// and by the emulated build's registration (torch.ops.dflash2_emulated.*, the same
// CUDA kernels run on the CPU's SIMT runtime).
#pragma once

namespace dflash2 {
namespace schemas {

// The grouped dynamic conv on CPU tensors (SPEC section 1). x [N, H], delta [N, K, G],
// base [K, H]; unit last strides, any row strides.
constexpr const char* kConvForwardCpu =
    "conv_forward_cpu(Tensor x, Tensor delta, Tensor base, int block_size, ScalarType out_dtype) -> Tensor";
constexpr const char* kConvBackwardCpu =
    "conv_backward_cpu(Tensor grad_out, Tensor x, Tensor delta, Tensor base, int block_size)"
    " -> (Tensor, Tensor, Tensor)";

// The candidate selector's scores (SPEC section 2). unary [N, V] (or [N, k] when
// unary_gathered), projected [N, r], codebooks [V, r], predecessor_ids [N],
// candidate_ids [N, k] -> scores [N, k] in out_dtype.
constexpr const char* kSelectorScores =
    "selector_scores(Tensor unary, Tensor projected, Tensor predecessor_codebook, "
    "Tensor successor_codebook, Tensor predecessor_ids, Tensor candidate_ids, bool unary_gathered, "
    "ScalarType out_dtype) -> Tensor";
// -> (grad_unary [N, unary_width] unary_dtype, grad_projected, grad_predecessor_codebook,
//     grad_successor_codebook), each gradient in its input's dtype.
constexpr const char* kSelectorScoresBackward =
    "selector_scores_backward(Tensor grad_scores, Tensor projected, Tensor predecessor_codebook, "
    "Tensor successor_codebook, Tensor predecessor_ids, Tensor candidate_ids, bool unary_gathered, "
    "int unary_width, ScalarType unary_dtype) -> (Tensor, Tensor, Tensor, Tensor)";

// Serving (SPEC sections 2 and 3). logits [R, V] (float16/bfloat16/float32, unit
// last stride) -> (values [R, k] logits' dtype, ids [R, k] int64), sorted descending,
// NaN above everything; k <= 32.
constexpr const char* kCandidateTopk = "candidate_topk(Tensor logits, int top_k) -> (Tensor, Tensor)";
// One drafted block: logits [B, D, V], projected [B, D, r] (codebook dtype or fp32),
// codebooks [V, r], anchor_ids [B] int64, uniforms [B, D] float32 (read only when
// temperature > 0). -> (path [B, D] int64, candidate_ids [B, D, k] int64,
// draft_probs [B, D, k] float32 (one-hot of the choice when greedy),
// edges [B, D, k, k] score_dtype).
constexpr const char* kSelectPath =
    "select_path(Tensor logits, Tensor projected, Tensor predecessor_codebook, Tensor successor_codebook, "
    "Tensor anchor_ids, Tensor uniforms, int top_k, float temperature, ScalarType score_dtype) "
    "-> (Tensor, Tensor, Tensor, Tensor)";
// draft_tokens [B, D] int64, target_probs [B, D+1, V] float, draft_probs [B, D, k]
// float32, candidate_ids [B, D, k] int64, uniforms [B, D+1] float32
// -> (accepted [B] int64, bonus [B] int64).
constexpr const char* kRejectionSample =
    "rejection_sample(Tensor draft_tokens, Tensor target_probs, Tensor draft_probs, Tensor candidate_ids, "
    "Tensor uniforms) -> (Tensor, Tensor)";

// The draft head's row kernel (SPEC section 7) over one chunk of rows, CPU tensors
// (csrc/head_cpu.cpp says what each pass does). logits [R, V] (float32 or float64: raw
// h W^T in, the transformed logits out), target_logits [R, V] likewise, labels [R] int64
// (-100: an ignored row), loss_mask: bit l asks for loss l of (kl_div, rkl, jsd, tv, ce),
// softcap 0: none. loss_grads [L, R, V]: dL/ds per requested loss, written when given.
// -> (losses [L, R], stats [R, 3] (draft_lse, target_lse, overlap), argmax [R, 2] int64,
//     topk_ids [R, k] int64, topk_values [R, k], target_at_topk [R, k], label_values [R]).
constexpr const char* kDraftHeadRowsCpu =
    "draft_head_rows_cpu(Tensor(a!) logits, Tensor(b!)? target_logits, Tensor? labels, int loss_mask, "
    "int top_k, float logit_scale, float softcap, ScalarType logits_dtype, Tensor(c!)? loss_grads) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)";
// The backward's recompute: logits becomes sum_l grad_losses[l] dL_l/ds, grad_losses [L, R].
constexpr const char* kDraftHeadRowsBackwardCpu =
    "draft_head_rows_backward_cpu(Tensor(a!) logits, Tensor(b!)? target_logits, Tensor? labels, int loss_mask, "
    "float logit_scale, float softcap, ScalarType logits_dtype, Tensor grad_losses) -> ()";
// The row kernels on one rank's shard of the vocabulary (csrc/head_shard_cpu.cpp says what
// each computes). Stats: logits [R, V_local] raw in, transformed out -> (stats [R, 3]
// float64, topk_ids [R, k] int64 local, topk_values [R, k] float64, target_argmax [R] int64).
constexpr const char* kDraftHeadShardStatsCpu =
    "draft_head_shard_stats_cpu(Tensor(a!) logits, Tensor(b!)? target_logits, int top_k, float logit_scale, "
    "float softcap, ScalarType logits_dtype) -> (Tensor, Tensor, Tensor, Tensor)";
// Rows: the shares [R, 6] float64 (or [0, 6]) of the losses' sums against the global
// row_stats [R, 7], and dL/ds into loss_grads [L, R, V_local] or, with grad_losses [L, R],
// over logits.
constexpr const char* kDraftHeadShardRowsCpu =
    "draft_head_shard_rows_cpu(Tensor(a!) logits, Tensor(b!)? target_logits, Tensor labels, int loss_mask, "
    "float logit_scale, float softcap, Tensor row_stats, bool transform, bool shares, Tensor(c!)? loss_grads, "
    "Tensor? grad_losses) -> Tensor";

// An uninitialized contiguous CPU tensor of `size` and `dtype` from the CPU result cache
// (csrc/cpu_result_cache.h): the draft head's per-chunk [R, V] buffers, which a fresh
// allocation would page-fault in on every call.
constexpr const char* kCpuCachedEmpty = "cpu_cached_empty(int[] size, ScalarType dtype) -> Tensor";

}  // namespace schemas
}  // namespace dflash2
