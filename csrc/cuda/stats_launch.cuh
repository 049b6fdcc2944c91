// Interface between numguard's CUDA kernels (stats_kernels.cu, CUDA and c10 headers only) and the
// ATen side that registers the ops (ops_cuda.cu). Nothing here includes ATen.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "numguard/stats_reduce.h"

namespace numguard {
namespace cuda {

// Element kinds: numguard::ElementKind (numguard/stats_reduce.h), shared with the CPU ops.

constexpr int kStatsThreads = 256;     // threads per block of the stats kernel
constexpr int kFinalizeThreads = 128;  // threads per block of the cleanup kernel
constexpr int kRecordThreads = 256;    // threads of the single-block recording kernel

// NOTE: [multi-tensor table]
// One stats launch covers up to kMaxTensorsPerLaunch tensors. Their addresses, sizes and the
// block -> (tensor, chunk) map are passed by value as the kernel argument (no host->device copy,
// so a launch is capturable in a CUDA graph and never waits on the host). The map is stored as
// prefix sums: tensor i owns blocks [block_start[i], block_start[i+1]) of the launch, block b of
// it reads elements [b * chunk[i], (b + 1) * chunk[i]). A tensor with no elements owns no blocks.
// The table stays under the classic 4 KB kernel-parameter limit.
constexpr int kMaxTensorsPerLaunch = 96;

struct TensorTable {
  const void* data[kMaxTensorsPerLaunch];  // first element (the tensor is dense from there)
  int64_t numel[kMaxTensorsPerLaunch];     // elements to read
  int64_t chunk[kMaxTensorsPerLaunch];     // elements per block
  int64_t repeat[kMaxTensorsPerLaunch];    // each element stands for this many (stride-0 dims)
  int32_t block_start[kMaxTensorsPerLaunch + 1];
  ElementKind kind[kMaxTensorsPerLaunch];
  int32_t num_tensors;
  int64_t partial_base;  // workspace slot of this launch's block 0
  int64_t first_record;  // output row of tensor 0
};
static_assert(sizeof(TensorTable) + 3 * sizeof(void*) <= 4096, "kernel arguments must fit 4 KB");

// One block's partial stats: a FloatStatsAccum or an IntStatsAccum, 64 bytes.
constexpr int kPartialWords = 8;

// Stats blocks that fit on all SMs of the current device at once (one full wave); the host sizes
// the chunks of large tensors so that they spread over about this many blocks.
int stats_blocks_per_wave();

// Args:
//   table       tensors of this launch (table.block_start[table.num_tensors] blocks, > 0)
//   workspace   int64[*, kPartialWords]; row table.partial_base + b receives block b's partial
void launch_stats(const TensorTable& table, int64_t* workspace, cudaStream_t stream);

// Merges each tensor's partials (one block per tensor) and writes its finished record.
// Args:
//   records     float64[*, 8]; row table.first_record + i receives tensor i's record
//   max_values  nullptr, or float64[*]: finfo.max of low-precision tensors (fp16, bf16, fp8), else 0
void launch_finalize(const TensorTable& table, const int64_t* workspace, double* records, double* max_values,
                     cudaStream_t stream);

// Single-block recording step: update_recording_state over the frame's n records (the first
// `context` of them context: NOTE: [context records]), then (unless the ring was frozen before
// this call) write record i to ring row (position + i) mod ring_rows.
void launch_record(const double* records, const double* max_values, int64_t n, double* ring, int64_t ring_rows,
                   int64_t* state, int64_t position, double headroom, int64_t context, cudaStream_t stream);

// record_at_cursor_'s step: like launch_record, at the position cursor[0] holds on the device;
// then logs the call and advances the cursor (numguard/graph_record.h). Launched even for n == 0
// (the call is still logged).
void launch_record_at_cursor(const double* records, const double* max_values, int64_t n, double* ring,
                             int64_t ring_rows, int64_t* state, int64_t* cursor, int64_t* log, int64_t log_rows,
                             int64_t slot, double headroom, int64_t context, cudaStream_t stream);

}  // namespace cuda
}  // namespace numguard
