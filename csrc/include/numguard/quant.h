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

}  // namespace numguard
