// CUDA implementations of numguard's ops (schemas: csrc/ops.cpp) and the list of CUDA
// architectures compiled in. This file prepares tensors (strides, dtypes, launch tables) and
// launches the kernels of stats_kernels.cu on the current stream; it never waits on the device.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "numguard/build_info.h"
#include "numguard/stats_reduce.h"
#include "stats_device.cuh"
#include "stats_launch.cuh"

namespace numguard {

std::vector<std::string> cuda_architectures() {
  std::vector<std::string> archs;
  auto add = [&archs](int arch) {
    const std::string name = "sm_" + std::to_string(arch / 10);
    if (std::find(archs.begin(), archs.end(), name) == archs.end()) archs.push_back(name);
  };
#if defined(__CUDA_ARCH_LIST__)
  // nvcc defines this from the build's -gencode list, e.g. 800,900 (also in host compilation).
  for (int arch : {__CUDA_ARCH_LIST__}) add(arch);
#elif defined(NUMGUARD_CUDA_ARCH_LIST)
  for (int arch : {NUMGUARD_CUDA_ARCH_LIST}) add(arch);
#else
  add(0);  // CUDA kernels are built, but the compiler did not say for which architectures
  archs.back() = "unknown";
#endif
  return archs;
}

namespace cuda {
namespace {

// Tensors at least this large are split over blocks; smaller ones are read by one block.
constexpr int64_t kMinChunkBytes = 32 * 1024;

// How errors name argument i: `x` for tensor_stats, `xs[i]` for the list ops. Built only when an
// error is raised (TORCH_CHECK evaluates its message arguments lazily).
struct ArgName {
  bool single;
  int64_t index;
  std::string str() const { return single ? std::string("x") : "xs[" + std::to_string(index) + "]"; }
};

ElementKind element_kind(const at::Tensor& x, const ArgName& what) {
  switch (x.scalar_type()) {
    case at::kDouble: return ElementKind::kFloat64;
    case at::kFloat: return ElementKind::kFloat32;
    case at::kHalf: return ElementKind::kFloat16;
    case at::kBFloat16: return ElementKind::kBFloat16;
    case at::kFloat8_e4m3fn: return ElementKind::kFloat8E4M3FN;
    case at::kFloat8_e5m2: return ElementKind::kFloat8E5M2;
    case at::kChar: return ElementKind::kInt8;
    case at::kByte: return ElementKind::kUInt8;
    case at::kShort: return ElementKind::kInt16;
    case at::kUInt16: return ElementKind::kUInt16;
    case at::kInt: return ElementKind::kInt32;
    case at::kUInt32: return ElementKind::kUInt32;
    case at::kLong: return ElementKind::kInt64;
    case at::kUInt64: return ElementKind::kUInt64;
    case at::kBool: return ElementKind::kBool;
    default: break;
  }
  TORCH_CHECK_TYPE(!x.is_complex(), "numguard: ", what.str(), " has complex dtype ", x.scalar_type(),
                   "; stats are defined for real tensors: pass torch.view_as_real(x) to check its real and "
                   "imaginary parts");
  TORCH_CHECK_TYPE(false, "numguard: ", what.str(), " has dtype ", x.scalar_type(),
                   ", which numguard does not support: convert it to a floating or integer dtype first");
  return ElementKind::kFloat32;  // unreachable
}

// A tensor as the kernels read it: `numel` dense elements from `data`, each standing for `repeat`.
struct DenseView {
  const void* data = nullptr;
  int64_t numel = 0;
  int64_t repeat = 1;
  int64_t element_size = 1;
  ElementKind kind = ElementKind::kFloat32;
};

// NOTE: [strides without copies]
// Stats do not depend on element order. Dims of size 1 are dropped; dims of stride 0 (expanded)
// are dropped and counted in `repeat` (finalize multiplies the counts by it; min/max are
// unchanged). If the remaining dims, sorted by stride, tile memory without gaps or overlap
// (contiguous, transposed, permuted, channels_last), the tensor is the dense range starting at its
// data pointer and is read in place. Only other layouts (slices with gaps, overlapping views)
// are copied, once, to a contiguous temporary on the current stream.
DenseView dense_view(const at::Tensor& input, const ArgName& what, std::vector<at::Tensor>& keep_alive) {
  TORCH_CHECK(input.layout() == at::kStrided, "numguard: ", what.str(), " has layout ", input.layout(),
              "; only dense (strided) tensors are supported: pass x.to_dense()");
  // A lazily negated view holds the values un-negated in memory: +Inf and -Inf would swap.
  const at::Tensor x = input.is_neg() ? input.resolve_neg() : input;
  if (input.is_neg()) keep_alive.push_back(x);
  DenseView view;
  view.kind = element_kind(x, what);
  view.element_size = static_cast<int64_t>(x.element_size());
  if (x.numel() == 0) return view;
  if (x.is_contiguous()) {  // the common case, without the general analysis below
    view.data = x.const_data_ptr();
    view.numel = x.numel();
    return view;
  }
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims that remain
  std::vector<int64_t> kept_sizes, kept_strides;
  for (int64_t d = 0; d < x.dim(); ++d) {
    const int64_t size = x.size(d), stride = x.stride(d);
    if (size == 1) continue;
    if (stride == 0) {
      view.repeat *= size;
      continue;
    }
    dims.emplace_back(stride, size);
    kept_sizes.push_back(size);
    kept_strides.push_back(stride);
  }
  std::sort(dims.begin(), dims.end());
  bool dense = true;
  int64_t extent = 1;
  for (const auto& dim : dims) {
    if (dim.first != extent) dense = false;
    extent *= dim.second;
  }
  view.numel = extent;
  if (dense) {
    view.data = x.const_data_ptr();
  } else {
    at::Tensor packed = x.as_strided(kept_sizes, kept_strides).contiguous();
    view.data = packed.const_data_ptr();
    keep_alive.push_back(std::move(packed));
  }
  return view;
}

// Records of xs (all on the current device) into records[first_row + i]; see stats_launch.cuh.
// `single`: the call is tensor_stats(x), so errors name `x` rather than `xs[i]`.
void compute_records(at::TensorList xs, double* records, double* max_values, const at::Device& device,
                     bool single = false) {
  const int64_t n = static_cast<int64_t>(xs.size());
  std::vector<at::Tensor> keep_alive;  // contiguous copies, freed stream-ordered after the launches
  std::vector<DenseView> views;
  views.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const ArgName what{single, i};
    TORCH_CHECK(xs[i].defined(), "numguard: ", what.str(), " is an undefined tensor");
    TORCH_CHECK(xs[i].device() == device, "numguard: ", what.str(), " is on ", xs[i].device(), " but xs[0] is on ",
                device, "; all tensors of one call must be on one device: split the call per device");
    views.push_back(dense_view(xs[i], what, keep_alive));
  }

  // Chunking: a large tensor spreads over about one wave of blocks, a small one gets one block.
  const int64_t wave = stats_blocks_per_wave();
  std::vector<int64_t> chunks(n, 1), blocks(n, 0);
  int64_t total_blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    const device::ChunkPlan plan = device::plan_chunks(views[i].numel, views[i].element_size, wave, kMinChunkBytes);
    chunks[i] = plan.chunk;
    blocks[i] = plan.blocks;
    total_blocks += plan.blocks;
  }
  at::Tensor workspace;
  if (total_blocks > 0) {
    workspace = at::empty({total_blocks, kPartialWords}, at::TensorOptions().dtype(at::kLong).device(device));
  }
  int64_t* ws = total_blocks > 0 ? workspace.mutable_data_ptr<int64_t>() : nullptr;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  int64_t partial_base = 0;
  for (int64_t first = 0; first < n; first += kMaxTensorsPerLaunch) {
    TensorTable table{};
    table.num_tensors = static_cast<int32_t>(std::min<int64_t>(kMaxTensorsPerLaunch, n - first));
    table.partial_base = partial_base;
    table.first_record = first;
    int64_t launch_blocks = 0;
    for (int32_t t = 0; t < table.num_tensors; ++t) {
      const DenseView& v = views[first + t];
      table.data[t] = v.data;
      table.numel[t] = v.numel;
      table.chunk[t] = chunks[first + t];
      table.repeat[t] = v.repeat;
      table.kind[t] = v.kind;
      table.block_start[t] = static_cast<int32_t>(launch_blocks);
      launch_blocks += blocks[first + t];
      TORCH_CHECK(launch_blocks < (int64_t{1} << 31), "numguard: too many CUDA blocks in one launch");
    }
    table.block_start[table.num_tensors] = static_cast<int32_t>(launch_blocks);
    launch_stats(table, ws, stream);  // no launch when every tensor is empty
    launch_finalize(table, ws, records, max_values, stream);
    partial_base += launch_blocks;
  }
}

at::Tensor tensor_stats_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.defined(), "numguard: x is an undefined tensor; pass a real tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({kNumStats}, at::TensorOptions().dtype(at::kDouble).device(x.device()));
  compute_records(at::TensorList(&x, 1), out.mutable_data_ptr<double>(), nullptr, x.device(), /*single=*/true);
  return out;
}

at::Tensor multi_tensor_stats_cuda(at::TensorList xs) {
  TORCH_CHECK(!xs.empty() && xs[0].defined(), "numguard: multi_tensor_stats on CUDA needs at least one tensor");
  const at::Device device = xs[0].device();
  for (size_t i = 1; i < xs.size(); ++i) {  // before the guard: xs[0] itself may be the odd one out
    TORCH_CHECK(!xs[i].defined() || xs[i].device() == device, "numguard: xs[", i, "] is on ", xs[i].device(),
                " but xs[0] is on ", device, "; all tensors of one call must be on one device: split the call per device");
  }
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({static_cast<int64_t>(xs.size()), kNumStats},
                             at::TensorOptions().dtype(at::kDouble).device(device));
  compute_records(xs, out.mutable_data_ptr<double>(), nullptr, device);
  return out;
}

void record_cuda(const at::Tensor& ring, const at::Tensor& state, at::TensorList xs, int64_t position,
                 double headroom) {
  TORCH_CHECK(ring.defined() && ring.is_cuda() && ring.layout() == at::kStrided,
              "numguard: ring must be a dense CUDA tensor here, got ",
              ring.defined() ? c10::str(ring.device()) : std::string("an undefined tensor"));
  TORCH_CHECK(ring.scalar_type() == at::kDouble && ring.dim() == 2 && ring.size(0) >= 1 && ring.size(1) == kNumStats,
              "numguard: ring must be float64[R, ", kNumStats, "] with R >= 1 (see numguard.ops.new_ring), got ",
              ring.scalar_type(), ring.sizes());
  TORCH_CHECK(ring.is_contiguous(), "numguard: ring must be contiguous on CUDA, got strides ", ring.strides(),
              "; pass a ring made by numguard.ops.new_ring");
  TORCH_CHECK(state.defined() && state.device() == ring.device() && state.layout() == at::kStrided,
              "numguard: state must be a dense tensor on the ring's device (", ring.device(), "), got ",
              state.defined() ? c10::str(state.device()) : std::string("an undefined tensor"));
  TORCH_CHECK(state.scalar_type() == at::kLong && state.dim() == 1 && state.size(0) == kStateSize,
              "numguard: state must be int64[", kStateSize, "] (see numguard.ops.new_ring), got ", state.scalar_type(),
              state.sizes());
  TORCH_CHECK(state.is_contiguous(), "numguard: state must be contiguous on CUDA, got strides ", state.strides(),
              "; pass a state made by numguard.ops.new_ring");
  if (xs.empty()) return;
  const at::Device device = ring.device();
  const c10::cuda::CUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(xs.size());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(xs[i].defined(), "numguard: xs[", i, "] is an undefined tensor");
    TORCH_CHECK(xs[i].device() == device, "numguard: xs[", i, "] is on ", xs[i].device(), " but the ring is on ",
                device, "; record tensors into a ring on their own device");
  }
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor records = at::empty({n, kNumStats}, options);
  at::Tensor max_values = at::empty({n}, options);
  double* records_ptr = records.mutable_data_ptr<double>();
  double* max_ptr = max_values.mutable_data_ptr<double>();
  compute_records(xs, records_ptr, max_ptr, device);
  launch_record(records_ptr, max_ptr, n, ring.mutable_data_ptr<double>(), ring.size(0),
                state.mutable_data_ptr<int64_t>(), position, headroom,
                c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

}  // namespace
}  // namespace cuda
}  // namespace numguard

TORCH_LIBRARY_IMPL(numguard, CUDA, m) {
  m.impl("tensor_stats", &numguard::cuda::tensor_stats_cuda);
  m.impl("multi_tensor_stats", &numguard::cuda::multi_tensor_stats_cuda);
  m.impl("record_", &numguard::cuda::record_cuda);
}
