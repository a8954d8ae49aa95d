// What every kernel file includes first for CUDA's types and intrinsics: the toolkit's
// headers under nvcc, plus the CPU's SIMT runtime in the emulated build (which makes
// the same code a host program: csrc/emulation/simt.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#if defined(DFLASH2_EMULATED)
#include "emulation/simt.h"
#endif
