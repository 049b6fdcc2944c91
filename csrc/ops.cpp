// Every numguard op schema, declared once. Device files only register implementations
// (csrc/cpu: TORCH_LIBRARY_IMPL(numguard, CPU, m); csrc/cuda: TORCH_LIBRARY_IMPL(numguard, CUDA, m)).
//
// The Python module `numguard._C` exists so that importing it runs these static registrations; its
// only functions are host-side helpers that are not tensor ops.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "numguard/build_info.h"

TORCH_LIBRARY(numguard, m) {
  // float64[8] record of x (see numguard.STAT_FIELDS). Never synchronizes with the host.
  m.def("tensor_stats(Tensor x) -> Tensor");
  // float64[len(xs), 8]: one record per tensor, in one pass per tensor (one launch on CUDA).
  m.def("multi_tensor_stats(Tensor[] xs) -> Tensor");
  // Write the records of xs into ring[(position + i) % ring.size(0)] unless state says the ring
  // is tripped (frozen); then trip it if any record holds NaN/Inf, and flag low-precision tensors
  // whose abs max exceeds headroom * finfo.max (headroom <= 0 disables that check).
  // ring: float64[R, 8]; state: int64[4] (see StateField in numguard/stats_reduce.h).
  m.def("record_(Tensor(a!) ring, Tensor(b!) state, Tensor[] xs, int position, float headroom) -> ()");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "numguard native kernels (ops are registered under torch.ops.numguard)";
  module.def("cpu_capabilities", &numguard::cpu_capabilities,
             "Instruction sets the CPU kernels were built for and which one this CPU runs.");
  module.def("cuda_architectures", &numguard::cuda_architectures,
             "CUDA architectures the kernels were compiled for (empty without CUDA kernels).");
}
