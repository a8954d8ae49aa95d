// The selector forward's gather in isolation, to choose its software prefetch:
// out[n k + j] = dot(context[n], B[cand[n, j]]) over N = 4096 rows, k = 16 uniformly
// random candidates in a [32000, r] float table, 2 OpenMP threads, AVX-512 (AVX2 or scalar
// where the CPU lacks it; r a multiple of 16). Schemes,
// timed in turns (one call each per round, 150 rounds, after 10 warm-up calls each):
//   none        no software prefetch
//   row:R       the next row's k candidate rows requested at once, R rows ahead (the
//               selector's scheme before 5536583, R = 4)
//   cand:D      each candidate's row requested D candidates ahead (the scheme since)
//
// With --cold first, 64 MB are written before every timed call, so the table starts in
// DRAM, as it does in a training step, where the projection GEMMs and the other layers
// pass tens of MB through the cache between the selector's calls.
//
//   g++ -O3 -fopenmp benchmarks/micro/gather_prefetch.cpp -o /tmp/gather_prefetch
//   OMP_NUM_THREADS=2 /tmp/gather_prefetch 64 none row:4 row:1 cand:4 cand:8 cand:16
//   OMP_NUM_THREADS=2 /tmp/gather_prefetch --cold 64 cand:8 cand:16 cand:32
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {
constexpr int kRows = 4096, kVocab = 32000, kTopK = 16;

// The selector's kernel dots with AVX-512 where the CPU has it, AVX2 elsewhere (an AMD
// Zen 3 has no AVX-512): clones picked when the program loads.
__attribute__((target("avx512f"))) float dot(const float* x, const float* y, int rank) {
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < rank; i += 16) sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  return _mm512_reduce_add_ps(sum);
}

__attribute__((target("avx2"))) float dot(const float* x, const float* y, int rank) {
  __m256 sum = _mm256_setzero_ps();
  for (int i = 0; i < rank; i += 8) sum = _mm256_add_ps(sum, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

__attribute__((target("default"))) float dot(const float* x, const float* y, int rank) {
  float sum = 0.0f;
  for (int i = 0; i < rank; ++i) sum += x[i] * y[i];
  return sum;
}

void prefetch_row(const float* row, int rank) {
  for (int byte = 0; byte < rank * 4; byte += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + byte);
}

struct Scheme {
  std::string name;
  char kind;  // 'n' none, 'r' row burst, 'c' per candidate
  int distance;
};
}  // namespace

int main(int argc, char** argv) {
  const bool cold = argc > 1 && std::strcmp(argv[1], "--cold") == 0;
  if (cold) {
    --argc;
    ++argv;
  }
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s [--cold] RANK SCHEME...  (SCHEME: none, row:R, cand:D)\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  std::vector<Scheme> schemes;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto colon = arg.find(':');
    const int distance = colon == std::string::npos ? 0 : std::atoi(arg.c_str() + colon + 1);
    schemes.push_back({arg, arg[0] == 'r' ? 'r' : arg[0] == 'c' ? 'c' : 'n', distance});
  }
  std::vector<float> table(size_t(kVocab) * rank), contexts(size_t(kRows) * rank), out(size_t(kRows) * kTopK);
  std::vector<int64_t> candidates(size_t(kRows) * kTopK);
  std::mt19937 generator(0);
  for (auto& v : table) v = generator() * 1e-10f;
  for (auto& v : contexts) v = generator() * 1e-10f;
  for (auto& c : candidates) c = generator() % kVocab;
  const int64_t entries = int64_t(kRows) * kTopK;

  auto run = [&](const Scheme& scheme) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < kRows; ++n) {
      if (scheme.kind == 'r' && n + scheme.distance < kRows) {
        for (int j = 0; j < kTopK; ++j) {
          prefetch_row(table.data() + candidates[size_t(n + scheme.distance) * kTopK + j] * rank, rank);
        }
      }
      for (int j = 0; j < kTopK; ++j) {
        const int64_t e = int64_t(n) * kTopK + j;
        if (scheme.kind == 'c' && e + scheme.distance < entries) {
          prefetch_row(table.data() + candidates[e + scheme.distance] * rank, rank);
        }
        out[e] = dot(contexts.data() + size_t(n) * rank, table.data() + candidates[e] * rank, rank);
      }
    }
  };
  for (const auto& scheme : schemes) {
    for (int i = 0; i < 10; ++i) run(scheme);
  }
  std::vector<char> eviction(cold ? size_t(64) << 20 : 0);
  std::vector<std::vector<double>> samples(schemes.size());
  for (int round = 0; round < 150; ++round) {
    for (size_t s = 0; s < schemes.size(); ++s) {
      if (cold) {
#pragma omp parallel for schedule(static)
        for (size_t byte = 0; byte < eviction.size(); byte += 64) eviction[byte] = char(round + s);
      }
      const auto start = std::chrono::steady_clock::now();
      run(schemes[s]);
      samples[s].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
  }
  for (size_t s = 0; s < schemes.size(); ++s) {
    auto& v = samples[s];
    std::sort(v.begin(), v.end());
    std::printf("r=%d%s %-8s min %.3f  p20 %.3f  median %.3f ms\n", rank, cold ? " cold" : "", schemes[s].name.c_str(),
                v[0], v[v.size() / 5], v[v.size() / 2]);
  }
  return 0;
}
