// C++ CPU kernels of the selector ops: the same per-element math as the CUDA kernels
// (kernels/selector_math.h), parallel with at::parallel_for.
//
// The work is gathers from [V, r] tables at random ids, so the passes are arranged for
// memory, not arithmetic: the next rows' table rows are prefetched; a large batch's
// transition terms run in candidate-id order (each B row read once, as a stream); the
// full-vocabulary unary entries are gathered in a pass of their own, where their misses
// overlap; and the dense results (dU [N, V], dA, dB) are written whole in one pass, with
// no separate zero fill, into memory kept from earlier calls (cpu_result_cache.h). dA
// and dB are sums over rows grouped by id; they run over a stable counting sort of the
// ids, so each id's terms are added in one fixed order whatever the number of threads.
// On AVX-512 the backward's sums in double (g over a row's candidates, dA and dB over
// an id's rows) hold each 64-wide chunk of r in registers (double_lanes.h), and dA and
// dB are written past the cache; every path gives the same bits.
#include <ATen/Parallel.h>
#include <torch/all.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_row_kernel.h"
#include "double_lanes.h"
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

// Calls f(T{}) for a float dtype: float16, bfloat16, float32 or float64.
template <typename F>
void dispatch_float(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kDouble: return f(double{});
    default: TORCH_CHECK_TYPE(false, "unsupported dtype ", type);
  }
}

// Calls f(W{}, P{}) for the codebook dtype W and the projected dtype P (W or float).
template <typename F>
void dispatch_types(at::ScalarType codebook, at::ScalarType projected, F&& f) {
  dispatch_float(codebook, [&](auto codebook_tag) {
    using W = decltype(codebook_tag);
    if (projected == codebook) {
      f(codebook_tag, W{});
    } else {
      f(codebook_tag, float{});
    }
  });
}

// The rows a row reads (its A row, its k B rows) lie anywhere in tables of up to V
// rows: each is a cache miss, and a loop that waits for one before asking for the next
// runs at memory latency. Rows this far ahead are requested early, so their misses
// overlap the current row's arithmetic: a row's A and P rows kPrefetchRows rows ahead,
// each candidate's B row kPrefetchCandidates candidates ahead (across row ends), a few
// misses in flight at a time, steadily. (Requesting a row's k B rows at once, four rows
// ahead, ran 1.3x slower in benchmarks/micro/gather_prefetch.cpp, these gathers alone,
// at r = 64 and 128: the burst overran the core's miss buffers, and the row's own loads
// queued behind it.) An entry of a sum over ids reads a single [N, r] row, so the same
// lead in time is more entries than rows.
//
// The rows of many lines (B rows, the candidate-order contexts, the sums' term rows)
// are requested into L2 (prefetcht1), not L1: at r = 256 fp32 a row is 16 lines, and 8
// candidates ahead are 128 lines in flight, more than the L1 tracks; requests past that
// wait or drop, and the loads they were for miss. Into L2 they queue where more fit,
// and the loads find them a few cycles away. In turns with the bench's floor and
// torch.compile in one process (docs/BENCHMARKS.md at 743a4f8), r = 256: the candidate-order
// forward 0.80 of the time with every request into L1, forward+backward 0.79; r = 64,
// where a row is 4 lines: 0.97-1.00.
constexpr int64_t kPrefetchRows = 2;
constexpr int64_t kPrefetchCandidates = 8;
constexpr int64_t kPrefetchEntries = 16;
constexpr int64_t kPrefetchIds = 4;
constexpr int64_t kPrefetchEntryBytes = 4096;
constexpr int64_t kCacheLine = 64;

// Entries ahead to request a context row of row_bytes in the candidate-order dots: a
// lead of kPrefetchEntryBytes (16 rows at r = 64 fp32, 4 at r = 256), at least 2.
inline int64_t entries_ahead_for(int64_t row_bytes) {
  return std::max<int64_t>(2, kPrefetchEntryBytes / std::max<int64_t>(row_bytes, 1));
}

// Requests the lines of count elements at first: into L1 (kLocality 3, prefetcht0) or
// into L2 (kLocality 2, prefetcht1).
template <int kLocality = 3, typename T>
inline void prefetch_elements(const T* first, int64_t count) {
  const char* begin = reinterpret_cast<const char*>(first);
  const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
  for (int64_t byte = 0; byte < bytes; byte += kCacheLine) __builtin_prefetch(begin + byte, 0, kLocality);
}

template <typename T>
inline void prefetch_elements_to_l2(const T* first, int64_t count) {
  prefetch_elements<2>(first, count);
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

// Requests row n's A and P rows, if n < end.
template <typename W, typename P>
DFLASH2_INLINE void prefetch_row_inputs(const TypedRows<W, P>& rows_of, const Rows& rows, int64_t n, int64_t end) {
  if (n >= end) return;
  prefetch_elements(rows_of.a(rows.predecessor_ids[n]), rows.shape.rank);
  prefetch_elements(rows_of.p(n), rows.shape.rank);
}

// Requests the B row of flat entry e (row e / k, candidate e mod k), if e < end_entry.
template <typename W, typename P>
DFLASH2_INLINE void prefetch_candidate_row(const TypedRows<W, P>& rows_of, const Rows& rows, int64_t e,
                                           int64_t end_entry) {
  if (e < end_entry) prefetch_elements_to_l2(rows_of.b(rows.candidate_ids[e]), rows.shape.rank);
}

// count elements of T, left unset: for buffers a kernel writes whole before it reads
// them (a std::vector would zero them first: an 8 MB memset a call at r = 256). From
// cpu_result_cache::kMinBytes their memory is kept across calls (cpu_result_cache.h),
// as fresh pages would fault on first write every call. Poisoned (all bits set: NaN,
// or -1) where outputs are (output_alloc.h), so that an element read before it is
// written shows.
template <typename T>
class Unfilled {
 public:
  explicit Unfilled(int64_t count) {
    const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
    if (bytes >= static_cast<int64_t>(cpu_result_cache::kMinBytes)) {
      kept_ = cpu_result_cache::scratch(bytes);
      data_ = static_cast<T*>(kept_.data_ptr());
    } else {
      small_.reset(new T[count]);
      data_ = small_.get();
    }
    if (poison_outputs()) std::memset(static_cast<void*>(data_), 0xFF, bytes);
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  T& operator[](int64_t i) { return data_[i]; }
  const T& operator[](int64_t i) const { return data_[i]; }

 private:
  at::Tensor kept_;
  std::unique_ptr<T[]> small_;
  T* data_ = nullptr;
};

// The entries of `ids` (values in [0, vocab)) grouped by id, stably: a counting sort.
// Slots starts[id] .. starts[id + 1] hold id's entries, in entry order: rows[s] is the
// entry's row (flat index / row_width), entries[s] its flat index where asked for (with
// row_width 1 it is the row) and weights[s] its weight where weights are given. The
// sweeps over ids read these in slot order: a row is not a 64-bit division per entry,
// nor a weight a miss in an [N k] table.
struct IdSegments {
  int64_t vocab;
  Unfilled<int64_t> starts;     // [vocab + 1]
  Unfilled<int64_t> rows;       // [ids.size]
  Unfilled<int64_t> entries;    // [ids.size], or none
  Unfilled<double> weights;     // [ids.size], or none
};

// Chunks of entries, one per thread, each counted into its own histogram; a chunk's
// entries of an id go after the earlier chunks' entries of that id, so the order is the
// stable one whatever the number of threads. weights: [count] or null.
IdSegments segments_by_id(const int64_t* ids, int64_t count, int64_t vocab, int64_t row_width = 1,
                          bool with_entries = false, const double* weights = nullptr) {
  constexpr int64_t kMinEntriesPerChunk = 8192;
  const int64_t chunks = std::clamp<int64_t>(count / kMinEntriesPerChunk, 1, at::get_num_threads());
  const auto chunk_begin = [&](int64_t chunk) { return chunk * count / chunks; };
  Unfilled<int64_t> next(chunks * vocab);  // [chunk, id]: a count, then where its next entry goes
  std::fill_n(next.data(), chunks * vocab, int64_t(0));
  at::parallel_for(0, chunks, 1, [&](int64_t first_chunk, int64_t end_chunk) {
    for (int64_t chunk = first_chunk; chunk < end_chunk; ++chunk) {
      int64_t* counts = next.data() + chunk * vocab;
      for (int64_t e = chunk_begin(chunk); e < chunk_begin(chunk + 1); ++e) ++counts[ids[e]];
    }
  });
  IdSegments segments{vocab, Unfilled<int64_t>(vocab + 1), Unfilled<int64_t>(count),
                      Unfilled<int64_t>(with_entries ? count : 0), Unfilled<double>(weights == nullptr ? 0 : count)};
  int64_t running = 0;
  for (int64_t id = 0; id < vocab; ++id) {
    segments.starts[id] = running;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const int64_t entries = next[chunk * vocab + id];
      next[chunk * vocab + id] = running;
      running += entries;
    }
  }
  segments.starts[vocab] = running;
  at::parallel_for(0, chunks, 1, [&](int64_t first_chunk, int64_t end_chunk) {
    for (int64_t chunk = first_chunk; chunk < end_chunk; ++chunk) {
      int64_t* slots = next.data() + chunk * vocab;
      const int64_t begin = chunk_begin(chunk), width = std::max<int64_t>(row_width, 1);  // 0 only with no entries
      int64_t row = begin / width, column = begin % width;
      for (int64_t e = begin; e < chunk_begin(chunk + 1); ++e) {
        const int64_t slot = slots[ids[e]]++;
        segments.rows[slot] = row;
        if (with_entries) segments.entries[slot] = e;
        if (weights != nullptr) segments.weights[slot] = weights[e];
        if (++column == width) {
          column = 0;
          ++row;
        }
      }
    }
  });
  return segments;
}

// Row n's context A[pred[n]] * P[n], in Acc.
template <typename W, typename P, typename Acc>
inline void context_of_row(const TypedRows<W, P>& rows_of, const Rows& rows, int64_t n, Acc* context) {
  const W* a = rows_of.a(rows.predecessor_ids[n]);
  const P* p = rows_of.p(n);
  for (int64_t rho = 0; rho < rows.shape.rank; ++rho) {
    context[rho] = context_term(static_cast<Acc>(a[rho]), static_cast<Acc>(p[rho]));
  }
}

// Whether the transition terms run in candidate-id order: when B is too large to stay
// in the last-level cache (32 MB on this project's machines, shared with everything
// else), each of the N k candidate rows read in row order is a DRAM miss; when they
// are at least twice the rows of B, reading each B row in use once, in id order (a
// forward stream), and the N x r contexts at random moves less from DRAM (r = 256 fp32,
// B 32 MB: ahead of the row order in most readings here, docs/BENCHMARKS.md at 743a4f8). A B
// that stays in cache is read fastest in row order, without the counting sort (r = 64,
// B 8 MB: the sort cost 1.6x).
// DFLASH2_SELECTOR_ORDER=row or =candidate forces one order (the tests run both on
// every case and expect the same bits); read on every call, as output_alloc.h's switch.
bool transitions_by_candidate(const SelectorShape& shape, int64_t codebook_element_size) {
  const char* forced = std::getenv("DFLASH2_SELECTOR_ORDER");
  if (forced != nullptr && std::strcmp(forced, "row") == 0) return false;
  if (forced != nullptr && std::strcmp(forced, "candidate") == 0) return true;
  constexpr int64_t kCachedCodebookBytes = int64_t(16) << 20;
  const int64_t entries = shape.rows * shape.top_k;
  return shape.vocab * shape.rank * codebook_element_size > kCachedCodebookBytes && entries >= 2 * shape.vocab;
}

// transition[n k + j] = lane_dot(A[pred[n]] * P[n], B[cand[n, j]]) for rows [begin,
// end), in row order: per row, its context, then its k candidates.
template <typename W, typename P, typename Acc, typename Dot>
DFLASH2_INLINE void row_order_dots_with(const Dot& dot, const TypedRows<W, P>& rows_of, const Rows& rows,
                                        int64_t begin, int64_t end, Acc* context, Acc* transition) {
  const int64_t rank = rows.shape.rank, top_k = rows.shape.top_k;
  for (int64_t n = begin; n < end; ++n) {
    prefetch_row_inputs(rows_of, rows, n + kPrefetchRows, end);
    context_of_row(rows_of, rows, n, context);
    for (int64_t e = n * top_k; e < (n + 1) * top_k; ++e) {
      prefetch_candidate_row(rows_of, rows, e + kPrefetchCandidates, end * top_k);
      transition[e] = dot(context, rows_of.b(rows.candidate_ids[e]), rank);
    }
  }
}

template <typename W, typename P, typename Acc>
DFLASH2_ROW_KERNEL void row_order_dots_clone(const TypedRows<W, P>& rows_of, const Rows& rows, int64_t begin,
                                             int64_t end, Acc* context, Acc* transition) {
  row_order_dots_with([](const Acc* x, const W* y, int64_t n) { return lane_dot(x, y, n); }, rows_of, rows, begin,
                      end, context, transition);
}

#if DFLASH2_HAS_AVX512_KERNELS
template <typename W, typename P>
DFLASH2_AVX512_KERNEL void row_order_dots_avx512(const TypedRows<W, P>& rows_of, const Rows& rows, int64_t begin,
                                                 int64_t end, float* context, float* transition) {
  row_order_dots_with(
      [](const float* x, const W* y, int64_t n) __attribute__((always_inline)) { return lane_dot_in<16>(x, y, n); },
      rows_of, rows, begin, end, context, transition);
}
#endif

template <typename W, typename P, typename Acc>
void row_order_dots(const TypedRows<W, P>& rows_of, const Rows& rows, int64_t begin, int64_t end, Acc* context,
                    Acc* transition) {
#if DFLASH2_HAS_AVX512_KERNELS
  if constexpr (std::is_same_v<Acc, float>) {
    if (cpu_has_avx512()) return row_order_dots_avx512(rows_of, rows, begin, end, context, transition);
  }
#endif
  row_order_dots_clone(rows_of, rows, begin, end, context, transition);
}

template <typename W, typename P, typename Acc>
void transitions_in_row_order(const TypedRows<W, P>& rows_of, const Rows& rows, Acc* transition) {
  at::parallel_for(0, rows.shape.rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<Acc> context(rows.shape.rank);
    row_order_dots(rows_of, rows, begin, end, context.data(), transition);
  });
}

// transition[entries[e]] for the entries e of ids [first_id, end_id): B row id read
// once, dotted with each of its entries' contexts (row rows[e] of contexts [N, r]).
// B is read in id order, but a 4 KB page holds 4 of its rows at r = 256 fp32 and the
// hardware's stream prefetch stops at page ends: the B row of the id kPrefetchIds ahead
// is requested too, where that id has entries (r = 256, in turns with the bench's
// floor: 0.93-0.97 of the time without, two ids ahead into L1; 0.82-0.86 four ahead
// into L2; and a lead of 4 KB of context rows, rather than 16 rows whatever their
// width: 0.97 of the time of 16; docs/BENCHMARKS.md at 743a4f8).
template <typename Acc, typename W, typename Dot>
DFLASH2_INLINE void dots_by_candidate_with(const Dot& dot, const Acc* contexts, const W* b_table, int64_t b_stride,
                                           const int64_t* starts, const int64_t* entries, const int64_t* entry_rows,
                                           int64_t first_id, int64_t end_id, int64_t rank, Acc* transition) {
  const int64_t last_entry = starts[end_id];
  const int64_t entries_ahead = entries_ahead_for(rank * static_cast<int64_t>(sizeof(Acc)));
  for (int64_t id = first_id; id < end_id; ++id) {
    const W* b = b_table + id * b_stride;
    const int64_t ahead = id + kPrefetchIds;
    if (ahead < end_id && starts[ahead] != starts[ahead + 1]) {
      prefetch_elements_to_l2(b + kPrefetchIds * b_stride, rank);
    }
    for (int64_t e = starts[id]; e < starts[id + 1]; ++e) {
      if (e + entries_ahead < last_entry) {
        prefetch_elements_to_l2(contexts + entry_rows[e + entries_ahead] * rank, rank);
      }
      transition[entries[e]] = dot(contexts + entry_rows[e] * rank, b, rank);
    }
  }
}

template <typename Acc, typename W>
DFLASH2_ROW_KERNEL void dots_by_candidate_clone(const Acc* contexts, const W* b_table, int64_t b_stride,
                                                const int64_t* starts, const int64_t* entries,
                                                const int64_t* entry_rows, int64_t first_id, int64_t end_id,
                                                int64_t rank, Acc* transition) {
  dots_by_candidate_with([](const Acc* x, const W* y, int64_t n) { return lane_dot(x, y, n); }, contexts, b_table,
                         b_stride, starts, entries, entry_rows, first_id, end_id, rank, transition);
}

#if DFLASH2_HAS_AVX512_KERNELS
template <typename W>
DFLASH2_AVX512_KERNEL void dots_by_candidate_avx512(const float* contexts, const W* b_table, int64_t b_stride,
                                                    const int64_t* starts, const int64_t* entries,
                                                    const int64_t* entry_rows, int64_t first_id, int64_t end_id,
                                                    int64_t rank, float* transition) {
  dots_by_candidate_with(
      [](const float* x, const W* y, int64_t n) __attribute__((always_inline)) { return lane_dot_in<16>(x, y, n); },
      contexts, b_table, b_stride, starts, entries, entry_rows, first_id, end_id, rank, transition);
}
#endif

template <typename Acc, typename W>
void dots_by_candidate(const Acc* contexts, const W* b_table, int64_t b_stride, const int64_t* starts,
                       const int64_t* entries, const int64_t* entry_rows, int64_t first_id, int64_t end_id,
                       int64_t rank, Acc* transition) {
#if DFLASH2_HAS_AVX512_KERNELS
  if constexpr (std::is_same_v<Acc, float>) {
    if (cpu_has_avx512()) {
      return dots_by_candidate_avx512(contexts, b_table, b_stride, starts, entries, entry_rows, first_id, end_id,
                                      rank, transition);
    }
  }
#endif
  dots_by_candidate_clone(contexts, b_table, b_stride, starts, entries, entry_rows, first_id, end_id, rank, transition);
}

// The same terms (the same lane_dot, the same bits) in candidate-id order: each B row in
// use read once, its entries' contexts gathered from an [N, r] table.
template <typename W, typename P, typename Acc>
void transitions_by_candidate_order(const TypedRows<W, P>& rows_of, const Rows& rows, Acc* transition) {
  const auto& shape = rows.shape;
  const int64_t rank = shape.rank;
  Unfilled<Acc> contexts(shape.rows * rank);
  at::parallel_for(0, shape.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      prefetch_row_inputs(rows_of, rows, n + kPrefetchRows, end);
      context_of_row(rows_of, rows, n, contexts.data() + n * rank);
    }
  });
  const IdSegments by_candidate =
      segments_by_id(rows.candidate_ids, shape.rows * shape.top_k, shape.vocab, shape.top_k, /*with_entries=*/true);
  const int64_t grain = std::max<int64_t>(1, shape.vocab / (4 * std::max(1, at::get_num_threads())));
  at::parallel_for(0, shape.vocab, grain, [&](int64_t begin, int64_t end) {
    dots_by_candidate(contexts.data(), rows_of.b_table, rows_of.b_stride, by_candidate.starts.data(),
                      by_candidate.entries.data(), by_candidate.rows.data(), begin, end, rank, transition);
  });
}

// A double result in T as store_dynamic rounds it: 16-bit types through float.
template <typename T>
inline T round_from_double(double value) {
  if constexpr (std::is_same_v<T, double>) {
    return value;
  } else {
    return static_cast<T>(static_cast<float>(value));
  }
}

// scores[n, j] = U[n, j or cand[n, j]] + transition[n k + j], rounded once. A pass of
// its own: k independent loads a row, which overlap where, interleaved with the
// transition arithmetic, each full-vocabulary U entry (a miss in a 500 MB table) waited
// alone.
template <typename Acc>
void add_unary(const Rows& rows, const at::Tensor& unary, bool unary_gathered, const Acc* transition,
               at::Tensor& scores) {
  const auto& shape = rows.shape;
  const int64_t u_stride = unary.stride(0), top_k = shape.top_k;
  const int64_t* ids = rows.candidate_ids;
  dispatch_float(unary.scalar_type(), [&](auto unary_tag) {
    dispatch_float(scores.scalar_type(), [&](auto score_tag) {
      using U = decltype(unary_tag);
      using S = decltype(score_tag);
      const U* u = unary.const_data_ptr<U>();
      S* out = scores.mutable_data_ptr<S>();
      at::parallel_for(0, shape.rows, 64, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          const U* u_row = u + n * u_stride;
          for (int64_t j = 0; j < top_k; ++j) {
            const int64_t flat = n * top_k + j;
            const double total =
                static_cast<double>(u_row[unary_gathered ? j : ids[flat]]) + static_cast<double>(transition[flat]);
            out[flat] = round_from_double<S>(total);
          }
        }
      });
    });
  });
}

template <typename W, typename P>
void scores_forward(const Rows& rows, const at::Tensor& unary, bool unary_gathered, at::Tensor& scores) {
  using Acc = accumulator_t<W>;
  const TypedRows<W, P> rows_of(rows);
  Unfilled<Acc> transition(rows.shape.rows * rows.shape.top_k);
  if (transitions_by_candidate(rows.shape, sizeof(W))) {
    transitions_by_candidate_order(rows_of, rows, transition.data());
  } else {
    transitions_in_row_order(rows_of, rows, transition.data());
  }
  add_unary(rows, unary, unary_gathered, transition.data(), scores);
}

// Elements [first_rho, rank) of the row of the id whose slots are [first, stop), acc
// [rank] in memory: the whole sum of the clone below, the tail after the AVX-512
// kernel's 64-wide chunks. The terms' rows are prefetched ahead where `prefetch`.
template <typename W, typename T>
DFLASH2_INLINE void id_sum_elements(const int64_t* term_rows, int64_t first, int64_t stop, int64_t last_entry,
                                    bool prefetch, const double* weights, const T* terms, int64_t first_rho,
                                    int64_t rank, double* acc, W* row) {
  std::fill(acc + first_rho, acc + rank, 0.0);
  for (int64_t e = first; e < stop; ++e) {
    if (prefetch && e + kPrefetchEntries < last_entry) {
      prefetch_elements_to_l2(terms + term_rows[e + kPrefetchEntries] * rank, rank);
    }
    const T* term = terms + term_rows[e] * rank;
    if (weights == nullptr) {
      for (int64_t rho = first_rho; rho < rank; ++rho) acc[rho] += static_cast<double>(term[rho]);
    } else {
      const double weight = weights[e];
      for (int64_t rho = first_rho; rho < rank; ++rho) acc[rho] += weight * static_cast<double>(term[rho]);
    }
  }
  for (int64_t rho = first_rho; rho < rank; ++rho) row[rho] = round_from_double<W>(acc[rho]);
}

// Rows [begin, end) of a [V, r] table in W: row id = sum over id's slots s (in slot
// order) of weights[s] * terms[term_rows[s]] (weight 1 where weights is null), in double
// whatever W is, rounded once; rows of ids with no entry are zero. One clone owns the
// whole sweep, so its row arithmetic inlines and compiles for its target. acc: [rank].
template <typename W, typename T>
DFLASH2_ROW_KERNEL void id_sums(const int64_t* starts, const int64_t* term_rows, int64_t begin, int64_t end,
                                const double* weights, const T* terms, int64_t rank, double* acc, W* out) {
  for (int64_t id = begin; id < end; ++id) {
    W* row = out + id * rank;
    if (starts[id] == starts[id + 1]) {
      std::fill(row, row + rank, W(0));
    } else {
      id_sum_elements(term_rows, starts[id], starts[id + 1], starts[end], /*prefetch=*/true, weights, terms, 0, rank,
                      acc, row);
    }
  }
}

#if DFLASH2_HAS_AVX512_KERNELS
// id_sums with each 64-element chunk of an id's sum in registers (double_lanes.h):
// an id's terms are read once per chunk, from cache after the first. W: float or
// bfloat16; T: float, bfloat16 or double. kStream: the table's rows are written with
// non-temporal stores (rank a multiple of 64, the table 64-byte aligned).
template <bool kStream, typename W, typename T>
DFLASH2_AVX512_KERNEL void id_sums_avx512(const int64_t* starts, const int64_t* term_rows, int64_t begin,
                                          int64_t end, const double* weights, const T* terms, int64_t rank,
                                          double* acc, W* out) {
  const int64_t last_entry = starts[end];
  const int64_t chunked = rank - rank % kDoubleChunk;
  for (int64_t id = begin; id < end; ++id) {
    W* row = out + id * rank;
    const int64_t first = starts[id], stop = starts[id + 1];
    if (first == stop) {
      if constexpr (kStream) {
        for (int64_t rho = 0; rho < rank; rho += 8) stream8(row + rho, FloatLanes<8>::floats{});
      } else {
        std::fill(row, row + rank, W(0));
      }
      continue;
    }
    const auto prefetch_ahead = [&](int64_t e) {
      if (e + kPrefetchEntries < last_entry) {
        prefetch_elements_to_l2(terms + term_rows[e + kPrefetchEntries] * rank, rank);
      }
    };
    for (int64_t c0 = 0; c0 < chunked; c0 += kDoubleChunk) {
      DoubleChunk sums = zero_chunk();
      for (int64_t e = first; e < stop; ++e) {
        if (c0 == 0) prefetch_ahead(e);
        const T* term = terms + term_rows[e] * rank + c0;
        if (weights == nullptr) {
          add_chunk(sums, term);
        } else {
          add_scaled_chunk(sums, weights[e], term);
        }
      }
      for (int v = 0; v < 8; ++v) {
        if constexpr (kStream) {
          stream8(row + c0 + 8 * v, narrow8(sums.lanes[v]));
        } else {
          store_rounded8(row + c0 + 8 * v, sums.lanes[v]);
        }
      }
    }
    if (chunked < rank) {
      id_sum_elements(term_rows, first, stop, last_entry, /*prefetch=*/chunked == 0, weights, terms, chunked, rank,
                      acc, row);
    }
  }
  if constexpr (kStream) _mm_sfence();
}
#endif

// table [V, r] in W, every row (id_sums over segments, weighted by the segments' weights
// where they have them). The sums run in double: a float sum missed SPEC section 4 at
// training sizes, where an id's terms (~1,000 rows of a 64k-row batch over a small
// vocabulary) form one serial chain while torch's reference sums in a tree; the terms
// are products of two floats, exact in double. The whole table is written in id order,
// so it needs no separate zero fill.
template <typename W, typename T>
void id_sum_table(const IdSegments& segments, bool weighted, const T* terms, int64_t rank, at::Tensor& table) {
  const int64_t vocab = segments.vocab;
  W* out = table.data_ptr<W>();
  const double* weights = weighted ? segments.weights.data() : nullptr;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, rank));
  at::parallel_for(0, vocab, grain, [&](int64_t begin, int64_t end) {
    Unfilled<double> acc(rank);
#if DFLASH2_HAS_AVX512_KERNELS
    if constexpr (std::is_same_v<W, float> || std::is_same_v<W, at::BFloat16>) {
      if (cpu_has_avx512()) {
        const bool stream = rank % kDoubleChunk == 0 && reinterpret_cast<uintptr_t>(out) % kCacheLine == 0;
        const auto sweep = stream ? id_sums_avx512<true, W, T> : id_sums_avx512<false, W, T>;
        return sweep(segments.starts.data(), segments.rows.data(), begin, end, weights, terms, rank, acc.data(), out);
      }
    }
#endif
    id_sums<W, T>(segments.starts.data(), segments.rows.data(), begin, end, weights, terms, rank, acc.data(), out);
  });
}

// Elements [first_rho, rank) of row n of the backward's row pass: g = sum_j dS[n, j]
// B[cand[n, j]] in double (g [rank] in memory), then dP = A[pred] * g, row n's dA term
// P * g (double) and its context A[pred] * P (the dB terms' row vector, Acc). The whole
// row in the clone below, the tail after the AVX-512 kernel's 64-wide chunks. The
// candidates' B rows are prefetched ahead (rows up to `end`) where `prefetch`.
// ds: [N k] double.
template <typename W, typename P, typename Acc>
DFLASH2_INLINE void backward_row_elements(const TypedRows<W, P>& rows_of, const Rows& rows, int64_t n, int64_t end,
                                          bool prefetch, int64_t first_rho, const double* ds, double* g,
                                          P* dp_table, double* projected_times_g, Acc* contexts) {
  const int64_t rank = rows.shape.rank, top_k = rows.shape.top_k;
  std::fill(g + first_rho, g + rank, 0.0);
  for (int64_t e = n * top_k; e < (n + 1) * top_k; ++e) {
    if (prefetch) prefetch_candidate_row(rows_of, rows, e + kPrefetchCandidates, end * top_k);
    const W* b = rows_of.b(rows.candidate_ids[e]);
    const double weight = ds[e];
    for (int64_t rho = first_rho; rho < rank; ++rho) g[rho] += weight * static_cast<double>(b[rho]);
  }
  const W* a = rows_of.a(rows.predecessor_ids[n]);
  const P* p = rows_of.p(n);
  P* dp = dp_table + n * rank;
  double* pg = projected_times_g + n * rank;
  Acc* context = contexts + n * rank;
  for (int64_t rho = first_rho; rho < rank; ++rho) {
    const Acc a_rho = static_cast<Acc>(a[rho]), p_rho = static_cast<Acc>(p[rho]);
    dp[rho] = round_from_double<P>(static_cast<double>(a_rho) * g[rho]);
    pg[rho] = static_cast<double>(p_rho) * g[rho];
    context[rho] = context_term(a_rho, p_rho);
  }
}

// Rows [begin, end) of the backward's row pass (backward_row_elements, whole rows). One
// clone owns the rows, as id_sums. g: [rank].
template <typename W, typename P, typename Acc>
DFLASH2_ROW_KERNEL void backward_row_terms_clone(const TypedRows<W, P>& rows_of, const Rows& rows, int64_t begin,
                                                 int64_t end, const double* ds, double* g, P* dp_table,
                                                 double* projected_times_g, Acc* contexts) {
  for (int64_t n = begin; n < end; ++n) {
    prefetch_row_inputs(rows_of, rows, n + kPrefetchRows, end);
    backward_row_elements(rows_of, rows, n, end, /*prefetch=*/true, 0, ds, g, dp_table, projected_times_g,
                          contexts);
  }
}

#if DFLASH2_HAS_AVX512_KERNELS
// backward_row_terms for float or bfloat16 codebooks (Acc float) with each 64-element
// chunk of g in registers (double_lanes.h): a row's k B rows are read once per chunk,
// from cache after the first.
template <typename W, typename P>
DFLASH2_AVX512_KERNEL void backward_row_terms_avx512(const TypedRows<W, P>& rows_of, const Rows& rows,
                                                     int64_t begin, int64_t end, const double* ds, double* g,
                                                     P* dp_table, double* projected_times_g, float* contexts) {
  const int64_t rank = rows.shape.rank, top_k = rows.shape.top_k;
  const int64_t chunked = rank - rank % kDoubleChunk;
  for (int64_t n = begin; n < end; ++n) {
    prefetch_row_inputs(rows_of, rows, n + kPrefetchRows, end);
    const int64_t* candidates = rows.candidate_ids + n * top_k;
    const double* weights = ds + n * top_k;
    const auto prefetch_ahead = [&](int64_t j) {
      prefetch_candidate_row(rows_of, rows, n * top_k + j + kPrefetchCandidates, end * top_k);
    };
    const W* a = rows_of.a(rows.predecessor_ids[n]);
    const P* p = rows_of.p(n);
    P* dp = dp_table + n * rank;
    double* pg = projected_times_g + n * rank;
    float* context = contexts + n * rank;
    for (int64_t c0 = 0; c0 < chunked; c0 += kDoubleChunk) {
      DoubleChunk sums = zero_chunk();
      for (int64_t j = 0; j < top_k; ++j) {
        if (c0 == 0) prefetch_ahead(j);
        add_scaled_chunk(sums, weights[j], rows_of.b(candidates[j]) + c0);
      }
      for (int v = 0; v < 8; ++v) {
        const int64_t at = c0 + 8 * v;
        const FloatLanes<8>::floats a8 = load_floats<8>(a + at), p8 = load_floats<8>(p + at);
        const Doubles8 a_d = widen8(a8), p_d = widen8(p8);
        store_rounded8(dp + at, a_d * sums.lanes[v]);
        const Doubles8 pg8 = p_d * sums.lanes[v];
        std::memcpy(pg + at, &pg8, sizeof(pg8));
        store_floats<8>(context + at, a8 * p8);
      }
    }
    if (chunked < rank) {
      backward_row_elements(rows_of, rows, n, end, /*prefetch=*/chunked == 0, chunked, ds, g, dp_table,
                            projected_times_g, contexts);
    }
  }
}
#endif

template <typename W, typename P, typename Acc>
void backward_row_terms(const TypedRows<W, P>& rows_of, const Rows& rows, int64_t begin, int64_t end,
                        const double* ds, double* g, P* dp_table, double* projected_times_g, Acc* contexts) {
#if DFLASH2_HAS_AVX512_KERNELS
  if constexpr (std::is_same_v<W, float> || std::is_same_v<W, at::BFloat16>) {
    if (cpu_has_avx512()) {
      return backward_row_terms_avx512(rows_of, rows, begin, end, ds, g, dp_table, projected_times_g, contexts);
    }
  }
#endif
  backward_row_terms_clone(rows_of, rows, begin, end, ds, g, dp_table, projected_times_g, contexts);
}

// dU rows [begin, end) of full-vocabulary logits, whole: zeros (all-zero bits in every
// float dtype), then the candidates' dS, repeated ids summed and rounded once at their
// first occurrence. Written row by row, while the row is in cache, instead of after a
// separate [N, V] zero fill. ds: [N k] double.
void write_unary_gradient_rows(const Rows& rows, const double* ds, int64_t begin, int64_t end,
                               at::Tensor& grad_unary) {
  const int64_t top_k = rows.shape.top_k;
  char* du = static_cast<char*>(grad_unary.data_ptr());
  const int64_t row_bytes = grad_unary.stride(0) * grad_unary.element_size();
  for (int64_t n = begin; n < end; ++n) {
    const int64_t* candidates = rows.candidate_ids + n * top_k;
    std::memset(du + n * row_bytes, 0, rows.shape.vocab * grad_unary.element_size());
    for (int64_t j = 0; j < top_k; ++j) {
      bool first_occurrence = true;
      for (int64_t earlier = 0; earlier < j && first_occurrence; ++earlier) {
        first_occurrence = candidates[earlier] != candidates[j];
      }
      if (!first_occurrence) continue;
      double total = 0.0;
      for (int64_t later = j; later < top_k; ++later) {
        if (candidates[later] == candidates[j]) total += ds[n * top_k + later];
      }
      store_dynamic(grad_unary.data_ptr(), n * grad_unary.stride(0) + candidates[j], grad_unary.scalar_type(),
                    total);
    }
  }
}

template <typename W, typename P>
void scores_backward(const Rows& rows, const at::Tensor& grad, bool unary_gathered, at::Tensor& grad_unary,
                     at::Tensor& grad_projected, at::Tensor& grad_predecessor, at::Tensor& grad_successor) {
  using Acc = accumulator_t<W>;
  const auto& shape = rows.shape;
  const int64_t rank = shape.rank, entries = shape.rows * shape.top_k;
  const TypedRows<W, P> rows_of(rows);
  // dS in double, read by the row pass (g's weights, dU) and, sorted by candidate, by
  // dB's sums.
  Unfilled<double> ds(entries);
  const void* ds_in = grad.data_ptr();
  const auto ds_type = grad.scalar_type();
  at::parallel_for(0, entries, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
    for (int64_t flat = begin; flat < end; ++flat) ds[flat] = load_dynamic(ds_in, flat, ds_type);
  });
  // g = sum_j dS_j B[cand_j] runs in double (products of two floats are exact there),
  // as do the sums over ids below: in float, a batch whose rows share dS and ids (a
  // broadcast grad_scores) repeats g's rounding error in every row of an id's dA sum,
  // past SPEC section 4. Per row: P * g (row n's dA term, double) and the context
  // A[pred] * P (the dB terms' row vector, Acc), kept so that the sums over ids read
  // one [N, r] row per term instead of an A row, a P row and a recomputation.
  Unfilled<double> projected_times_g(shape.rows * rank);
  Unfilled<Acc> contexts(shape.rows * rank);
  at::parallel_for(0, shape.rows, 16, [&](int64_t begin, int64_t end) {
    Unfilled<double> g(rank);
    backward_row_terms(rows_of, rows, begin, end, ds.data(), g.data(), grad_projected.data_ptr<P>(),
                       projected_times_g.data(), contexts.data());
    if (!unary_gathered) write_unary_gradient_rows(rows, ds.data(), begin, end, grad_unary);
  });

  const IdSegments by_predecessor = segments_by_id(rows.predecessor_ids, shape.rows, shape.vocab);
  id_sum_table<W>(by_predecessor, /*weighted=*/false, projected_times_g.data(), rank, grad_predecessor);
  const IdSegments by_candidate =
      segments_by_id(rows.candidate_ids, entries, shape.vocab, shape.top_k, /*with_entries=*/false, ds.data());
  id_sum_table<W>(by_candidate, /*weighted=*/true, contexts.data(), rank, grad_successor);
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
                                                        unary_width, unary_dtype, /*zero_filled=*/false);
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
