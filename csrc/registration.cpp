// The op library (schemas: op_schemas.h) and the Python module that lets `import
// dflash2_kernels._C` load this library; its only functions are the CPU result cache's
// (cpu_result_cache.h), wrapped by dflash2_kernels/memory.py. Kernels register
// themselves per device in their own files (TORCH_LIBRARY_IMPL).
#include <Python.h>
#include <torch/library.h>

#include "cpu_result_cache.h"
#include "op_schemas.h"

namespace {

PyObject* cpu_cache_bytes(PyObject*, PyObject*) {
  return PyLong_FromSize_t(dflash2::cpu_result_cache::retained_bytes());
}

PyObject* empty_cpu_cache(PyObject*, PyObject*) {
  dflash2::cpu_result_cache::release_all();
  Py_RETURN_NONE;
}

PyMethodDef module_functions[] = {
    {"cpu_cache_bytes", cpu_cache_bytes, METH_NOARGS, "Bytes the CPU result cache keeps for reuse."},
    {"empty_cpu_cache", empty_cpu_cache, METH_NOARGS, "Unmap every block the CPU result cache keeps."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" {
// Importing the module also runs the static op registrations.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, module_functions};
  return PyModule_Create(&module);
}
}

TORCH_LIBRARY(dflash2, m) {
  using namespace dflash2::schemas;
  for (const char* schema : {kConvForwardCpu, kConvBackwardCpu, kSelectorScores, kSelectorScoresBackward,
                             kCandidateTopk, kSelectPath, kRejectionSample, kDraftHeadRowsCpu,
                             kDraftHeadRowsBackwardCpu, kDraftHeadShardStatsCpu, kDraftHeadShardRowsCpu,
                             kCpuCachedEmpty}) {
    m.def(schema);
  }
}
