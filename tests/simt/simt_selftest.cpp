// Self-tests of the CPU SIMT runtime (csrc/emulation/): small kernels with known
// answers for every primitive the package's kernels use, and planted bugs (a race, a
// missing barrier, divergent collectives, exited lanes, a spin) that it must report.
//
//   simt_selftest --list        the case names, one a line
//   simt_selftest CASE          runs one case; exit 0 and "ok" when it holds
//
// tests/test_simt_runtime.py builds this file and runs every case in its own process.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kernels/launch.cuh"

namespace dflash2 {
namespace {

constexpr unsigned kFull = 0xffffffffu;

// ---- kernels with known answers ----

__global__ void warp_xor_sum_kernel(int* out) {
  int value = static_cast<int>(threadIdx.x % 32) + 1;
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(kFull, value, offset);
  out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}

__global__ void warp_scan_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  int running = lane + 1;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int below = __shfl_up_sync(kFull, running, offset);
    if (lane >= offset) running += below;
  }
  out[threadIdx.x] = running;
}

__global__ void warp_down_sum_kernel(double* out) {
  double value = 0.5 * static_cast<double>(threadIdx.x % 32);
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_down_sync(kFull, value, offset);
  out[threadIdx.x] = value;  // lane 0 holds the warp's sum
}

// Broadcast inside width-8 segments from each segment's lane 5, and a 64-bit payload.
__global__ void warp_broadcast_kernel(long long* out) {
  const long long mine = (static_cast<long long>(threadIdx.x) << 40) + threadIdx.x;
  out[threadIdx.x] = __shfl_sync(kFull, mine, 5, 8);
}

__global__ void warp_vote_kernel(unsigned* out) {
  const int lane = threadIdx.x % 32;
  const unsigned ballot = __ballot_sync(kFull, lane % 3 == 0);
  const int any_big = __any_sync(kFull, lane > 30);
  const int all_small = __all_sync(kFull, lane < 32);
  const int all_even = __all_sync(kFull, lane % 2 == 0);
  if (lane == 0) {
    out[0] = ballot;
    out[1] = static_cast<unsigned>(any_big);
    out[2] = static_cast<unsigned>(all_small);
    out[3] = static_cast<unsigned>(all_even);
  }
}

// Lanes 0-15 exchange among themselves while lanes 16-31 have exited: legal with the
// half mask.
__global__ void half_warp_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane >= 16) return;
  __syncwarp(0x0000ffffu);
  out[lane] = __shfl_xor_sync(0x0000ffffu, lane, 1);
}

__global__ void block_sum_kernel(const float* in, float* out) {
  __shared__ float scratch[8];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  float value = in[blockIdx.x * blockDim.x + threadIdx.x];
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(kFull, value, offset);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += scratch[w];
    out[blockIdx.x] = total;
  }
}

// threadFenceReduction's pattern: each block writes its partial, and the last block to
// arrive (whichever it is) sums them all.
__global__ void last_block_kernel(const int* in, int* partials, unsigned* counter, int* total) {
  __shared__ bool is_last;
  __shared__ int block_total;
  if (threadIdx.x == 0) block_total = 0;
  __syncthreads();
  atomicAdd(&block_total, in[blockIdx.x * blockDim.x + threadIdx.x]);
  __syncthreads();
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = block_total;
    __threadfence();
    is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (is_last && threadIdx.x == 0) {
    int sum = 0;
    for (unsigned b = 0; b < gridDim.x; ++b) sum += __ldcg(partials + b);
    *total = sum;
  }
}

__global__ void atomics_kernel(unsigned long long* minimum, long long* maximum, int* swaps, float* sum) {
  const int t = static_cast<int>(threadIdx.x + blockIdx.x * blockDim.x);
  atomicMin(minimum, static_cast<unsigned long long>(1000 - t));
  atomicMax(maximum, static_cast<long long>(t) * 3);
  int expected = *swaps;
  while (atomicCAS(swaps, expected, expected + 1) != expected) expected = *swaps;
  atomicAdd(sum, 0.5f);
}

__global__ void builtins_kernel(unsigned* out) {
  const unsigned linear = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  out[block * blockDim.x * blockDim.y * blockDim.z + linear] = block * 1000 + linear;
}

__global__ void bits_kernel(unsigned* out) {
  if (threadIdx.x != 0) return;
  out[0] = static_cast<unsigned>(__popc(0xf0f0u));
  out[1] = static_cast<unsigned>(__ffs(0x50));
  out[2] = static_cast<unsigned>(__clz(0x00ffffff));
  out[3] = __float_as_uint(-1.5f);
  out[4] = __uint_as_float(0x3fc00000u) == 1.5f;
  out[5] = static_cast<unsigned>(__clz(0));
  out[6] = __half2float(__float2half_rn(1.0009765625f + 1.0f / 4096)) == 1.0009765625f;  // ties to even
  out[7] = __bfloat162float(__float2bfloat16_rn(1.00390625f)) == 1.0f;                // ties to even
}

// ---- planted bugs ----

// Every thread writes the same shared word with no order between them.
__global__ void planted_race_kernel(int* out) {
  __shared__ int owner;
  owner = static_cast<int>(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = owner;
}

// block_sum_kernel without the barrier between the warps' writes and thread 0's read.
__global__ void planted_missing_barrier_kernel(const float* in, float* out) {
  __shared__ float scratch[8];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x < 8) scratch[threadIdx.x] = 0.0f;
  __syncthreads();
  float value = in[threadIdx.x];
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(kFull, value, offset);
  if (lane == 0) scratch[warp] = value;
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += scratch[w];
    out[0] = total;
  }
}

__global__ void planted_divergent_shuffle_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  int value = lane;
  if (lane < 16) {
    value = __shfl_xor_sync(kFull, value, 1);
  } else {
    value = __shfl_xor_sync(kFull, value, 2);
  }
  out[threadIdx.x] = value;
}

__global__ void planted_exited_lane_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane == 7) return;
  out[threadIdx.x] = __shfl_xor_sync(kFull, lane, 1);
}

__global__ void planted_divergent_barrier_kernel(int* out) {
  if (threadIdx.x < 64) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

__global__ void planted_barrier_after_exit_kernel(int* out) {
  if (threadIdx.x >= 128) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

// A warp collective that waits for a lane parked at __syncthreads.
__global__ void planted_collective_vs_barrier_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane == 3) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_sync(kFull, lane, 0);
    __syncthreads();
  }
}

// Reads a lane the mask leaves out.
__global__ void planted_unnamed_source_kernel(int* out) {
  out[threadIdx.x] = __shfl_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 20);
}

// Each block raises its flag and spins until the other's is up: fine on a GPU, where
// both blocks are resident; here blocks run one at a time, so the first spins forever.
__global__ void planted_spin_kernel(volatile int* flags) {
  if (threadIdx.x != 0) return;
  flags[blockIdx.x] = 1;
  while (flags[1 - blockIdx.x] == 0) {
  }
}

// 16-byte stores (store_16_bytes): each thread's four words, 16-byte aligned from `out`;
// `offset` words past it, a GPU faults ("misaligned address") unless offset % 4 == 0.
__global__ void vector_store_kernel(unsigned* out, int offset) {
  store_16_bytes(out + offset + 4 * threadIdx.x, make_uint4(threadIdx.x, 1, 2, 3));
}

// ---- the harness ----

struct Failure {
  std::string message;
};

void expect(bool condition, const std::string& message) {
  if (!condition) throw Failure{message};
}

void expect_ok(cudaError_t status) {
  expect(status == cudaSuccess, std::string("launch failed: ") + emulation::last_launch_error());
}

void expect_error(cudaError_t status, const std::vector<std::string>& fragments) {
  expect(status != cudaSuccess, "the launch succeeded; an error was expected");
  const std::string message = emulation::last_launch_error();
  for (const std::string& fragment : fragments) {
    expect(message.find(fragment) != std::string::npos, "message lacks '" + fragment + "': " + message);
  }
  std::printf("reported: %s\n", message.c_str());
}

constexpr uint64_t kSeeds[] = {1, 2, 3, 4, 5, 6, 7, 8};

std::map<std::string, std::function<void()>> cases() {
  std::map<std::string, std::function<void()>> all;

  all["warp_xor_sum"] = [] {
    for (uint64_t seed : kSeeds) {
      emulation::set_schedule_seed(seed);
      std::vector<int> out(2 * 64, -1);
      expect_ok(launch_kernel<warp_xor_sum_kernel>(2, 64, 0, nullptr, out.data()));
      for (int v : out) expect(v == 528, "a lane's xor-reduced sum is " + std::to_string(v) + ", not 528");
    }
  };
  all["warp_scan"] = [] {
    for (uint64_t seed : kSeeds) {
      emulation::set_schedule_seed(seed);
      std::vector<int> out(64, -1);
      expect_ok(launch_kernel<warp_scan_kernel>(1, 64, 0, nullptr, out.data()));
      for (int t = 0; t < 64; ++t) {
        const int lane = t % 32;
        expect(out[t] == (lane + 1) * (lane + 2) / 2, "scan of lane " + std::to_string(lane) + " is wrong");
      }
    }
  };
  all["warp_down_sum"] = [] {
    std::vector<double> out(32, -1.0);
    expect_ok(launch_kernel<warp_down_sum_kernel>(1, 32, 0, nullptr, out.data()));
    expect(out[0] == 0.5 * 496, "lane 0 of the shfl_down reduction is " + std::to_string(out[0]));
    // A lane whose source is past the warp reads its own value: lane 31 doubles 5 times.
    expect(out[31] == 0.5 * 31 * 32, "lane 31 of the shfl_down reduction is " + std::to_string(out[31]));
  };
  all["warp_broadcast_width"] = [] {
    std::vector<long long> out(32, -1);
    expect_ok(launch_kernel<warp_broadcast_kernel>(1, 32, 0, nullptr, out.data()));
    for (int lane = 0; lane < 32; ++lane) {
      const long long source = lane / 8 * 8 + 5;
      expect(out[lane] == (source << 40) + source, "lane " + std::to_string(lane) + " read the wrong lane");
    }
  };
  all["warp_votes"] = [] {
    std::vector<unsigned> out(4, 7);
    expect_ok(launch_kernel<warp_vote_kernel>(1, 32, 0, nullptr, out.data()));
    unsigned ballot = 0;
    for (int lane = 0; lane < 32; lane += 3) ballot |= 1u << lane;
    expect(out[0] == ballot, "ballot is wrong");
    expect(out[1] == 1 && out[2] == 1 && out[3] == 0, "any/all are wrong");
  };
  all["half_warp_after_exit"] = [] {
    for (uint64_t seed : kSeeds) {
      emulation::set_schedule_seed(seed);
      std::vector<int> out(16, -1);
      expect_ok(launch_kernel<half_warp_kernel>(1, 32, 0, nullptr, out.data()));
      for (int lane = 0; lane < 16; ++lane) expect(out[lane] == (lane ^ 1), "half-warp exchange is wrong");
    }
  };
  all["block_sum_shared"] = [] {
    std::vector<float> in(4 * 256);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 256);
    for (uint64_t seed : kSeeds) {
      emulation::set_schedule_seed(seed);
      std::vector<float> out(4, -1.0f);
      expect_ok(launch_kernel<block_sum_kernel>(4, 256, 0, nullptr, in.data(), out.data()));
      for (float v : out) expect(v == 255.0f * 256 / 2, "block sum is " + std::to_string(v));
    }
  };
  all["last_block_done"] = [] {
    const int blocks = 13;
    std::vector<int> in(blocks * 64);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<int>(i);
    const int expected = static_cast<int>(in.size() * (in.size() - 1) / 2);
    for (uint64_t seed : kSeeds) {
      emulation::set_schedule_seed(seed);
      std::vector<int> partials(blocks, 0);
      unsigned counter = 0;
      int total = -1;
      expect_ok(launch_kernel<last_block_kernel>(blocks, 64, 0, nullptr, in.data(), partials.data(), &counter, &total));
      expect(total == expected, "the last block's total is " + std::to_string(total));
      expect(counter == static_cast<unsigned>(blocks), "the counter is wrong");
    }
  };
  all["atomics"] = [] {
    unsigned long long minimum = ~0ull;
    long long maximum = -1;
    int swaps = 0;
    float sum = 0.0f;
    expect_ok(launch_kernel<atomics_kernel>(3, 96, 0, nullptr, &minimum, &maximum, &swaps, &sum));
    expect(minimum == 1000 - 287 && maximum == 287 * 3 && swaps == 288 && sum == 144.0f, "an atomic is wrong");
  };
  all["builtins_3d"] = [] {
    const dim3 grid(2, 3, 2), block(4, 2, 3);
    std::vector<unsigned> out(12 * 24, 0);
    expect_ok(launch_kernel<builtins_kernel>(grid, block, 0, nullptr, out.data()));
    for (unsigned b = 0; b < 12; ++b) {
      for (unsigned t = 0; t < 24; ++t) expect(out[b * 24 + t] == b * 1000 + t, "threadIdx/blockIdx are wrong");
    }
  };
  all["bits_and_conversions"] = [] {
    std::vector<unsigned> out(8, 0);
    expect_ok(launch_kernel<bits_kernel>(1, 32, 0, nullptr, out.data()));
    expect(out[0] == 8 && out[1] == 5 && out[2] == 8 && out[3] == 0xbfc00000u && out[4] == 1 && out[5] == 32,
           "a bit intrinsic is wrong");
    expect(out[6] == 1 && out[7] == 1, "fp16/bf16 conversions do not round to nearest even");
  };
  all["same_seed_same_schedule"] = [] {
    std::vector<int> first(4, -1), second(4, -1);
    emulation::set_schedule_seed(42);
    expect_ok(launch_kernel<planted_race_kernel>(4, 128, 0, nullptr, first.data()));
    emulation::set_schedule_seed(42);
    expect_ok(launch_kernel<planted_race_kernel>(4, 128, 0, nullptr, second.data()));
    expect(first == second, "one seed gave two schedules");
  };

  // Races show up as results that depend on the seed.
  all["planted_race"] = [] {
    std::set<std::vector<int>> outcomes;
    for (uint64_t seed : kSeeds) {
      emulation::set_schedule_seed(seed);
      std::vector<int> out(4, -1);
      expect_ok(launch_kernel<planted_race_kernel>(4, 128, 0, nullptr, out.data()));
      outcomes.insert(out);
    }
    expect(outcomes.size() > 1, "the race gave the same result under every seed");
    std::printf("reported: %zu different results over %zu seeds\n", outcomes.size(), std::size(kSeeds));
  };
  all["planted_missing_barrier"] = [] {
    std::vector<float> in(256, 1.0f);
    std::set<float> outcomes;
    for (uint64_t seed : kSeeds) {
      emulation::set_schedule_seed(seed);
      float out = -1.0f;
      expect_ok(launch_kernel<planted_missing_barrier_kernel>(1, 256, 0, nullptr, in.data(), &out));
      outcomes.insert(out);
    }
    expect(outcomes.size() > 1, "the missing barrier gave the same result under every seed");
    std::printf("reported: %zu different sums over %zu seeds (256 expected)\n", outcomes.size(), std::size(kSeeds));
  };
  all["planted_divergent_shuffle"] = [] {
    std::vector<int> out(32, -1);
    expect_error(launch_kernel<planted_divergent_shuffle_kernel>(1, 32, 0, nullptr, out.data()),
                 {"planted_divergent_shuffle_kernel", "divergent warp collective", "__shfl_xor_sync",
                  "simt_selftest.cpp:"});
  };
  all["planted_exited_lane"] = [] {
    std::vector<int> out(32, -1);
    expect_error(launch_kernel<planted_exited_lane_kernel>(1, 32, 0, nullptr, out.data()),
                 {"planted_exited_lane_kernel", "lane 7", "exited"});
  };
  all["planted_divergent_barrier"] = [] {
    std::vector<int> out(128, -1);
    expect_error(launch_kernel<planted_divergent_barrier_kernel>(1, 128, 0, nullptr, out.data()),
                 {"divergent __syncthreads"});
  };
  all["planted_barrier_after_exit"] = [] {
    std::vector<int> out(256, -1);
    expect_error(launch_kernel<planted_barrier_after_exit_kernel>(1, 256, 0, nullptr, out.data()),
                 {"__syncthreads", "will never reach"});
  };
  all["planted_collective_vs_barrier"] = [] {
    std::vector<int> out(64, -1);
    expect_error(launch_kernel<planted_collective_vs_barrier_kernel>(1, 64, 0, nullptr, out.data()),
                 {"__shfl_sync", "lane 3", "__syncthreads"});
  };
  all["planted_unnamed_source"] = [] {
    std::vector<int> out(16, -1);
    // Only lanes 0-15 take part; a lane outside the mask must not run the collective.
    expect_error(launch_kernel<planted_unnamed_source_kernel>(1, 16, 0, nullptr, out.data()),
                 {"reads lane 20", "not in the mask"});
  };
  all["vector_store"] = [] {
    alignas(16) unsigned out[4 * 8 + 4] = {};
    expect_ok(launch_kernel<vector_store_kernel>(1, 8, 0, nullptr, static_cast<unsigned*>(out), 4));
    for (unsigned t = 0; t < 8; ++t) {
      const unsigned* word = out + 4 + 4 * t;
      expect(word[0] == t && word[1] == 1 && word[2] == 2 && word[3] == 3, "a 16-byte store wrote the wrong words");
    }
  };
  all["planted_misaligned_vector_store"] = [] {
    alignas(16) unsigned out[4 * 8 + 4] = {};
    expect_error(launch_kernel<vector_store_kernel>(1, 8, 0, nullptr, static_cast<unsigned*>(out), 1),
                 {"16-byte store to a misaligned address", "vector_store_kernel", "thread (", "simt_selftest.cpp"});
  };
  all["invalid_launch"] = [] {
    int out = 0;
    expect_error(launch_kernel<planted_race_kernel>(1, 2048, 0, nullptr, &out), {"2048 threads"});
  };
  all["planted_spin"] = [] {
    // Aborts with the watchdog's message; the Python test checks the exit and stderr.
    int flags[2] = {0, 0};
    launch_kernel<planted_spin_kernel>(2, 32, 0, nullptr, static_cast<volatile int*>(flags));
    expect(false, "the spinning kernel finished");
  };
  return all;
}

}  // namespace
}  // namespace dflash2

int main(int argc, char** argv) {
  const auto all = dflash2::cases();
  if (argc == 2 && std::strcmp(argv[1], "--list") == 0) {
    for (const auto& [name, run] : all) std::printf("%s\n", name.c_str());
    return 0;
  }
  if (argc != 2 || all.count(argv[1]) == 0) {
    std::fprintf(stderr, "usage: %s --list | CASE\n", argv[0]);
    return 2;
  }
  try {
    all.at(argv[1])();
  } catch (const dflash2::Failure& failure) {
    std::printf("FAILED: %s\n", failure.message.c_str());
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
