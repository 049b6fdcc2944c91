// CUDA implementations of numguard's ops (schemas: csrc/ops.cpp) and the list of CUDA
// architectures compiled in. This file prepares tensors (with the CPU ops' dtype table, input rule
// and stride analysis: numguard/host_checks.h), builds launch tables and launches the kernels of
// stats_kernels.cu on the current stream; it never waits on the device.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "numguard/build_info.h"
#include "numguard/host_checks.h"
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

// A tensor as the kernels read it: `numel` dense elements from `data`, each standing for `repeat`.
struct DenseView {
  const void* data = nullptr;
  int64_t numel = 0;
  int64_t repeat = 1;
  int64_t element_size = 1;
  ElementKind kind = ElementKind::kFloat32;
};

// Dense in place when the stride analysis allows (NOTE: [layouts] in numguard/host_checks.h);
// any other layout (slices with gaps, overlapping views) is copied once to a contiguous temporary
// on the current stream. `what`/`index` name the argument in errors ("x", or "xs" and its index).
DenseView dense_view(const at::Tensor& input, const char* what, int64_t index, std::vector<at::Tensor>& keep_alive) {
  const DtypeInfo info = check_input(input, what, index);
  // A lazily negated view holds the values un-negated in memory: +Inf and -Inf would swap.
  // NOTE: [element alignment] (numguard/host_checks.h): a misaligned start is read from a copy.
  const at::Tensor x = element_aligned(input.is_neg() ? input.resolve_neg() : input);
  if (!x.is_same(input)) keep_alive.push_back(x);
  DenseView view;
  view.kind = info.kind;
  view.element_size = info.elem_size;
  if (x.numel() == 0) return view;
  if (x.is_contiguous()) {  // the common case, without the general analysis
    view.data = x.const_data_ptr();
    view.numel = x.numel();
    return view;
  }
  const StrideLayout layout = analyze_strides(x);
  view.numel = layout.numel;
  view.repeat = layout.repeat;
  if (layout.dense()) {
    view.data = x.const_data_ptr();
  } else {
    at::Tensor packed = x.as_strided(layout.sizes, layout.strides).contiguous();
    view.data = packed.const_data_ptr();
    keep_alive.push_back(std::move(packed));
  }
  return view;
}

// The launch plan of a stats call: each tensor as the kernels read it, its chunking, and the
// workspace words its per-block partials need.
struct StatsPlan {
  std::vector<DenseView> views;
  std::vector<int64_t> chunks, blocks;
  int64_t total_blocks = 0;
  std::vector<at::Tensor> keep_alive;  // contiguous copies, freed stream-ordered after the launches

  int64_t workspace_words() const { return total_blocks * kPartialWords; }
};

// `single`: the call is tensor_stats(x), so errors name `x` rather than `xs[i]`.
StatsPlan plan_stats(at::TensorList xs, bool single = false) {
  const int64_t n = static_cast<int64_t>(xs.size());
  StatsPlan plan;
  plan.views.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    plan.views.push_back(dense_view(xs[i], single ? "x" : "xs", single ? -1 : i, plan.keep_alive));
  }
  // Chunking: a large tensor spreads over about one wave of blocks, a small one gets one block.
  const int64_t wave = stats_blocks_per_wave();
  plan.chunks.assign(n, 1);
  plan.blocks.assign(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    const device::ChunkPlan chunking =
        device::plan_chunks(plan.views[i].numel, plan.views[i].element_size, wave, kMinChunkBytes);
    plan.chunks[i] = chunking.chunk;
    plan.blocks[i] = chunking.blocks;
    plan.total_blocks += chunking.blocks;
  }
  return plan;
}

// Launches `plan` on the current stream: partials into `ws` (plan.workspace_words() int64), the
// record of tensor i into records[i] (and max_values[i] when not null); see stats_launch.cuh.
void launch_plan(const StatsPlan& plan, int64_t* ws, double* records, double* max_values, const at::Device& device) {
  const int64_t n = static_cast<int64_t>(plan.views.size());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  int64_t partial_base = 0;
  for (int64_t first = 0; first < n; first += kMaxTensorsPerLaunch) {
    TensorTable table{};
    table.num_tensors = static_cast<int32_t>(std::min<int64_t>(kMaxTensorsPerLaunch, n - first));
    table.partial_base = partial_base;
    table.first_record = first;
    int64_t launch_blocks = 0;
    for (int32_t t = 0; t < table.num_tensors; ++t) {
      const DenseView& v = plan.views[first + t];
      table.data[t] = v.data;
      table.numel[t] = v.numel;
      table.chunk[t] = plan.chunks[first + t];
      table.repeat[t] = v.repeat;
      table.kind[t] = v.kind;
      table.block_start[t] = static_cast<int32_t>(launch_blocks);
      launch_blocks += plan.blocks[first + t];
      TORCH_CHECK(launch_blocks < (int64_t{1} << 31), "numguard: too many CUDA blocks in one launch");
    }
    table.block_start[table.num_tensors] = static_cast<int32_t>(launch_blocks);
    launch_stats(table, ws, stream);  // no launch when every tensor is empty
    launch_finalize(table, ws, records, max_values, stream);
    partial_base += launch_blocks;
  }
}

// Records of xs (all on `device`, the current one) into records[i], with a workspace of their own.
void compute_records(at::TensorList xs, double* records, double* max_values, const at::Device& device,
                     bool single = false) {
  const StatsPlan plan = plan_stats(xs, single);
  at::Tensor workspace;
  if (plan.total_blocks > 0) {
    workspace = at::empty({plan.workspace_words()}, at::TensorOptions().dtype(at::kLong).device(device));
  }
  launch_plan(plan, plan.total_blocks > 0 ? workspace.mutable_data_ptr<int64_t>() : nullptr, records, max_values,
              device);
}

// One device buffer for a recording call: the partials' workspace, then n records and n max
// values (8-byte words all), so a recorded frame costs one allocation, not three.
struct RecordScratch {
  at::Tensor buffer;
  int64_t* workspace = nullptr;
  double* records = nullptr;
  double* max_values = nullptr;

  RecordScratch(const StatsPlan& plan, int64_t n, const at::Device& device) {
    static_assert(sizeof(double) == sizeof(int64_t), "records and partials share 8-byte words");
    const int64_t rows = std::max<int64_t>(n, 1);
    buffer = at::empty({plan.workspace_words() + rows * kNumStats + rows},
                       at::TensorOptions().dtype(at::kLong).device(device));
    workspace = buffer.mutable_data_ptr<int64_t>();
    records = reinterpret_cast<double*>(workspace + plan.workspace_words());
    max_values = records + rows * kNumStats;
  }
};

at::Tensor tensor_stats_cuda(const at::Tensor& x) {
  check_input(x, "x", -1);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({kNumStats}, at::TensorOptions().dtype(at::kDouble).device(x.device()));
  compute_records(at::TensorList(&x, 1), out.mutable_data_ptr<double>(), nullptr, x.device(), /*single=*/true);
  return out;
}

at::Tensor multi_tensor_stats_cuda(at::TensorList xs) {
  TORCH_CHECK(!xs.empty() && xs[0].defined(), "numguard: multi_tensor_stats on CUDA needs at least one tensor");
  check_same_device(xs, "xs");  // before the guard: xs[0] itself may be the odd one out
  const at::Device device = xs[0].device();
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({static_cast<int64_t>(xs.size()), kNumStats},
                             at::TensorOptions().dtype(at::kDouble).device(device));
  compute_records(xs, out.mutable_data_ptr<double>(), nullptr, device);
  return out;
}

// NOTE: [rings on side streams]
// A ring is allocated on one stream; a frame recorded on another stream writes it later than the
// allocator knows. Marking the ring's tensors as used on that stream keeps their memory from being
// handed out again while the write is pending. Not done while the stream is being captured: the
// graph's replays write memory the graph's owner keeps alive.
void mark_used_on_side_stream(std::initializer_list<const at::Tensor*> tensors, const c10::cuda::CUDAStream& stream) {
  if (stream == c10::cuda::getDefaultCUDAStream(stream.device_index())) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  for (const at::Tensor* t : tensors) t->record_stream(stream);
}

void record_cuda(const at::Tensor& ring, const at::Tensor& state, at::TensorList xs, int64_t position,
                 double headroom, int64_t context) {
  check_ring_and_state(ring, state, at::kCUDA, /*contiguous=*/true);
  check_on_ring_device(xs, ring);
  if (xs.empty()) return;
  const at::Device device = ring.device();
  const c10::cuda::CUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(xs.size());
  const StatsPlan plan = plan_stats(xs);
  RecordScratch scratch(plan, n, device);
  launch_plan(plan, scratch.workspace, scratch.records, scratch.max_values, device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  mark_used_on_side_stream({&ring, &state}, stream);
  launch_record(scratch.records, scratch.max_values, n, ring.mutable_data_ptr<double>(), ring.size(0),
                state.mutable_data_ptr<int64_t>(), position, headroom, context, stream.stream());
}

// record_at_cursor_ (csrc/ops.cpp): record_cuda with the position read on the device.
void record_at_cursor_cuda(const at::Tensor& ring, const at::Tensor& state, const at::Tensor& cursor,
                           const at::Tensor& log, at::TensorList xs, int64_t slot, double headroom,
                           int64_t context) {
  check_ring_and_state(ring, state, at::kCUDA, /*contiguous=*/true);
  check_cursor_and_log(cursor, log, ring);
  check_on_ring_device(xs, ring);
  const at::Device device = ring.device();
  const c10::cuda::CUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(xs.size());
  const StatsPlan plan = plan_stats(xs);
  RecordScratch scratch(plan, n, device);
  if (n > 0) launch_plan(plan, scratch.workspace, scratch.records, scratch.max_values, device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  mark_used_on_side_stream({&ring, &state, &cursor, &log}, stream);
  launch_record_at_cursor(scratch.records, scratch.max_values, n, ring.mutable_data_ptr<double>(), ring.size(0),
                          state.mutable_data_ptr<int64_t>(), cursor.mutable_data_ptr<int64_t>(),
                          log.mutable_data_ptr<int64_t>(), log.size(0), slot, headroom, context, stream.stream());
}

}  // namespace
}  // namespace cuda
}  // namespace numguard

TORCH_LIBRARY_IMPL(numguard, CUDA, m) {
  m.impl("tensor_stats", &numguard::cuda::tensor_stats_cuda);
  m.impl("multi_tensor_stats", &numguard::cuda::multi_tensor_stats_cuda);
  m.impl("record_", &numguard::cuda::record_cuda);
  m.impl("record_at_cursor_", &numguard::cuda::record_at_cursor_cuda);
}
