// CUDA kernels of batched lossless verification (SPEC section 3), torch-free.
//
// Two launches:
//   1. verify_mass_kernel, one block per (sequence b, vocabulary slice): finds b's
//      accepted prefix a (D short steps, redone by every block: cheaper than a
//      launch), then sums the slice's mass under the two possible bonus
//      distributions: the residual max(p_a - q_a, 0) and the target max(p_a, 0).
//   2. verify_bonus_kernel, one block per sequence: picks the distribution (the
//      residual unless it has no mass or all D were accepted), finds the slice where
//      u * total falls and scans that slice alone in shared memory.
// Both kernels weigh every element with the same function, and the residual is
// formed element by element (never as p-mass minus q-mass), so a residual that is
// exactly empty sums to exactly zero and the fallback to p is taken.
#include "kernels/device_dtype.cuh"
#include "kernels/launch.cuh"
#include "kernels/serving.cuh"

namespace dflash2 {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kMask = 0xffffffffu;
constexpr int kThreads = 256;
constexpr int kElementsPerThread = static_cast<int>(kVerifySliceLength / kThreads);
constexpr int kMaxSliceCandidates = 64;  // candidates of one slice held in shared memory

__device__ __forceinline__ int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

// Shared-memory slot of a slice element: one pad word per 32 keeps the scan's
// per-thread runs of kElementsPerThread consecutive elements free of bank conflicts.
__device__ __forceinline__ int padded(int offset) { return offset + offset / kWarp; }

__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(kMask, value, offset);
  return value;
}

__device__ __forceinline__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  value = warp_sum(value);
  __syncthreads();
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / kWarp; ++w) total += scratch[w];
  return total;
}

// The accepted prefix of sequence b: d_t is kept while u_t * q_t(d_t) < p_t(d_t). The
// whole block calls this; warp w tests positions w, w + 8, ... at once, so the D
// tests cost one round of loads, not D. q sums in a fixed lane order.
__device__ int64_t accepted_prefix(const RejectionParams& p, int64_t b, unsigned long long* first_failure) {
  const int lane = threadIdx.x % kWarp;
  if (threadIdx.x == 0) *first_failure = static_cast<unsigned long long>(p.draft);
  __syncthreads();
  for (int64_t t = threadIdx.x / kWarp; t < p.draft; t += kThreads / kWarp) {
    const int64_t position = b * p.draft + t;
    const int64_t token = p.draft_tokens[position];
    float q = 0.0f;
    for (int64_t j = lane; j < p.top_k; j += kWarp) {
      if (p.candidate_ids[position * p.top_k + j] == token) q += p.draft_probs[position * p.top_k + j];
    }
    q = warp_sum(q);
    // A token outside the vocabulary has no target mass: it is never accepted.
    const float target = id_in_range(token, p.vocab)
                             ? fmaxf(load_float(p.target_probs,
                                                b * p.target_batch_stride + t * p.target_position_stride + token,
                                                p.target_dtype),
                                     0.0f)
                             : 0.0f;
    if (lane == 0 && !(p.uniforms[b * (p.draft + 1) + t] * q < target)) {
      atomicMin(first_failure, static_cast<unsigned long long>(t));
    }
  }
  __syncthreads();
  return static_cast<int64_t>(*first_failure);
}

// The candidates of row a that fall in [begin, end), with their proposal mass. A slice
// holding more than kMaxSliceCandidates of them (only possible for k > 64) is marked
// `overflow`, and its weights read the whole candidate row from global memory instead:
// the same sums in the same order, just slower.
struct SliceCandidates {
  int64_t ids[kMaxSliceCandidates];
  float mass[kMaxSliceCandidates];
  int count;
  bool overflow;
  const int64_t* row_ids;   // candidate_ids of row a (null when a = D: no proposal)
  const float* row_mass;    // draft_probs of row a
};

// Thread 0 fills the list (ascending j, so repeated ids add in one fixed order).
__device__ void collect_slice_candidates(const RejectionParams& p, int64_t b, int64_t a, int64_t begin, int64_t end,
                                         SliceCandidates& list) {
  if (threadIdx.x == 0) {
    int count = 0;
    list.overflow = false;
    list.row_ids = nullptr;
    list.row_mass = nullptr;
    if (a < p.draft) {
      const int64_t position = b * p.draft + a;
      list.row_ids = p.candidate_ids + position * p.top_k;
      list.row_mass = p.draft_probs + position * p.top_k;
      for (int64_t j = 0; j < p.top_k; ++j) {
        const int64_t id = list.row_ids[j];
        if (id >= begin && id < end) {
          if (count == kMaxSliceCandidates) {
            list.overflow = true;
            break;
          }
          list.ids[count] = id;
          list.mass[count] = list.row_mass[j];
          ++count;
        }
      }
    }
    list.count = count;
  }
  __syncthreads();
}

// max(p_v - q_v, 0), q_v summed over the candidates equal to v in ascending j.
__device__ __forceinline__ float residual_weight(float target, int64_t v, const SliceCandidates& list,
                                                 int64_t top_k) {
  float proposal = 0.0f;
  if (list.overflow) {
    for (int64_t j = 0; j < top_k; ++j) {
      if (list.row_ids[j] == v) proposal += list.row_mass[j];
    }
  } else {
    for (int c = 0; c < list.count; ++c) {
      if (list.ids[c] == v) proposal += list.mass[c];
    }
  }
  return fmaxf(target - proposal, 0.0f);
}

__global__ void __launch_bounds__(kThreads) verify_mass_kernel(const RejectionParams p) {
  __shared__ SliceCandidates list;
  __shared__ float scratch[kThreads / kWarp];
  __shared__ unsigned long long first_failure;
  const int64_t b = blockIdx.x / p.slices;
  const int64_t slice = blockIdx.x % p.slices;
  const int64_t a = accepted_prefix(p, b, &first_failure);
  if (slice == 0 && threadIdx.x == 0) p.accepted[b] = a;
  const int64_t begin = slice * p.slice_length;
  const int64_t end = smaller(begin + p.slice_length, p.vocab);
  collect_slice_candidates(p, b, a, begin, end, list);
  const int64_t row = b * p.target_batch_stride + a * p.target_position_stride;
  float target_sum = 0.0f;
  float residual_sum = 0.0f;
  for (int64_t v = begin + threadIdx.x; v < end; v += kThreads) {
    const float target = fmaxf(load_float(p.target_probs, row + v, p.target_dtype), 0.0f);
    target_sum += target;
    residual_sum += residual_weight(target, v, list, p.top_k);
  }
  target_sum = block_sum(target_sum, scratch);
  residual_sum = block_sum(residual_sum, scratch);
  if (threadIdx.x == 0) {
    p.slice_mass[(b * p.slices + slice) * 2] = residual_sum;
    p.slice_mass[(b * p.slices + slice) * 2 + 1] = target_sum;
  }
}

__global__ void __launch_bounds__(kThreads) verify_bonus_kernel(const RejectionParams p) {
  __shared__ SliceCandidates list;
  __shared__ float residual_mass[kMaxVerifySlices];
  __shared__ float target_mass[kMaxVerifySlices];
  __shared__ float element_weights[kVerifySliceLength + kVerifySliceLength / kWarp];
  __shared__ float scratch[kThreads / kWarp];
  __shared__ int64_t chosen_slice;
  __shared__ float slice_target;
  __shared__ bool use_residual;
  __shared__ unsigned long long first_above;
  __shared__ long long last_positive;
  const int64_t b = blockIdx.x;
  const int64_t a = p.accepted[b];
  const float u = p.uniforms[b * (p.draft + 1) + p.draft];
  const float* mass = p.slice_mass + b * p.slices * 2;
  for (int64_t s = threadIdx.x; s < p.slices; s += kThreads) {
    residual_mass[s] = mass[s * 2];
    target_mass[s] = mass[s * 2 + 1];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // Residual weights are >= 0 element by element: an empty residual sums to 0.
    float residual_total = 0.0f;
    for (int64_t s = 0; s < p.slices; ++s) residual_total += residual_mass[s];
    use_residual = a < p.draft && residual_total > 0.0f;
    const float* slice_weights = use_residual ? residual_mass : target_mass;
    float total = 0.0f;
    for (int64_t s = 0; s < p.slices; ++s) total += slice_weights[s];
    const float target = u * total;
    int64_t chosen = -1;
    int64_t last_with_mass = -1;
    float before = 0.0f;
    for (int64_t s = 0; s < p.slices; ++s) {
      if (slice_weights[s] > 0.0f) last_with_mass = s;
      if (before + slice_weights[s] > target && slice_weights[s] > 0.0f) {
        chosen = s;
        break;
      }
      before += slice_weights[s];
    }
    if (chosen < 0 && last_with_mass >= 0) {  // rounding left u * total past the end
      chosen = last_with_mass;
      before = total - slice_weights[chosen];
    }
    chosen_slice = chosen;
    slice_target = target - before;
    first_above = ~0ull;
    last_positive = -1;
  }
  __syncthreads();
  if (chosen_slice < 0) {  // no mass at all (an all-zero or NaN target row)
    if (threadIdx.x == 0) p.bonus[b] = -1;
    return;
  }
  const int64_t begin = chosen_slice * p.slice_length;
  const int64_t end = smaller(begin + p.slice_length, p.vocab);
  collect_slice_candidates(p, b, use_residual ? a : p.draft, begin, end, list);
  const int64_t row = b * p.target_batch_stride + a * p.target_position_stride;
  for (int64_t v = begin + threadIdx.x; v < begin + kVerifySliceLength; v += kThreads) {
    float weight = 0.0f;
    if (v < end) {
      weight = fmaxf(load_float(p.target_probs, row + v, p.target_dtype), 0.0f);
      if (use_residual) weight = residual_weight(weight, v, list, p.top_k);
    }
    element_weights[padded(static_cast<int>(v - begin))] = weight;
  }
  __syncthreads();

  // Each thread owns kElementsPerThread consecutive elements; an exclusive scan of the
  // threads' sums gives each its running sum at its first element.
  float own = 0.0f;
  for (int e = 0; e < kElementsPerThread; ++e) own += element_weights[padded(threadIdx.x * kElementsPerThread + e)];
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  float inclusive = own;
  for (int offset = 1; offset < kWarp; offset <<= 1) {
    const float below = __shfl_up_sync(kMask, inclusive, offset);
    if (lane >= offset) inclusive += below;
  }
  if (lane == kWarp - 1) scratch[warp] = inclusive;
  __syncthreads();
  float running = inclusive - own;
  for (int w = 0; w < warp; ++w) running += scratch[w];
  for (int e = 0; e < kElementsPerThread; ++e) {
    const int offset = threadIdx.x * kElementsPerThread + e;
    const float weight = element_weights[padded(offset)];
    running += weight;
    if (weight > 0.0f) {
      atomicMax(&last_positive, static_cast<long long>(begin + offset));
      if (running > slice_target) {
        atomicMin(&first_above, static_cast<unsigned long long>(begin + offset));
        break;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    p.bonus[b] = first_above != ~0ull ? static_cast<int64_t>(first_above) : static_cast<int64_t>(last_positive);
  }
}

}  // namespace

cudaError_t launch_rejection_sample(const RejectionParams& params, cudaStream_t stream) {
  if (params.batch == 0) return cudaSuccess;
  const cudaError_t status =
      launch_kernel<verify_mass_kernel>(params.batch * params.slices, kThreads, 0, stream, params);
  if (status != cudaSuccess) return status;
  return launch_kernel<verify_bonus_kernel>(params.batch, kThreads, 0, stream, params);
}

}  // namespace dflash2
