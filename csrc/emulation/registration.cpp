// torch.ops.dflash2_emulated.*: the CUDA kernels' ops with the schemas of their
// torch.ops.dflash2 twins, run on CPU tensors by the SIMT runtime, plus the schedule
// seed and the emulated GPU's compute capability. A test library: built by the test
// command (scripts/build_emulated.py), never by a user's pip install.
#include <torch/library.h>

#include "emulation/runtime.h"
#include "op_schemas.h"

namespace dflash2 {
namespace {

void set_schedule_seed(int64_t seed) { emulation::set_schedule_seed(static_cast<uint64_t>(seed)); }

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
  // The compute capability the emulated GPU reports from now on (default 9.0).
  m.def("set_device_capability(int major, int minor) -> ()", &dflash2::set_device_capability);
}
