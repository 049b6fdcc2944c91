// CUDA implementations of numguard's ops (schemas: csrc/ops.cpp) and the list of CUDA
// architectures compiled in. This file prepares tensors (with the CPU ops' dtype table, input rule
// and stride analysis: numguard/host_checks.h), builds launch tables and launches the kernels of
// stats_kernels.cu on the current stream; it never waits on the device.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "numguard/build_info.h"
#include "numguard/host_checks.h"
#include "numguard/quant.h"
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

// A tensor as the kernels read it: `numel` elements from `data`, each standing for `repeat`: one
// dense span, or the merged dims of a strided view (NOTE: [strided reads]).
struct TensorView {
  const void* data = nullptr;
  int64_t numel = 0;
  int64_t repeat = 1;
  int64_t element_size = 1;
  ElementKind kind = ElementKind::kFloat32;
  bool strided = false;
  device::StridedDims dims{};  // innermost first, when `strided`
};

// In place whenever the stride analysis allows (NOTE: [layouts] in numguard/host_checks.h): one
// dense span (contiguous, transposed, channels_last, expanded), or a strided walk of up to
// kMaxStridedDims merged dims (slices with gaps, columns, overlapping views: NOTE: [strided
// reads]). Only a view with more merged dims is copied once to a contiguous temporary on the
// current stream. `what`/`index` name the argument in errors ("x", or "xs" and its index).
TensorView tensor_view(const at::Tensor& input, const char* what, int64_t index, std::vector<at::Tensor>& keep_alive) {
  const DtypeInfo info = check_input(input, what, index);
  // A lazily negated view holds the values un-negated in memory: +Inf and -Inf would swap.
  // NOTE: [element alignment] (numguard/host_checks.h): a misaligned start is read from a copy.
  const at::Tensor x = element_aligned(input.is_neg() ? input.resolve_neg() : input);
  if (!x.is_same(input)) keep_alive.push_back(x);
  TensorView view;
  view.kind = info.kind;
  view.element_size = info.elem_size;
  if (x.numel() == 0) return view;
  view.data = x.const_data_ptr();
  if (x.is_contiguous()) {  // the common case, without the general analysis
    view.numel = x.numel();
    return view;
  }
  const StrideLayout layout = analyze_strides(x);
  view.numel = layout.numel;
  view.repeat = layout.repeat;
  const int64_t dims = static_cast<int64_t>(layout.sizes.size());
  if (layout.dense()) return view;
  if (dims <= device::kMaxStridedDims) {
    view.strided = true;
    view.dims.dims = static_cast<int32_t>(dims);
    for (int64_t d = 0; d < dims; ++d) {  // the analysis lists dims outermost first
      view.dims.sizes[d] = layout.sizes[dims - 1 - d];
      view.dims.strides[d] = layout.strides[dims - 1 - d];
    }
    return view;
  }
  at::Tensor packed = x.as_strided(layout.sizes, layout.strides).contiguous();
  view.data = packed.const_data_ptr();
  keep_alive.push_back(std::move(packed));
  return view;
}

// The launch plan of a stats call: each tensor as the kernels read it, its chunking, the
// workspace words its per-block partials need, and where the launches split.
struct StatsPlan {
  std::vector<TensorView> views;
  std::vector<int64_t> chunks, blocks;
  std::vector<int64_t> launch_starts;  // first tensor of each launch
  int64_t total_blocks = 0;
  std::vector<at::Tensor> keep_alive;  // copies, freed stream-ordered after the launches

  int64_t workspace_words() const { return total_blocks * device::kPartialWords; }
};

// `single`: the call is tensor_stats(x), so errors name `x` rather than `xs[i]`.
StatsPlan plan_stats(at::TensorList xs, bool single = false) {
  const int64_t n = static_cast<int64_t>(xs.size());
  StatsPlan plan;
  plan.views.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    plan.views.push_back(tensor_view(xs[i], single ? "x" : "xs", single ? -1 : i, plan.keep_alive));
  }
  // Chunking: a large tensor spreads over about one wave of blocks, a small one gets one block.
  const int64_t wave = stats_blocks_per_wave();
  plan.chunks.assign(n, 1);
  plan.blocks.assign(n, 1);
  int64_t in_launch = 0, strided_in_launch = 0;
  for (int64_t i = 0; i < n; ++i) {
    const TensorView& v = plan.views[i];
    if (i == 0 || in_launch == kMaxTensorsPerLaunch || (v.strided && strided_in_launch == kMaxStridedPerLaunch)) {
      plan.launch_starts.push_back(i);
      in_launch = strided_in_launch = 0;
    }
    ++in_launch;
    strided_in_launch += v.strided ? 1 : 0;
    const device::ChunkPlan chunking = device::plan_chunks(v.numel, v.element_size, wave, kMinChunkBytes);
    plan.chunks[i] = chunking.chunk;
    plan.blocks[i] = chunking.blocks;
    plan.total_blocks += chunking.blocks;
  }
  return plan;
}

// NOTE: [launch counters]
// The kernel's last-block counters (NOTE: [one launch per frame]) must read zero when a launch
// begins; each launch leaves them zero again (atomicInc wraps on the last arrival). Launches on
// one stream run one after another, so on a stream that is not being captured the counters are a
// buffer kept per (device, stream), zeroed once when first used there: no memset per call. A
// stream being captured into a CUDA graph gets counters in the call's scratch, zeroed by a memset
// node in the graph, since the graph may later be replayed on any stream, alongside anything.
constexpr size_t kMaxKeptCounterBuffers = 1024;

unsigned int* stream_counters(const c10::cuda::CUDAStream& stream) {
  static std::mutex mutex;
  // Never destroyed: CUDA may be torn down before static destructors run.
  static auto* kept = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(static_cast<int>(stream.device_index()), stream.stream());
  auto it = kept->find(key);
  if (it == kept->end()) {
    if (kept->size() >= kMaxKeptCounterBuffers) return nullptr;  // many short-lived streams: memset instead
    // Zeroed on this stream, so before any launch on it reads the counters.
    at::Tensor counters = at::zeros({kLaunchCounters}, at::TensorOptions().dtype(at::kInt).device(stream.device()));
    it = kept->emplace(key, std::move(counters)).first;
  }
  return reinterpret_cast<unsigned int*>(it->second.mutable_data_ptr<int32_t>());
}

// The default stream is never captured (CUDA graphs are captured on other streams), and asking
// about it while another stream captures in global mode is itself an error.
bool is_capturing(const c10::cuda::CUDAStream& stream) {
  if (stream == c10::cuda::getDefaultCUDAStream(stream.device_index())) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capture));
  return capture != cudaStreamCaptureStatusNone;
}

// One device buffer for a call: the partials' workspace, then (when asked) n records and n max
// values, then (while capturing) the launch counters: a frame costs one allocation.
struct Scratch {
  at::Tensor buffer;
  int64_t* workspace = nullptr;
  double* records = nullptr;
  double* max_values = nullptr;
  unsigned int* counters = nullptr;

  Scratch(const StatsPlan& plan, int64_t records_needed, const c10::cuda::CUDAStream& stream) {
    static_assert(sizeof(double) == sizeof(int64_t), "records and partials share 8-byte words");
    const bool capturing = is_capturing(stream);
    if (!capturing) counters = stream_counters(stream);
    const int64_t counter_words = counters == nullptr ? (kLaunchCounters + 1) / 2 : 0;
    const int64_t words = plan.workspace_words() + records_needed * (kNumStats + 1) + counter_words;
    buffer = at::empty({std::max<int64_t>(words, 1)}, at::TensorOptions().dtype(at::kLong).device(stream.device()));
    workspace = buffer.mutable_data_ptr<int64_t>();
    if (records_needed > 0) {
      records = reinterpret_cast<double*>(workspace + plan.workspace_words());
      max_values = records + records_needed * kNumStats;
    }
    if (counters == nullptr) {
      counters = reinterpret_cast<unsigned int*>(workspace + plan.workspace_words() + records_needed * (kNumStats + 1));
      C10_CUDA_CHECK(cudaMemsetAsync(counters, 0, kLaunchCounters * sizeof(unsigned int), stream.stream()));
    }
  }
};

// Launches `plan` on `stream` (NOTE: [one launch per frame]): the record of tensor i goes to
// frame.records row i (and frame.max_values[i] when not null); frame.step runs once, at the end
// of the last launch. With no tensors (record_at_cursor_ of none), one launch runs the step alone.
void launch_plan(const StatsPlan& plan, const Scratch& scratch, FrameArgs frame, const c10::cuda::CUDAStream& stream) {
  const int64_t n = static_cast<int64_t>(plan.views.size());
  frame.counters = scratch.counters;
  const FrameStep step = frame.step;
  if (n == 0) {
    TensorTable table{};
    launch_stats(table, frame, scratch.workspace, stream.stream());
    return;
  }
  int64_t partial_base = 0;
  for (size_t l = 0; l < plan.launch_starts.size(); ++l) {
    const int64_t first = plan.launch_starts[l];
    const int64_t end = l + 1 < plan.launch_starts.size() ? plan.launch_starts[l + 1] : n;
    TensorTable table{};
    table.num_tensors = static_cast<int32_t>(end - first);
    table.partial_base = partial_base;
    table.first_record = first;
    int64_t launch_blocks = 0;
    int strided = 0;
    for (int32_t t = 0; t < table.num_tensors; ++t) {
      const TensorView& v = plan.views[first + t];
      table.data[t] = v.data;
      table.numel[t] = v.numel;
      table.chunk[t] = plan.chunks[first + t];
      table.repeat[t] = v.repeat;
      table.kind[t] = v.kind;
      table.layout[t] = kDenseLayout;
      if (v.strided) {
        table.strided[strided] = v.dims;
        table.layout[t] = static_cast<uint8_t>(strided++);
      }
      table.block_start[t] = static_cast<int32_t>(launch_blocks);
      launch_blocks += plan.blocks[first + t];
      TORCH_CHECK(launch_blocks < (int64_t{1} << 31), "numguard: too many CUDA blocks in one launch");
    }
    table.block_start[table.num_tensors] = static_cast<int32_t>(launch_blocks);
    frame.step = end == n ? step : FrameStep::kStatsOnly;
    launch_stats(table, frame, scratch.workspace, stream.stream());
    partial_base += launch_blocks;
  }
}

// Records of xs (all on the current device) into `records` (float64[len(xs), 8] on the device).
void compute_records(at::TensorList xs, double* records, bool single = false) {
  const StatsPlan plan = plan_stats(xs, single);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  const Scratch scratch(plan, 0, stream);
  FrameArgs frame{};
  frame.records = records;
  frame.step = FrameStep::kStatsOnly;
  launch_plan(plan, scratch, frame, stream);
}

at::Tensor tensor_stats_cuda(const at::Tensor& x) {
  check_input(x, "x", -1);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({kNumStats}, at::TensorOptions().dtype(at::kDouble).device(x.device()));
  compute_records(at::TensorList(&x, 1), out.mutable_data_ptr<double>(), /*single=*/true);
  return out;
}

at::Tensor multi_tensor_stats_cuda(at::TensorList xs) {
  TORCH_CHECK(!xs.empty() && xs[0].defined(), "numguard: multi_tensor_stats on CUDA needs at least one tensor");
  check_same_device(xs, "xs");  // before the guard: xs[0] itself may be the odd one out
  const at::Device device = xs[0].device();
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({static_cast<int64_t>(xs.size()), kNumStats},
                             at::TensorOptions().dtype(at::kDouble).device(device));
  compute_records(xs, out.mutable_data_ptr<double>());
  return out;
}

// NOTE: [rings on side streams]
// A ring is allocated on one stream; a frame recorded on another stream writes it later than the
// allocator knows. Marking the ring's tensors as used on that stream keeps their memory from being
// handed out again while the write is pending. Not done while the stream is being captured: the
// graph's replays write memory the graph's owner keeps alive.
void mark_used_on_side_stream(std::initializer_list<const at::Tensor*> tensors, const c10::cuda::CUDAStream& stream) {
  if (stream == c10::cuda::getDefaultCUDAStream(stream.device_index()) || is_capturing(stream)) return;
  for (const at::Tensor* t : tensors) t->record_stream(stream);
}

// The frame arguments common to record_ and record_at_cursor_, with records in `scratch`.
FrameArgs frame_args(const Scratch& scratch, int64_t n, const at::Tensor& ring, const at::Tensor& state,
                     double headroom, int64_t context) {
  FrameArgs frame{};
  frame.records = scratch.records;
  frame.max_values = scratch.max_values;
  frame.n = n;
  frame.ring = ring.mutable_data_ptr<double>();
  frame.ring_rows = ring.size(0);
  frame.state = state.mutable_data_ptr<int64_t>();
  frame.headroom = headroom;
  frame.context = context;
  return frame;
}

// record_'s stats and recording step.
void record_stats_cuda(const at::Tensor& ring, const at::Tensor& state, at::TensorList xs, int64_t position,
                       double headroom, int64_t context) {
  if (xs.empty()) return;
  const c10::cuda::CUDAGuard guard(ring.device());
  const int64_t n = static_cast<int64_t>(xs.size());
  const StatsPlan plan = plan_stats(xs);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  const Scratch scratch(plan, n, stream);
  mark_used_on_side_stream({&ring, &state}, stream);
  FrameArgs frame = frame_args(scratch, n, ring, state, headroom, context);
  frame.step = FrameStep::kRecord;
  frame.position = position;
  launch_plan(plan, scratch, frame, stream);
}

using QuantWatchSignature = at::Tensor(const at::Tensor&, int64_t, at::TensorList, int64_t);

// record_'s what-if (NOTE: [quant in the stats call]): on CUDA the measurement is quant_watch_'s
// launches, queued after the stats' on the same stream within the one record_ call (its amax by a
// pass of its own: the stats' is on the device only once their launch has run).
void record_cuda(const at::Tensor& ring, const at::Tensor& state, at::TensorList xs, int64_t position,
                 double headroom, int64_t context, const std::optional<at::Tensor>& quant_sums, int64_t quant_row,
                 int64_t quant_format, at::IntArrayRef quant_xs, const std::optional<at::Tensor>& quant_records) {
  check_ring_and_state(ring, state, at::kCUDA, /*contiguous=*/true);
  check_on_ring_device(xs, ring);
  const bool quant = quant_sums.has_value() && quant_sums->defined();
  const at::Tensor out_records = quant && quant_records.has_value() ? *quant_records : at::Tensor();
  std::vector<at::Tensor> measured;
  if (quant) {
    measured = check_record_quant_args(*quant_sums, quant_row, quant_format, kQuantNvfp4 + 1, quant_xs, xs,
                                       out_records);
  }
  record_stats_cuda(ring, state, xs, position, headroom, context);
  if (measured.empty()) return;
  static const auto quant_watch = c10::Dispatcher::singleton()
                                      .findSchemaOrThrow("numguard::quant_watch_", "")
                                      .typed<QuantWatchSignature>();
  at::Tensor records = quant_watch.call(*quant_sums, quant_row, measured, quant_format);
  if (out_records.defined()) out_records.copy_(records);
}

// record_at_cursor_ (csrc/ops.cpp): record_cuda with the position read on the device.
void record_at_cursor_cuda(const at::Tensor& ring, const at::Tensor& state, const at::Tensor& cursor,
                           const at::Tensor& log, at::TensorList xs, int64_t slot, double headroom,
                           int64_t context) {
  check_ring_and_state(ring, state, at::kCUDA, /*contiguous=*/true);
  check_cursor_and_log(cursor, log, ring);
  check_on_ring_device(xs, ring);
  const c10::cuda::CUDAGuard guard(ring.device());
  const int64_t n = static_cast<int64_t>(xs.size());
  const StatsPlan plan = plan_stats(xs);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  const Scratch scratch(plan, n, stream);
  mark_used_on_side_stream({&ring, &state, &cursor, &log}, stream);
  FrameArgs frame = frame_args(scratch, n, ring, state, headroom, context);
  frame.step = FrameStep::kRecordAtCursor;
  frame.cursor = cursor.mutable_data_ptr<int64_t>();
  frame.log = log.mutable_data_ptr<int64_t>();
  frame.log_rows = log.size(0);
  frame.slot = slot;
  launch_plan(plan, scratch, frame, stream);
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
