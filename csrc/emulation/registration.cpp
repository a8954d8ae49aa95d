// torch.ops.dflash2_emulated.*: the CUDA kernels' ops with the schemas of their
// torch.ops.dflash2 twins, run on CPU tensors by the SIMT runtime, plus the schedule
// seed, the emulated GPU's compute capability and the global-memory traffic counters
// (emulation/traffic.h). A test library: built by the test command (scripts/asan.py), never
// by a user's pip install.
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "emulation/runtime.h"
#include "emulation/traffic.h"
#include "emulation/traffic_probe.h"
#include "op_schemas.h"

namespace dflash2 {
namespace {

void set_schedule_seed(int64_t seed) { emulation::set_schedule_seed(static_cast<uint64_t>(seed)); }
void traffic_start() { emulation::traffic::start(); }
std::string traffic_stop() { return emulation::traffic::stop(); }

at::Tensor traffic_probe(const at::Tensor& x, int64_t variant) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous() && x.device().is_cpu(),
              "traffic_probe: x must be a contiguous 1-D float32 CPU tensor");
  TORCH_CHECK(variant >= 0 && variant <= 2, "traffic_probe: variant must be 0, 1 or 2, got ", variant);
  TORCH_CHECK(variant != 2 || x.numel() % kTrafficProbeThreads == 0, "traffic_probe: variant 2 needs a multiple of ",
              kTrafficProbeThreads, " elements");
  at::Tensor out = at::empty_like(x);
  const cudaError_t status =
      launch_traffic_probe(x.data_ptr<float>(), out.data_ptr<float>(), x.numel(), static_cast<int>(variant));
  TORCH_CHECK(status == cudaSuccess, emulation::last_launch_error());
  return out;
}

void set_device_capability(int64_t major, int64_t minor) {
  TORCH_CHECK(major >= 1 && major <= 99 && minor >= 0 && minor <= 9,
              "set_device_capability: a compute capability is major.minor with major in [1, 99] and minor in [0, 9], "
              "got ", major, ".", minor);
  emulation::set_device_capability(static_cast<int>(major), static_cast<int>(minor));
}

}  // namespace
}  // namespace dflash2

TORCH_LIBRARY(dflash2_emulated, m) {
  using namespace dflash2::schemas;
  for (const char* schema : {kSelectorScores, kSelectorScoresBackward, kCandidateTopk, kSelectPath, kRejectionSample}) {
    m.def(schema);
  }
  // Seeds the order in which blocks and threads run from now on.
  m.def("set_schedule_seed(int seed) -> ()", &dflash2::set_schedule_seed);
  // Counts every kernel launch's global-memory traffic from now on (emulation/traffic.h).
  m.def("traffic_start() -> ()", &dflash2::traffic_start);
  // Ends counting: one JSON object per launch since traffic_start, as a JSON array.
  m.def("traffic_stop() -> str", &dflash2::traffic_stop);
  // A copy kernel with planted traffic bugs (emulation/traffic_probe.h), for the tests.
  m.def("traffic_probe(Tensor x, int variant) -> Tensor", &dflash2::traffic_probe);
  // The compute capability the emulated GPU reports from now on (default 9.0).
  m.def("set_device_capability(int major, int minor) -> ()", &dflash2::set_device_capability);
}
