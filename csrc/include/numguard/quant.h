// numguard's low-precision what-if (numguard::quant_stats; numguard.quant), written once for the
// host (csrc/cpu/quant_ops.cpp) and the device: the element formats and their rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "numguard/stats_reduce.h"  // NUMGUARD_HD

namespace numguard {

// numguard.schema.QUANT_* holds the same formats.
//
// NOTE: [quant rounding]
// A magnitude a <= the format's max rounds to nearest, ties to even, on the format's grid: with
// e = max(floor(log2 a), the format's smallest normal exponent), the grid step there is
// 2^(e - mantissa bits), and a / step is an integer plus a fraction whose rounding (rint, ties to
// even) gives the element: its parity is the mantissa's last bit, subnormals included. Every
// step is exact in float32 (a power-of-two scaling), so host and device agree bit for bit with
// torch's own float8 casts.

enum QuantFormatCode : int64_t {  // numguard.schema.QUANT_FORMATS, in that order
  kQuantFloat8E4M3 = 0,
  kQuantFloat8E5M2 = 1,
  kQuantMxfp8E4M3 = 2,
  kQuantMxfp8E5M2 = 3,
  kQuantNvfp4 = 4,
};

struct QuantElement {
  int mantissa_bits;
  int min_exp;      // exponent of the smallest normal value
  int emax;         // exponent of the largest power of two (OCP MX's emax_elem)
  float max_value;  // the cast saturates here
};

NUMGUARD_HD QuantElement quant_e4m3() { return {3, -6, 8, 448.0f}; }
NUMGUARD_HD QuantElement quant_e5m2() { return {2, -14, 15, 57344.0f}; }
NUMGUARD_HD QuantElement quant_e2m1() { return {1, 0, 2, 6.0f}; }

// Whether x is neither NaN nor Inf (from its bits: the same test on the host and the device).
NUMGUARD_HD bool quant_finite(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7F800000u) != 0x7F800000u;
}

// floor(log2(a)) of a finite a > 0 (from the float's bits: exact, subnormals included).
NUMGUARD_HD int floor_log2(float a) {
  uint32_t bits;
  memcpy(&bits, &a, sizeof bits);
  const int biased = static_cast<int>((bits >> 23) & 0xFF);
  if (biased != 0) return biased - 127;
  int e = -127;  // subnormal: the position of the highest set mantissa bit
  for (uint32_t m = bits & 0x7FFFFF; m < 0x400000u; m <<= 1) --e;
  return e;
}

// 2^k as a float for -149 <= k <= 127 (exact).
NUMGUARD_HD float pow2f(int k) {
  if (k >= -126) {
    const uint32_t bits = static_cast<uint32_t>(k + 127) << 23;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
  }
  const uint32_t bits = 1u << (k + 149);
  float out;
  memcpy(&out, &bits, sizeof out);
  return out;
}

// NOTE: [quant rounding]: v clamped to +-max and rounded onto the element grid (its sign kept,
// -0.0 included).
NUMGUARD_HD float quant_round(float v, const QuantElement& f) {
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);
  const bool negative = (bits >> 31) != 0;
  float a = negative ? -v : v;
  if (a > f.max_value) a = f.max_value;
  float q = 0.0f;
  if (a != 0.0f) {
    int e = floor_log2(a);
    if (e < f.min_exp) e = f.min_exp;
    const float step = pow2f(e - f.mantissa_bits);
    q = rintf(a / step) * step;  // the default rounding mode: to nearest, ties to even
  }
  return negative ? -q : q;
}

// The record of numguard::quant_stats, in numguard.schema.QUANT_FIELDS order.
enum QuantField : int {
  kQuantNonfinite = 0,
  kQuantNonzero = 1,
  kQuantUnderflow = 2,
  kQuantSaturated = 3,
  kQuantAmax = 4,
  kQuantSqError = 5,
  kQuantBlocks = 6,
  kQuantSaturatedBlocks = 7,
  kQuantScaleExpMin = 8,
  kQuantScaleExpMax = 9,
};
constexpr int kNumQuantFields = 10;

NUMGUARD_HD bool quant_per_tensor(int64_t format) {
  return format == kQuantFloat8E4M3 || format == kQuantFloat8E5M2;
}

// Elements per scaling block; 0 for the per-tensor formats (one block of any size).
NUMGUARD_HD int64_t quant_block_size(int64_t format) {
  return quant_per_tensor(format) ? 0 : (format == kQuantNvfp4 ? 16 : 32);
}

NUMGUARD_HD QuantElement quant_element(int64_t format) {
  if (format == kQuantNvfp4) return quant_e2m1();
  return format == kQuantFloat8E5M2 || format == kQuantMxfp8E5M2 ? quant_e5m2() : quant_e4m3();
}

// NVFP4's default global scale 448 * 6 / amax, in float32 (1 when amax is 0).
NUMGUARD_HD float nvfp4_global_scale(float amax) { return amax > 0.0f ? 2688.0f / amax : 1.0f; }

// watch(quant=)'s current per-tensor scale, Transformer Engine's: fmax / amax in float32, one
// float32 step lower where amax * scale would pass fmax (a saturation only the rounding made);
// 1 when amax is 0 or the tensor holds NaN/Inf (a batch that trips anyway).
NUMGUARD_HD float quant_current_scale(float amax, bool any_nonfinite, float fmax) {
  if (any_nonfinite || !(amax > 0.0f)) return 1.0f;
  const float scale = fmax / amax;
  return amax * scale > fmax ? nextafterf(scale, 0.0f) : scale;
}

// NOTE: [quant block scale]
// How one block's elements reach the element grid and come back (numguard.quant's formats):
//   float8:  v = x * scale,           dequantized q / scale;
//   MX:      v = x * 2^-shared,       dequantized q * 2^shared (shared from the block's amax);
//   NVFP4:   v = x * g / s,           dequantized q * s / g (s = e4m3(block amax * g / 6); s == 0:
//            v = 0, the block underflows whole).
// Every step on v is float32 and the dequantized value is float64, in this order, on the host
// and the device alike: (double)q * deq_mul / deq_div covers all three (a multiplication or
// division by 1.0 is exact).
struct QuantBlockScale {
  float mul;       // v = x * mul (then / div for NVFP4)
  float div;       // NVFP4's block scale s; 1 otherwise
  double deq_mul;  // dequantized: (double)q * deq_mul / deq_div
  double deq_div;
  bool has_exponent;  // the block notes a scale exponent (NVFP4: only where s > 0)
  int exponent;
};

// `scale`: float8's scale, NVFP4's global scale g; unused for MX. `bamax`: the block's amax of
// finite values (per-tensor formats: unused).
NUMGUARD_HD QuantBlockScale quant_block_scale(int64_t format, float bamax, float scale) {
  QuantBlockScale b{scale, 1.0f, 1.0, static_cast<double>(scale), true, 0};
  if (quant_per_tensor(format)) {
    b.exponent = floor_log2(scale);
  } else if (format == kQuantNvfp4) {
    float s = bamax * scale / 6.0f;
    s = quant_round(s < 448.0f ? s : 448.0f, quant_e4m3());
    b.div = s;
    b.deq_mul = static_cast<double>(s);
    b.deq_div = static_cast<double>(scale);
    b.has_exponent = s > 0.0f;
    b.exponent = s > 0.0f ? floor_log2(s) : 0;
  } else {
    const QuantElement f = quant_element(format);
    int shared = bamax > 0.0f ? floor_log2(bamax) - f.emax : -127;
    shared = shared < -127 ? -127 : (shared > 127 ? 127 : shared);
    b.mul = pow2f(-shared);
    b.deq_mul = static_cast<double>(pow2f(shared));
    b.deq_div = 1.0;
    b.exponent = shared;
  }
  return b;
}

// x (finite, float32) on the element grid's scale, before rounding.
NUMGUARD_HD float quant_scaled(int64_t format, const QuantBlockScale& b, float x) {
  if (format == kQuantNvfp4) return b.div > 0.0f ? x * b.mul / b.div : 0.0f;
  return x * b.mul;
}

// d * d, rounded on its own: never fused into the addition that follows (the device compiler
// fuses a multiply and an add unless told not to; the host build turns fusing off).
NUMGUARD_HD double quant_square(double d) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(d, d);
#else
  return d * d;
#endif
}

// One finite element x: counts its underflow and saturation into the given counters and returns
// its squared error (float64), the term numguard.quant sums.
NUMGUARD_HD double quant_element_error(int64_t format, const QuantElement& f, const QuantBlockScale& b, float x,
                                       int64_t& underflow, int64_t& saturated) {
  const float v = quant_scaled(format, b, x);
  const float q = quant_round(v, f);
  saturated += fabsf(v) > f.max_value;
  underflow += (x != 0.0f && q == 0.0f);
  const double d = static_cast<double>(q) * b.deq_mul / b.deq_div - static_cast<double>(x);
  return quant_square(d);
}

// Partial record of a run of elements; partials merge in a fixed order (the sum of squares is the
// only field whose value depends on that order).
struct QuantAccum {
  int64_t nonfinite, nonzero, underflow, saturated, blocks, saturated_blocks;
  float amax;
  double sq_error;
  int exp_min, exp_max;

  NUMGUARD_HD void init() {
    nonfinite = nonzero = underflow = saturated = blocks = saturated_blocks = 0;
    amax = 0.0f;
    sq_error = 0.0;
    exp_min = 1 << 30;
    exp_max = -(1 << 30);
  }

  NUMGUARD_HD void note_exponent(int e) {
    exp_min = e < exp_min ? e : exp_min;
    exp_max = e > exp_max ? e : exp_max;
  }

  NUMGUARD_HD void merge(const QuantAccum& o) {
    nonfinite += o.nonfinite;
    nonzero += o.nonzero;
    underflow += o.underflow;
    saturated += o.saturated;
    blocks += o.blocks;
    saturated_blocks += o.saturated_blocks;
    amax = o.amax > amax ? o.amax : amax;
    sq_error += o.sq_error;
    exp_min = o.exp_min < exp_min ? o.exp_min : exp_min;
    exp_max = o.exp_max > exp_max ? o.exp_max : exp_max;
  }

  // The record: exponents +inf / -inf where no block noted one.
  NUMGUARD_HD void write(double* out) const {
    const uint64_t inf_bits = 0x7FF0000000000000ull;
    double inf;
    memcpy(&inf, &inf_bits, sizeof inf);
    out[kQuantNonfinite] = static_cast<double>(nonfinite);
    out[kQuantNonzero] = static_cast<double>(nonzero);
    out[kQuantUnderflow] = static_cast<double>(underflow);
    out[kQuantSaturated] = static_cast<double>(saturated);
    out[kQuantAmax] = static_cast<double>(amax);
    out[kQuantSqError] = sq_error;
    out[kQuantBlocks] = static_cast<double>(blocks);
    out[kQuantSaturatedBlocks] = static_cast<double>(saturated_blocks);
    out[kQuantScaleExpMin] = exp_min > exp_max ? inf : static_cast<double>(exp_min);
    out[kQuantScaleExpMax] = exp_min > exp_max ? -inf : static_cast<double>(exp_max);
  }
};

// watch(quant=)'s running sums (numguard.inspector.quant_watch) keep a record's leading fields,
// nonfinite to sq_error, added up over calls.
constexpr int kQuantSummedFields = kQuantSqError + 1;

NUMGUARD_HD void quant_add_to_sums(double* sums, const double* record) {
  for (int j = 0; j < kQuantSummedFields; ++j) sums[j] += record[j];
}

}  // namespace numguard
