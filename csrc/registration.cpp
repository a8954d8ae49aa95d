// The op library (schemas: op_schemas.h) and the Python module that lets `import
// dflash2_kernels._C` load this library; its functions are the CPU result cache's
// (cpu_result_cache.h), wrapped by dflash2_kernels/memory.py, and what the build holds
// (dflash2_kernels/build_info.py). Kernels register themselves per device in their own
// files (TORCH_LIBRARY_IMPL).
#include <Python.h>
#include <torch/library.h>

#include "cpu_result_cache.h"
#include "cuda_arch.h"
#include "op_schemas.h"

// What setup.py built with (empty where it did not say: the sanitized test build).
#ifndef DFLASH2_BUILD_TORCH
#define DFLASH2_BUILD_TORCH ""
#endif
#ifndef DFLASH2_BUILD_TORCH_CUDA
#define DFLASH2_BUILD_TORCH_CUDA ""
#endif
#ifndef DFLASH2_BUILD_NVCC
#define DFLASH2_BUILD_NVCC ""
#endif
#ifndef DFLASH2_BUILD_TRITON
#define DFLASH2_BUILD_TRITON ""
#endif

namespace {

PyObject* cpu_cache_bytes(PyObject*, PyObject*) {
  return PyLong_FromSize_t(dflash2::cpu_result_cache::retained_bytes());
}

PyObject* empty_cpu_cache(PyObject*, PyObject*) {
  dflash2::cpu_result_cache::release_all();
  Py_RETURN_NONE;
}

PyObject* build_info(PyObject*, PyObject*) {
#if defined(DFLASH2_WITH_CUDA)
  const bool with_cuda = true;
#else
  const bool with_cuda = false;
#endif
  return Py_BuildValue("{s:s,s:s,s:s,s:s,s:O,s:s,s:s}", "torch", DFLASH2_BUILD_TORCH, "torch_cuda",
                       DFLASH2_BUILD_TORCH_CUDA, "nvcc", DFLASH2_BUILD_NVCC, "triton", DFLASH2_BUILD_TRITON,
                       "with_cuda", with_cuda ? Py_True : Py_False, "cuda_codes", DFLASH2_CUDA_CODES,
                       "cuda_arch_list", DFLASH2_CUDA_ARCH_LIST);
}

// cuda_code_for(major, minor[, codes]): the code a GPU of that compute capability runs
// ("sm_86", "compute_120") of the build's (or of `codes`, "sm_80 compute_90"), None when
// there is none.
PyObject* cuda_code_for(PyObject*, PyObject* args) {
  int major = 0, minor = 0;
  const char* codes = DFLASH2_CUDA_CODES;
  if (!PyArg_ParseTuple(args, "ii|s", &major, &minor, &codes)) return nullptr;
  const std::string code = dflash2::cuda_arch::code_for(codes, major, minor);
  if (code.empty()) Py_RETURN_NONE;
  return PyUnicode_FromString(code.c_str());
}

// missing_code_message(device, major, minor): the error a launch on such a GPU raises.
PyObject* missing_code_message(PyObject*, PyObject* args) {
  int device = 0, major = 0, minor = 0;
  if (!PyArg_ParseTuple(args, "iii", &device, &major, &minor)) return nullptr;
  const std::string message =
      dflash2::cuda_arch::missing_code_message(DFLASH2_CUDA_CODES, DFLASH2_CUDA_ARCH_LIST, device, major, minor);
  return PyUnicode_FromString(message.c_str());
}

PyMethodDef module_functions[] = {
    {"cpu_cache_bytes", cpu_cache_bytes, METH_NOARGS, "Bytes the CPU result cache keeps for reuse."},
    {"empty_cpu_cache", empty_cpu_cache, METH_NOARGS, "Unmap every block the CPU result cache keeps."},
    {"build_info", build_info, METH_NOARGS, "What this build was made with and the CUDA code it holds."},
    {"cuda_code_for", cuda_code_for, METH_VARARGS, "The build's CUDA code a GPU of compute capability (major, minor) runs."},
    {"missing_code_message", missing_code_message, METH_VARARGS,
     "The error a CUDA op raises on a GPU (device, major, minor) the build holds no code for."},
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
