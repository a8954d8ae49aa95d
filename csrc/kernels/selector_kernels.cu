// CUDA kernels of the candidate selector (SPEC section 2), torch-free.
//
// One warp per row: lanes split the rank axis into 16-byte vectors, so a candidate's
// codebook row B[b] (r = 256 bf16 = 512 bytes) is one coalesced warp load. Nothing of
// size [N, k, r] is ever formed: the context A[pred] * P lives in registers, and each
// candidate's dot product is reduced across the warp.
//
// Backward: one row pass forms g[n] = sum_j dS[n, j] B[cand[n, j]] and writes dP and
// dA's per-row terms; dA and dB are then sums over rows grouped by id, done as
// deterministic segmented sums over the ids sorted by the caller (no atomics).
#include <type_traits>

#include "kernels/launch.cuh"
#include "kernels/selector.cuh"

namespace dflash2 {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kCandidatesPerPass = 32;  // a pass keeps one partial dot per candidate in registers
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_acc(double v);
template <>
__device__ __forceinline__ float from_acc<float>(double v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <>
__device__ __forceinline__ __half from_acc<__half>(double v) { return __double2half(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(double v) { return __double2bfloat16(v); }

// Loads and stores of tensors whose dtype is only known at run time (U, S, dS, dU):
// k elements a row, so the switch costs nothing next to the codebook traffic.
__device__ __forceinline__ double load_dynamic(const void* base, int64_t index, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[index];
    case DType::kFloat16: return __half2float(static_cast<const __half*>(base)[index]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
    default: return static_cast<const double*>(base)[index];
  }
}

__device__ __forceinline__ void store_dynamic(void* base, int64_t index, DType dtype, double value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[index] = static_cast<float>(value); break;
    case DType::kFloat16: static_cast<__half*>(base)[index] = __double2half(value); break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(base)[index] = __double2bfloat16(value); break;
    default: static_cast<double*>(base)[index] = value; break;
  }
}

// VEC consecutive elements as accumulators; 16-byte loads when the bytes allow
// (the bindings guarantee alignment whenever VEC > 1).
template <int VEC, typename T, typename Acc>
__device__ __forceinline__ void load_vector(const T* __restrict__ source, Acc (&out)[VEC]) {
  constexpr int kBytes = VEC * static_cast<int>(sizeof(T));
  if constexpr (VEC > 1 && kBytes % 16 == 0) {
    constexpr int kPerLoad = 16 / static_cast<int>(sizeof(T));
#pragma unroll
    for (int piece = 0; piece < kBytes / 16; ++piece) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(source) + piece);
      const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPerLoad; ++i) out[piece * kPerLoad + i] = static_cast<Acc>(to_acc(values[i]));
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = static_cast<Acc>(to_acc(source[i]));
  }
}

// An element's bits, for packing 16-byte stores.
__device__ __forceinline__ uint64_t element_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ uint64_t element_bits(double v) { return static_cast<uint64_t>(__double_as_longlong(v)); }
__device__ __forceinline__ uint64_t element_bits(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint64_t element_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// VEC consecutive elements from accumulators; 16-byte stores when the bytes allow (the
// bindings guarantee alignment whenever VEC > 1). nvcc does not merge scalar stores to
// a pointer of unknown alignment, and a warp's 4-byte stores 16 bytes apart touch four
// times the sectors of one 16-byte store each (benchmarks/traffic_minimum.py counts).
template <int VEC, typename T, typename Acc>
__device__ __forceinline__ void store_vector(T* __restrict__ target, const Acc (&values)[VEC]) {
  constexpr int kBytes = VEC * static_cast<int>(sizeof(T));
  if constexpr (VEC > 1 && kBytes % 16 == 0) {
    constexpr int kPerStore = 16 / static_cast<int>(sizeof(T));
    constexpr int kBits = 8 * static_cast<int>(sizeof(T));
#pragma unroll
    for (int piece = 0; piece < kBytes / 16; ++piece) {
      uint64_t halves[2] = {0, 0};  // the 16 bytes, packed in registers
#pragma unroll
      for (int i = 0; i < kPerStore; ++i) {
        const uint64_t bits = element_bits(from_acc<T>(static_cast<double>(values[piece * kPerStore + i])));
        halves[i * kBits / 64] |= bits << (i * kBits % 64);
      }
      store_16_bytes(target + piece * kPerStore,
                     make_uint4(static_cast<uint32_t>(halves[0]), static_cast<uint32_t>(halves[0] >> 32),
                                static_cast<uint32_t>(halves[1]), static_cast<uint32_t>(halves[1] >> 32)));
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) target[i] = from_acc<T>(static_cast<double>(values[i]));
  }
}

template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc value) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

__device__ __forceinline__ int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
}

// What a row's warp reads: its predecessor's A row (row 0 stands in for a bad id, whose
// results are then discarded), its P row, B, and its candidate ids.
template <typename W, typename P>
struct SelectorRow {
  bool predecessor_ok;
  const W* a_row;
  const P* p_row;
  const W* b_table;
  const int64_t* candidates;

  __device__ __forceinline__ SelectorRow(const SelectorOperands& op, int64_t row) {
    const int64_t predecessor = op.predecessor_ids[row];
    predecessor_ok = id_in_range(predecessor, op.vocab);
    a_row = static_cast<const W*>(op.predecessor_codebook) + (predecessor_ok ? predecessor : 0) * op.predecessor_row_stride;
    p_row = static_cast<const P*>(op.projected) + row * op.projected_row_stride;
    b_table = static_cast<const W*>(op.successor_codebook);
    candidates = op.candidate_ids + row * op.top_k;
  }
};

// S[n, j] = U[n, cand[n, j]] + sum_rho A[pred[n], rho] * P[n, rho] * B[cand[n, j], rho].
// An id out of [0, V) yields NaN for its score (and the whole row for a bad
// predecessor) instead of a read out of bounds.
template <typename W, typename P, int VEC>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    selector_scores_forward_kernel(const SelectorForwardParams params) {
  using Acc = accumulator_t<W>;
  const SelectorOperands& op = params.operands;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = warp_row();
  if (row >= op.rows) return;

  const SelectorRow<W, P> row_in(op, row);

  for (int64_t first = 0; first < op.top_k; first += kCandidatesPerPass) {
    const int count = static_cast<int>(min(static_cast<int64_t>(kCandidatesPerPass), op.top_k - first));
    // Lane j holds candidate j's id and hands it to the others as the loop needs it:
    // hoisted out of the rank loop, 32 ids would hold 64 registers (and spill).
    const int64_t lane_id = lane < count ? row_in.candidates[first + lane] : int64_t(-1);
    Acc dots[kCandidatesPerPass];
#pragma unroll
    for (int j = 0; j < kCandidatesPerPass; ++j) dots[j] = Acc(0);

    // Every lane runs every step (the shuffles need the whole warp); lanes past the rank
    // load nothing.
    for (int64_t step = 0; step < op.rank; step += kWarp * VEC) {
      const int64_t rho = step + static_cast<int64_t>(lane) * VEC;
      const bool in_rank = rho < op.rank;
      Acc a[VEC], p[VEC], context[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) context[i] = Acc(0);
      if (in_rank) {
        load_vector<VEC>(row_in.a_row + rho, a);
        load_vector<VEC>(row_in.p_row + rho, p);
#pragma unroll
        for (int i = 0; i < VEC; ++i) context[i] = context_term(a[i], p[i]);
      }
      // Guards, not breaks: a fully unrolled loop keeps dots[] in registers.
#pragma unroll
      for (int j = 0; j < kCandidatesPerPass; ++j) {
        const int64_t id = __shfl_sync(kFullMask, lane_id, j);
        if (in_rank && id_in_range(id, op.vocab)) {
          Acc b[VEC];
          load_vector<VEC>(row_in.b_table + id * op.successor_row_stride + rho, b);
#pragma unroll
          for (int i = 0; i < VEC; ++i) dots[j] += context[i] * b[i];
        }
      }
    }

    Acc mine = Acc(0);
#pragma unroll
    for (int j = 0; j < kCandidatesPerPass; ++j) {
      if (j < count) {
        const Acc total = warp_sum(dots[j]);
        if (j == lane) mine = total;
      }
    }
    if (lane < count) {
      const int64_t j = first + lane;
      const int64_t id = row_in.candidates[j];
      double score = __longlong_as_double(0x7ff8000000000000LL);  // quiet NaN
      if (row_in.predecessor_ok && id_in_range(id, op.vocab)) {
        const int64_t column = params.unary_gathered ? j : id;
        score = load_dynamic(params.unary, row * params.unary_row_stride + column, params.unary_dtype) +
                static_cast<double>(mine);
      }
      store_dynamic(params.scores, row * op.top_k + j, params.scores_dtype, score);
    }
  }
}

// Per row n: g = sum_j dS[n, j] B[cand[n, j]]; dP[n] = A[pred[n]] * g; dA's term
// P[n] * g into projected_times_g; dU[n, id] = the sum of dS[n, j] over the j with
// cand[n, j] == id, written once per distinct id (so repeats round once).
// At least kRowsPassBlocksPerSm blocks a multiprocessor, not the 16 of full occupancy:
// that lets ptxas keep the ~48 registers the pass needs, where it would otherwise squeeze
// it into 32 and spill (CUDA 13.0's ptxas, sm_80 ... sm_120: 8-12 bytes a thread).
constexpr int kRowsPassBlocksPerSm = 8;
template <typename W, typename P, int VEC>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock, kRowsPassBlocksPerSm)
    selector_backward_rows_kernel(const SelectorBackwardParams params) {
  using Acc = accumulator_t<W>;
  const SelectorOperands& op = params.operands;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = warp_row();
  if (row >= op.rows) return;

  const SelectorRow<W, P> row_in(op, row);
  const int64_t grad_row = row * op.top_k;
  P* dp_row = static_cast<P*>(params.grad_projected) + row * op.rank;
  Acc* pg_row = static_cast<Acc*>(params.projected_times_g) + row * op.rank;

  for (int64_t rho = static_cast<int64_t>(lane) * VEC; rho < op.rank; rho += kWarp * VEC) {
    Acc g[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) g[i] = Acc(0);
    for (int64_t j = 0; j < op.top_k; ++j) {
      const int64_t id = row_in.candidates[j];
      if (!id_in_range(id, op.vocab)) continue;
      const Acc weight = static_cast<Acc>(load_dynamic(params.grad_scores, grad_row + j, params.grad_scores_dtype));
      Acc b[VEC];
      load_vector<VEC>(row_in.b_table + id * op.successor_row_stride + rho, b);
#pragma unroll
      for (int i = 0; i < VEC; ++i) g[i] += weight * b[i];
    }
    Acc a[VEC], p[VEC], dp[VEC], pg[VEC];
    load_vector<VEC>(row_in.a_row + rho, a);
    load_vector<VEC>(row_in.p_row + rho, p);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      dp[i] = row_in.predecessor_ok ? a[i] * g[i] : Acc(0);
      pg[i] = row_in.predecessor_ok ? p[i] * g[i] : Acc(0);
    }
    store_vector<VEC>(dp_row + rho, dp);
    store_vector<VEC>(pg_row + rho, pg);
  }

  if (params.grad_unary == nullptr) return;
  for (int64_t j = lane; j < op.top_k; j += kWarp) {
    const int64_t id = row_in.candidates[j];
    if (!id_in_range(id, op.vocab)) continue;
    bool first_occurrence = true;
    for (int64_t earlier = 0; earlier < j && first_occurrence; ++earlier) {
      first_occurrence = row_in.candidates[earlier] != id;
    }
    if (!first_occurrence) continue;
    double total = 0.0;
    for (int64_t later = j; later < op.top_k; ++later) {
      if (row_in.candidates[later] == id) {
        total += load_dynamic(params.grad_scores, grad_row + later, params.grad_scores_dtype);
      }
    }
    store_dynamic(params.grad_unary, row * params.grad_unary_row_stride + id, params.grad_unary_dtype, total);
  }
}

// dA and dB: sums over entries grouped by id, the entries sorted by id. What an
// entry e (original index `order[e]`) contributes to its id's row, for rank slice rho:
//   predecessors: P[n] * g[n]                      (n = order[e], from the rows pass)
//   successors:   dS[n, j] * A[pred[n]] * P[n]     (n, j from order[e] = n * k + j)
template <typename W, typename P, int VEC, bool kSuccessors>
__device__ __forceinline__ void add_contribution(const SelectorBackwardParams& params, int64_t original, int64_t rho,
                                                 accumulator_t<W> (&acc)[VEC]) {
  using Acc = accumulator_t<W>;
  const SelectorOperands& op = params.operands;
  if constexpr (kSuccessors) {
    const int64_t row = original / op.top_k;
    const int64_t predecessor = op.predecessor_ids[row];
    if (!id_in_range(predecessor, op.vocab)) return;
    const Acc weight = static_cast<Acc>(load_dynamic(params.grad_scores, original, params.grad_scores_dtype));
    Acc a[VEC], p[VEC];
    load_vector<VEC>(static_cast<const W*>(op.predecessor_codebook) + predecessor * op.predecessor_row_stride + rho, a);
    load_vector<VEC>(static_cast<const P*>(op.projected) + row * op.projected_row_stride + rho, p);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] += weight * context_term(a[i], p[i]);
  } else {
    Acc pg[VEC];
    load_vector<VEC>(static_cast<const Acc*>(params.projected_times_g) + original * op.rank + rho, pg);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] += pg[i];
  }
}

// Pass 1 of a segmented sum: one warp per chunk of kSegmentChunk sorted entries.
// A minimum of 4 blocks per multiprocessor (a 64-register cap, above what it uses): without
// one, sm_80's ptxas spilled 8 bytes in the float64 successor instance (two 16-byte stores
// per piece); any explicit minimum keeps it in 44 registers.
template <typename W, typename P, int VEC, bool kSuccessors>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock, 4)
    selector_segment_chunks_kernel(const SelectorBackwardParams params, const int64_t* __restrict__ sorted_ids,
                                   const int64_t* __restrict__ order, int64_t entries,
                                   accumulator_t<W>* __restrict__ partials, W* __restrict__ grad_table) {
  using Acc = accumulator_t<W>;
  const SelectorOperands& op = params.operands;
  const int lane = threadIdx.x % kWarp;
  const int64_t chunk = warp_row();
  const int64_t chunk_start = chunk * kSegmentChunk;
  if (chunk_start >= entries) return;
  const int64_t chunk_end = min(entries, chunk_start + kSegmentChunk);

  for (int64_t rho = static_cast<int64_t>(lane) * VEC; rho < op.rank; rho += kWarp * VEC) {
    Acc acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = Acc(0);
    int64_t piece_start = chunk_start;
    for (int64_t e = chunk_start; e < chunk_end; ++e) {
      const int64_t id = sorted_ids[e];
      add_contribution<W, P, VEC, kSuccessors>(params, order[e], rho, acc);
      if (e + 1 < chunk_end && sorted_ids[e + 1] == id) continue;

      const bool began_before = piece_start == chunk_start && chunk_start > 0 && sorted_ids[chunk_start - 1] == id;
      const bool continues = e + 1 == chunk_end && chunk_end < entries && sorted_ids[chunk_end] == id;
      const Piece piece = classify_piece(began_before, continues);
      if (piece == Piece::kComplete) {
        if (id_in_range(id, op.vocab)) store_vector<VEC>(grad_table + id * op.rank + rho, acc);
      } else {
        const int slot = piece == Piece::kLeading ? 0 : 1;
        store_vector<VEC>(partials + (chunk * 2 + slot) * op.rank + rho, acc);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = Acc(0);
      piece_start = e + 1;
    }
  }
}

// Pass 2: the chunk where a run that crosses chunks begins adds its trailing piece
// and the following chunks' leading pieces, in chunk order, and writes the row.
template <typename W>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    selector_segment_carry_kernel(const int64_t* __restrict__ sorted_ids, int64_t entries, int64_t rank,
                                  int64_t vocab, const accumulator_t<W>* __restrict__ partials,
                                  W* __restrict__ grad_table) {
  using Acc = accumulator_t<W>;
  const int lane = threadIdx.x % kWarp;
  const int64_t chunk = warp_row();
  const int64_t chunk_start = chunk * kSegmentChunk;
  if (chunk_start >= entries) return;
  const int64_t chunk_end = min(entries, chunk_start + kSegmentChunk);
  const int64_t id = sorted_ids[chunk_end - 1];
  const bool continues = chunk_end < entries && sorted_ids[chunk_end] == id;
  const bool whole_chunk_began_before =
      sorted_ids[chunk_start] == id && chunk_start > 0 && sorted_ids[chunk_start - 1] == id;
  if (!continues || whole_chunk_began_before || !id_in_range(id, vocab)) return;

  for (int64_t rho = lane; rho < rank; rho += kWarp) {
    Acc total = partials[(chunk * 2 + 1) * rank + rho];
    for (int64_t next = chunk + 1;; ++next) {
      total += partials[(next * 2) * rank + rho];
      const int64_t next_end = min(entries, (next + 1) * kSegmentChunk);
      if (next_end >= entries || sorted_ids[next_end] != id) break;
    }
    grad_table[id * rank + rho] = from_acc<W>(static_cast<double>(total));
  }
}

unsigned blocks_for_warps(int64_t warps) {
  return static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// Calls f(W{}, P{}, std::integral_constant<int, VEC>{}) for the run-time dtypes.
template <typename F>
cudaError_t dispatch_types(const SelectorOperands& op, F&& f) {
  auto with_projected = [&](auto codebook_tag) -> cudaError_t {
    using W = decltype(codebook_tag);
    constexpr int kVec = 16 / static_cast<int>(sizeof(W));
    auto with_vec = [&](auto projected_tag) -> cudaError_t {
      if (op.vectorized) return f(codebook_tag, projected_tag, std::integral_constant<int, kVec>{});
      return f(codebook_tag, projected_tag, std::integral_constant<int, 1>{});
    };
    if (op.projected_dtype == op.codebook_dtype) return with_vec(W{});
    if (op.projected_dtype == DType::kFloat32) return with_vec(float{});
    return cudaErrorInvalidValue;
  };
  switch (op.codebook_dtype) {
    case DType::kFloat32: return with_projected(float{});
    case DType::kFloat16: return with_projected(__half{});
    case DType::kBFloat16: return with_projected(__nv_bfloat16{});
    case DType::kFloat64: return with_projected(double{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_selector_forward(const SelectorForwardParams& params, cudaStream_t stream) {
  if (params.operands.rows == 0 || params.operands.top_k == 0) return cudaSuccess;
  return dispatch_types(params.operands, [&](auto codebook_tag, auto projected_tag, auto vec) {
    using W = decltype(codebook_tag);
    using P = decltype(projected_tag);
    return launch_kernel<selector_scores_forward_kernel<W, P, decltype(vec)::value>>(
        blocks_for_warps(params.operands.rows), kWarp * kWarpsPerBlock, 0, stream, params);
  });
}

cudaError_t launch_selector_backward(const SelectorBackwardParams& params, cudaStream_t stream) {
  const SelectorOperands& op = params.operands;
  if (op.rows == 0) return cudaSuccess;
  return dispatch_types(op, [&](auto codebook_tag, auto projected_tag, auto vec) {
    using W = decltype(codebook_tag);
    using P = decltype(projected_tag);
    using Acc = accumulator_t<W>;
    constexpr int kVec = decltype(vec)::value;
    const unsigned threads = kWarp * kWarpsPerBlock;
    cudaError_t status =
        launch_kernel<selector_backward_rows_kernel<W, P, kVec>>(blocks_for_warps(op.rows), threads, 0, stream, params);
    if (status != cudaSuccess) return status;

    Acc* partials = static_cast<Acc*>(params.chunk_partials);
    const int64_t predecessor_chunks = segment_chunks(op.rows);
    Acc* successor_partials = partials + predecessor_chunks * 2 * op.rank;
    W* grad_a = static_cast<W*>(params.grad_predecessor_codebook);
    W* grad_b = static_cast<W*>(params.grad_successor_codebook);

    status = launch_kernel<selector_segment_chunks_kernel<W, P, kVec, false>>(
        blocks_for_warps(predecessor_chunks), threads, 0, stream, params, params.predecessor_sorted_ids,
        params.predecessor_order, op.rows, partials, grad_a);
    if (status != cudaSuccess) return status;
    status = launch_kernel<selector_segment_carry_kernel<W>>(blocks_for_warps(predecessor_chunks), threads, 0, stream,
                                                             params.predecessor_sorted_ids, op.rows, op.rank, op.vocab,
                                                             partials, grad_a);
    if (status != cudaSuccess) return status;

    const int64_t candidate_entries = op.rows * op.top_k;
    if (candidate_entries == 0) return cudaSuccess;
    const int64_t candidate_chunks = segment_chunks(candidate_entries);
    status = launch_kernel<selector_segment_chunks_kernel<W, P, kVec, true>>(
        blocks_for_warps(candidate_chunks), threads, 0, stream, params, params.candidate_sorted_ids,
        params.candidate_order, candidate_entries, successor_partials, grad_b);
    if (status != cudaSuccess) return status;
    return launch_kernel<selector_segment_carry_kernel<W>>(blocks_for_warps(candidate_chunks), threads, 0, stream,
                                                           params.candidate_sorted_ids, candidate_entries, op.rank,
                                                           op.vocab, successor_partials, grad_b);
  });
}

}  // namespace dflash2
