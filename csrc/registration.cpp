// Schemas of every C++ op (one TORCH_LIBRARY for the namespace) and the Python module
// stub that lets `import dflash2_kernels._C` load this library. Kernels register
// themselves per device in their own files (TORCH_LIBRARY_IMPL).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// No Python functions: importing the module only runs the static registrations.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
}

TORCH_LIBRARY(dflash2, m) {
  // The grouped dynamic conv on CPU tensors (SPEC section 1). x [N, H], delta [N, K, G],
  // base [K, H]; unit last strides, any row strides.
  m.def("conv_forward_cpu(Tensor x, Tensor delta, Tensor base, int block_size, ScalarType out_dtype) -> Tensor");
  m.def(
      "conv_backward_cpu(Tensor grad_out, Tensor x, Tensor delta, Tensor base, int block_size)"
      " -> (Tensor, Tensor, Tensor)");
  // The candidate selector's scores (SPEC section 2). unary [N, V] (or [N, k] when
  // unary_gathered), projected [N, r], codebooks [V, r], predecessor_ids [N],
  // candidate_ids [N, k] -> scores [N, k] in out_dtype.
  m.def(
      "selector_scores(Tensor unary, Tensor projected, Tensor predecessor_codebook, "
      "Tensor successor_codebook, Tensor predecessor_ids, Tensor candidate_ids, bool unary_gathered, "
      "ScalarType out_dtype) -> Tensor");
  // -> (grad_unary [N, unary_width] unary_dtype, grad_projected, grad_predecessor_codebook,
  //     grad_successor_codebook), each gradient in its input's dtype.
  m.def(
      "selector_scores_backward(Tensor grad_scores, Tensor projected, Tensor predecessor_codebook, "
      "Tensor successor_codebook, Tensor predecessor_ids, Tensor candidate_ids, bool unary_gathered, "
      "int unary_width, ScalarType unary_dtype) -> (Tensor, Tensor, Tensor, Tensor)");
}
