// The CUDA bindings (selector_cuda.cpp) compiled for CPU tensors: device_binding.h
// points them at the SIMT runtime and registers them under dflash2_emulated.
#include "selector_cuda.cpp"
