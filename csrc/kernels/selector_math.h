// Per-element math of the candidate selector, shared by the CPU and CUDA kernels.
// Torch-free and host/device: the CUDA kernels and the C++ CPU twin compute the same
// sums in the same accumulator types and classify reduction pieces the same way.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define DFLASH2_HD __host__ __device__ __forceinline__
#else
#define DFLASH2_HD inline
#endif

namespace dflash2 {

// Element types of the tensors a kernel reads or writes, as the bindings name them.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// Accumulate in fp32, or in fp64 when the codebooks are fp64.
template <typename T>
using accumulator_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

DFLASH2_HD bool id_in_range(int64_t id, int64_t vocab) { return id >= 0 && id < vocab; }

// One scored candidate's transition term, summed over rank rho:
//   T(a, b) += A[a, rho] * P[rho] * B[b, rho]
// The context A[a] * P is formed once per row; each candidate adds context * B[b].
template <typename Acc>
DFLASH2_HD Acc context_term(Acc predecessor, Acc projected) { return predecessor * projected; }

// Sorted-key segmented sums (dA over predecessor ids, dB over candidate ids) are cut
// into fixed chunks of entries. A key's run inside one chunk is a "piece":
//   - complete: the run starts and ends in this chunk; its sum is final,
//   - leading:  the run began in an earlier chunk (slot 0 of the chunk's partials),
//   - trailing: the run begins here and continues past the chunk (slot 1).
// A second pass adds a trailing piece and the following chunks' leading pieces in
// chunk order, so every sum is formed in one fixed order: deterministic.
enum class Piece : int32_t { kComplete = 0, kLeading = 1, kTrailing = 2 };

DFLASH2_HD Piece classify_piece(bool began_before_chunk, bool continues_after_chunk) {
  if (began_before_chunk) return Piece::kLeading;
  return continues_after_chunk ? Piece::kTrailing : Piece::kComplete;
}

}  // namespace dflash2
