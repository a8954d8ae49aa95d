// Which of this build's CUDA code runs on a GPU of a given compute capability, and the
// error for a GPU it has none for. Torch-free: the CUDA bindings (device_binding.h) check
// every launch's device with it, the module's build_info (registration.cpp) reports it.
//
// The build's code comes from setup.py as DFLASH2_CUDA_CODES ("sm_80 sm_86 ... compute_120",
// read from the -gencode flags nvcc got) and the list it was asked for as
// DFLASH2_CUDA_ARCH_LIST ("8.0;8.6;...;12.0+PTX"); both are empty in a CPU-only build.
// CUDA's rules: machine code for sm_XY runs on compute capability X.Z with Z >= Y (the same
// major), sm_XYa on X.Y alone, sm_XYf on X.Z with Z >= Y; PTX for compute_XY is
// JIT-compiled by the driver for X.Y and every later capability (compute_XYa / compute_XYf:
// as their machine code).
#pragma once

#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#ifndef DFLASH2_CUDA_CODES
#define DFLASH2_CUDA_CODES ""
#endif
#ifndef DFLASH2_CUDA_ARCH_LIST
#define DFLASH2_CUDA_ARCH_LIST ""
#endif

namespace dflash2 {
namespace cuda_arch {

struct Code {
  std::string name;  // as nvcc spells it: sm_90, sm_90a, compute_120
  bool ptx;
  int major;
  int minor;
  char variant;  // 0, 'a' (this capability only) or 'f' (its family)
};

// "sm_80 sm_86 compute_120" (spaces or semicolons) -> its codes; unreadable words are skipped.
inline std::vector<Code> parse_codes(std::string_view codes) {
  std::vector<Code> parsed;
  size_t start = 0;
  while (start < codes.size()) {
    size_t end = codes.find_first_of(" ;", start);
    if (end == std::string_view::npos) end = codes.size();
    const std::string word(codes.substr(start, end - start));
    start = end + 1;
    const bool ptx = word.rfind("compute_", 0) == 0;
    if (!ptx && word.rfind("sm_", 0) != 0) continue;
    std::string digits = word.substr(ptx ? 8 : 3);
    char variant = 0;
    if (!digits.empty() && (digits.back() == 'a' || digits.back() == 'f')) {
      variant = digits.back();
      digits.pop_back();
    }
    if (digits.size() < 2 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const int number = std::atoi(digits.c_str());
    parsed.push_back(Code{word, ptx, number / 10, number % 10, variant});
  }
  return parsed;
}

inline bool runs_on(const Code& code, int major, int minor) {
  if (code.variant == 'a') return major == code.major && minor == code.minor;
  if (code.ptx && code.variant == 0) return major > code.major || (major == code.major && minor >= code.minor);
  return major == code.major && minor >= code.minor;
}

// The code a device of compute capability major.minor runs: the newest machine code that
// runs there, else the newest PTX; "" when none does.
inline std::string code_for(std::string_view codes, int major, int minor) {
  const std::vector<Code> parsed = parse_codes(codes);
  const Code* best = nullptr;
  for (const Code& code : parsed) {
    if (!runs_on(code, major, minor)) continue;
    const bool better = best == nullptr || (best->ptx && !code.ptx) ||
                        (best->ptx == code.ptx && code.major * 10 + code.minor > best->major * 10 + best->minor);
    if (better) best = &code;
  }
  return best == nullptr ? std::string() : best->name;
}

inline std::string build_codes() { return DFLASH2_CUDA_CODES; }
inline std::string build_arch_list() { return DFLASH2_CUDA_ARCH_LIST; }

// The error for a device this build has no code for: the device, its capability, what
// the build holds, and the command that builds for it.
inline std::string missing_code_message(std::string_view codes, std::string_view arch_list, int device, int major,
                                        int minor) {
  const std::string capability = std::to_string(major) + "." + std::to_string(minor);
  std::string held;
  for (const Code& code : parse_codes(codes)) {
    held += (held.empty() ? "" : ", ") + code.name + (code.ptx ? " (PTX)" : "");
  }
  return "dflash2_kernels was built without code for cuda:" + std::to_string(device) + ", a GPU of compute capability " +
         capability + " (sm_" + std::to_string(major * 10 + minor) + "): the build holds " +
         (held.empty() ? std::string("no CUDA code") : held) + " (TORCH_CUDA_ARCH_LIST=\"" + std::string(arch_list) +
         "\"). Rebuild it for this GPU, from the source tree: TORCH_CUDA_ARCH_LIST=\"" + capability +
         "+PTX\" pip install --no-build-isolation --no-deps --force-reinstall . (or build it on a machine where this "
         "GPU is visible: the build then targets it); dflash2_kernels.build_info() shows what a build holds.";
}

}  // namespace cuda_arch
}  // namespace dflash2
