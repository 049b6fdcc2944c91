// CPU reduction kernels over one contiguous run of elements, compiled once per instruction-set
// level (reduce_baseline.cpp, reduce_avx2.cpp, reduce_avx512.cpp) and chosen once at run time.
//
// Every kernel folds its run into an accumulator of numguard/stats_reduce.h; accumulators merge
// exactly in any order (NOTE: [magnitude bits]), so how a tensor is split into runs, chunks and
// threads never changes its record.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // quant_impl.inc: fused multiply-adds and float16 conversions of the levels that have them
#endif

#include "numguard/quant.h"
#include "numguard/stats_reduce.h"

namespace numguard {
namespace cpu {

// NOTE: [fast blocks]
// Floating runs are scanned in blocks of kFastBlockBytes. A block first gets only three unsigned
// reductions of its magnitude bits m: min(m), max(m) and min(m - 1) (zeros wrap to all-ones and
// drop out of the last one). If max < finite_limit and min(m - 1) >= min_normal - 1, every value
// of the block is finite and either zero or normal: those three numbers, plus a count of zeros
// when min(m) == 0 (a second pass over the block, still in L1), are the block's whole
// contribution. Only blocks holding a NaN, an Inf or a subnormal are scanned again with the full
// bookkeeping. Weights, activations (ReLU zeros included) and gradients take the fast path almost
// everywhere, which keeps the kernel memory-bound.
constexpr int64_t kFastBlockBytes = 4096;

// Full-bookkeeping scans count in the element's own unsigned width within sub-blocks small enough
// that the counters cannot overflow (NOTE: [narrow counters]).
constexpr int64_t kNarrowSubBlock = 128;   // 1-byte elements: counts <= 128 fit in uint8
constexpr int64_t kWideSubBlock = 4096;    // wider elements: counts <= 4096 fit in uint16

// Work is split into chunks of this many bytes of a tensor's elements, whatever the thread count;
// partials are merged in chunk order.
constexpr int64_t kChunkBytes = 256 * 1024;

// Below this many bytes in one call, everything runs on the calling thread.
constexpr int64_t kParallelMinBytes = 512 * 1024;

// Strided runs shorter than this are gathered into a local buffer of kGatherBytes first.
constexpr int64_t kDirectRunElements = 256;
constexpr int64_t kGatherBytes = 16 * 1024;

// quant_stats (quant_impl.inc): a chunk is split into sub-blocks of kQuantSubBlock elements, and
// squares are summed in kQuantLanes lanes (NOTE: [quant lanes]). Chunks hold whole sub-blocks
// (and so whole MX and NVFP4 blocks).
constexpr int64_t kQuantLanes = 16;
constexpr int64_t kQuantSubBlock = 256;
constexpr int64_t kQuantChunkElements = 1 << 16;
static_assert(kQuantChunkElements % kQuantSubBlock == 0 && kQuantSubBlock % 32 == 0, "whole blocks per chunk");

// One tensor's quant_stats parameters, as the kernels take them.
struct QuantRun {
  // How v comes from x for the per-tensor formats: scale 1; a power-of-two scale (dequantized
  // errors exact); any other scale (the element-by-element reference); or v = x * scale measured
  // at scale 1, the squares divided by scale^2 by the op (watch(quant=)'s current scaling).
  enum Float8Mode : int { kUnitScale, kPowerOfTwoScale, kGeneralScale, kPrescaled };
  // The element type the kernels read (NOTE: [quant inputs]): float32, or bfloat16 / float16 bits
  // widened to float32 in registers.
  enum Input : int { kFloat32, kBFloat16, kFloat16 };
  int64_t format;
  QuantElement f;
  float scale;  // float8: the per-tensor scale; NVFP4: the global scale g; MX: unused
  int mode;     // Float8Mode (per-tensor formats)
  int input;    // Input
};

// Bytes of one element of a QuantRun::Input.
inline int64_t quant_input_size(int input) { return input == QuantRun::kFloat32 ? 4 : 2; }

// A chunk's partial record, its squares still in lanes.
struct QuantPartial {
  QuantAccum acc;
  double lanes[kQuantLanes];
  void init() {
    acc.init();
    for (double& lane : lanes) lane = 0.0;
  }
  // The chunk's sum of squares: its lanes added pairwise in a fixed tree (NOTE: [quant lanes]).
  double lane_sum() const {
    double s[kQuantLanes];
    for (int j = 0; j < kQuantLanes; ++j) s[j] = lanes[j];
    for (int width = kQuantLanes / 2; width > 0; width /= 2) {
      for (int j = 0; j < width; ++j) s[j] = s[j] + s[j + width];
    }
    return s[0];
  }
};

// Contiguous-run kernels of one instruction-set level. Floating kernels take the raw bits.
struct KernelTable {
  const char* isa;
  void (*float8)(const uint8_t* p, int64_t n, const FloatFormat& f, FloatStatsAccum& acc);
  void (*float16)(const uint16_t* p, int64_t n, const FloatFormat& f, FloatStatsAccum& acc);
  void (*float32)(const uint32_t* p, int64_t n, const FloatFormat& f, FloatStatsAccum& acc);
  void (*float64)(const uint64_t* p, int64_t n, const FloatFormat& f, FloatStatsAccum& acc);
  void (*int8)(const int8_t* p, int64_t n, IntStatsAccum& acc);
  void (*int16)(const int16_t* p, int64_t n, IntStatsAccum& acc);
  void (*int32)(const int32_t* p, int64_t n, IntStatsAccum& acc);
  void (*int64)(const int64_t* p, int64_t n, IntStatsAccum& acc);
  void (*uint8)(const uint8_t* p, int64_t n, IntStatsAccum& acc);
  void (*uint16)(const uint16_t* p, int64_t n, IntStatsAccum& acc);
  void (*uint32)(const uint32_t* p, int64_t n, IntStatsAccum& acc);
  void (*uint64)(const uint64_t* p, int64_t n, IntStatsAccum& acc);
  void (*boolean)(const uint8_t* p, int64_t n, IntStatsAccum& acc);  // any non-zero byte is true (1)
  // quant_stats of one chunk of values of run.input's type (p: its first element, at a multiple
  // of kQuantSubBlock from the tensor's start; n <= kQuantChunkElements), into `out` (initialized).
  void (*quant)(const void* p, int64_t n, const QuantRun& run, QuantPartial& out);
  // The largest |x| of n values of `input`'s type, as float32 bits (NaN and Inf are above every
  // finite value); with finite_only, of the finite values (0 when there is none).
  uint32_t (*quant_amax)(const void* p, int64_t n, int input, bool finite_only);
};

const KernelTable& baseline_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();

// The table this process uses: the best level this CPU supports, chosen on first use.
// NUMGUARD_CPU_ISA=baseline|avx2|avx512 caps the level (for testing and comparisons); any other
// non-empty value throws a ValueError naming the variable (numguard.ops.CPU_ISA_CHOICES).
const KernelTable& active_kernels();

// Names of the levels compiled into this build, best first.
const char* const* built_isa_names(int* count);

}  // namespace cpu
}  // namespace numguard
