// C++ CPU kernels of the serving path (SPEC sections 2 and 3): the candidate top-k,
// one drafted block's edge scores and walk (select_path), and batched lossless
// verification (rejection_sample). Ordering, tie and draw rules come from
// kernels/serving_math.h, so this twin and the CUDA kernels pick the same candidates
// and draw the same tokens from the same uniforms.
#include <ATen/Parallel.h>
#include <torch/all.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_row_kernel.h"
#include "kernels/serving_math.h"
#include "output_alloc.h"
#include "selector_checks.h"
#include "tensor_checks.h"

namespace dflash2 {
namespace {

// Elements of work per parallel task: below this, waking threads costs more than the
// work (a walk step or a small top-k row is a few dozen operations).
constexpr int64_t kTaskElements = 1 << 15;

int64_t grain_for(int64_t elements_per_item) {
  return std::max<int64_t>(1, kTaskElements / std::max<int64_t>(elements_per_item, 1));
}

// Calls f(T{}) for the element type T of a serving float dtype.
template <typename F>
void dispatch_serving_float(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: TORCH_CHECK_TYPE(false, "unsupported dtype ", type, "; expected float16, bfloat16 or float32");
  }
}

// The score as NeMo holds it: rounded once (to nearest even) to the score dtype.
float round_to(float value, at::ScalarType type) {
  switch (type) {
    case at::kHalf: return static_cast<float>(static_cast<at::Half>(value));
    case at::kBFloat16: return static_cast<float>(static_cast<at::BFloat16>(value));
    default: return value;
  }
}

// ---- Checks ----------------------------------------------------------------------

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
}

void check_serving_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(is_serving_float(t.scalar_type()), name, " must be float16, bfloat16 or float32, got ",
                   t.scalar_type());
}

// The dtypes check_dtype asks for, as torch spells them (and the CUDA bindings' messages).
const char* dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kLong: return "int64";
    case at::kFloat: return "float32";
    default: return c10::toString(type);
  }
}

void check_dtype(const at::Tensor& t, at::ScalarType type, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == type, name, " must be ", dtype_name(type), ", got ", t.scalar_type());
}

void check_shape(const at::Tensor& t, at::IntArrayRef expected, const char* name, const char* symbolic) {
  TORCH_CHECK_VALUE(t.sizes() == expected, name, " must be ", symbolic, " = ", expected, ", got ", t.sizes());
}

void check_top_k(int64_t top_k, int64_t vocab) {
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= std::min<int64_t>(vocab, kMaxServingTopK), "top_k must be in [1, min(V, ",
                    kMaxServingTopK, ")] for a vocabulary of ", vocab, ", got ", top_k);
}

// The kernels index rows by their strides but read each row contiguously.
at::Tensor with_unit_last_stride(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// ---- Top-k -----------------------------------------------------------------------

// Elements screened at once before any is offered to the top-k one by one: once the
// k-th value is high, almost every chunk is skipped by a vectorised compare.
constexpr int64_t kTopkChunk = 64;

// An fp16's bits as a signed integer whose order is the values' order (-0 below +0)
// for everything but NaN: negative values have their magnitude bits flipped.
inline int16_t ordered_half_bits(uint16_t bits) {
  const int16_t value = static_cast<int16_t>(bits);
  return static_cast<int16_t>(value ^ ((value >> 15) & 0x7FFF));
}

constexpr int16_t kHalfInfinityBits = 0x7C00;

// Whether any value might enter the top-k: is not below `bound`, or is NaN.
template <typename T>
inline bool chunk_not_below(const T* values, int64_t count, float bound) {
  int found = 0;
  if constexpr (std::is_same_v<T, at::Half>) {
    // fp16 -> float does not vectorise; the bound (an element, so exact in fp16) and
    // the values compare as ordered bits instead.
    if (bound != bound) return count > 0;
    const int16_t floor = ordered_half_bits(static_cast<at::Half>(bound).x);
    for (int64_t i = 0; i < count; ++i) {
      const uint16_t bits = values[i].x;
      found |= (ordered_half_bits(bits) >= floor) | (static_cast<int16_t>(bits & 0x7FFF) > kHalfInfinityBits);
    }
  } else {
    for (int64_t i = 0; i < count; ++i) found |= !(static_cast<float>(values[i]) < bound);
  }
  return found != 0;
}

// The start of the first chunk from `start` on that might hold an entering element, or
// `vocab`. One call skips many chunks, so the dispatch of the vector clone is paid per
// hit rather than per chunk.
template <typename T>
DFLASH2_ROW_KERNEL int64_t next_candidate_chunk(const T* row, int64_t start, int64_t vocab, float bound) {
  for (; start < vocab; start += kTopkChunk) {
    if (chunk_not_below(row + start, std::min(kTopkChunk, vocab - start), bound)) return start;
  }
  return vocab;
}

// Inserts (key, id) into the descending top-k if it beats the k-th key. Ids arrive in
// ascending order, so an equal key already held stays ahead: ties go to the lower index.
inline void offer(uint32_t key, int64_t id, int top_k, uint32_t* keys, int64_t* ids) {
  if (key <= keys[top_k - 1]) return;
  int slot = top_k - 1;
  for (; slot > 0 && keys[slot - 1] < key; --slot) {
    keys[slot] = keys[slot - 1];
    ids[slot] = ids[slot - 1];
  }
  keys[slot] = key;
  ids[slot] = id;
}

// The k-th value held, as a bound every entering element is not below. A real value
// strictly below it has a smaller key. With a slot still empty, or NaN as the k-th
// value, the bound is NaN, which nothing compares below.
inline float kth_bound(const uint32_t* keys, int top_k) {
  const uint32_t kth = keys[top_k - 1];
  return kth == kEmptyKey ? NAN : key_value(kth);
}

// The top_k largest of a row in torch.topk's order (ordered_key), ties to the lower
// index, as descending keys and their ids. The slots start at kEmptyKey, below every
// element's key, so the first top_k elements always enter.
template <typename T>
void topk_row(const T* row, int64_t vocab, int top_k, uint32_t* keys, int64_t* ids) {
  std::fill(keys, keys + top_k, kEmptyKey);
  float bound = NAN;
  for (int64_t start = next_candidate_chunk(row, 0, vocab, bound); start < vocab;
       start = next_candidate_chunk(row, start + kTopkChunk, vocab, bound)) {
    const int64_t stop = std::min(start + kTopkChunk, vocab);
    for (int64_t v = start; v < stop; ++v) {
      const float value = static_cast<float>(row[v]);
      if (value < bound) continue;
      offer(ordered_key(value), v, top_k, keys, ids);
      bound = kth_bound(keys, top_k);
    }
  }
}

template <typename T>
void topk_rows(const at::Tensor& logits, int top_k, at::Tensor& values, at::Tensor& ids) {
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  const T* base = logits.data_ptr<T>();
  const int64_t stride = logits.stride(0);
  T* out_values = values.data_ptr<T>();
  int64_t* out_ids = ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_for(vocab), [&](int64_t begin, int64_t end) {
    uint32_t keys[kMaxServingTopK];
    for (int64_t r = begin; r < end; ++r) {
      const T* row = base + r * stride;
      int64_t* row_ids = out_ids + r * top_k;
      topk_row(row, vocab, top_k, keys, row_ids);
      // The element itself, not key_value(key): a NaN keeps its payload, as in torch.topk.
      for (int j = 0; j < top_k; ++j) out_values[r * top_k + j] = row[row_ids[j]];
    }
  });
}

std::tuple<at::Tensor, at::Tensor> candidate_topk_cpu(const at::Tensor& logits, int64_t top_k) {
  check_defined({{logits, "logits"}});
  check_cpu(logits, "logits");
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be [R, V], got ", logits.sizes());
  check_serving_float(logits, "logits");
  check_top_k(top_k, logits.size(1));
  const at::Tensor rows = with_unit_last_stride(logits);
  at::Tensor values = empty_output({rows.size(0), top_k}, rows.options());
  at::Tensor ids = empty_output({rows.size(0), top_k}, rows.options().dtype(at::kLong));
  dispatch_serving_float(rows.scalar_type(), [&](auto tag) {
    topk_rows<decltype(tag)>(rows, static_cast<int>(top_k), values, ids);
  });
  return {values, ids};
}

// ---- select_path -------------------------------------------------------------------

struct BlockShape {
  int64_t batch;  // B
  int64_t draft;  // D
  int64_t vocab;  // V
  int64_t rank;   // r
  int top_k;      // k

  int64_t positions() const { return batch * draft; }
};

BlockShape check_select_path(const at::Tensor& logits, const at::Tensor& projected,
                             const at::Tensor& predecessor_codebook, const at::Tensor& successor_codebook,
                             const at::Tensor& anchor_ids, const at::Tensor& uniforms, int64_t top_k,
                             double temperature, at::ScalarType score_dtype) {
  // uniforms too: the schema takes a tensor (read only when temperature > 0; the
  // Python wrapper passes an empty one when greedy).
  check_defined({{logits, "logits"}, {projected, "projected"}, {predecessor_codebook, "predecessor_codebook"},
                 {successor_codebook, "successor_codebook"}, {anchor_ids, "anchor_ids"}, {uniforms, "uniforms"}});
  for (const auto& [t, name] : {std::pair{&logits, "logits"}, {&projected, "projected"},
                                {&predecessor_codebook, "predecessor_codebook"},
                                {&successor_codebook, "successor_codebook"}, {&anchor_ids, "anchor_ids"}}) {
    check_cpu(*t, name);
  }
  TORCH_CHECK_VALUE(logits.dim() == 3, "logits must be [B, D, V], got ", logits.sizes());
  TORCH_CHECK_VALUE(predecessor_codebook.dim() == 2, "predecessor_codebook must be [V, r], got ",
                    predecessor_codebook.sizes());
  const BlockShape shape{logits.size(0), logits.size(1), logits.size(2), predecessor_codebook.size(1),
                         static_cast<int>(top_k)};
  check_shape(predecessor_codebook, {shape.vocab, shape.rank}, "predecessor_codebook", "[V, r]");
  check_shape(successor_codebook, {shape.vocab, shape.rank}, "successor_codebook", "[V, r]");
  check_shape(projected, {shape.batch, shape.draft, shape.rank}, "projected", "[B, D, r]");
  check_shape(anchor_ids, {shape.batch}, "anchor_ids", "[B]");
  check_serving_float(logits, "logits");
  check_serving_float(predecessor_codebook, "predecessor_codebook");
  TORCH_CHECK_TYPE(successor_codebook.scalar_type() == predecessor_codebook.scalar_type(),
                   "successor_codebook must have predecessor_codebook's dtype ", predecessor_codebook.scalar_type(),
                   ", got ", successor_codebook.scalar_type());
  TORCH_CHECK_TYPE(projected.scalar_type() == predecessor_codebook.scalar_type() ||
                       projected.scalar_type() == at::kFloat,
                   "projected must have the codebooks' dtype (", predecessor_codebook.scalar_type(),
                   ") or float32, got ", projected.scalar_type());
  check_dtype(anchor_ids, at::kLong, "anchor_ids");
  TORCH_CHECK_TYPE(is_serving_float(score_dtype), "score_dtype must be float16, bfloat16 or float32, got ",
                   score_dtype);
  check_top_k(top_k, shape.vocab);
  // Also rejects NaN, which would silently select greedy decoding.
  if (kernel_temperature(temperature) > 0.0f) {
    check_cpu(uniforms, "uniforms");
    check_shape(uniforms, {shape.batch, shape.draft}, "uniforms", "[B, D]");
    check_dtype(uniforms, at::kFloat, "uniforms");
  }
  return shape;
}

// Position n = b * D + t of the block, flattened; every buffer below is indexed by it.
struct BlockBuffers {
  int64_t* candidates;    // [B*D, k]
  float* unary;           // [B*D, k]: the candidates' logits as floats
  float* scores;          // [B*D, k, k]: edges, already rounded to the score dtype
  const int64_t* anchors; // [B]
  const float* projected; // [B*D, r]
};

template <typename T>
void block_topk(const at::Tensor& logits, const BlockShape& shape, const BlockBuffers& buffers) {
  const T* base = logits.data_ptr<T>();
  const int64_t batch_stride = logits.stride(0);
  const int64_t draft_stride = logits.stride(1);
  at::parallel_for(0, shape.positions(), grain_for(shape.vocab), [&](int64_t begin, int64_t end) {
    uint32_t keys[kMaxServingTopK];
    for (int64_t n = begin; n < end; ++n) {
      const T* row = base + (n / shape.draft) * batch_stride + (n % shape.draft) * draft_stride;
      int64_t* ids = buffers.candidates + n * shape.top_k;
      topk_row(row, shape.vocab, shape.top_k, keys, ids);
      for (int j = 0; j < shape.top_k; ++j) buffers.unary[n * shape.top_k + j] = static_cast<float>(row[ids[j]]);
    }
  });
}


// E[n, i, j] = U[n, j] + sum_rho A[prev_i, rho] * P[n, rho] * B[cand[n, j], rho], in
// fp32, rounded once to the score dtype. Position t = 0 has the anchor as every row's
// predecessor, so its first row is computed once and copied.
template <typename W>
void edge_scores_position(int64_t n, const BlockShape& shape, const BlockBuffers& buffers, const W* a_table,
                          int64_t a_stride, const W* b_table, int64_t b_stride, at::ScalarType score_dtype,
                          float* context) {
  const int k = shape.top_k;
  const int64_t t = n % shape.draft;
  const int64_t* candidates = buffers.candidates + n * k;
  const float* unary = buffers.unary + n * k;
  const float* projected = buffers.projected + n * shape.rank;
  float* scores = buffers.scores + n * k * k;
  const int distinct_rows = t == 0 ? 1 : k;
  for (int i = 0; i < distinct_rows; ++i) {
    const int64_t predecessor = t == 0 ? buffers.anchors[n / shape.draft] : buffers.candidates[(n - 1) * k + i];
    const W* a = a_table + predecessor * a_stride;
    for (int64_t rho = 0; rho < shape.rank; ++rho) {
      context[rho] = context_term(static_cast<float>(a[rho]), projected[rho]);
    }
    float dots[kMaxServingTopK];
    candidate_dots(context, b_table, b_stride, candidates, k, shape.rank, dots);
    for (int j = 0; j < k; ++j) scores[i * k + j] = round_to(unary[j] + dots[j], score_dtype);
  }
  for (int i = distinct_rows; i < k; ++i) std::copy(scores, scores + k, scores + i * k);
}

template <typename W>
void block_edge_scores(const at::Tensor& predecessor_codebook, const at::Tensor& successor_codebook,
                       const BlockShape& shape, const BlockBuffers& buffers, at::ScalarType score_dtype) {
  const W* a_table = predecessor_codebook.data_ptr<W>();
  const W* b_table = successor_codebook.data_ptr<W>();
  const int64_t a_stride = predecessor_codebook.stride(0);
  const int64_t b_stride = successor_codebook.stride(0);
  const int64_t work = static_cast<int64_t>(shape.top_k) * shape.top_k * std::max<int64_t>(shape.rank, 1);
  at::parallel_for(0, shape.positions(), grain_for(work), [&](int64_t begin, int64_t end) {
    std::vector<float> context(shape.rank);
    for (int64_t n = begin; n < end; ++n) {
      edge_scores_position(n, shape, buffers, a_table, a_stride, b_table, b_stride, score_dtype, context.data());
    }
  });
}

// torch.argmax's choice: the first maximum, NaN counting as the maximum.
int greedy_index(const float* scores, int count) {
  int best = 0;
  for (int j = 1; j < count; ++j) {
    if (argmax_prefers(scores[j], j, scores[best], best)) best = j;
  }
  return best;
}

// Inverse-CDF draw over weights >= 0: the first index whose running sum exceeds
// u * total (both sums formed in Acc, in index order, as the reference's cumsum), or,
// when rounding leaves none, the last index with positive weight; -1 when no weight
// is positive.
template <typename Acc>
int64_t draw_index(const Acc* weights, int64_t count, Acc u) {
  Acc total = 0;
  for (int64_t v = 0; v < count; ++v) total += weights[v];
  const Acc target = u * total;
  Acc running = 0;
  for (int64_t v = 0; v < count; ++v) {
    running += weights[v];
    if (running > target) return v;
  }
  for (int64_t v = count - 1; v >= 0; --v) {
    if (weights[v] > 0) return v;
  }
  return -1;
}

// q = softmax(scores / temperature) in fp32 into probs, and the index drawn from q.
// Scores without a finite softmax (NaN, +inf, all -inf) leave no positive weight; the
// step then falls back to the greedy choice.
int sampled_index(const float* scores, int count, float temperature, float u, float* probs) {
  float peak = -INFINITY;
  for (int j = 0; j < count; ++j) peak = std::max(peak, scores[j] / temperature);
  float total = 0.0f;
  for (int j = 0; j < count; ++j) {
    probs[j] = std::exp(scores[j] / temperature - peak);
    total += probs[j];
  }
  for (int j = 0; j < count; ++j) probs[j] /= total;
  const int64_t drawn = draw_index(probs, count, u);
  return drawn >= 0 ? static_cast<int>(drawn) : greedy_index(scores, count);
}

struct WalkOutputs {
  int64_t* path;      // [B, D]
  float* draft_probs; // [B*D, k]
};

// NeMo's walk for sequence b: each step scores the chosen predecessor's row (row 0 at
// t = 0, where every row is the anchor's) and picks the next candidate.
void walk_sequence(int64_t b, const BlockShape& shape, const BlockBuffers& buffers, float temperature,
                   const float* uniforms, const WalkOutputs& out) {
  const int k = shape.top_k;
  int row = 0;
  for (int64_t t = 0; t < shape.draft; ++t) {
    const int64_t n = b * shape.draft + t;
    const float* scores = buffers.scores + (n * k + row) * k;
    float* probs = out.draft_probs + n * k;
    int choice;
    if (temperature > 0) {
      choice = sampled_index(scores, k, temperature, uniforms[n], probs);
    } else {
      choice = greedy_index(scores, k);
      std::fill(probs, probs + k, 0.0f);
      probs[choice] = 1.0f;
    }
    out.path[n] = buffers.candidates[n * k + choice];
    row = choice;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> select_path_cpu(
    const at::Tensor& logits, const at::Tensor& projected, const at::Tensor& predecessor_codebook,
    const at::Tensor& successor_codebook, const at::Tensor& anchor_ids, const at::Tensor& uniforms, int64_t top_k,
    double temperature, at::ScalarType score_dtype) {
  const BlockShape shape = check_select_path(logits, projected, predecessor_codebook, successor_codebook, anchor_ids,
                                             uniforms, top_k, temperature, score_dtype);
  const at::Tensor anchors = anchor_ids.contiguous();
  check_ids_in_range(anchors, shape.vocab, "anchor_ids");
  const at::Tensor logit_rows = with_unit_last_stride(logits);
  const at::Tensor a_rows = with_unit_last_stride(predecessor_codebook);
  const at::Tensor b_rows = with_unit_last_stride(successor_codebook);
  // P is B*D*r values: converting it to fp32 (exact) costs nothing and leaves the
  // codebook dtype as the only type parameter of the edge math.
  const at::Tensor projected_f32 = projected.to(at::kFloat).contiguous();
  const float kernel_temp = kernel_temperature(temperature);
  const at::Tensor draws = kernel_temp > 0.0f ? uniforms.contiguous() : at::Tensor();

  const auto options = logits.options();
  at::Tensor path = empty_output({shape.batch, shape.draft}, options.dtype(at::kLong));
  at::Tensor candidate_ids = empty_output({shape.batch, shape.draft, top_k}, options.dtype(at::kLong));
  at::Tensor draft_probs = empty_output({shape.batch, shape.draft, top_k}, options.dtype(at::kFloat));
  at::Tensor unary = empty_output({shape.batch, shape.draft, top_k}, options.dtype(at::kFloat));
  at::Tensor scores = empty_output({shape.batch, shape.draft, top_k, top_k}, options.dtype(at::kFloat));
  const BlockBuffers buffers{candidate_ids.data_ptr<int64_t>(), unary.data_ptr<float>(), scores.data_ptr<float>(),
                             anchors.data_ptr<int64_t>(), projected_f32.data_ptr<float>()};

  dispatch_serving_float(logit_rows.scalar_type(),
                         [&](auto tag) { block_topk<decltype(tag)>(logit_rows, shape, buffers); });
  dispatch_serving_float(a_rows.scalar_type(), [&](auto tag) {
    block_edge_scores<decltype(tag)>(a_rows, b_rows, shape, buffers, score_dtype);
  });
  const WalkOutputs out{path.data_ptr<int64_t>(), draft_probs.data_ptr<float>()};
  const float* uniform_data = kernel_temp > 0.0f ? draws.data_ptr<float>() : nullptr;
  at::parallel_for(0, shape.batch, grain_for(shape.draft * top_k), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      walk_sequence(b, shape, buffers, kernel_temp, uniform_data, out);
    }
  });
  // The scores already hold score-dtype values, so this cast is exact.
  return {path, candidate_ids, draft_probs, scores.to(score_dtype)};
}

// ---- rejection_sample ---------------------------------------------------------------

struct VerifyInputs {
  const int64_t* tokens;      // [B, D]
  const float* draft_probs;   // [B*D, k]
  const int64_t* candidates;  // [B*D, k]
  const float* uniforms;      // [B, D+1]
  int64_t draft;              // D
  int64_t top_k;              // k
  int64_t vocab;              // V
};

// q_t(token): the draft probability of token, summed over every candidate slot holding it.
double draft_mass(const float* probs, const int64_t* candidates, int64_t count, int64_t token) {
  double mass = 0.0;
  for (int64_t j = 0; j < count; ++j) {
    if (candidates[j] == token) mass += probs[j];
  }
  return mass;
}

template <typename T>
double target_probability(const T* row, int64_t token) {
  return std::max(static_cast<double>(static_cast<float>(row[token])), 0.0);
}

// max(p - q, 0) differs from p only at the k candidates: weights holds p, and the
// draft mass comes off those positions (a repeated candidate loses each of its slots'
// mass in slot order, as the reference's scatter_add). Without any mass left, the
// draw falls back to p itself.
template <typename T>
void residual_from_target(const T* target, const float* probs, const int64_t* candidates, int64_t count,
                          double* weights, int64_t vocab) {
  for (int64_t j = 0; j < count; ++j) weights[candidates[j]] -= probs[j];
  for (int64_t j = 0; j < count; ++j) weights[candidates[j]] = std::max(weights[candidates[j]], 0.0);
  double total = 0.0;
  for (int64_t v = 0; v < vocab; ++v) total += weights[v];
  if (total > 0) return;
  for (int64_t j = 0; j < count; ++j) weights[candidates[j]] = target_probability(target, candidates[j]);
}

// NeMo's rule for sequence b: accept d_t while u_t * q_t(d_t) < p_t(d_t); the bonus is
// drawn with u_D from the residual at the first rejection (from p there when the
// residual has no mass), or from p_D when every draft token is accepted.
template <typename T>
void verify_sequence(int64_t b, const VerifyInputs& in, const T* target, int64_t batch_stride, int64_t draft_stride,
                     double* weights, int64_t* accepted, int64_t* bonus) {
  const T* target_rows = target + b * batch_stride;
  const float* uniforms = in.uniforms + b * (in.draft + 1);
  int64_t a = 0;
  for (; a < in.draft; ++a) {
    const int64_t n = b * in.draft + a;
    const int64_t token = in.tokens[n];
    const double p = target_probability(target_rows + a * draft_stride, token);
    const double q = draft_mass(in.draft_probs + n * in.top_k, in.candidates + n * in.top_k, in.top_k, token);
    if (!(static_cast<double>(uniforms[a]) * q < p)) break;
  }
  const T* row = target_rows + a * draft_stride;
  for (int64_t v = 0; v < in.vocab; ++v) weights[v] = target_probability(row, v);
  if (a < in.draft) {
    const int64_t n = b * in.draft + a;
    residual_from_target(row, in.draft_probs + n * in.top_k, in.candidates + n * in.top_k, in.top_k, weights,
                         in.vocab);
  }
  accepted[b] = a;
  bonus[b] = draw_index(weights, in.vocab, static_cast<double>(uniforms[in.draft]));
}

std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(const at::Tensor& draft_tokens, const at::Tensor& target_probs,
                                                        const at::Tensor& draft_probs,
                                                        const at::Tensor& candidate_ids, const at::Tensor& uniforms) {
  check_defined({{draft_tokens, "draft_tokens"}, {target_probs, "target_probs"}, {draft_probs, "draft_probs"},
                 {candidate_ids, "candidate_ids"}, {uniforms, "uniforms"}});
  for (const auto& [t, name] : {std::pair{&draft_tokens, "draft_tokens"}, {&target_probs, "target_probs"},
                                {&draft_probs, "draft_probs"}, {&candidate_ids, "candidate_ids"},
                                {&uniforms, "uniforms"}}) {
    check_cpu(*t, name);
  }
  TORCH_CHECK_VALUE(draft_tokens.dim() == 2 && draft_tokens.size(1) >= 1, "draft_tokens must be [B, D] with D >= 1, got ",
                    draft_tokens.sizes());
  TORCH_CHECK_VALUE(draft_probs.dim() == 3 && draft_probs.size(2) >= 1, "draft_probs must be [B, D, k] with k >= 1, got ",
                    draft_probs.sizes());
  TORCH_CHECK_VALUE(target_probs.dim() == 3, "target_probs must be [B, D+1, V], got ", target_probs.sizes());
  const int64_t batch = draft_tokens.size(0);
  const int64_t draft = draft_tokens.size(1);
  const int64_t top_k = draft_probs.size(2);
  const int64_t vocab = target_probs.size(2);
  TORCH_CHECK_VALUE(vocab >= 1 && vocab <= kMaxVerifyVocab, "target_probs must have a vocabulary of 1 to ",
                    kMaxVerifyVocab, " tokens, got ", vocab);
  check_shape(target_probs, {batch, draft + 1, vocab}, "target_probs", "[B, D+1, V]");
  check_shape(draft_probs, {batch, draft, top_k}, "draft_probs", "[B, D, k]");
  check_shape(candidate_ids, {batch, draft, top_k}, "candidate_ids", "[B, D, k]");
  check_shape(uniforms, {batch, draft + 1}, "uniforms", "[B, D+1]");
  check_dtype(draft_tokens, at::kLong, "draft_tokens");
  check_serving_float(target_probs, "target_probs");
  check_dtype(draft_probs, at::kFloat, "draft_probs");
  check_dtype(candidate_ids, at::kLong, "candidate_ids");
  check_dtype(uniforms, at::kFloat, "uniforms");

  const at::Tensor tokens = draft_tokens.contiguous();
  const at::Tensor candidates = candidate_ids.contiguous();
  check_ids_in_range(tokens, vocab, "draft_tokens");
  check_ids_in_range(candidates, vocab, "candidate_ids");
  const at::Tensor probs = draft_probs.contiguous();
  const at::Tensor draws = uniforms.contiguous();
  const at::Tensor target = with_unit_last_stride(target_probs);
  at::Tensor accepted = empty_output({batch}, draft_tokens.options());
  at::Tensor bonus = empty_output({batch}, draft_tokens.options());

  const VerifyInputs in{tokens.data_ptr<int64_t>(), probs.data_ptr<float>(), candidates.data_ptr<int64_t>(),
                        draws.data_ptr<float>(), draft, top_k, vocab};
  dispatch_serving_float(target.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, batch, grain_for(vocab), [&](int64_t begin, int64_t end) {
      std::vector<double> weights(vocab);
      for (int64_t b = begin; b < end; ++b) {
        verify_sequence(b, in, target.data_ptr<T>(), target.stride(0), target.stride(1), weights.data(),
                        accepted.data_ptr<int64_t>(), bonus.data_ptr<int64_t>());
      }
    });
  });
  return {accepted, bonus};
}

}  // namespace

TORCH_LIBRARY_IMPL(dflash2, CPU, m) {
  m.impl("candidate_topk", &candidate_topk_cpu);
  m.impl("select_path", &select_path_cpu);
  m.impl("rejection_sample", &rejection_sample_cpu);
}

}  // namespace dflash2
