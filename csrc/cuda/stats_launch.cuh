// Interface between numguard's CUDA kernels (stats_kernels.cu, CUDA and c10 headers only) and the
// ATen side that registers the ops (ops_cuda.cu). Nothing here includes ATen.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "numguard/stats_reduce.h"
#include "stats_device.cuh"

namespace numguard {
namespace cuda {

// Element kinds: numguard::ElementKind (numguard/stats_reduce.h), shared with the CPU ops.

constexpr int kStatsThreads = 256;  // threads per block of the stats kernel (and of its record step)

// NOTE: [multi-tensor table]
// One stats launch covers up to kMaxTensorsPerLaunch tensors, of which up to kMaxStridedPerLaunch
// are read through strided offsets (NOTE: [strided reads] in stats_device.cuh). Their addresses,
// sizes, layouts and the block -> (tensor, chunk) map are passed by value as the kernel argument
// (no host->device copy, so a launch is capturable in a CUDA graph and never waits on the host).
// The map is stored as prefix sums: tensor i owns blocks [block_start[i], block_start[i+1]) of the
// launch (at least one), block b of it reads logical elements [b * chunk[i], (b + 1) * chunk[i]).
// Table and frame arguments together stay under the classic 4 KB kernel-parameter limit.
constexpr int kMaxTensorsPerLaunch = 72;
constexpr int kMaxStridedPerLaunch = 8;
constexpr uint8_t kDenseLayout = 0xFF;  // TensorTable::layout of a tensor read as one dense span

struct TensorTable {
  const void* data[kMaxTensorsPerLaunch];  // first element
  int64_t numel[kMaxTensorsPerLaunch];     // elements to read
  int64_t chunk[kMaxTensorsPerLaunch];     // elements per block
  int64_t repeat[kMaxTensorsPerLaunch];    // each element stands for this many (stride-0 dims)
  int32_t block_start[kMaxTensorsPerLaunch + 1];
  ElementKind kind[kMaxTensorsPerLaunch];
  uint8_t layout[kMaxTensorsPerLaunch];  // kDenseLayout, or an index into `strided`
  device::StridedDims strided[kMaxStridedPerLaunch];
  int32_t num_tensors;   // 0 only for a record_at_cursor_ call of no tensors (one block, the step alone)
  int64_t partial_base;  // workspace slot of this launch's block 0
  int64_t first_record;  // output row of tensor 0
};

// What the launch's last block does once every record of the launch is written.
enum class FrameStep : int32_t {
  kStatsOnly,       // tensor_stats, multi_tensor_stats, and every launch of a frame but its last
  kRecord,          // record_: update_recording_state, then the rows at `position`
  kRecordAtCursor,  // record_at_cursor_: the same at the device cursor, and the call logged
};

// Launch counters: one per tensor of a launch (its blocks that finished) and one for the launch
// (its tensors whose record is written). Zero before a launch, and zero again after it.
constexpr int kLaunchCounters = kMaxTensorsPerLaunch + 1;

// Args of one launch besides its table: where records go and the frame's recording step.
struct FrameArgs {
  double* records;          // float64[*, 8]; row table.first_record + i receives tensor i's record
  double* max_values;       // nullptr, or float64[*]: finfo.max of fp16/bf16/fp8 tensors, else 0
  unsigned int* counters;   // kLaunchCounters words (NOTE: [launch counters] in ops_cuda.cu)
  FrameStep step;
  int64_t n;                // records of the whole frame (rows 0..n-1 of `records`)
  double* ring;
  int64_t ring_rows;
  int64_t* state;
  int64_t position;         // kRecord: position of the frame's first record
  int64_t* cursor;          // kRecordAtCursor: numguard/graph_record.h
  int64_t* log;
  int64_t log_rows;
  int64_t slot;
  double headroom;
  int64_t context;          // leading context records (NOTE: [context records])
};
static_assert(sizeof(TensorTable) + sizeof(FrameArgs) + sizeof(void*) <= 4096, "kernel arguments must fit 4 KB");

// Stats blocks that fit on all SMs of the current device at once (one full wave); the host sizes
// the chunks of large tensors so that they spread over about this many blocks.
int stats_blocks_per_wave();

// One launch: per-block partials of the table's tensors into `workspace` (int64[*, kPartialWords];
// row table.partial_base + b receives block b's), the last block of each tensor merges them into
// its record, and the last of those runs frame.step (NOTE: [one launch per frame]).
void launch_stats(const TensorTable& table, const FrameArgs& frame, int64_t* workspace, cudaStream_t stream);

}  // namespace cuda
}  // namespace numguard
