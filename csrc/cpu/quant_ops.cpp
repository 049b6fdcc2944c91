// CPU kernel of numguard::quant_stats (schema: csrc/ops.cpp; meaning: numguard.quant): one pass
// over the tensor's float32 values per block of the format (two for NVFP4, whose global scale
// needs the tensor's amax first). The rounding is the shared header's (numguard/quant.h, NOTE:
// [quant rounding]).
//
// Chunks of whole blocks are reduced in parallel and merged in chunk order, so the record does
// not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "numguard/quant.h"

namespace numguard {
namespace cpu {
namespace {

constexpr int kQuantFields = 10;  // numguard.schema.QUANT_FIELDS
constexpr int64_t kChunkElements = 1 << 16;

struct QuantAccum {
  int64_t nonfinite = 0, nonzero = 0, underflow = 0, saturated = 0, blocks = 0, saturated_blocks = 0;
  float amax = 0.0f;
  double sq_error = 0.0;
  int exp_min = std::numeric_limits<int>::max();
  int exp_max = std::numeric_limits<int>::min();

  void merge(const QuantAccum& o) {
    nonfinite += o.nonfinite;
    nonzero += o.nonzero;
    underflow += o.underflow;
    saturated += o.saturated;
    blocks += o.blocks;
    saturated_blocks += o.saturated_blocks;
    amax = std::max(amax, o.amax);
    sq_error += o.sq_error;
    exp_min = std::min(exp_min, o.exp_min);
    exp_max = std::max(exp_max, o.exp_max);
  }

  void note_exponent(int e) {
    exp_min = std::min(exp_min, e);
    exp_max = std::max(exp_max, e);
  }
};

// One element already scaled to the element grid: `v` its scaled value, `x` its float32 value,
// `dequant` what q maps back to (a function of q).
template <typename Dequant>
inline bool add_element(QuantAccum& acc, float x, float v, const QuantElement& f, Dequant dequant) {
  const bool saturated = std::fabs(v) > f.max_value;
  const float q = quant_round(v, f);
  acc.saturated += saturated;
  acc.underflow += (x != 0.0f && q == 0.0f);
  const double d = dequant(q) - static_cast<double>(x);
  acc.sq_error += d * d;
  return saturated;
}

// The finite float32 value of element i (0 for NaN/Inf, which are only counted).
inline float finite_value(const float* data, int64_t i, QuantAccum& acc) {
  const float x = data[i];
  if (!std::isfinite(x)) {
    ++acc.nonfinite;
    return 0.0f;
  }
  acc.nonzero += (x != 0.0f);
  acc.amax = std::max(acc.amax, std::fabs(x));
  return x;
}

QuantAccum reduce_blocks(const float* data, int64_t n, int64_t first_block, int64_t last_block, int64_t block,
                         int64_t format, float scale) {
  QuantAccum acc;
  const bool e5m2 = format == kQuantFloat8E5M2 || format == kQuantMxfp8E5M2;
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t begin = b * block;
    const int64_t end = std::min(n, begin + block);
    float xs[32];
    float bamax = 0.0f;
    for (int64_t i = begin; i < end; ++i) {
      xs[i - begin] = finite_value(data, i, acc);
      bamax = std::max(bamax, std::fabs(xs[i - begin]));
    }
    ++acc.blocks;
    bool block_saturated = false;
    if (format == kQuantFloat8E4M3 || format == kQuantFloat8E5M2) {
      const QuantElement f = e5m2 ? quant_e5m2() : quant_e4m3();
      const double s = scale;
      for (int64_t i = 0; i < end - begin; ++i) {
        block_saturated |= add_element(acc, xs[i], xs[i] * scale, f, [s](float q) { return q / s; });
      }
    } else if (format == kQuantMxfp8E4M3 || format == kQuantMxfp8E5M2) {
      const QuantElement f = e5m2 ? quant_e5m2() : quant_e4m3();
      int shared = bamax > 0.0f ? floor_log2(bamax) - f.emax : -127;
      shared = std::min(127, std::max(-127, shared));
      acc.note_exponent(shared);
      const float down = pow2f(-shared);
      const double up = std::ldexp(1.0, shared);
      for (int64_t i = 0; i < end - begin; ++i) {
        block_saturated |= add_element(acc, xs[i], xs[i] * down, f, [up](float q) { return q * up; });
      }
    } else {  // NVFP4: `scale` is the global scale g
      const QuantElement f = quant_e2m1();
      const float s = quant_round(std::min(bamax * scale / 6.0f, 448.0f), quant_e4m3());
      if (s > 0.0f) acc.note_exponent(floor_log2(s));
      const double back = static_cast<double>(s) / static_cast<double>(scale);
      for (int64_t i = 0; i < end - begin; ++i) {
        const float v = s > 0.0f ? xs[i] * scale / s : 0.0f;
        const double sd = s, gd = scale;
        block_saturated |= add_element(acc, xs[i], v, f, [sd, gd](float q) { return q * sd / gd; });
      }
      (void)back;
    }
    acc.saturated_blocks += block_saturated;
  }
  return acc;
}

at::Tensor quant_stats_cpu(const at::Tensor& x, int64_t format, double scale, bool has_scale) {
  TORCH_CHECK_VALUE(format >= kQuantFloat8E4M3 && format <= kQuantNvfp4, "numguard: unknown quant format code ",
                    format);
  const at::Tensor values = x.detach().reshape({-1}).to(at::kFloat).contiguous();
  const float* data = values.const_data_ptr<float>();
  const int64_t n = values.numel();
  const bool per_tensor = format == kQuantFloat8E4M3 || format == kQuantFloat8E5M2;
  const int64_t block = per_tensor ? std::max<int64_t>(n, 1) : (format == kQuantNvfp4 ? 16 : 32);
  float s = per_tensor ? static_cast<float>(has_scale ? scale : 1.0) : 1.0f;
  if (format == kQuantNvfp4) {
    if (has_scale) {
      s = static_cast<float>(scale);
    } else {
      float amax = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        if (std::isfinite(data[i])) amax = std::max(amax, std::fabs(data[i]));
      }
      s = amax > 0.0f ? 2688.0f / amax : 1.0f;  // 448 * 6 / amax, in float32
    }
  }
  const int64_t num_blocks = n == 0 ? 0 : (n + block - 1) / block;
  QuantAccum total;
  if (per_tensor) {
    // One block of any size: chunks of elements, merged in order (the block counted once).
    const int64_t chunks = (n + kChunkElements - 1) / kChunkElements;
    std::vector<QuantAccum> parts(std::max<int64_t>(chunks, 1));
    at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        const int64_t begin = c * kChunkElements;
        const int64_t end = std::min(n, begin + kChunkElements);
        QuantAccum& acc = parts[c];
        const QuantElement f = format == kQuantFloat8E5M2 ? quant_e5m2() : quant_e4m3();
        const double sd = s;
        bool sat = false;
        for (int64_t i = begin; i < end; ++i) {
          const float xv = finite_value(data, i, acc);
          sat |= add_element(acc, xv, xv * s, f, [sd](float q) { return q / sd; });
        }
        acc.saturated_blocks = sat;
      }
    });
    bool any_saturated = false;
    for (int64_t c = 0; c < chunks; ++c) {
      any_saturated |= parts[c].saturated_blocks > 0;
      parts[c].saturated_blocks = 0;
      total.merge(parts[c]);
    }
    if (n > 0) {
      total.blocks = 1;
      total.saturated_blocks = any_saturated;
      total.note_exponent(floor_log2(s));
    }
  } else {
    const int64_t per_chunk = kChunkElements / block;
    const int64_t chunks = (num_blocks + per_chunk - 1) / per_chunk;
    std::vector<QuantAccum> parts(std::max<int64_t>(chunks, 1));
    at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        parts[c] = reduce_blocks(data, n, c * per_chunk, std::min(num_blocks, (c + 1) * per_chunk), block, format, s);
      }
    });
    for (int64_t c = 0; c < chunks; ++c) total.merge(parts[c]);
  }
  at::Tensor out = at::empty({kQuantFields}, x.options().dtype(at::kDouble).device(at::kCPU));
  double* o = out.mutable_data_ptr<double>();
  const double inf = std::numeric_limits<double>::infinity();
  o[0] = static_cast<double>(total.nonfinite);
  o[1] = static_cast<double>(total.nonzero);
  o[2] = static_cast<double>(total.underflow);
  o[3] = static_cast<double>(total.saturated);
  o[4] = static_cast<double>(total.amax);
  o[5] = total.sq_error;
  o[6] = static_cast<double>(total.blocks);
  o[7] = static_cast<double>(total.saturated_blocks);
  o[8] = total.exp_min == std::numeric_limits<int>::max() ? inf : static_cast<double>(total.exp_min);
  o[9] = total.exp_max == std::numeric_limits<int>::min() ? -inf : static_cast<double>(total.exp_max);
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace numguard

TORCH_LIBRARY_IMPL(numguard, CPU, m) {
  m.impl("quant_stats", &numguard::cpu::quant_stats_cpu);
}
