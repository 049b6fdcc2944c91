// Host-side build facts for Python (numguard._C.cpu_capabilities / cuda_architectures).
#include "numguard/build_info.h"

#include "reduce_kernels.h"

namespace numguard {

// ["built=avx512,avx2,baseline", "active=avx512"]: the instruction-set levels compiled into the
// CPU kernels (best first) and the one this process runs (after NUMGUARD_CPU_ISA, if set).
std::vector<std::string> cpu_capabilities() {
  int count = 0;
  const char* const* names = cpu::built_isa_names(&count);
  std::string built = "built=";
  for (int i = 0; i < count; ++i) {
    if (i > 0) built += ",";
    built += names[i];
  }
  return {built, std::string("active=") + cpu::active_kernels().isa};
}

#ifndef NUMGUARD_WITH_CUDA
// CPU-only build: no CUDA kernels (the CUDA build defines this in csrc/cuda).
std::vector<std::string> cuda_architectures() {
  return {};
}
#endif

}  // namespace numguard
