// kernels/verify_kernels.cu compiled as host C++ for the SIMT runtime.
#include "kernels/verify_kernels.cu"
