// A SIMT runtime for the CPU: lets csrc/kernels/*.cu compile with g++ as host code and
// run thread by thread, so every CUDA kernel of the package executes (and is checked
// against the float64 reference) on machines with no GPU.
//
// kernels/launch.cuh includes it in the emulated build (csrc/emulation/*_kernels.cpp
// compile the kernel files as C++); compile with -DDFLASH2_EMULATED and the CUDA
// toolkit's include directory on the path (cuda_fp16.h / cuda_bf16.h compile as host
// code there, with round-to-nearest-even conversions).
//
// Execution model (simt.cpp):
//   - blocks run one at a time, in an order drawn from the schedule seed;
//   - every CUDA thread of a block is a fiber on the calling OS thread; a fiber runs
//     until it reaches a barrier, a warp collective, an atomic or a fence, and the next
//     fiber to run is drawn from the seed, so a race or an ordering assumption shows up
//     as a difference between seeds;
//   - __syncthreads, __syncwarp and the shuffles and votes wait for every thread they
//     name; a thread missing from one (exited, or parked at another barrier or
//     collective) is an error naming the kernel, block, threads and source lines, never
//     a hang;
//   - __shared__ variables are function-local statics: one instance, reused by each
//     block in turn (launches are serialised).
// It checks indexing, barrier placement, collectives and rounding order, not a GPU's
// speed or memory model.
#pragma once

#if !defined(DFLASH2_EMULATED)
#error "csrc/emulation/simt.h is only for the emulated build (-DDFLASH2_EMULATED)"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

// crt/host_defines.h defines both to nothing for a host compiler. Function-local
// statics stand for a block's shared memory.
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "emulation/runtime.h"

namespace dflash2 {
namespace emulation {

// What a running CUDA thread sees as its built-in variables.
struct ThreadContext {
  uint3 thread_index;
  uint3 block_index;
  dim3 block_dim;
  dim3 grid_dim;
};

// The running fiber's context; set by the scheduler before each switch.
extern const ThreadContext* current_thread;

enum class WarpOp : int { kSyncwarp, kShfl, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll };

// A warp collective: parks the calling lane until every lane in `mask` has arrived at
// the same collective, then returns this lane's result (the 64-bit payload of a
// shuffle, or the vote). `argument` is the source lane, delta or xor mask.
uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int argument, int width, const char* file,
                         int line);
void block_barrier(const char* file, int line);
// Lets the scheduler run another thread first: every atomic and fence is such a point.
void yield_point(const char* file, int line);
// What a GPU would stop the kernel for (a misaligned vector access): the launch fails
// with `what`, naming the thread and the source line; the thread itself runs on.
void device_fault(const char* what, const char* file, int line);

template <typename T>
uint64_t to_payload(T value) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>, "shuffle of an unsupported type");
  uint64_t payload = 0;
  std::memcpy(&payload, &value, sizeof(T));
  return payload;
}

template <typename T>
T from_payload(uint64_t payload) {
  T value;
  std::memcpy(&value, &payload, sizeof(T));
  return value;
}

template <typename T>
struct Identity {
  using type = T;
};

// "selector_scores_forward_kernel<float, float, 4>" out of a __PRETTY_FUNCTION__ that
// names the kernel as its template argument `Kernel`.
const char* kernel_name_from_signature(const char* signature, char* buffer, size_t buffer_size);

template <auto Kernel>
const char* kernel_name() {
  static char buffer[256];
  static const char* name = kernel_name_from_signature(__PRETTY_FUNCTION__, buffer, sizeof(buffer));
  return name;
}

}  // namespace emulation
}  // namespace dflash2

// Built-in variables.
#define threadIdx (::dflash2::emulation::current_thread->thread_index)
#define blockIdx (::dflash2::emulation::current_thread->block_index)
#define blockDim (::dflash2::emulation::current_thread->block_dim)
#define gridDim (::dflash2::emulation::current_thread->grid_dim)
#define warpSize 32

// Synchronisation. Default arguments carry the caller's source line into messages.
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::dflash2::emulation::block_barrier(file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::dflash2::emulation::warp_collective(::dflash2::emulation::WarpOp::kSyncwarp, mask, 0, 0, 32, file, line);
}
inline void __threadfence(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::dflash2::emulation::yield_point(file, line);
}
inline void __threadfence_block(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::dflash2::emulation::yield_point(file, line);
}

// Shuffles and votes.
template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32, const char* file = __builtin_FILE(),
              int line = __builtin_LINE()) {
  using namespace ::dflash2::emulation;
  return from_payload<T>(warp_collective(WarpOp::kShfl, mask, to_payload(var), src_lane, width, file, line));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32, const char* file = __builtin_FILE(),
                 int line = __builtin_LINE()) {
  using namespace ::dflash2::emulation;
  return from_payload<T>(
      warp_collective(WarpOp::kShflUp, mask, to_payload(var), static_cast<int>(delta), width, file, line));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32, const char* file = __builtin_FILE(),
                   int line = __builtin_LINE()) {
  using namespace ::dflash2::emulation;
  return from_payload<T>(
      warp_collective(WarpOp::kShflDown, mask, to_payload(var), static_cast<int>(delta), width, file, line));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32, const char* file = __builtin_FILE(),
                  int line = __builtin_LINE()) {
  using namespace ::dflash2::emulation;
  return from_payload<T>(warp_collective(WarpOp::kShflXor, mask, to_payload(var), lane_mask, width, file, line));
}
inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  using namespace ::dflash2::emulation;
  return static_cast<unsigned>(warp_collective(WarpOp::kBallot, mask, predicate != 0, 0, 32, file, line));
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace ::dflash2::emulation;
  return static_cast<int>(warp_collective(WarpOp::kAny, mask, predicate != 0, 0, 32, file, line));
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace ::dflash2::emulation;
  return static_cast<int>(warp_collective(WarpOp::kAll, mask, predicate != 0, 0, 32, file, line));
}

// Atomics: a scheduling point, then the read-modify-write (fibers of one OS thread
// never interleave inside it). The pointer's type alone picks T, as CUDA's overloads do.
#define DFLASH2_EMULATED_ATOMIC(name, expression)                                                     \
  template <typename T>                                                                              \
  T name(T* address, typename ::dflash2::emulation::Identity<T>::type value,                        \
         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {                         \
    ::dflash2::emulation::yield_point(file, line);                                                   \
    const T old = *address;                                                                          \
    *address = (expression);                                                                         \
    return old;                                                                                      \
  }
DFLASH2_EMULATED_ATOMIC(atomicAdd, old + value)
DFLASH2_EMULATED_ATOMIC(atomicSub, old - value)
DFLASH2_EMULATED_ATOMIC(atomicExch, value)
DFLASH2_EMULATED_ATOMIC(atomicMin, value < old ? value : old)
DFLASH2_EMULATED_ATOMIC(atomicMax, value > old ? value : old)
DFLASH2_EMULATED_ATOMIC(atomicAnd, old & value)
DFLASH2_EMULATED_ATOMIC(atomicOr, old | value)
#undef DFLASH2_EMULATED_ATOMIC

template <typename T>
T atomicCAS(T* address, typename ::dflash2::emulation::Identity<T>::type compare,
            typename ::dflash2::emulation::Identity<T>::type value, const char* file = __builtin_FILE(),
            int line = __builtin_LINE()) {
  ::dflash2::emulation::yield_point(file, line);
  const T old = *address;
  if (old == compare) *address = value;
  return old;
}

// Loads through the caches are plain loads here: one access of sizeof(T) bytes, as
// the GPU's vector load (a copy of a uint4 could otherwise become four 4-byte loads,
// which the traffic counters would see as four strided requests).
template <typename T>
T __ldg(const T* address) {
  T value;
  __builtin_memcpy(&value, address, sizeof(T));
  return value;
}
template <typename T>
T __ldcg(const T* address) {
  T value;
  __builtin_memcpy(&value, address, sizeof(T));
  return value;
}

// Bit intrinsics.
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline unsigned __brev(unsigned x) {
  unsigned reversed = 0;
  for (int bit = 0; bit < 32; ++bit) reversed |= ((x >> bit) & 1u) << (31 - bit);
  return reversed;
}

// Reinterpretations.
inline unsigned __float_as_uint(float x) { return ::dflash2::emulation::from_payload<unsigned>(::dflash2::emulation::to_payload(x)); }
inline float __uint_as_float(unsigned x) { return ::dflash2::emulation::from_payload<float>(x); }
inline int __float_as_int(float x) { return ::dflash2::emulation::from_payload<int>(::dflash2::emulation::to_payload(x)); }
inline float __int_as_float(int x) { return ::dflash2::emulation::from_payload<float>(static_cast<uint32_t>(x)); }
inline long long __double_as_longlong(double x) { return ::dflash2::emulation::from_payload<long long>(::dflash2::emulation::to_payload(x)); }
inline double __longlong_as_double(long long x) { return ::dflash2::emulation::from_payload<double>(static_cast<uint64_t>(x)); }

// Rounded arithmetic that the compiler must not fuse into a multiply-add (the emulated
// build also compiles with -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }

// CUDA's device min/max overloads; integer arguments of mixed types take their common type.
template <typename A, typename B>
std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <typename A, typename B>
std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}
