// Runtime choice of the CPU kernels' instruction-set level (see reduce_kernels.h).
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

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
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("bmi2")) {
    return kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt")) {
    return kAvx2;
  }
#endif
  return kBaseline;
}

// NUMGUARD_CPU_ISA's values, indexed by the level they cap at (numguard.ops.CPU_ISA_CHOICES lists
// the same, best first).
constexpr const char* kLevelNames[] = {"baseline", "avx2", "avx512"};

// NUMGUARD_CPU_ISA caps the level. Unset or empty: no cap. Like every NUMGUARD_* variable it is
// read trimmed and in lower case, and a value it does not accept is an error, not ignored.
int requested_cap() {
  const char* raw = std::getenv("NUMGUARD_CPU_ISA");
  std::string value = raw == nullptr ? "" : raw;
  const auto not_space = [](unsigned char c) { return !std::isspace(c); };
  value.erase(value.begin(), std::find_if(value.begin(), value.end(), not_space));
  value.erase(std::find_if(value.rbegin(), value.rend(), not_space).base(), value.end());
  std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
  if (value.empty()) return kAvx512;
  std::string accepted;
  for (int level = kAvx512; level >= kBaseline; --level) {
    if (value == kLevelNames[level]) return level;
    accepted += (level < kAvx512 ? ", " : "") + std::string(kLevelNames[level]);
  }
  TORCH_CHECK_VALUE(false, "NUMGUARD_CPU_ISA='", value, "' is not valid: use one of ", accepted);
  return kAvx512;  // unreachable
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
  // A throwing choose() leaves the static uninitialized: every later call raises the same error.
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
