// CPU kernels of the grouped dynamic causal conv (SPEC section 1), forward and backward.
//
// Shapes: x [N, H], delta [N, K, G], base [K, H], grad_out [N, H]; group size gs = H / G,
// block position p(n) = n % block_size. Each operand may be float16, bfloat16, float32 or
// float64, independently. Everything is computed in acc_t (float, or double when any input
// is float64) and rounded once to the result's dtype, except the backward's reductions
// (ddelta over a group, dbase over rows), which sum the exact products in double.
//
// The op is memory-bound, so each kernel walks the rows once (each thread a contiguous
// range), and the inner loops run over the contiguous channel axis, one group (one delta
// coefficient) at a time, vectorised by the compiler. A row already stored in acc_t is
// used in place; a row of another dtype is converted into a per-thread scratch row that
// stays in cache, so the float32 path copies nothing and mixed dtypes cost no extra DRAM
// traffic. The forward's common cases (float accumulation, float or bfloat16 x and out,
// group size a multiple of 8) skip even those copies: forward_rows_in_registers widens
// and rounds in vector registers, with an AVX-512 twin where the CPU has it.
#include <ATen/Parallel.h>
#include <torch/all.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_row_kernel.h"
#include "output_alloc.h"
#include "tensor_checks.h"

namespace dflash2 {
namespace {

// dbase is summed per fixed chunk of rows, then over chunks in order, so its rounding
// does not depend on the thread count.
// 64 rows: a serving-size batch (256 rows) still splits over the threads; the chunk's
// running sum is a double one (sum_t), so its length costs no accuracy.
constexpr int64_t kDbaseChunkRows = 64;

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

// Bad arguments raise before any kernel runs, naming the argument: a dtype the kernels
// cannot read or store is a TypeError, a device, a shape, a stride or a size a ValueError.
void check_operand(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device(), ".");
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes(), ".");
  TORCH_CHECK_TYPE(
      is_supported_dtype(t.scalar_type()), name,
      " must be float16, bfloat16, float32 or float64, got ", t.scalar_type(), ".");
  TORCH_CHECK_VALUE(
      t.size(-1) <= 1 || t.stride(-1) == 1, name, " must have a unit last stride, got strides ",
      t.strides(), ".");
}

ConvShape check_conv_args(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& base, int64_t block_size) {
  check_operand(x, "x", 2);
  check_operand(delta, "delta", 3);
  check_operand(base, "base", 2);
  TORCH_CHECK_VALUE(block_size >= 1, "block_size must be >= 1, got ", block_size, ".");
  const ConvShape shape{x.size(0), x.size(1), delta.size(1), delta.size(2), 0};
  TORCH_CHECK_VALUE(
      shape.taps >= 1, "delta must have at least one tap (dimension 1), got shape ", delta.sizes(), ".");
  TORCH_CHECK_VALUE(
      shape.groups >= 1 && shape.hidden % shape.groups == 0, "delta's group count (dimension 2) must divide x's ",
      shape.hidden, " channels, got shape ", delta.sizes(), ".");
  TORCH_CHECK_VALUE(
      delta.size(0) == shape.rows, "delta must have shape [", shape.rows, ", K, G] (x's row count), got ",
      delta.sizes(), ".");
  TORCH_CHECK_VALUE(
      base.size(0) == shape.taps && base.size(1) == shape.hidden, "base must have shape [", shape.taps, ", ",
      shape.hidden, "] (delta's taps, x's channels), got ", base.sizes(), ".");
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
  int64_t element_size;

  explicit Rows(const at::Tensor& t)
      : data(static_cast<char*>(t.data_ptr())),
        stride0(t.stride(0) * t.element_size()),
        stride1(t.dim() > 2 ? t.stride(1) * t.element_size() : 0),
        type(t.scalar_type()),
        element_size(t.element_size()) {}

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

// Calls f(std::integral_constant<int64_t, kGroupSize>{}): the group size 16 of every
// published drafter as a compile-time constant, so that the per-group loops compile to
// straight vector code (with a run-time trip count their set-up outweighs their 16
// elements); any other group size is read at run time (kGroupSize 0).
template <typename F>
void with_group_size(int64_t group_size, const F& f) {
  if (group_size == 16) {
    f(std::integral_constant<int64_t, 16>{});
  } else {
    f(std::integral_constant<int64_t, 0>{});
  }
}

// Rows this many ahead of the one being computed are requested from memory early: a row
// is first touched one group at a time, and the hardware prefetcher restarts at every
// 4 KB page, so without this each group of a new row waits on DRAM.
constexpr int64_t kPrefetchRows = 2;
constexpr int64_t kCacheLine = 64;

// Requests group g's channels of row `row` of `rows` (for writing when kWrite).
template <bool kWrite = false>
inline void prefetch_group(const Rows& rows, int64_t row, int64_t first_channel, int64_t group_size) {
  const char* begin = rows.at(row) + first_channel * rows.element_size;
  for (int64_t byte = 0; byte < group_size * rows.element_size; byte += kCacheLine) {
    __builtin_prefetch(begin + byte, kWrite ? 1 : 0);
  }
}

// What both directions read: x [N, H], delta [N, K, G] and base_x [K, H] contiguous, which
// is base rounded to x's dtype (as speculators does), held as acc_t.
template <typename acc_t>
struct ConvInputs {
  Rows x;
  Rows delta;
  const acc_t* base_x;
  ConvShape shape;
  int64_t block_size;
};

// One tap on the channels [first, last) of a group:
//   out[c] (= for the first tap, else +=) (base_row[c] + coefficient) * values[c],
// coefficient being the group's delta. The forward applies it to x rows, dx to grad_out rows.
template <typename acc_t>
inline void apply_tap_to_group(
    acc_t* __restrict out, const acc_t* __restrict base_row, acc_t coefficient, const acc_t* __restrict values,
    int64_t first, int64_t last, bool first_tap) {
  if (first_tap) {
#pragma omp simd
    for (int64_t c = first; c < last; ++c) {
      out[c] = (base_row[c] + coefficient) * values[c];
    }
  } else {
#pragma omp simd
    for (int64_t c = first; c < last; ++c) {
      out[c] += (base_row[c] + coefficient) * values[c];
    }
  }
}

// The reductions of the backward (ddelta's sum over a group's channels, dbase's over
// rows) run in double whatever acc_t is. The product of two floats is exact in double
// (24 + 24 significant bits), so these sums carry almost no error before their single
// rounding to the result's dtype. Float sums failed SPEC section 4: 300 channels summed
// in 8 lanes (37 terms a lane), or the 64 rows of a chunk (64 identical terms for an
// expanded, row-stride-0 operand, whose errors add up coherently), lost up to 13x the
// error of torch's cascade sums.
using sum_t = double;

// 4 values as one GCC vector: 4 doubles fill one AVX2 register in the AVX2 clone, two
// SSE registers otherwise. (A vector wider than a register goes through the stack, and
// the SLP vectoriser leaves a lane reduction scalar: both cost more than the doubles.)
template <typename T>
struct Quad {
  typedef T type __attribute__((vector_size(4 * sizeof(T))));
};

// sum_c a[c] * b[c] over c < count, in double, adding each product to partial[c] too.
// The sum runs in 8 lanes (c mod 8: two quads) folded by halves: a fixed order
// (deterministic, the same in both clones) in a few vector instructions, where a
// compiler's own reduction epilogue adds the lanes one at a time (once per group, that
// dominated the backward).
template <typename acc_t>
inline sum_t sum_products_into(
    sum_t* __restrict partial, const acc_t* __restrict a, const acc_t* __restrict b, int64_t count) {
  using Sums = typename Quad<sum_t>::type;
  Sums low = {}, high = {};
  int64_t c = 0;
  for (; c + 8 <= count; c += 8) {
    const acc_t* x = a + c;
    const acc_t* y = b + c;
    const Sums product_low = Sums{sum_t(x[0]), sum_t(x[1]), sum_t(x[2]), sum_t(x[3])} *
                             Sums{sum_t(y[0]), sum_t(y[1]), sum_t(y[2]), sum_t(y[3])};
    const Sums product_high = Sums{sum_t(x[4]), sum_t(x[5]), sum_t(x[6]), sum_t(x[7])} *
                              Sums{sum_t(y[4]), sum_t(y[5]), sum_t(y[6]), sum_t(y[7])};
    low += product_low;
    high += product_high;
    Sums p_low, p_high;  // memcpy: unaligned vector loads and stores
    std::memcpy(&p_low, partial + c, sizeof(Sums));
    std::memcpy(&p_high, partial + c + 4, sizeof(Sums));
    p_low += product_low;
    p_high += product_high;
    std::memcpy(partial + c, &p_low, sizeof(Sums));
    std::memcpy(partial + c + 4, &p_high, sizeof(Sums));
  }
  low += high;
  sum_t sum = (low[0] + low[2]) + (low[1] + low[3]);
  for (; c < count; ++c) {
    const sum_t product = static_cast<sum_t>(a[c]) * static_cast<sum_t>(b[c]);
    sum += product;
    partial[c] += product;
  }
  return sum;
}

// out rows [first_row, end_row). Tap by tap over whole rows: row n - tau is still in
// cache from row n - tau's own pass, so each row costs one read of x and one write of out.
template <typename acc_t>
DFLASH2_ROW_KERNEL void forward_rows(const ConvInputs<acc_t>& in, const Rows& out, int64_t first_row, int64_t end_row) {
  const ConvShape& shape = in.shape;
  const int64_t hidden = shape.hidden, groups = shape.groups, group_size = shape.group_size;
  std::vector<acc_t> scratch(2 * hidden + groups);
  acc_t* x_scratch = scratch.data();            // [H]
  acc_t* out_scratch = x_scratch + hidden;      // [H]
  acc_t* delta_scratch = out_scratch + hidden;  // [G]
  for (int64_t n = first_row; n < end_row; ++n) {
    // Taps reaching before the start of row n's block read zero: skip them.
    const int64_t read_taps = std::min(shape.taps, n % in.block_size + 1);
    acc_t* __restrict out_row = result_row(out.at(n), out.type, out_scratch);
    for (int64_t tau = 0; tau < read_taps; ++tau) {
      const acc_t* x_row = read_as(in.x.at(n - tau), in.x.type, hidden, x_scratch);
      const acc_t* delta_row = read_as(in.delta.at(n, tau), in.delta.type, groups, delta_scratch);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * group_size;
        apply_tap_to_group(
            out_row, in.base_x + tau * hidden, delta_row[g], x_row, first, first + group_size, tau == 0);
      }
    }
    store_row(out_row, out.at(n), out.type, hidden);
  }
}

// One out row of forward_rows_lanes with two taps (every published drafter): tap 0 on
// x0, then tap 1 on x1 unless x1 is null (block position 0). Its operands are restrict
// pointers held in registers; through the general path's per-tap arrays, the stores'
// possible aliasing made the compiler reload them for every chunk.
template <typename X, typename O, int kWidth>
DFLASH2_INLINE void two_tap_row(const float* __restrict base0, const float* __restrict base1,
                                const float* __restrict delta0, const float* __restrict delta1,
                                const X* __restrict x0, const X* __restrict x1, O* __restrict out_row, int64_t hidden,
                                int64_t group_size) {
  for (int64_t c = 0, g = 0; c < hidden; g += 1) {
    const float d0 = delta0[g], d1 = x1 != nullptr ? delta1[g] : 0.0f;
    for (const int64_t group_end = c + group_size; c < group_end; c += kWidth) {
      auto sum = (load_floats<kWidth>(base0 + c) + d0) * load_floats<kWidth>(x0 + c);
      if (x1 != nullptr) sum += (load_floats<kWidth>(base1 + c) + d1) * load_floats<kWidth>(x1 + c);
      store_floats<kWidth>(out_row + c, sum);
    }
  }
}

// forward_rows for float accumulation, x rows of type X and out rows of type O (each
// float or bfloat16), group size a multiple of kWidth: each kWidth-channel chunk lies in
// one group, and all taps of a chunk are summed in registers before its one store, with
// no converted copies of x or out rows (cpu_row_kernel.h widens and rounds bfloat16 in
// registers). The same products in the same tap order as forward_rows: the same bits,
// at either width.
template <typename X, typename O, int kWidth>
DFLASH2_INLINE void forward_rows_lanes(const ConvInputs<float>& in, const Rows& out, int64_t first_row, int64_t end_row) {
  const ConvShape& shape = in.shape;
  const int64_t hidden = shape.hidden, groups = shape.groups, group_size = shape.group_size;
  std::vector<float> delta_scratch(shape.taps * groups);
  std::vector<const float*> delta_rows(shape.taps);
  std::vector<const X*> x_rows(shape.taps);
  for (int64_t n = first_row; n < end_row; ++n) {
    const int64_t read_taps = std::min(shape.taps, n % in.block_size + 1);
    for (int64_t tau = 0; tau < read_taps; ++tau) {
      x_rows[tau] = reinterpret_cast<const X*>(in.x.at(n - tau));
      delta_rows[tau] = read_as(in.delta.at(n, tau), in.delta.type, groups, delta_scratch.data() + tau * groups);
    }
    O* __restrict out_row = reinterpret_cast<O*>(out.at(n));
    if (shape.taps == 2) {
      const bool both = read_taps == 2;
      two_tap_row<X, O, kWidth>(in.base_x, in.base_x + hidden, delta_rows[0], both ? delta_rows[1] : nullptr,
                                x_rows[0], both ? x_rows[1] : nullptr, out_row, hidden, group_size);
      continue;
    }
    for (int64_t c = 0, g = 0; c < hidden; g += 1) {
      for (const int64_t group_end = c + group_size; c < group_end; c += kWidth) {
        auto sum = (load_floats<kWidth>(in.base_x + c) + delta_rows[0][g]) * load_floats<kWidth>(x_rows[0] + c);
        for (int64_t tau = 1; tau < read_taps; ++tau) {
          sum += (load_floats<kWidth>(in.base_x + tau * hidden + c) + delta_rows[tau][g]) *
                 load_floats<kWidth>(x_rows[tau] + c);
        }
        store_floats<kWidth>(out_row + c, sum);
      }
    }
  }
}

template <typename X, typename O>
DFLASH2_ROW_KERNEL void forward_rows_in_registers(
    const ConvInputs<float>& in, const Rows& out, int64_t first_row, int64_t end_row) {
  forward_rows_lanes<X, O, 8>(in, out, first_row, end_row);
}

#if DFLASH2_HAS_AVX512_KERNELS
template <typename X, typename O>
DFLASH2_AVX512_KERNEL void forward_rows_in_avx512_registers(
    const ConvInputs<float>& in, const Rows& out, int64_t first_row, int64_t end_row) {
  forward_rows_lanes<X, O, 16>(in, out, first_row, end_row);
}
#endif

// Runs f(X{}, O{}) when forward_rows_in_registers covers these operands; false if not.
template <typename F>
bool with_register_forward(const at::Tensor& x, at::ScalarType out_dtype, int64_t group_size, bool double_acc,
                           const F& f) {
  if (double_acc || group_size % 8 != 0) return false;
  const auto x_type = x.scalar_type();
  if (x_type == at::kFloat && out_dtype == at::kFloat) return f(float{}, float{}), true;
  if (x_type == at::kBFloat16 && out_dtype == at::kBFloat16) return f(c10::BFloat16{}, c10::BFloat16{}), true;
  if (x_type == at::kBFloat16 && out_dtype == at::kFloat) return f(c10::BFloat16{}, float{}), true;
  return false;
}

// dx and ddelta rows [first_row, end_row), and their dbase terms summed into partial
// [K, H] (double, zeroed here). Each row is one sweep over the groups doing every tap of
// dx, ddelta and dbase, so that the three rows it touches first (grad_out n + K - 1, x n,
// dx n) stream together.
template <typename acc_t, int64_t kGroupSize>
DFLASH2_ROW_KERNEL void backward_rows(
    const ConvInputs<acc_t>& in, const Rows& grad_out, const Rows& dx, const Rows& ddelta, sum_t* partial,
    int64_t first_row, int64_t end_row) {
  const ConvShape& shape = in.shape;
  const int64_t hidden = shape.hidden, groups = shape.groups, taps = shape.taps;
  const int64_t group_size = kGroupSize > 0 ? kGroupSize : shape.group_size;
  std::vector<acc_t> scratch((2 * taps + 1) * hidden + 2 * taps * groups);
  acc_t* dy_scratch = scratch.data();                     // [K, H]: grad_out rows n .. n + K - 1
  acc_t* x_scratch = dy_scratch + taps * hidden;          // [K, H]: x rows n .. n - K + 1
  acc_t* dx_scratch = x_scratch + taps * hidden;          // [H]
  acc_t* delta_scratch = dx_scratch + hidden;             // [K, G]: delta[n + tau, tau]
  acc_t* ddelta_scratch = delta_scratch + taps * groups;  // [K, G]
  std::vector<const acc_t*> dy_rows(taps), x_rows(taps), delta_rows(taps);
  std::fill(partial, partial + taps * hidden, sum_t(0));
  for (int64_t n = first_row; n < end_row; ++n) {
    const int64_t position = n % in.block_size;
    // dx row n collects tap tau of each row n + tau in the same block.
    const int64_t dx_taps = std::min({taps, in.block_size - position, shape.rows - n});
    // The taps of row n that reach back inside its block: its ddelta and dbase terms.
    const int64_t read_taps = std::min(taps, position + 1);
    for (int64_t tau = 0; tau < dx_taps; ++tau) {
      dy_rows[tau] = read_as(grad_out.at(n + tau), grad_out.type, hidden, dy_scratch + tau * hidden);
      delta_rows[tau] = read_as(in.delta.at(n + tau, tau), in.delta.type, groups, delta_scratch + tau * groups);
    }
    for (int64_t tau = 0; tau < read_taps; ++tau) {
      x_rows[tau] = read_as(in.x.at(n - tau), in.x.type, hidden, x_scratch + tau * hidden);
    }
    const acc_t* dy_row = dy_rows[0];
    acc_t* __restrict dx_row = result_row(dx.at(n), dx.type, dx_scratch);
    acc_t* __restrict ddelta_row = result_row(ddelta.at(n), ddelta.type, ddelta_scratch);
    const bool prefetch = n + kPrefetchRows + taps - 1 < shape.rows;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = g * group_size;
      if (prefetch) {
        prefetch_group(grad_out, n + kPrefetchRows + taps - 1, first, group_size);
        prefetch_group(in.x, n + kPrefetchRows, first, group_size);
        prefetch_group</*kWrite=*/true>(dx, n + kPrefetchRows, first, group_size);
      }
      for (int64_t tau = 0; tau < dx_taps; ++tau) {
        apply_tap_to_group(
            dx_row, in.base_x + tau * hidden, delta_rows[tau][g], dy_rows[tau], first, first + group_size, tau == 0);
      }
      for (int64_t tau = 0; tau < read_taps; ++tau) {
        ddelta_row[tau * groups + g] = static_cast<acc_t>(
            sum_products_into(partial + tau * hidden + first, dy_row + first, x_rows[tau] + first, group_size));
      }
    }
    std::fill(ddelta_row + read_taps * groups, ddelta_row + taps * groups, acc_t(0));
    store_row(dx_row, dx.at(n), dx.type, hidden);
    store_row(ddelta_row, ddelta.at(n), ddelta.type, taps * groups);
  }
}

// dbase [K, H] in dbase's dtype = the chunks' partial sums (double) added in chunk
// order, in double, and rounded once: a float running sum over N / 64 chunks lost
// accuracy as N grew (at 64k rows 7x the reference's error); adding K * H values per
// chunk costs nothing next to the rows' own pass.
void sum_dbase_partials(const sum_t* dbase_partials, int64_t chunks, const Rows& dbase, int64_t size) {
  at::parallel_for(0, size, at::internal::GRAIN_SIZE, [&](int64_t first, int64_t end) {
    std::vector<sum_t> total(end - first, 0.0);
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const sum_t* partial = dbase_partials + chunk * size + first;
      for (int64_t i = 0; i < end - first; ++i) {
        total[i] += partial[i];
      }
    }
    store_row(total.data(), dbase.data + first * dbase.element_size, dbase.type, end - first);
  });
}

// base rounded to x's dtype (as speculators does), as acc_t [K, H] contiguous.
at::Tensor rounded_base(const at::Tensor& base, const at::Tensor& x, at::ScalarType acc_type) {
  return base.to(x.scalar_type()).to(acc_type).contiguous();
}

// x [N, H], delta [N, K, G], base [K, H] -> out [N, H] in out_dtype.
at::Tensor grouped_dynamic_conv_forward_cpu(
    const at::Tensor& x, const at::Tensor& delta, const at::Tensor& base, int64_t block_size,
    at::ScalarType out_dtype) {
  check_defined({{x, "x"}, {delta, "delta"}, {base, "base"}});
  const ConvShape shape = check_conv_args(x, delta, base, block_size);
  TORCH_CHECK_TYPE(
      is_supported_dtype(out_dtype), "out_dtype must be float16, bfloat16, float32 or float64, got ", out_dtype, ".");
  at::Tensor out = empty_output({shape.rows, shape.hidden}, x.options().dtype(out_dtype));
  const at::ScalarType acc_type = any_double({&x, &delta, &base}) ? at::kDouble : at::kFloat;
  const at::Tensor base_x = rounded_base(base, x, acc_type);
  const int64_t grain_rows = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, shape.hidden));
  const Rows out_rows(out);
  const bool in_registers = with_register_forward(
      x, out_dtype, shape.group_size, acc_type == at::kDouble, [&](auto x_tag, auto out_tag) {
        const ConvInputs<float> in{Rows(x), Rows(delta), base_x.const_data_ptr<float>(), shape, block_size};
        using X = decltype(x_tag);
        using O = decltype(out_tag);
        const bool avx512 = cpu_has_avx512() && shape.group_size % 16 == 0;
        at::parallel_for(0, shape.rows, grain_rows, [&](int64_t first_row, int64_t end_row) {
#if DFLASH2_HAS_AVX512_KERNELS
          if (avx512) return forward_rows_in_avx512_registers<X, O>(in, out_rows, first_row, end_row);
#endif
          forward_rows_in_registers<X, O>(in, out_rows, first_row, end_row);
        });
        (void)avx512;
      });
  if (!in_registers) {
    AT_DISPATCH_FLOATING_TYPES(acc_type, "grouped_dynamic_conv_forward_cpu", [&] {
      const ConvInputs<scalar_t> in{Rows(x), Rows(delta), base_x.const_data_ptr<scalar_t>(), shape, block_size};
      at::parallel_for(0, shape.rows, grain_rows, [&](int64_t first_row, int64_t end_row) {
        forward_rows(in, out_rows, first_row, end_row);
      });
    });
  }
  return out;
}

// grad_out [N, H] -> (dx [N, H] x's dtype, ddelta [N, K, G] delta's dtype, dbase [K, H]
// base's dtype), all contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor> grouped_dynamic_conv_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& delta, const at::Tensor& base,
    int64_t block_size) {
  check_defined({{grad_out, "grad_out"}, {x, "x"}, {delta, "delta"}, {base, "base"}});
  const ConvShape shape = check_conv_args(x, delta, base, block_size);
  check_operand(grad_out, "grad_out", 2);
  TORCH_CHECK_VALUE(
      grad_out.sizes() == x.sizes(), "grad_out must have x's shape ", x.sizes(), ", got ", grad_out.sizes(), ".");
  at::Tensor dx = empty_output({shape.rows, shape.hidden}, x.options());
  at::Tensor ddelta = empty_output({shape.rows, shape.taps, shape.groups}, delta.options());
  at::Tensor dbase = empty_output({shape.taps, shape.hidden}, base.options());
  const at::ScalarType acc_type = any_double({&grad_out, &x, &delta, &base}) ? at::kDouble : at::kFloat;
  const at::Tensor base_x = rounded_base(base, x, acc_type);
  // One dbase partial sum [K, H] (double) per fixed chunk of rows, each written by the
  // one thread that owns the chunk.
  const int64_t chunks = (shape.rows + kDbaseChunkRows - 1) / kDbaseChunkRows;
  at::Tensor dbase_partials = empty_output({chunks, shape.taps, shape.hidden}, x.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(acc_type, "grouped_dynamic_conv_backward_cpu", [&] {
    const ConvInputs<scalar_t> in{Rows(x), Rows(delta), base_x.const_data_ptr<scalar_t>(), shape, block_size};
    const Rows dy_rows(grad_out), dx_rows(dx), ddelta_rows(ddelta);
    sum_t* partials = dbase_partials.mutable_data_ptr<sum_t>();
    with_group_size(shape.group_size, [&](auto group_size) {
      at::parallel_for(0, chunks, 1, [&](int64_t first_chunk, int64_t end_chunk) {
        for (int64_t chunk = first_chunk; chunk < end_chunk; ++chunk) {
          backward_rows<scalar_t, group_size>(
              in, dy_rows, dx_rows, ddelta_rows, partials + chunk * shape.taps * shape.hidden,
              chunk * kDbaseChunkRows, std::min(shape.rows, (chunk + 1) * kDbaseChunkRows));
        }
      });
    });
    sum_dbase_partials(partials, chunks, Rows(dbase), shape.taps * shape.hidden);
  });
  return {dx, ddelta, dbase};
}

}  // namespace
}  // namespace dflash2

TORCH_LIBRARY_IMPL(dflash2, CPU, m) {
  m.impl("conv_forward_cpu", &dflash2::grouped_dynamic_conv_forward_cpu);
  m.impl("conv_backward_cpu", &dflash2::grouped_dynamic_conv_backward_cpu);
}
