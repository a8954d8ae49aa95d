// The CUDA bindings (serving_cuda.cpp) compiled for CPU tensors: device_binding.h
// points them at the SIMT runtime and registers them under dflash2_emulated.
#include "serving_cuda.cpp"
