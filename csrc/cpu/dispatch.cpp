// Runtime choice of the CPU kernels' instruction-set level (see reduce_kernels.h).
#include <cstdlib>
#include <cstring>

#include "reduce_kernels.h"

namespace numguard {
namespace cpu {
namespace {

enum Level { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

int supported_level() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2")) {
    return kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
      __builtin_cpu_supports("popcnt")) {
    return kAvx2;
  }
#endif
  return kBaseline;
}

// NUMGUARD_CPU_ISA caps the level; an unknown value is ignored (the best level is used).
int requested_cap() {
  const char* value = std::getenv("NUMGUARD_CPU_ISA");
  if (value == nullptr || value[0] == '\0') return kAvx512;
  if (std::strcmp(value, "baseline") == 0) return kBaseline;
  if (std::strcmp(value, "avx2") == 0) return kAvx2;
  return kAvx512;
}

const KernelTable& choose() {
  const int cap = requested_cap();
  const int have = supported_level();
  const int level = have < cap ? have : cap;
  if (level == kAvx512) return avx512_kernels();
  if (level == kAvx2) return avx2_kernels();
  return baseline_kernels();
}

}  // namespace

const KernelTable& active_kernels() {
  static const KernelTable& table = choose();
  return table;
}

const char* const* built_isa_names(int* count) {
#if defined(__x86_64__) || defined(__i386__)
  static const char* const kNames[] = {"avx512", "avx2", "baseline"};
  *count = 3;
#else
  static const char* const kNames[] = {"baseline"};
  *count = 1;
#endif
  return kNames;
}

}  // namespace cpu
}  // namespace numguard
