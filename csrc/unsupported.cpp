// Kernels for every dispatch key numguard has no real kernel for: sparse, mkldnn, quantized and
// nested tensors, and devices this build has no kernels for. Without them the dispatcher answers
// "Could not run 'numguard::...' with arguments from the 'SparseCPU' backend"; with them every
// entry point names the offending argument, what it is and what is accepted, with the messages of
// the dense kernels and of numguard.ops (numguard/host_checks.h).
//
// CompositeExplicitAutograd serves every backend key without a kernel of its own (the CPU and
// CUDA registrations win for dense tensors; meta goes to the fake kernels). Nested tensors are
// dispatched on keys it does not cover: AutogradNestedTensor first, NestedTensorCPU/CUDA under
// torch.inference_mode().
#include <torch/library.h>

#include <optional>
#include <string>

#include "numguard/host_checks.h"

namespace numguard {
namespace {

// The devices this build has kernels for, for the error of a dense tensor elsewhere.
#ifdef NUMGUARD_WITH_CUDA
constexpr const char* kKernelDevices = "cpu, cuda";
#else
constexpr const char* kKernelDevices = "cpu (built without CUDA kernels: rebuild with NUMGUARD_BUILD_CUDA=1)";
#endif

// Reached when every tensor passed the input rule: a dense tensor on a device without kernels.
void no_kernel(const at::Tensor& x, const char* name) {
  TORCH_CHECK(false, "numguard: ", name, " is on ", x.device(), ", for which this build of numguard has no kernels; ",
              "it has kernels for ", kKernelDevices);
}

void check_all(at::TensorList xs, const char* what) {
  for (size_t i = 0; i < xs.size(); ++i) check_input(xs[i], what, static_cast<int64_t>(i));
  check_same_device(xs, what);
}

at::Tensor tensor_stats_unsupported(const at::Tensor& x) {
  check_input(x, "x", -1);
  no_kernel(x, "x");
  return {};
}

at::Tensor multi_tensor_stats_unsupported(at::TensorList xs) {
  check_all(xs, "xs");
  TORCH_CHECK_VALUE(!xs.empty(), "numguard: xs holds no tensor; pass at least one");
  no_kernel(xs[0], "xs[0]");
  return {};
}

void check_record(const at::Tensor& ring, const at::Tensor& state, at::TensorList xs) {
  check_all(xs, "xs");
  check_input(ring, "ring", -1);
  check_input(state, "state", -1);
  no_kernel(ring, "ring");
}

void record_unsupported(const at::Tensor& ring, const at::Tensor& state, at::TensorList xs, int64_t, double, int64_t,
                        const std::optional<at::Tensor>&, int64_t, int64_t, at::IntArrayRef,
                        const std::optional<at::Tensor>&) {
  check_record(ring, state, xs);
}

void record_at_cursor_unsupported(const at::Tensor& ring, const at::Tensor& state, const at::Tensor&, const at::Tensor&,
                                  at::TensorList xs, int64_t, double, int64_t) {
  check_record(ring, state, xs);
}

}  // namespace
}  // namespace numguard

#define NUMGUARD_REGISTER_UNSUPPORTED(key)                                       \
  TORCH_LIBRARY_IMPL(numguard, key, m) {                                         \
    m.impl("tensor_stats", &numguard::tensor_stats_unsupported);                 \
    m.impl("multi_tensor_stats", &numguard::multi_tensor_stats_unsupported);     \
    m.impl("record_", &numguard::record_unsupported);                            \
    m.impl("record_at_cursor_", &numguard::record_at_cursor_unsupported);        \
  }

NUMGUARD_REGISTER_UNSUPPORTED(CompositeExplicitAutograd)
NUMGUARD_REGISTER_UNSUPPORTED(AutogradNestedTensor)
NUMGUARD_REGISTER_UNSUPPORTED(NestedTensorCPU)
NUMGUARD_REGISTER_UNSUPPORTED(NestedTensorCUDA)
