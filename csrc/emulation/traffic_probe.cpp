// torch.ops.dflash2_emulated.traffic_probe: a copy kernel with planted traffic bugs, so
// the tests can show that the traffic checks (benchmarks/traffic_minimum.py) catch what
// they are meant to catch in a CUDA kernel. Test build only, like the rest of
// csrc/emulation/; compiled as a kernel file (its accesses are counted).
//
//   variant 0: out[i] = 2 * x[i], one coalesced read and write per element;
//   variant 1: the same sum, but x[i] read a second time after a barrier;
//   variant 2: a warp reads a column of a 32 x 8 tile (stride 8 elements): strided reads.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "kernels/launch.cuh"

namespace dflash2 {
namespace {

constexpr int kThreads = 256;

__global__ void traffic_probe_kernel(const float* x, float* out, int64_t n, int variant) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads;
  const int thread = static_cast<int>(threadIdx.x);
  if (variant == 2) {
    const int64_t source = base + (thread % 32) * (kThreads / 32) + thread / 32;
    if (source < n) out[source] = 2.0f * x[source];
    return;
  }
  const int64_t i = base + thread;
  const float first = i < n ? x[i] : 0.0f;
  if (variant == 1) {
    __syncthreads();
    if (i < n) out[i] = first + x[i];
  } else if (i < n) {
    out[i] = first + first;
  }
}

at::Tensor traffic_probe(const at::Tensor& x, int64_t variant) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous() && x.device().is_cpu(),
              "traffic_probe: x must be a contiguous 1-D float32 CPU tensor");
  TORCH_CHECK(variant >= 0 && variant <= 2, "traffic_probe: variant must be 0, 1 or 2, got ", variant);
  TORCH_CHECK(variant != 2 || x.numel() % kThreads == 0, "traffic_probe: variant 2 needs a multiple of ", kThreads,
              " elements");
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  const unsigned blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  const cudaError_t status = launch_kernel<traffic_probe_kernel>(blocks, kThreads, 0, nullptr, x.data_ptr<float>(),
                                                                 out.data_ptr<float>(), n, static_cast<int>(variant));
  TORCH_CHECK(status == cudaSuccess, emulation::last_launch_error());
  return out;
}

}  // namespace
}  // namespace dflash2

TORCH_LIBRARY_FRAGMENT(dflash2_emulated, m) {
  m.def("traffic_probe(Tensor x, int variant) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash2_emulated, CPU, m) { m.impl("traffic_probe", &dflash2::traffic_probe); }
