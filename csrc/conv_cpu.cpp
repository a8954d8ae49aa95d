// CPU kernels of the grouped dynamic causal conv (SPEC section 1), forward and backward.
//
// Shapes: x [N, H], delta [N, K, G], base [K, H], grad_out [N, H]; group size gs = H / G,
// block position p(n) = n % block_size. Each operand may be float16, bfloat16, float32 or
// float64, independently. Everything is computed in acc_t (float, or double when any input
// is float64) and rounded once to the result's dtype.
//
// The op is memory-bound, so each kernel walks rows once, and every inner loop runs over
// the contiguous channel axis (auto-vectorised). A row already stored in acc_t is used in
// place; a row of another dtype is converted into a per-thread scratch row that stays in
// L1, so the float32 path copies nothing and mixed dtypes cost no extra DRAM traffic.
#include <ATen/Parallel.h>
#include <torch/all.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace dflash2 {
namespace {

// dbase is summed per fixed chunk of rows, then over chunks in order, so its rounding
// does not depend on the thread count.
constexpr int64_t kDbaseChunkRows = 256;

struct ConvShape {
  int64_t rows;        // N
  int64_t hidden;      // H
  int64_t taps;        // K
  int64_t groups;      // G
  int64_t group_size;  // gs = H / G
};

bool is_supported_dtype(at::ScalarType type) {
  return type == at::kHalf || type == at::kBFloat16 || type == at::kFloat || type == at::kDouble;
}

void check_operand(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device(), ".");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes(), ".");
  TORCH_CHECK(
      is_supported_dtype(t.scalar_type()), name,
      " must be float16, bfloat16, float32 or float64, got ", t.scalar_type(), ".");
  TORCH_CHECK(
      t.size(-1) <= 1 || t.stride(-1) == 1, name, " must have a unit last stride, got strides ",
      t.strides(), ".");
}

ConvShape check_conv_args(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& base, int64_t block_size) {
  check_operand(x, "x", 2);
  check_operand(delta, "delta", 3);
  check_operand(base, "base", 2);
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1, got ", block_size, ".");
  const ConvShape shape{x.size(0), x.size(1), delta.size(1), delta.size(2), 0};
  TORCH_CHECK(shape.taps >= 1, "delta must have at least one tap (dimension 1), got shape ", delta.sizes(), ".");
  TORCH_CHECK(
      shape.groups >= 1 && shape.hidden % shape.groups == 0, "delta's group count (dimension 2) must divide x's ",
      shape.hidden, " channels, got shape ", delta.sizes(), ".");
  TORCH_CHECK(
      delta.size(0) == shape.rows, "delta must have shape [", shape.rows, ", K, G] (x's row count), got ",
      delta.sizes(), ".");
  TORCH_CHECK(
      base.size(0) == shape.taps && base.size(1) == shape.hidden, "base must have shape [", shape.taps, ", ",
      shape.hidden, "], got ", base.sizes(), ".");
  return ConvShape{shape.rows, shape.hidden, shape.taps, shape.groups, shape.hidden / shape.groups};
}

bool any_double(std::initializer_list<const at::Tensor*> tensors) {
  return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor* t) { return t->scalar_type() == at::kDouble; });
}

// Raw rows of a tensor with unit last stride: element (i, j, 0) lies at
// data + i * stride0 + j * stride1 bytes. Row stride 0 (an expanded tensor) is fine.
struct Rows {
  char* data;
  int64_t stride0;
  int64_t stride1;
  at::ScalarType type;

  explicit Rows(const at::Tensor& t)
      : data(static_cast<char*>(t.data_ptr())),
        stride0(t.stride(0) * t.element_size()),
        stride1(t.dim() > 2 ? t.stride(1) * t.element_size() : 0),
        type(t.scalar_type()) {}

  char* at(int64_t i, int64_t j = 0) const { return data + i * stride0 + j * stride1; }
};

// `count` elements of dtype `type` at `src`, as acc_t: in place when already acc_t,
// otherwise converted into `scratch`.
template <typename acc_t>
const acc_t* read_as(const char* src, at::ScalarType type, int64_t count, acc_t* scratch) {
  if (type == c10::CppTypeToScalarType<acc_t>::value) {
    return reinterpret_cast<const acc_t*>(src);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, type, "dflash2_read_as", [&] {
    const scalar_t* typed = reinterpret_cast<const scalar_t*>(src);
    for (int64_t i = 0; i < count; ++i) {
      scratch[i] = static_cast<acc_t>(typed[i]);
    }
  });
  return scratch;
}

// Where a result row of dtype `type` is computed: the row itself when it is acc_t,
// otherwise `scratch`, rounded into the row by store_row.
template <typename acc_t>
acc_t* result_row(char* dst, at::ScalarType type, acc_t* scratch) {
  return type == c10::CppTypeToScalarType<acc_t>::value ? reinterpret_cast<acc_t*>(dst) : scratch;
}

template <typename acc_t>
void store_row(const acc_t* computed, char* dst, at::ScalarType type, int64_t count) {
  if (reinterpret_cast<const char*>(computed) == dst) {
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, type, "dflash2_store_row", [&] {
    scalar_t* typed = reinterpret_cast<scalar_t*>(dst);
    for (int64_t i = 0; i < count; ++i) {
      typed[i] = static_cast<scalar_t>(computed[i]);
    }
  });
}

// One tap over a row of H = G * gs channels:
//   out[c] (= or +=) (base_row[c] + delta_row[c / gs]) * values[c].
// The forward applies it to x rows, the dx backward to grad_out rows.
template <bool kAccumulate, typename acc_t>
void apply_tap(
    acc_t* __restrict out, const acc_t* __restrict base_row, const acc_t* __restrict delta_row,
    const acc_t* __restrict values, const ConvShape& shape) {
  for (int64_t g = 0; g < shape.groups; ++g) {
    const acc_t coefficient = delta_row[g];
    const int64_t first = g * shape.group_size;
    for (int64_t c = first; c < first + shape.group_size; ++c) {
      const acc_t term = (base_row[c] + coefficient) * values[c];
      out[c] = kAccumulate ? out[c] + term : term;
    }
  }
}

// base_x = base rounded to x's dtype (as speculators does), held as acc_t [K, H] contiguous.
at::Tensor rounded_base(const at::Tensor& base, const at::Tensor& x, at::ScalarType acc_type) {
  return base.to(x.scalar_type()).to(acc_type).contiguous();
}

template <typename acc_t>
void grouped_dynamic_conv_forward_cpu_kernel(
    const Rows& x, const Rows& delta, const acc_t* base_x, const Rows& out, const ConvShape& shape,
    int64_t block_size) {
  const int64_t grain_rows = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, shape.hidden));
  at::parallel_for(0, shape.rows, grain_rows, [&](int64_t first_row, int64_t end_row) {
    std::vector<acc_t> scratch(2 * shape.hidden + shape.groups);
    acc_t* x_scratch = scratch.data();
    acc_t* out_scratch = x_scratch + shape.hidden;
    acc_t* delta_scratch = out_scratch + shape.hidden;
    for (int64_t n = first_row; n < end_row; ++n) {
      // Taps reaching before the start of row n's block read zero: skip them.
      const int64_t taps = std::min(shape.taps, n % block_size + 1);
      acc_t* out_row = result_row(out.at(n), out.type, out_scratch);
      for (int64_t tau = 0; tau < taps; ++tau) {
        const acc_t* x_row = read_as(x.at(n - tau), x.type, shape.hidden, x_scratch);
        const acc_t* delta_row = read_as(delta.at(n, tau), delta.type, shape.groups, delta_scratch);
        const acc_t* base_row = base_x + tau * shape.hidden;
        if (tau == 0) {
          apply_tap<false>(out_row, base_row, delta_row, x_row, shape);
        } else {
          apply_tap<true>(out_row, base_row, delta_row, x_row, shape);
        }
      }
      store_row(out_row, out.at(n), out.type, shape.hidden);
    }
  });
}

// dbase_partials: acc_t [chunks, K, H], one slice per kDbaseChunkRows rows, each written
// by the one thread that owns the chunk.
template <typename acc_t>
void grouped_dynamic_conv_backward_cpu_kernel(
    const Rows& grad_out, const Rows& x, const Rows& delta, const acc_t* base_x, const Rows& dx,
    const Rows& ddelta, acc_t* dbase_partials, const ConvShape& shape, int64_t block_size) {
  const int64_t chunks = (shape.rows + kDbaseChunkRows - 1) / kDbaseChunkRows;
  const int64_t partial_size = shape.taps * shape.hidden;
  const int64_t ddelta_row_size = shape.taps * shape.groups;
  at::parallel_for(0, chunks, 1, [&](int64_t first_chunk, int64_t end_chunk) {
    std::vector<acc_t> scratch(3 * shape.hidden + shape.groups + ddelta_row_size);
    acc_t* dy_scratch = scratch.data();
    acc_t* x_scratch = dy_scratch + shape.hidden;
    acc_t* dx_scratch = x_scratch + shape.hidden;
    acc_t* delta_scratch = dx_scratch + shape.hidden;
    acc_t* ddelta_scratch = delta_scratch + shape.groups;
    for (int64_t chunk = first_chunk; chunk < end_chunk; ++chunk) {
      acc_t* partial = dbase_partials + chunk * partial_size;
      std::fill(partial, partial + partial_size, acc_t(0));
      const int64_t end_row = std::min(shape.rows, (chunk + 1) * kDbaseChunkRows);
      for (int64_t n = chunk * kDbaseChunkRows; n < end_row; ++n) {
        const int64_t position = n % block_size;

        // dx row n: the taps of the later rows n + tau of the same block read row n.
        acc_t* dx_row = result_row(dx.at(n), dx.type, dx_scratch);
        for (int64_t tau = 0; tau < shape.taps && position + tau < block_size && n + tau < shape.rows; ++tau) {
          const acc_t* dy_row = read_as(grad_out.at(n + tau), grad_out.type, shape.hidden, dy_scratch);
          const acc_t* delta_row = read_as(delta.at(n + tau, tau), delta.type, shape.groups, delta_scratch);
          const acc_t* base_row = base_x + tau * shape.hidden;
          if (tau == 0) {
            apply_tap<false>(dx_row, base_row, delta_row, dy_row, shape);
          } else {
            apply_tap<true>(dx_row, base_row, delta_row, dy_row, shape);
          }
        }
        store_row(dx_row, dx.at(n), dx.type, shape.hidden);

        // ddelta row n and row n's dbase terms: grad_out row n times the x rows it read.
        const acc_t* dy_row = read_as(grad_out.at(n), grad_out.type, shape.hidden, dy_scratch);
        acc_t* ddelta_row = result_row(ddelta.at(n), ddelta.type, ddelta_scratch);
        for (int64_t tau = 0; tau < shape.taps; ++tau) {
          acc_t* ddelta_tap = ddelta_row + tau * shape.groups;
          if (tau > position) {
            std::fill(ddelta_tap, ddelta_tap + shape.groups, acc_t(0));
            continue;
          }
          const acc_t* __restrict x_row = read_as(x.at(n - tau), x.type, shape.hidden, x_scratch);
          acc_t* __restrict partial_tap = partial + tau * shape.hidden;
          for (int64_t g = 0; g < shape.groups; ++g) {
            const int64_t first = g * shape.group_size;
            acc_t group_sum = 0;
            // The reduction order is fixed at compile time: deterministic.
#pragma omp simd reduction(+ : group_sum)
            for (int64_t c = first; c < first + shape.group_size; ++c) {
              const acc_t product = dy_row[c] * x_row[c];
              group_sum += product;
              partial_tap[c] += product;
            }
            ddelta_tap[g] = group_sum;
          }
        }
        store_row(ddelta_row, ddelta.at(n), ddelta.type, ddelta_row_size);
      }
    }
  });
}

// dbase [K, H] in dbase's dtype = the chunks' partial sums added in chunk order.
template <typename acc_t>
void sum_dbase_partials(const acc_t* dbase_partials, int64_t chunks, const Rows& dbase, int64_t size) {
  at::parallel_for(0, size, at::internal::GRAIN_SIZE, [&](int64_t first, int64_t end) {
    std::vector<acc_t> total(end - first, acc_t(0));
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const acc_t* partial = dbase_partials + chunk * size + first;
      for (int64_t i = 0; i < end - first; ++i) {
        total[i] += partial[i];
      }
    }
    const int64_t element_size = c10::elementSize(dbase.type);
    store_row(total.data(), dbase.data + first * element_size, dbase.type, end - first);
  });
}

// x [N, H], delta [N, K, G], base [K, H] -> out [N, H] in out_dtype.
at::Tensor grouped_dynamic_conv_forward_cpu(
    const at::Tensor& x, const at::Tensor& delta, const at::Tensor& base, int64_t block_size,
    at::ScalarType out_dtype) {
  const ConvShape shape = check_conv_args(x, delta, base, block_size);
  TORCH_CHECK(
      is_supported_dtype(out_dtype), "out_dtype must be float16, bfloat16, float32 or float64, got ", out_dtype, ".");
  at::Tensor out = at::empty({shape.rows, shape.hidden}, x.options().dtype(out_dtype));
  const at::ScalarType acc_type = any_double({&x, &delta, &base}) ? at::kDouble : at::kFloat;
  const at::Tensor base_x = rounded_base(base, x, acc_type);
  AT_DISPATCH_FLOATING_TYPES(acc_type, "grouped_dynamic_conv_forward_cpu", [&] {
    grouped_dynamic_conv_forward_cpu_kernel<scalar_t>(
        Rows(x), Rows(delta), base_x.const_data_ptr<scalar_t>(), Rows(out), shape, block_size);
  });
  return out;
}

// grad_out [N, H] -> (dx [N, H] x's dtype, ddelta [N, K, G] delta's dtype, dbase [K, H]
// base's dtype), all contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor> grouped_dynamic_conv_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& delta, const at::Tensor& base,
    int64_t block_size) {
  const ConvShape shape = check_conv_args(x, delta, base, block_size);
  check_operand(grad_out, "grad_out", 2);
  TORCH_CHECK(
      grad_out.sizes() == x.sizes(), "grad_out must have x's shape ", x.sizes(), ", got ", grad_out.sizes(), ".");
  at::Tensor dx = at::empty({shape.rows, shape.hidden}, x.options());
  at::Tensor ddelta = at::empty({shape.rows, shape.taps, shape.groups}, delta.options());
  at::Tensor dbase = at::empty({shape.taps, shape.hidden}, base.options());
  const at::ScalarType acc_type = any_double({&grad_out, &x, &delta, &base}) ? at::kDouble : at::kFloat;
  const at::Tensor base_x = rounded_base(base, x, acc_type);
  const int64_t chunks = (shape.rows + kDbaseChunkRows - 1) / kDbaseChunkRows;
  at::Tensor dbase_partials = at::empty({chunks, shape.taps, shape.hidden}, x.options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES(acc_type, "grouped_dynamic_conv_backward_cpu", [&] {
    scalar_t* partials = dbase_partials.mutable_data_ptr<scalar_t>();
    grouped_dynamic_conv_backward_cpu_kernel<scalar_t>(
        Rows(grad_out), Rows(x), Rows(delta), base_x.const_data_ptr<scalar_t>(), Rows(dx), Rows(ddelta), partials,
        shape, block_size);
    sum_dbase_partials<scalar_t>(partials, chunks, Rows(dbase), shape.taps * shape.hidden);
  });
  return {dx, ddelta, dbase};
}

}  // namespace
}  // namespace dflash2

TORCH_LIBRARY_IMPL(dflash2, CPU, m) {
  m.impl("conv_forward_cpu", &dflash2::grouped_dynamic_conv_forward_cpu);
  m.impl("conv_backward_cpu", &dflash2::grouped_dynamic_conv_backward_cpu);
}
