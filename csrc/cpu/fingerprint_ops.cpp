// CPU implementation of numguard::multi_tensor_fingerprint (NOTE: [fingerprint] in
// numguard/fingerprint.h), and its "unsupported" kernels for the dispatch keys without a real one
// (the messages of csrc/unsupported.cpp).
//
// The work of one call, over all its tensors, is a flat list of fixed-size chunks run on
// at::parallel_for; each chunk adds its partial digest into its tensor's slot with a wrapping
// atomic add. Addition mod 2^64 is order-free, so the digest is the same for any thread count.
// A tensor that is not contiguous (slices, transposes, expanded dims) is read through its
// contiguous copy: the digest is defined over the logical row-major index.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "numguard/host_checks.h"
#include "numguard/fingerprint.h"

namespace numguard {
namespace cpu {
namespace {

constexpr int64_t kFingerprintChunkElems = 1 << 15;

struct FingerprintChunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

at::Tensor multi_tensor_fingerprint_cpu(at::TensorList xs) {
  std::vector<at::Tensor> dense;
  std::vector<DtypeInfo> infos;
  dense.reserve(xs.size());
  infos.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    infos.push_back(check_input(xs[i], "xs", static_cast<int64_t>(i)));
  }
  check_same_device(xs, "xs");
  std::vector<FingerprintChunk> chunks;
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor x = element_aligned(xs[i]);  // NOTE: [element alignment]
    dense.push_back(x.is_contiguous() ? x : x.contiguous());
    const int64_t n = dense.back().numel();
    for (int64_t b = 0; b < n; b += kFingerprintChunkElems) {
      chunks.push_back({static_cast<int64_t>(i), b, std::min(n, b + kFingerprintChunkElems)});
    }
  }
  std::vector<std::atomic<uint64_t>> sums(xs.size());
  for (auto& s : sums) s.store(0, std::memory_order_relaxed);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const FingerprintChunk& chunk = chunks[c];
      const at::Tensor& x = dense[chunk.tensor];
      const DtypeInfo& info = infos[chunk.tensor];
      const char* base = static_cast<const char*>(x.const_data_ptr()) + chunk.begin * info.elem_size;
      const uint64_t part = fingerprint_span(base, info.elem_size, info.kind == ElementKind::kBool,
                                             chunk.end - chunk.begin, static_cast<uint64_t>(chunk.begin));
      sums[chunk.tensor].fetch_add(part, std::memory_order_relaxed);
    }
  });
  at::Tensor out = at::empty({static_cast<int64_t>(xs.size())}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (size_t i = 0; i < xs.size(); ++i) o[i] = static_cast<int64_t>(sums[i].load(std::memory_order_relaxed));
  return out;
}

// Reached for dispatch keys without a kernel: name the argument that breaks the input rule, or
// the device this build has no kernel for.
at::Tensor multi_tensor_fingerprint_unsupported(at::TensorList xs) {
  for (size_t i = 0; i < xs.size(); ++i) check_input(xs[i], "xs", static_cast<int64_t>(i));
  check_same_device(xs, "xs");
  TORCH_CHECK_VALUE(!xs.empty(), "numguard: xs holds no tensor; pass at least one");
  TORCH_CHECK(false, "numguard: xs[0] is on ", xs[0].device(),
              ", for which this build of numguard has no fingerprint kernel; it has kernels for cpu",
#ifdef NUMGUARD_WITH_CUDA
              ", cuda"
#else
              " (built without CUDA kernels: rebuild with NUMGUARD_BUILD_CUDA=1)"
#endif
  );
  return {};
}

}  // namespace
}  // namespace cpu
}  // namespace numguard

TORCH_LIBRARY_IMPL(numguard, CPU, m) {
  m.impl("multi_tensor_fingerprint", &numguard::cpu::multi_tensor_fingerprint_cpu);
}

#define NUMGUARD_REGISTER_FINGERPRINT_UNSUPPORTED(key)                                      \
  TORCH_LIBRARY_IMPL(numguard, key, m) {                                                    \
    m.impl("multi_tensor_fingerprint", &numguard::cpu::multi_tensor_fingerprint_unsupported); \
  }

NUMGUARD_REGISTER_FINGERPRINT_UNSUPPORTED(CompositeExplicitAutograd)
NUMGUARD_REGISTER_FINGERPRINT_UNSUPPORTED(AutogradNestedTensor)
NUMGUARD_REGISTER_FINGERPRINT_UNSUPPORTED(NestedTensorCPU)
NUMGUARD_REGISTER_FINGERPRINT_UNSUPPORTED(NestedTensorCUDA)
