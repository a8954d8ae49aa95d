// CUDA kernels of the serving path's selection (SPEC section 2), torch-free.
//
// Two launches per drafted block:
//   1. topk_partial_kernel: one warp per (row, slice) keeps the slice's k best logits
//      (warp_topk.cuh) and writes them as (key, index) partials. Rows are split into
//      enough slices to keep every SM's loads in flight, even for one sequence.
//   2. select_path_kernel: one block per (sequence b, position t) merges the partials
//      of rows t and t-1 (its candidates and its predecessors), forms the k x k edge
//      scores from shared-memory tiles of the gathered codebook rows, and signals a
//      per-sequence counter; the block that completes a sequence walks it. No host
//      synchronisation anywhere: the whole selection captures in a CUDA graph.
// candidate_topk runs launch 1 and then topk_merge_kernel.
#include <algorithm>

#include "kernels/device_dtype.cuh"
#include "kernels/launch.cuh"
#include "kernels/serving.cuh"
#include "kernels/warp_topk.cuh"

namespace dflash2 {
namespace {

constexpr int kWarp = 32;
constexpr int kPartialWarpsPerBlock = 8;
constexpr int kMergeWarps = 8;
constexpr int kMergeThreads = kMergeWarps * kWarp;
constexpr int kLoadsInFlight = 4;  // 16-byte loads a lane issues before filtering them
constexpr int kRankTile = 128;     // rank columns of the codebook tiles in shared memory
constexpr int kMinSliceLength = 1024;
constexpr int kMaxSlices = 256;

__device__ __forceinline__ int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename T>
__device__ __forceinline__ float element_float(T value);
template <>
__device__ __forceinline__ float element_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ float element_float<__half>(__half value) { return __half2float(value); }
template <>
__device__ __forceinline__ float element_float<__nv_bfloat16>(__nv_bfloat16 value) {
  return __bfloat162float(value);
}

// VEC consecutive elements as floats: one 16-byte load when `whole` (the caller
// guarantees alignment), guarded scalar loads at a slice's ragged end.
template <typename T, int VEC>
__device__ __forceinline__ void load_elements(const T* __restrict__ source, int64_t valid, bool whole,
                                              float (&out)[VEC]) {
  if (VEC > 1 && whole) {
    union {
      uint4 raw;
      T elements[VEC];
    } vector;
    vector.raw = __ldg(reinterpret_cast<const uint4*>(source));
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = element_float(vector.elements[e]);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = e < valid ? element_float(source[e]) : 0.0f;
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kPartialWarpsPerBlock* kWarp)
    topk_partial_kernel(const TopkParams params) {
  if (blockIdx.x == 0) {
    for (int64_t i = threadIdx.x; i < params.counter_count; i += blockDim.x) params.counters[i] = 0;
  }
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kPartialWarpsPerBlock + threadIdx.x / kWarp;
  const TopkPartials& partials = params.partials;
  const int64_t row = warp / partials.slices;
  if (row >= params.rows) return;  // whole warps only: the list needs all 32 lanes
  const int64_t slice = warp % partials.slices;
  const int64_t start = slice * partials.slice_length;
  const int64_t end = smaller(start + partials.slice_length, params.vocab);
  const T* __restrict__ logits = static_cast<const T*>(params.logits) + row * params.logits_row_stride;

  WarpTopk list(params.top_k);
  constexpr int64_t kStep = static_cast<int64_t>(kWarp) * VEC * kLoadsInFlight;
  for (int64_t base = start; base < end; base += kStep) {
    float values[kLoadsInFlight][VEC];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t first = base + (static_cast<int64_t>(u) * kWarp + lane) * VEC;
      const int64_t valid = end - first;
      load_elements<T, VEC>(logits + first, valid, valid >= VEC && params.vectorized, values[u]);
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t first = base + (static_cast<int64_t>(u) * kWarp + lane) * VEC;
      uint32_t pending = 0;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if (first + e < end && !(values[u][e] < list.threshold_value)) pending |= 1u << e;
      }
      if (__any_sync(kWarpMask, pending != 0)) {
        uint32_t keys[VEC];
        uint32_t indices[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          keys[e] = ordered_key(values[u][e]);
          indices[e] = static_cast<uint32_t>(first + e);
        }
        list.offer<VEC>(keys, indices, pending, lane);
      }
    }
  }
  if (lane < params.top_k) {
    const int64_t slot = warp * params.top_k + lane;  // warp == row * slices + slice
    partials.keys[slot] = list.key;
    partials.indices[slot] = list.index;
  }
}

// Merges one row's partial lists with all kMergeWarps warps of the block; the result
// is left in warp 0's `merged` (lanes < k). `scratch` holds 2 * kMergeWarps * k words.
__device__ __forceinline__ void merge_row(const TopkPartials& partials, int64_t row, int top_k, uint32_t* scratch,
                                          WarpTopk& merged) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int64_t entries = static_cast<int64_t>(partials.slices) * top_k;
  // Whole 32-byte sectors (8 words) a warp: a share starting mid-sector costs each of its
  // requests a sector more.
  const int64_t per_warp = ((entries + kMergeWarps - 1) / kMergeWarps + 7) / 8 * 8;
  const int64_t first = smaller(static_cast<int64_t>(warp) * per_warp, entries);
  const int64_t count = smaller(per_warp, entries - first);
  const int64_t offset = row * entries + first;
  WarpTopk local(top_k);
  local.offer_entries(partials.keys + offset, partials.indices + offset, count, lane);
  uint32_t* scratch_keys = scratch;
  uint32_t* scratch_indices = scratch + kMergeWarps * top_k;
  if (lane < top_k) {
    scratch_keys[warp * top_k + lane] = local.key;
    scratch_indices[warp * top_k + lane] = local.index;
  }
  __syncthreads();
  if (warp == 0) merged.offer_entries(scratch_keys, scratch_indices, static_cast<int64_t>(kMergeWarps) * top_k, lane);
  __syncthreads();  // scratch is free again
}

__global__ void __launch_bounds__(kMergeThreads) topk_merge_kernel(const TopkParams params, const TopkOutputs outputs) {
  __shared__ uint32_t scratch[2 * kMergeWarps * kMaxServingTopK];
  const int64_t row = blockIdx.x;
  WarpTopk merged(params.top_k);
  merge_row(params.partials, row, params.top_k, scratch, merged);
  const int lane = threadIdx.x;
  if (threadIdx.x < kWarp && lane < params.top_k) {
    const int64_t slot = row * params.top_k + lane;
    store_rounded(outputs.values, slot, params.logits_dtype, key_value(merged.key));
    outputs.ids[slot] = static_cast<int64_t>(merged.index);
  }
}

// The walk of sequence b by one warp, over the edges every block of b has written.
__device__ void walk_sequence(const SelectPathParams& p, int64_t b, int top_k, bool anchor_valid) {
  const int lane = threadIdx.x % kWarp;
  const bool sampled = p.temperature > 0.0f;
  const int64_t kk = static_cast<int64_t>(top_k) * top_k;
  int choice = 0;  // the row of E[b, 0]: every row holds the anchor's scores
  for (int64_t t = 0; t < p.draft; ++t) {
    const int64_t position = b * p.draft + t;
    const float score =
        lane < top_k ? load_float_global(p.edges, position * kk + static_cast<int64_t>(choice) * top_k + lane,
                                         p.score_dtype)
                     : 0.0f;
    // Greedy choice: torch.argmax's rule, reduced across lanes.
    float best = score;
    int best_lane = lane < top_k ? lane : kWarp;
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(kWarpMask, best, offset);
      const int other_lane = __shfl_xor_sync(kWarpMask, best_lane, offset);
      if (other_lane < kWarp && (best_lane == kWarp || argmax_prefers(other, other_lane, best, best_lane))) {
        best = other;
        best_lane = other_lane;
      }
    }
    int next = best_lane;
    float q = lane == best_lane ? 1.0f : 0.0f;
    if (sampled) {
      const float x = lane < top_k ? score / p.temperature : -__int_as_float(0x7f800000);
      float peak = x;
      for (int offset = 16; offset > 0; offset >>= 1) peak = fmaxf(peak, __shfl_xor_sync(kWarpMask, peak, offset));
      const float weight = lane < top_k ? expf(x - peak) : 0.0f;
      float total = weight;
      for (int offset = 16; offset > 0; offset >>= 1) total += __shfl_xor_sync(kWarpMask, total, offset);
      q = weight / total;
      if (lane >= top_k) q = 0.0f;
      float running = q;  // inclusive scan over lanes
      for (int offset = 1; offset < kWarp; offset <<= 1) {
        const float below = __shfl_up_sync(kWarpMask, running, offset);
        if (lane >= offset) running += below;
      }
      const float target = p.uniforms[position] * __shfl_sync(kWarpMask, running, top_k - 1);
      const unsigned above = __ballot_sync(kWarpMask, lane < top_k && running > target);
      const unsigned positive = __ballot_sync(kWarpMask, lane < top_k && q > 0.0f);
      // Rounding can leave no running sum above the target: take the last candidate
      // with mass; NaN scores leave none, and the greedy choice stands.
      if (above != 0) {
        next = __ffs(above) - 1;
      } else if (positive != 0) {
        next = 31 - __clz(positive);
      }
    }
    if (lane < top_k) p.draft_probs[position * top_k + lane] = q;
    if (lane == 0) {
      const int64_t token = __ldcg(reinterpret_cast<const long long*>(p.candidate_ids) + position * top_k + next);
      p.path[position] = anchor_valid ? token : -1;
    }
    choice = next;
  }
}

__global__ void __launch_bounds__(kMergeThreads) select_path_kernel(const TopkParams topk, const SelectPathParams p) {
  const int top_k = topk.top_k;
  __shared__ uint32_t scratch[2 * kMergeWarps * kMaxServingTopK];
  __shared__ int64_t predecessors[kMaxServingTopK];
  __shared__ int64_t candidates[kMaxServingTopK];
  __shared__ float unary[kMaxServingTopK];
  __shared__ float projected_tile[kRankTile];
  // +1 column: the k candidates of one warp read one rank column without bank conflicts.
  __shared__ float context_tile[kMaxServingTopK][kRankTile + 1];
  __shared__ float successor_tile[kMaxServingTopK][kRankTile + 1];
  __shared__ bool completes_sequence;

  const int64_t b = blockIdx.x / p.draft;
  const int64_t t = blockIdx.x % p.draft;
  const int64_t row = b * p.draft + t;
  const int lane = threadIdx.x % kWarp;
  const int64_t anchor = p.anchor_ids[b];
  const bool anchor_valid = id_in_range(anchor, topk.vocab);

  if (t > 0) {
    WarpTopk previous(top_k);
    merge_row(topk.partials, row - 1, top_k, scratch, previous);
    if (threadIdx.x < kWarp && lane < top_k) predecessors[lane] = previous.index;
  } else if (threadIdx.x < top_k) {
    predecessors[threadIdx.x] = anchor_valid ? anchor : 0;
  }
  WarpTopk current(top_k);
  merge_row(topk.partials, row, top_k, scratch, current);
  if (threadIdx.x < kWarp && lane < top_k) {
    candidates[lane] = current.index;
    unary[lane] = key_value(current.key);
    p.candidate_ids[row * top_k + lane] = current.index;
  }
  __syncthreads();

  // E[i, j] = U[j] + sum_rho A[prev_i, rho] P[rho] B[cand_j, rho], in rank tiles. Each
  // dot is kDotLanes interleaved partial sums (rho mod kDotLanes) combined pairwise at
  // the end: a single chain over r = 256 loses several times the reference's accuracy.
  // Unfused multiplies and adds in the CPU twin's order (cpu_row_kernel.h's lane_dot)
  // make the edges, and so the greedy walk, bitwise equal on both devices.
  constexpr int kPairsPerThread = kMaxServingTopK * kMaxServingTopK / kMergeThreads;
  constexpr int kDotLanes = 16;
  static_assert(kRankTile % kDotLanes == 0, "a rank tile must hold whole groups of partial sums");
  const int pairs = top_k * top_k;
  float acc[kPairsPerThread][kDotLanes];
#pragma unroll
  for (int m = 0; m < kPairsPerThread; ++m) {
#pragma unroll
    for (int l = 0; l < kDotLanes; ++l) acc[m][l] = 0.0f;
  }
  for (int64_t tile = 0; tile < p.rank; tile += kRankTile) {
    const int width = static_cast<int>(smaller(kRankTile, p.rank - tile));
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
      projected_tile[c] = load_float(p.projected, row * p.rank + tile + c, p.projected_dtype);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < top_k * width; e += blockDim.x) {
      const int i = e / width;
      const int c = e % width;
      context_tile[i][c] = __fmul_rn(
          load_float(p.predecessor_codebook, predecessors[i] * p.predecessor_row_stride + tile + c, p.codebook_dtype),
          projected_tile[c]);
      successor_tile[i][c] =
          load_float(p.successor_codebook, candidates[i] * p.successor_row_stride + tile + c, p.codebook_dtype);
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < kPairsPerThread; ++m) {
      const int pair = threadIdx.x + m * kMergeThreads;
      if (pair < pairs) {
        const int i = pair / top_k;
        const int j = pair % top_k;
        for (int c0 = 0; c0 < width; c0 += kDotLanes) {
#pragma unroll
          for (int l = 0; l < kDotLanes; ++l) {
            if (c0 + l < width) {
              acc[m][l] = __fadd_rn(acc[m][l], __fmul_rn(context_tile[i][c0 + l], successor_tile[j][c0 + l]));
            }
          }
        }
      }
    }
    __syncthreads();
  }
  const float not_a_number = __int_as_float(0x7fc00000);
#pragma unroll
  for (int m = 0; m < kPairsPerThread; ++m) {
    const int pair = threadIdx.x + m * kMergeThreads;
    if (pair < pairs) {
#pragma unroll
      for (int half = kDotLanes / 2; half > 0; half /= 2) {
#pragma unroll
        for (int l = 0; l < half; ++l) acc[m][l] = __fadd_rn(acc[m][l], acc[m][l + half]);
      }
      const float score = (t == 0 && !anchor_valid) ? not_a_number : __fadd_rn(unary[pair % top_k], acc[m][0]);
      store_rounded(p.edges, row * pairs + pair, p.score_dtype, score);
    }
  }

  // Last block of sequence b to finish walks it (threadFenceReduction's pattern).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    completes_sequence = atomicAdd(p.counters + b, 1) == p.draft - 1;
    __threadfence();
  }
  __syncthreads();
  if (completes_sequence && threadIdx.x < kWarp) walk_sequence(p, b, top_k, anchor_valid);
}

int multiprocessors(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
      count = 132;
    }
    cached[device] = count;
  }
  return cached[device];
}

template <typename T>
cudaError_t launch_partials(const TopkParams& params, cudaStream_t stream) {
  const int64_t warps = params.rows * params.partials.slices;
  const int64_t blocks = (warps + kPartialWarpsPerBlock - 1) / kPartialWarpsPerBlock;
  constexpr int kVec = 16 / sizeof(T);
  if (params.vectorized) {
    return launch_kernel<topk_partial_kernel<T, kVec>>(blocks, kPartialWarpsPerBlock * kWarp, 0, stream, params);
  }
  return launch_kernel<topk_partial_kernel<T, 1>>(blocks, kPartialWarpsPerBlock * kWarp, 0, stream, params);
}

cudaError_t launch_topk_partials(const TopkParams& params, cudaStream_t stream) {
  switch (params.logits_dtype) {
    case DType::kFloat16: return launch_partials<__half>(params, stream);
    case DType::kBFloat16: return launch_partials<__nv_bfloat16>(params, stream);
    case DType::kFloat32: return launch_partials<float>(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

TopkSplit plan_topk_split(int64_t rows, int64_t vocab, int device) {
  // About 32 warps per SM keep enough 16-byte loads in flight to cover DRAM latency;
  // slices below kMinSliceLength would spend more on the merge than they save.
  const int64_t target_warps = static_cast<int64_t>(multiprocessors(device)) * 32;
  int64_t slices = std::max<int64_t>(1, (target_warps + rows - 1) / rows);
  slices = std::min<int64_t>({slices, kMaxSlices, std::max<int64_t>(1, vocab / kMinSliceLength)});
  // Slices start on 32-byte boundaries of a 16-bit row (a multiple of 16 elements): a
  // warp's 16-byte loads then never straddle a sector more than they must.
  int64_t length = (vocab + slices - 1) / slices;
  length = (length + 15) / 16 * 16;
  slices = (vocab + length - 1) / length;
  return TopkSplit{static_cast<int32_t>(slices), length};
}

cudaError_t launch_candidate_topk(const TopkParams& params, const TopkOutputs& outputs, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  const cudaError_t status = launch_topk_partials(params, stream);
  if (status != cudaSuccess) return status;
  return launch_kernel<topk_merge_kernel>(params.rows, kMergeThreads, 0, stream, params, outputs);
}

cudaError_t launch_select_path(const TopkParams& topk, const SelectPathParams& params, cudaStream_t stream) {
  if (params.batch == 0 || params.draft == 0) return cudaSuccess;
  const cudaError_t status = launch_topk_partials(topk, stream);
  if (status != cudaSuccess) return status;
  return launch_kernel<select_path_kernel>(params.batch * params.draft, kMergeThreads, 0, stream, topk, params);
}

}  // namespace dflash2
