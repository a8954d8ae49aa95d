// torch.ops.dflash2_emulated.*: the CUDA kernels' ops with the schemas of their
// torch.ops.dflash2 twins, run on CPU tensors by the SIMT runtime, plus the schedule
// seed and the global-memory traffic counters (emulation/traffic.h). A test library: built by the test command (scripts/build_emulated.py), never by
// a user's pip install.
#include <torch/library.h>

#include "emulation/runtime.h"
#include "emulation/traffic.h"
#include "op_schemas.h"

namespace dflash2 {
namespace {

void set_schedule_seed(int64_t seed) { emulation::set_schedule_seed(static_cast<uint64_t>(seed)); }
void traffic_start() { emulation::traffic::start(); }
std::string traffic_stop() { return emulation::traffic::stop(); }

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
}
