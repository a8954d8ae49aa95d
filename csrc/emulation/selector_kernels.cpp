// kernels/selector_kernels.cu compiled as host C++ for the SIMT runtime.
#include "kernels/selector_kernels.cu"
