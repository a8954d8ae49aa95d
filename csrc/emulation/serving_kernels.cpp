// kernels/serving_kernels.cu compiled as host C++ for the SIMT runtime.
#include "kernels/serving_kernels.cu"
