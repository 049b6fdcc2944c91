// numguard's CUDA kernel: one-pass stats over many tensors per launch, each tensor's partials
// merged by its last block, and the recording step of record_ / record_at_cursor_ run by the
// launch's last block, all in one launch per frame (NOTE: [one launch per frame]).
//
// The reduction math is the shared header's (numguard/stats_reduce.h); this file only decides how
// the elements reach it: 16-byte vector loads, a fast path for vectors of normal values, strided
// offsets for views that are not one dense span, and the multi-tensor launch shape (NOTE:
// [multi-tensor table] in stats_launch.cuh).
#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include <c10/cuda/CUDAException.h>

#include "numguard/graph_record.h"
#include "numguard/stats_reduce.h"
#include "stats_device.cuh"
#include "stats_launch.cuh"

namespace numguard {
namespace cuda {
namespace {

using namespace device;  // element formats, visitors, scan_chunk (stats_device.cuh)

__device__ __forceinline__ FloatFormat format_of(ElementKind kind) {
  switch (kind) {
    case ElementKind::kFloat64: return Float64Element::format();
    case ElementKind::kFloat32: return Float32Element::format();
    case ElementKind::kFloat16: return Float16Element::format();
    case ElementKind::kBFloat16: return BFloat16Element::format();
    case ElementKind::kFloat8E5M2: return Float8E5M2Element::format();
    default: return float8_e4m3fn_format();
  }
}

// ---------------------------------------------------------------------------------------------
// Block reduction of the accumulators (integer merges only: any order gives the same result).

__device__ __forceinline__ uint64_t shfl_down(uint64_t v, int offset) {
  return static_cast<uint64_t>(__shfl_down_sync(0xffffffffu, static_cast<unsigned long long>(v), offset));
}
__device__ __forceinline__ int64_t shfl_down(int64_t v, int offset) {
  return static_cast<int64_t>(__shfl_down_sync(0xffffffffu, static_cast<long long>(v), offset));
}

__device__ __forceinline__ FloatStatsAccum shfl_down(const FloatStatsAccum& a, int offset) {
  FloatStatsAccum r;
  r.min_abs = shfl_down(a.min_abs, offset);
  r.max_abs = shfl_down(a.max_abs, offset);
  r.min_nonzero = shfl_down(a.min_nonzero, offset);
  r.nan = shfl_down(a.nan, offset);
  r.pos_inf = shfl_down(a.pos_inf, offset);
  r.neg_inf = shfl_down(a.neg_inf, offset);
  r.zero = shfl_down(a.zero, offset);
  r.subnormal = shfl_down(a.subnormal, offset);
  return r;
}

__device__ __forceinline__ IntStatsAccum shfl_down(const IntStatsAccum& a, int offset) {
  IntStatsAccum r;
  r.min_abs = shfl_down(a.min_abs, offset);
  r.max_abs = shfl_down(a.max_abs, offset);
  r.min_nonzero = shfl_down(a.min_nonzero, offset);
  r.count = shfl_down(a.count, offset);
  r.zero = shfl_down(a.zero, offset);
  return r;
}

// Reduces acc over the block; the result is valid in thread 0. kThreads is a multiple of 32.
template <int kThreads, typename Accum>
__device__ __forceinline__ Accum block_reduce(Accum acc) {
  constexpr int kWarps = kThreads / 32;
  __shared__ Accum warp_results[kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc.merge(shfl_down(acc, offset));
  const int warp = threadIdx.x / 32;
  if ((threadIdx.x & 31) == 0) warp_results[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) acc.merge(warp_results[w]);
  }
  return acc;
}

// kStrided: the launch holds views read through strided offsets (NOTE: [strided reads]). The
// kernel is built twice so that launches of dense tensors alone (nearly all of them) keep the
// register budget of the dense scan; the strided walk needs more (NOTE: [stats kernel registers]).
//
// NOTE: [stats kernel registers]
// ptxas -v for sm_90 (nvcc 13.0): stats_kernel<false> 80 registers, stats_kernel<true> 120, no
// spills, no stack; the finish of NOTE: [one launch per frame] adds none to the dense kernel (80
// before it too). Neither is bounded with a minimum of blocks per SM: __launch_bounds__(256, 3)
// on the strided kernel gives 80 registers with 292 B of spill stores and 444 B of spill loads
// (80 B of stack); the dense kernel stays unbounded at 80 registers (3 blocks per SM). Whether 2 blocks
// of 256 threads per SM without spills or 3 with them read a strided view faster is for the
// bandwidth table on a GPU to say (benchmarks/bench_cuda_bandwidth.py, its view rows).
// A block's share of the launch: logical elements [begin, begin + count) of tensor t.
struct BlockShare {
  int t;
  int64_t begin;
  int64_t count;
  Partial* out;  // where the block's partial goes
};

template <bool kStrided, typename Visitor>
__device__ __forceinline__ void stats_block(const TensorTable& table, const BlockShare& share) {
  using Storage = typename Visitor::Storage;
  Visitor vis;
  vis.init();
  const auto* data = static_cast<const Storage*>(table.data[share.t]);
  if (!kStrided || table.layout[share.t] == kDenseLayout) {
    scan_chunk<kStatsThreads>(data + share.begin, share.count, vis);
  } else {
    scan_strided<kStatsThreads>(data, table.strided[table.layout[share.t]], share.begin, share.count, vis);
  }
  const auto acc = block_reduce<kStatsThreads>(vis.result());
  if (threadIdx.x == 0) {
    Partial p;
    if constexpr (std::is_same<typename std::decay<decltype(acc)>::type, FloatStatsAccum>::value) {
      p.f = acc;
    } else {
      p.i = acc;
    }
    *share.out = p;
  }
}

// NOTE: [one launch per frame]
// A recorded frame costs one kernel launch (more only past kMaxTensorsPerLaunch tensors or
// kMaxStridedPerLaunch strided ones), as ATen's reductions finish theirs: every block writes its
// partial, fences (release) and counts itself in its tensor's counter; the block that arrives last
// fences again (acquire), merges the tensor's partials and writes its record; it then counts the
// tensor in the launch counter, and the block that completes the launch runs the frame's step
// (update_recording_state and the ring rows, as the separate record kernel did) over all of the
// frame's records, earlier launches' included (they ended before this one began: stream order).
// Merges are integer min/max and sums, exact in any order, so the record does not depend on which
// block comes last or on the launch shape, and no float atomics are involved. Partials written by
// other blocks are read with ld.global.cg, past this SM's L1; records are read only by the block
// that completes the launch, after its acquire fence.

// The record of tensor t, merged from its partials by its last block.
__device__ __forceinline__ void finish_tensor(const TensorTable& table, const FrameArgs& frame, int t,
                                              const Partial* workspace) {
  const Partial* first = workspace + table.partial_base + table.block_start[t];
  const int64_t count = table.block_start[t + 1] - table.block_start[t];
  const ElementKind kind = table.kind[t];
  double* out = frame.records + (table.first_record + t) * kNumStats;
  if (is_float_kind(kind)) {
    const auto acc = block_reduce<kStatsThreads>(merge_partials<kStatsThreads, FloatStatsAccum>(first, count));
    if (threadIdx.x == 0) acc.finalize(format_of(kind), table.repeat[t], out);
  } else {
    const auto acc = block_reduce<kStatsThreads>(merge_partials<kStatsThreads, IntStatsAccum>(first, count));
    if (threadIdx.x == 0) acc.finalize(table.repeat[t], out);
  }
  if (threadIdx.x == 0 && frame.max_values != nullptr) {
    frame.max_values[table.first_record + t] = headroom_limit(kind);
  }
}

// The frame's records in ring rows from `position`. When a frame holds more records than the ring
// has rows, record i is overwritten by record i + ring_rows; only the last record of each row is
// stored, so the outcome is well defined.
__device__ __forceinline__ void write_block_rows(const double* records, int64_t n, double* ring, int64_t ring_rows,
                                                 int64_t position) {
  const int64_t first_kept = n > ring_rows ? n - ring_rows : 0;
  for (int64_t k = first_kept * kNumStats + threadIdx.x; k < n * kNumStats; k += kStatsThreads) {
    const int64_t i = k / kNumStats;
    ring[ring_row(position + i, ring_rows) * kNumStats + k % kNumStats] = records[k];
  }
}

// The frame's step, by the block that completed the launch. Thread 0 walks the records in order
// (numguard/stats_reduce.h), then the block writes them to the ring unless it was frozen before.
// record_at_cursor_ takes its positions and log row from the cursor on the device (so the launch
// is the same every call and can be captured in a CUDA graph, and calls running at once on
// different streams get distinct ones: NOTE: [concurrent recording]); nothing is taken, written or
// logged when the ring was frozen.
__device__ __forceinline__ void finish_frame(const FrameArgs& frame) {
  __shared__ bool write_rows;
  __shared__ int64_t start;
  if (threadIdx.x == 0) {
    if (frame.step == FrameStep::kRecord) {
      start = frame.position;
      write_rows = update_recording_state(frame.state, frame.records, frame.max_values, frame.n, frame.position,
                                          frame.headroom, frame.context);
    } else {
      write_rows = !state_is_set(frame.state, kTripped);
      if (write_rows) {
        const GraphCall call = claim_graph_call(frame.cursor, frame.n);
        start = call.start;
        note_records(frame.state, frame.records, frame.max_values, frame.n, call.start, frame.headroom,
                     frame.context);
        log_graph_call(call, frame.cursor, frame.log, frame.log_rows, frame.slot);
      }
    }
  }
  __syncthreads();
  if (write_rows) write_block_rows(frame.records, frame.n, frame.ring, frame.ring_rows, start);
}

// One block per (tensor, chunk) of the table (NOTE: [one launch per frame]).
template <bool kStrided>
__global__ void __launch_bounds__(kStatsThreads)
    stats_kernel(const TensorTable table, const FrameArgs frame, Partial* workspace) {
  __shared__ bool tensor_done;
  __shared__ bool launch_done;
  if (table.num_tensors > 0) {
    const int32_t b = static_cast<int32_t>(blockIdx.x);
    const int t = locate_block(table.block_start, table.num_tensors, b);
    const int64_t chunk = table.chunk[t];
    const int64_t begin = static_cast<int64_t>(b - table.block_start[t]) * chunk;
    const int64_t remaining = table.numel[t] - begin;
    const int64_t count = remaining < chunk ? (remaining > 0 ? remaining : 0) : chunk;
    const BlockShare share{t, begin, count, workspace + table.partial_base + b};
    switch (table.kind[t]) {
      case ElementKind::kFloat64: stats_block<kStrided, FloatVisitor<Float64Element>>(table, share); break;
      case ElementKind::kFloat32: stats_block<kStrided, FloatVisitor<Float32Element>>(table, share); break;
      case ElementKind::kFloat16: stats_block<kStrided, FloatVisitor<Float16Element>>(table, share); break;
      case ElementKind::kBFloat16: stats_block<kStrided, FloatVisitor<BFloat16Element>>(table, share); break;
      case ElementKind::kFloat8E4M3FN: stats_block<kStrided, FloatVisitor<E4M3FNElement>>(table, share); break;
      case ElementKind::kFloat8E5M2: stats_block<kStrided, FloatVisitor<Float8E5M2Element>>(table, share); break;
      case ElementKind::kInt8: stats_block<kStrided, IntVisitor<int8_t>>(table, share); break;
      case ElementKind::kUInt8: stats_block<kStrided, IntVisitor<uint8_t>>(table, share); break;
      case ElementKind::kInt16: stats_block<kStrided, IntVisitor<int16_t>>(table, share); break;
      case ElementKind::kUInt16: stats_block<kStrided, IntVisitor<uint16_t>>(table, share); break;
      case ElementKind::kInt32: stats_block<kStrided, IntVisitor<int32_t>>(table, share); break;
      case ElementKind::kUInt32: stats_block<kStrided, IntVisitor<uint32_t>>(table, share); break;
      case ElementKind::kInt64: stats_block<kStrided, IntVisitor<int64_t>>(table, share); break;
      case ElementKind::kUInt64: stats_block<kStrided, IntVisitor<uint64_t>>(table, share); break;
      case ElementKind::kBool: stats_block<kStrided, IntVisitor<uint8_t, true>>(table, share); break;
    }
    if (threadIdx.x == 0) {
      __threadfence();  // release: the partial is visible to any block that sees this arrival
      tensor_done = last_to_arrive(frame.counters + t, table.block_start[t + 1] - table.block_start[t]);
      if (tensor_done) __threadfence();  // acquire: the tensor's other partials are visible
    }
    __syncthreads();
    if (!tensor_done) return;
    finish_tensor(table, frame, t, workspace);
    if (threadIdx.x == 0) {
      __threadfence();  // release: the record is visible to the block that completes the launch
      launch_done = last_to_arrive(frame.counters + kMaxTensorsPerLaunch, table.num_tensors);
      if (launch_done) __threadfence();  // acquire: every record of the launch is visible
    }
    __syncthreads();
    if (!launch_done) return;
  }
  if (frame.step != FrameStep::kStatsOnly) finish_frame(frame);
}

}  // namespace

int stats_blocks_per_wave() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0: not computed yet; racing writers agree
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 0 && device < kMaxDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stats_kernel<false>, kStatsThreads, 0));
  const int wave = (sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  if (device >= 0 && device < kMaxDevices) cached[device].store(wave, std::memory_order_relaxed);
  return wave;
}

void launch_stats(const TensorTable& table, const FrameArgs& frame, int64_t* workspace, cudaStream_t stream) {
  const int32_t blocks = table.num_tensors > 0 ? table.block_start[table.num_tensors] : 1;
  bool strided = false;
  for (int32_t t = 0; t < table.num_tensors; ++t) strided |= table.layout[t] != kDenseLayout;
  auto* partials = reinterpret_cast<Partial*>(workspace);
  if (strided) {
    stats_kernel<true><<<blocks, kStatsThreads, 0, stream>>>(table, frame, partials);
  } else {
    stats_kernel<false><<<blocks, kStatsThreads, 0, stream>>>(table, frame, partials);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace numguard
