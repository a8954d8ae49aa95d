// The op library (schemas: op_schemas.h) and the Python module
// stub that lets `import dflash2_kernels._C` load this library. Kernels register
// themselves per device in their own files (TORCH_LIBRARY_IMPL).
#include <Python.h>
#include <torch/library.h>

#include "op_schemas.h"

extern "C" {
// No Python functions: importing the module only runs the static registrations.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
}

TORCH_LIBRARY(dflash2, m) {
  using namespace dflash2::schemas;
  for (const char* schema : {kConvForwardCpu, kConvBackwardCpu, kSelectorScores, kSelectorScoresBackward,
                             kCandidateTopk, kSelectPath, kRejectionSample}) {
    m.def(schema);
  }
}
