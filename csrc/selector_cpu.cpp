// C++ CPU kernels of the selector ops: the same per-row math as the CUDA kernels
// (kernels/selector_math.h), parallel over rows with at::parallel_for. dA and dB are
// sums over rows grouped by id; as on CUDA they run over stably sorted ids, one
// segment per task, so each id's terms are added in one fixed order whatever the
// number of threads.
#include <ATen/Parallel.h>
#include <torch/all.h>

#include <vector>

#include "cpu_row_kernel.h"
#include "kernels/selector_math.h"
#include "output_alloc.h"
#include "selector_checks.h"
#include "tensor_checks.h"

namespace dflash2 {
namespace {

// U, S, dS and dU have run-time dtypes; they are touched k times a row.
double load_dynamic(const void* base, int64_t index, at::ScalarType type) {
  switch (type) {
    case at::kFloat: return static_cast<const float*>(base)[index];
    case at::kHalf: return static_cast<float>(static_cast<const at::Half*>(base)[index]);
    case at::kBFloat16: return static_cast<float>(static_cast<const at::BFloat16*>(base)[index]);
    default: return static_cast<const double*>(base)[index];
  }
}

void store_dynamic(void* base, int64_t index, at::ScalarType type, double value) {
  switch (type) {
    case at::kFloat: static_cast<float*>(base)[index] = static_cast<float>(value); break;
    case at::kHalf: static_cast<at::Half*>(base)[index] = static_cast<at::Half>(static_cast<float>(value)); break;
    case at::kBFloat16:
      static_cast<at::BFloat16*>(base)[index] = static_cast<at::BFloat16>(static_cast<float>(value));
      break;
    default: static_cast<double*>(base)[index] = value; break;
  }
}

// Calls f(W{}, P{}) for the codebook dtype W and the projected dtype P (W or float).
template <typename F>
void dispatch_types(at::ScalarType codebook, at::ScalarType projected, F&& f) {
  auto with_projected = [&](auto codebook_tag) {
    using W = decltype(codebook_tag);
    if (projected == codebook) {
      f(codebook_tag, W{});
    } else {
      f(codebook_tag, float{});
    }
  };
  switch (codebook) {
    case at::kFloat: return with_projected(float{});
    case at::kHalf: return with_projected(at::Half{});
    case at::kBFloat16: return with_projected(at::BFloat16{});
    case at::kDouble: return with_projected(double{});
    default: TORCH_CHECK_TYPE(false, "unsupported codebook dtype ", codebook);
  }
}

// y[rho] += a * x[rho]: g's accumulation over a row's candidates.
template <typename Acc, typename T>
DFLASH2_ROW_KERNEL void scaled_add(Acc* y, Acc a, const T* x, int64_t length) {
  for (int64_t rho = 0; rho < length; ++rho) y[rho] += a * static_cast<Acc>(x[rho]);
}

struct Rows {
  const at::Tensor& projected;
  const at::Tensor& predecessor_codebook;
  const at::Tensor& successor_codebook;
  const int64_t* predecessor_ids;
  const int64_t* candidate_ids;
  SelectorShape shape;
};

// Row pointers of A, B (by token id) and P (by row), in their element types.
template <typename W, typename P>
struct TypedRows {
  const W* a_table;
  const W* b_table;
  const P* p_table;
  int64_t a_stride, b_stride, p_stride;

  explicit TypedRows(const Rows& rows)
      : a_table(rows.predecessor_codebook.data_ptr<W>()),
        b_table(rows.successor_codebook.data_ptr<W>()),
        p_table(rows.projected.data_ptr<P>()),
        a_stride(rows.predecessor_codebook.stride(0)),
        b_stride(rows.successor_codebook.stride(0)),
        p_stride(rows.projected.stride(0)) {}
  const W* a(int64_t id) const { return a_table + id * a_stride; }
  const W* b(int64_t id) const { return b_table + id * b_stride; }
  const P* p(int64_t row) const { return p_table + row * p_stride; }
};

template <typename W, typename P>
void scores_forward(const Rows& rows, const at::Tensor& unary, bool unary_gathered, at::Tensor& scores) {
  using Acc = accumulator_t<W>;
  const auto& shape = rows.shape;
  const TypedRows<W, P> rows_of(rows);
  const void* u = unary.data_ptr();
  const int64_t u_stride = unary.stride(0);
  void* s = scores.data_ptr();

  at::parallel_for(0, shape.rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<Acc> context(shape.rank);
    for (int64_t n = begin; n < end; ++n) {
      const W* a = rows_of.a(rows.predecessor_ids[n]);
      const P* p = rows_of.p(n);
      for (int64_t rho = 0; rho < shape.rank; ++rho) {
        context[rho] = context_term(static_cast<Acc>(a[rho]), static_cast<Acc>(p[rho]));
      }
      for (int64_t j = 0; j < shape.top_k; ++j) {
        const int64_t id = rows.candidate_ids[n * shape.top_k + j];
        const Acc dot = lane_dot(context.data(), rows_of.b(id), shape.rank);
        const int64_t column = unary_gathered ? j : id;
        const double total = load_dynamic(u, n * u_stride + column, unary.scalar_type()) + static_cast<double>(dot);
        store_dynamic(s, n * shape.top_k + j, scores.scalar_type(), total);
      }
    }
  });
}

// Sums, per distinct id of `sorted_ids`, the rank-length terms of its entries (in
// sorted order) and writes that row of `table` once.
template <typename W, typename Term>
void segmented_sum(const at::Tensor& sorted_ids, const at::Tensor& order, int64_t rank, at::Tensor& table,
                   const Term& add_term) {
  using Acc = accumulator_t<W>;
  const int64_t* ids = sorted_ids.data_ptr<int64_t>();
  const int64_t* original = order.data_ptr<int64_t>();
  const int64_t entries = sorted_ids.numel();
  std::vector<int64_t> starts;
  for (int64_t e = 0; e < entries; ++e) {
    if (e == 0 || ids[e] != ids[e - 1]) starts.push_back(e);
  }
  starts.push_back(entries);
  W* out = table.data_ptr<W>();
  at::parallel_for(0, static_cast<int64_t>(starts.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    std::vector<Acc> acc(rank);
    for (int64_t segment = begin; segment < end; ++segment) {
      std::fill(acc.begin(), acc.end(), Acc(0));
      for (int64_t e = starts[segment]; e < starts[segment + 1]; ++e) add_term(original[e], acc.data());
      W* row = out + ids[starts[segment]] * rank;
      for (int64_t rho = 0; rho < rank; ++rho) row[rho] = static_cast<W>(acc[rho]);
    }
  });
}

template <typename W, typename P>
void scores_backward(const Rows& rows, const at::Tensor& grad, bool unary_gathered, at::Tensor& grad_unary,
                     at::Tensor& grad_projected, at::Tensor& grad_predecessor, at::Tensor& grad_successor) {
  using Acc = accumulator_t<W>;
  const auto& shape = rows.shape;
  const TypedRows<W, P> rows_of(rows);
  const void* ds = grad.data_ptr();
  const auto ds_type = grad.scalar_type();
  P* dp_table = grad_projected.data_ptr<P>();
  std::vector<Acc> projected_times_g(shape.rows * shape.rank);

  at::parallel_for(0, shape.rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<Acc> g(shape.rank);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t* candidates = rows.candidate_ids + n * shape.top_k;
      std::fill(g.begin(), g.end(), Acc(0));
      for (int64_t j = 0; j < shape.top_k; ++j) {
        const Acc weight = static_cast<Acc>(load_dynamic(ds, n * shape.top_k + j, ds_type));
        scaled_add(g.data(), weight, rows_of.b(candidates[j]), shape.rank);
      }
      const W* a = rows_of.a(rows.predecessor_ids[n]);
      const P* p = rows_of.p(n);
      P* dp = dp_table + n * shape.rank;
      Acc* pg = projected_times_g.data() + n * shape.rank;
      for (int64_t rho = 0; rho < shape.rank; ++rho) {
        dp[rho] = static_cast<P>(static_cast<Acc>(a[rho]) * g[rho]);
        pg[rho] = static_cast<Acc>(p[rho]) * g[rho];
      }
      if (unary_gathered) continue;
      // Repeated ids in a row: their dS add up, rounded once, at the first occurrence.
      for (int64_t j = 0; j < shape.top_k; ++j) {
        bool first_occurrence = true;
        for (int64_t earlier = 0; earlier < j && first_occurrence; ++earlier) {
          first_occurrence = candidates[earlier] != candidates[j];
        }
        if (!first_occurrence) continue;
        double total = 0.0;
        for (int64_t later = j; later < shape.top_k; ++later) {
          if (candidates[later] == candidates[j]) total += load_dynamic(ds, n * shape.top_k + later, ds_type);
        }
        store_dynamic(grad_unary.data_ptr(), n * grad_unary.stride(0) + candidates[j], grad_unary.scalar_type(),
                      total);
      }
    }
  });

  const at::Tensor predecessor_ids = at::from_blob(const_cast<int64_t*>(rows.predecessor_ids), {shape.rows}, at::kLong);
  const at::Tensor candidate_ids =
      at::from_blob(const_cast<int64_t*>(rows.candidate_ids), {shape.rows * shape.top_k}, at::kLong);
  const auto [predecessor_sorted, predecessor_order] = at::sort(predecessor_ids, /*stable=*/true, 0, false);
  const auto [candidate_sorted, candidate_order] = at::sort(candidate_ids, /*stable=*/true, 0, false);

  segmented_sum<W>(predecessor_sorted, predecessor_order, shape.rank, grad_predecessor,
                   [&](int64_t n, Acc* acc) {
                     const Acc* pg = projected_times_g.data() + n * shape.rank;
                     for (int64_t rho = 0; rho < shape.rank; ++rho) acc[rho] += pg[rho];
                   });
  segmented_sum<W>(candidate_sorted, candidate_order, shape.rank, grad_successor, [&](int64_t flat, Acc* acc) {
    const int64_t n = flat / shape.top_k;
    const Acc weight = static_cast<Acc>(load_dynamic(ds, flat, ds_type));
    const W* a = rows_of.a(rows.predecessor_ids[n]);
    const P* p = rows_of.p(n);
    for (int64_t rho = 0; rho < shape.rank; ++rho) {
      acc[rho] += weight * context_term(static_cast<Acc>(a[rho]), static_cast<Acc>(p[rho]));
    }
  });
}

at::Tensor selector_scores_cpu(const at::Tensor& unary, const at::Tensor& projected,
                               const at::Tensor& predecessor_codebook, const at::Tensor& successor_codebook,
                               const at::Tensor& predecessor_ids, const at::Tensor& candidate_ids, bool unary_gathered,
                               at::ScalarType out_dtype) {
  check_defined({{unary, "unary"}, {projected, "projected"}, {predecessor_codebook, "predecessor_codebook"},
                 {successor_codebook, "successor_codebook"}, {predecessor_ids, "predecessor_ids"},
                 {candidate_ids, "candidate_ids"}});
  const SelectorShape shape =
      check_selector_operands(projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids);
  check_unary(unary, unary_gathered, shape, projected);
  check_scores_dtype(out_dtype);
  const at::Tensor predecessors = predecessor_ids.contiguous();
  const at::Tensor candidates = candidate_ids.contiguous();
  check_ids_in_range(predecessors, shape.vocab, "predecessor_ids");
  check_ids_in_range(candidates, shape.vocab, "candidate_ids");
  at::Tensor scores = empty_output({shape.rows, shape.top_k}, projected.options().dtype(out_dtype));
  const Rows rows{projected,   predecessor_codebook, successor_codebook, predecessors.data_ptr<int64_t>(),
                  candidates.data_ptr<int64_t>(), shape};
  dispatch_types(predecessor_codebook.scalar_type(), projected.scalar_type(), [&](auto codebook_tag, auto projected_tag) {
    scores_forward<decltype(codebook_tag), decltype(projected_tag)>(rows, unary, unary_gathered, scores);
  });
  return scores;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> selector_scores_backward_cpu(
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
  const at::Tensor grad = grad_scores.contiguous();
  const at::Tensor predecessors = predecessor_ids.contiguous();
  const at::Tensor candidates = candidate_ids.contiguous();
  check_ids_in_range(predecessors, shape.vocab, "predecessor_ids");
  check_ids_in_range(candidates, shape.vocab, "candidate_ids");
  SelectorGradients grads = allocate_selector_gradients(grad, projected, predecessor_codebook, shape, unary_gathered,
                                                        unary_width, unary_dtype);
  const Rows rows{projected,   predecessor_codebook, successor_codebook, predecessors.data_ptr<int64_t>(),
                  candidates.data_ptr<int64_t>(), shape};
  dispatch_types(predecessor_codebook.scalar_type(), projected.scalar_type(), [&](auto codebook_tag, auto projected_tag) {
    scores_backward<decltype(codebook_tag), decltype(projected_tag)>(
        rows, grad, unary_gathered, grads.unary, grads.projected, grads.predecessor_codebook,
        grads.successor_codebook);
  });
  return {grads.unary, grads.projected, grads.predecessor_codebook, grads.successor_codebook};
}

}  // namespace

TORCH_LIBRARY_IMPL(dflash2, CPU, m) {
  m.impl("selector_scores", &selector_scores_cpu);
  m.impl("selector_scores_backward", &selector_scores_backward_cpu);
}

}  // namespace dflash2
