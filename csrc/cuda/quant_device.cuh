// The per-warp logic of the CUDA quant_stats kernel (quant_kernels.cu), written so that the host
// can run it too (tests/test_cuda_build.py emulates a launch lane by lane and compares the record
// with the CPU kernel's). The math is the shared header's (numguard/quant.h); this file only says
// which elements a lane reads and how lanes, warps and blocks merge.
//
// NOTE: [quant tiles]
// A launch reads the tensor in tiles of 32 consecutive elements; warp w of the grid takes tiles
// w, w + warps, w + 2 * warps, ... and lane l reads element 32 * tile + l (0 past the end: padding
// adds nothing to any field). A tile is one MX block, two NVFP4 blocks (lanes 0-15 and 16-31), or
// 32 elements of the per-tensor block. The block amax is a max over the block's lanes; the lane
// that reads a block's first element counts the block, its scale exponent and whether any of its
// lanes saturated. Each thread keeps a QuantAccum; the threads of a CUDA block merge in a fixed
// tree (NOTE: [quant block merge]) into one partial per CUDA block, and one thread merges the
// partials in block order: the record is deterministic for a given grid, and the grid depends only
// on the element count.
#pragma once

#include <cstdint>

#include "numguard/quant.h"

namespace numguard {
namespace cuda {

constexpr int kQuantThreads = 256;
constexpr int kQuantWarps = kQuantThreads / 32;
constexpr int kQuantTile = 32;
constexpr int kQuantMaxBlocks = 1024;  // CUDA blocks of one measuring launch, at most

// CUDA blocks of a measuring launch over n elements: enough for every warp to take a few tiles,
// at most kQuantMaxBlocks; a function of n alone (NOTE: [quant tiles]).
NUMGUARD_HD int64_t quant_grid_blocks(int64_t n) {
  const int64_t tiles = (n + kQuantTile - 1) / kQuantTile;
  const int64_t blocks = (tiles + 4 * kQuantWarps - 1) / (4 * kQuantWarps);
  return blocks < 1 ? 1 : (blocks > kQuantMaxBlocks ? kQuantMaxBlocks : blocks);
}

// The first tile of warp `warp` of CUDA block `block`, and the step to its next (NOTE: [quant tiles]).
NUMGUARD_HD int64_t quant_first_tile(int64_t block, int warp) { return block * kQuantWarps + warp; }
NUMGUARD_HD int64_t quant_tile_step(int64_t grid_blocks) { return grid_blocks * kQuantWarps; }

// The lanes of the tile that share lane's scaling block, as a ballot mask; whether lane leads it.
NUMGUARD_HD unsigned int quant_block_lane_mask(int64_t format, int lane) {
  return format == kQuantNvfp4 ? (0xffffu << (lane & 16)) : 0xffffffffu;
}
NUMGUARD_HD bool quant_block_leader(int64_t format, int lane) { return lane % (format == kQuantNvfp4 ? 16 : 32) == 0; }

// How v comes from x for the per-tensor formats (numguard::cpu::QuantRun's modes, on the device
// only two matter: the reference's q / scale, or watch(quant=)'s v measured at scale 1).
enum QuantDeviceMode : int { kQuantDequantize = 0, kQuantPrescaled = 1 };

// |x| of a finite x, 0 for NaN/Inf (they are left out of block amaxes).
NUMGUARD_HD float quant_finite_abs(float x) { return quant_finite(x) ? fabsf(x) : 0.0f; }

// One lane's element: counts into acc, returns whether it saturated. `valid`: the lane's index is
// inside the tensor.
NUMGUARD_HD bool quant_lane_element(QuantAccum& acc, int64_t format, const QuantElement& f, const QuantBlockScale& b,
                                    int mode, float x, bool valid) {
  if (!valid) return false;
  if (!quant_finite(x)) {
    ++acc.nonfinite;
    return false;
  }
  const float ax = fabsf(x);
  acc.nonzero += x != 0.0f;
  acc.amax = ax > acc.amax ? ax : acc.amax;
  int64_t saturated = 0;
  if (mode == kQuantPrescaled) {
    const float v = x * b.mul;
    const float q = quant_round(v, f);
    saturated = fabsf(v) > f.max_value;
    acc.underflow += (x != 0.0f && q == 0.0f);
    acc.sq_error += quant_square(static_cast<double>(q) - static_cast<double>(v));
  } else {
    acc.sq_error += quant_element_error(format, f, b, x, acc.underflow, saturated);
  }
  acc.saturated += saturated;
  return saturated != 0;
}

// The block leader's bookkeeping: one more block, its exponent, whether it saturated (block
// formats; the per-tensor block is counted once by the finalizer).
NUMGUARD_HD void quant_lane_block(QuantAccum& acc, int64_t format, const QuantBlockScale& b, bool leader,
                                  bool block_saturated) {
  if (!leader || quant_per_tensor(format)) return;
  ++acc.blocks;
  if (b.has_exponent) acc.note_exponent(b.exponent);
  acc.saturated_blocks += block_saturated;
}

// NOTE: [quant block merge]
// Thread t's accumulator merges with thread t + offset for offset = 16, 8, 4, 2, 1 within each
// warp (shuffles), then warp w's with warp w + offset for offset = kQuantWarps / 2 .. 1 (shared
// memory): a fixed tree, the same on every launch and in the host emulation.

// The per-tensor record's last fields: one block (when there are elements) with the scale's
// exponent; saturated if any element was; watch(quant=)'s squares back in x's units.
NUMGUARD_HD void quant_finish_record(QuantAccum& total, int64_t format, int64_t n, float scale, int mode) {
  if (!quant_per_tensor(format)) return;
  const bool saturated = total.saturated > 0;
  total.blocks = n > 0 ? 1 : 0;
  total.saturated_blocks = n > 0 && saturated ? 1 : 0;
  if (n > 0) {
    total.exp_min = total.exp_max = floor_log2(scale);
  }
  if (mode == kQuantPrescaled) {
    const double s = static_cast<double>(scale);
    total.sq_error = total.sq_error / (s * s);
  }
}

}  // namespace cuda
}  // namespace numguard
