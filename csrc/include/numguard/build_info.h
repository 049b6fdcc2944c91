// Host-side facts about the build, exposed to Python through pybind11 (not tensor ops).
#pragma once

#include <string>
#include <vector>

namespace numguard {

// {"built": [...ISA levels compiled in...], "active": <ISA level this CPU uses>}
std::vector<std::string> cpu_capabilities();

// e.g. {"sm_80", "sm_90"}; empty when the CUDA kernels are not built.
std::vector<std::string> cuda_architectures();

}  // namespace numguard
