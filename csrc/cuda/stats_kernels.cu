// numguard's CUDA kernels: one-pass stats over many tensors per launch, a deterministic cleanup
// that merges per-block partials, and the single-block recording step of record_.
//
// The reduction math is the shared header's (numguard/stats_reduce.h); this file only decides how
// the elements reach it: 16-byte vector loads, a fast path for vectors of normal values, and the
// multi-tensor launch shape (NOTE: [multi-tensor table] in stats_launch.cuh).
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

union Partial {
  FloatStatsAccum f;
  IntStatsAccum i;
  int64_t words[kPartialWords];
};
static_assert(sizeof(Partial) == kPartialWords * sizeof(int64_t), "a partial is 64 bytes");

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

template <typename Visitor>
__device__ __forceinline__ void stats_block(const void* data, int64_t begin, int64_t count, Partial* out) {
  using Storage = typename Visitor::Storage;
  Visitor vis;
  vis.init();
  scan_chunk<kStatsThreads>(static_cast<const Storage*>(data) + begin, count, vis);
  const auto acc = block_reduce<kStatsThreads>(vis.result());
  if (threadIdx.x == 0) {
    Partial p;
    if constexpr (std::is_same<typename std::decay<decltype(acc)>::type, FloatStatsAccum>::value) {
      p.f = acc;
    } else {
      p.i = acc;
    }
    *out = p;
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels.

// One block per (tensor, chunk) of the table; writes the block's partial to the workspace.
__global__ void __launch_bounds__(kStatsThreads) stats_kernel(const TensorTable table, Partial* workspace) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  const int t = locate_block(table.block_start, table.num_tensors, b);
  const int64_t chunk = table.chunk[t];
  const int64_t begin = static_cast<int64_t>(b - table.block_start[t]) * chunk;
  const int64_t remaining = table.numel[t] - begin;
  const int64_t count = remaining < chunk ? remaining : chunk;
  const void* data = table.data[t];
  Partial* out = workspace + table.partial_base + b;
  switch (table.kind[t]) {
    case ElementKind::kFloat64: stats_block<FloatVisitor<Float64Element>>(data, begin, count, out); break;
    case ElementKind::kFloat32: stats_block<FloatVisitor<Float32Element>>(data, begin, count, out); break;
    case ElementKind::kFloat16: stats_block<FloatVisitor<Float16Element>>(data, begin, count, out); break;
    case ElementKind::kBFloat16: stats_block<FloatVisitor<BFloat16Element>>(data, begin, count, out); break;
    case ElementKind::kFloat8E4M3FN: stats_block<FloatVisitor<E4M3FNElement>>(data, begin, count, out); break;
    case ElementKind::kFloat8E5M2: stats_block<FloatVisitor<Float8E5M2Element>>(data, begin, count, out); break;
    case ElementKind::kInt8: stats_block<IntVisitor<int8_t>>(data, begin, count, out); break;
    case ElementKind::kUInt8: stats_block<IntVisitor<uint8_t>>(data, begin, count, out); break;
    case ElementKind::kInt16: stats_block<IntVisitor<int16_t>>(data, begin, count, out); break;
    case ElementKind::kUInt16: stats_block<IntVisitor<uint16_t>>(data, begin, count, out); break;
    case ElementKind::kInt32: stats_block<IntVisitor<int32_t>>(data, begin, count, out); break;
    case ElementKind::kUInt32: stats_block<IntVisitor<uint32_t>>(data, begin, count, out); break;
    case ElementKind::kInt64: stats_block<IntVisitor<int64_t>>(data, begin, count, out); break;
    case ElementKind::kUInt64: stats_block<IntVisitor<uint64_t>>(data, begin, count, out); break;
    case ElementKind::kBool: stats_block<IntVisitor<uint8_t, true>>(data, begin, count, out); break;
  }
}

// One block per tensor of the table: merges the tensor's partials and finalizes its record.
__global__ void __launch_bounds__(kFinalizeThreads)
    finalize_kernel(const TensorTable table, const Partial* workspace, double* records, double* max_values) {
  const int t = blockIdx.x;
  const int64_t first = table.partial_base + table.block_start[t];
  const int64_t count = table.block_start[t + 1] - table.block_start[t];
  const ElementKind kind = table.kind[t];
  double* out = records + (table.first_record + t) * kNumStats;
  if (is_float_kind(kind)) {
    FloatStatsAccum acc;
    acc.init();
    for (int64_t i = threadIdx.x; i < count; i += kFinalizeThreads) acc.merge(workspace[first + i].f);
    acc = block_reduce<kFinalizeThreads>(acc);
    if (threadIdx.x == 0) acc.finalize(format_of(kind), table.repeat[t], out);
  } else {
    IntStatsAccum acc;
    acc.init();
    for (int64_t i = threadIdx.x; i < count; i += kFinalizeThreads) acc.merge(workspace[first + i].i);
    acc = block_reduce<kFinalizeThreads>(acc);
    if (threadIdx.x == 0) acc.finalize(table.repeat[t], out);
  }
  if (threadIdx.x == 0 && max_values != nullptr) max_values[table.first_record + t] = headroom_limit(kind);
}

// A single-block recording kernel: thread 0 walks the frame's records in order (the state
// update of numguard/stats_reduce.h), then the whole block writes the records to the ring at
// `position` unless the ring was frozen before this frame.
__device__ __forceinline__ void write_block_rows(const double* records, int64_t n, double* ring, int64_t ring_rows,
                                                 int64_t position) {
  // When a frame holds more records than the ring has rows, record i is overwritten by record
  // i + ring_rows; only the last record of each row is stored, so the outcome is well defined.
  const int64_t first_kept = n > ring_rows ? n - ring_rows : 0;
  for (int64_t k = first_kept * kNumStats + threadIdx.x; k < n * kNumStats; k += kRecordThreads) {
    const int64_t i = k / kNumStats;
    ring[ring_row(position + i, ring_rows) * kNumStats + k % kNumStats] = records[k];
  }
}

__global__ void __launch_bounds__(kRecordThreads)
    record_kernel(const double* records, const double* max_values, int64_t n, double* ring, int64_t ring_rows,
                  int64_t* state, int64_t position, double headroom, int64_t context) {
  __shared__ bool write_rows;
  if (threadIdx.x == 0) {
    write_rows = update_recording_state(state, records, max_values, n, position, headroom, context);
  }
  __syncthreads();
  if (write_rows) write_block_rows(records, n, ring, ring_rows, position);
}

// record_at_cursor_: the frame's positions and log row are taken from the cursor on the device
// (so the launch is the same every call and can be captured in a CUDA graph, and calls running at
// once on different streams get distinct ones: NOTE: [concurrent recording]); nothing is taken,
// written or logged when the ring was frozen.
__global__ void __launch_bounds__(kRecordThreads)
    record_at_cursor_kernel(const double* records, const double* max_values, int64_t n, double* ring,
                            int64_t ring_rows, int64_t* state, int64_t* cursor, int64_t* log, int64_t log_rows,
                            int64_t slot, double headroom, int64_t context) {
  __shared__ bool write_rows;
  __shared__ int64_t start;
  if (threadIdx.x == 0) {
    write_rows = !state_is_set(state, kTripped);
    if (write_rows) {
      const GraphCall call = claim_graph_call(cursor, n);
      start = call.start;
      note_records(state, records, max_values, n, call.start, headroom, context);
      log_graph_call(call, cursor, log, log_rows, slot);
    }
  }
  __syncthreads();
  if (write_rows) write_block_rows(records, n, ring, ring_rows, start);
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
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stats_kernel, kStatsThreads, 0));
  const int wave = (sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  if (device >= 0 && device < kMaxDevices) cached[device].store(wave, std::memory_order_relaxed);
  return wave;
}

void launch_stats(const TensorTable& table, int64_t* workspace, cudaStream_t stream) {
  const int32_t blocks = table.block_start[table.num_tensors];
  if (blocks <= 0) return;
  stats_kernel<<<blocks, kStatsThreads, 0, stream>>>(table, reinterpret_cast<Partial*>(workspace));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_finalize(const TensorTable& table, const int64_t* workspace, double* records, double* max_values,
                     cudaStream_t stream) {
  if (table.num_tensors <= 0) return;
  finalize_kernel<<<table.num_tensors, kFinalizeThreads, 0, stream>>>(
      table, reinterpret_cast<const Partial*>(workspace), records, max_values);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_record(const double* records, const double* max_values, int64_t n, double* ring, int64_t ring_rows,
                   int64_t* state, int64_t position, double headroom, int64_t context, cudaStream_t stream) {
  if (n <= 0) return;
  record_kernel<<<1, kRecordThreads, 0, stream>>>(records, max_values, n, ring, ring_rows, state, position,
                                                   headroom, context);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_record_at_cursor(const double* records, const double* max_values, int64_t n, double* ring,
                             int64_t ring_rows, int64_t* state, int64_t* cursor, int64_t* log, int64_t log_rows,
                             int64_t slot, double headroom, int64_t context, cudaStream_t stream) {
  record_at_cursor_kernel<<<1, kRecordThreads, 0, stream>>>(records, max_values, n, ring, ring_rows, state, cursor,
                                                             log, log_rows, slot, headroom, context);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace numguard
