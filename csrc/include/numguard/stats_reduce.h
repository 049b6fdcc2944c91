// numguard's reduction logic, written once and compiled for the host (CPU kernels) and the device
// (CUDA kernels). It has no dependency on ATen so that a .cu file can include it alone.
//
// NOTE: [magnitude bits]
// Every floating format numguard handles (fp64, fp32, fp16, bf16, fp8 e4m3fn/e5m2) is
// sign-magnitude: with the sign bit cleared, the unsigned ordering of the bit pattern equals the
// ordering of |x|. So abs-min, abs-max and min-nonzero are unsigned min/max over magnitude bits,
// and NaN / Inf / zero / subnormal are range tests on the same bits. All of it is integer work:
// exact, associative and commutative, so the record is identical for any chunking, thread count
// or launch shape, and it vectorizes as plain integer SIMD. The bits are decoded to a double only
// once, when a record is finalized.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define NUMGUARD_HD __host__ __device__ __forceinline__
#else
#define NUMGUARD_HD inline
#endif

namespace numguard {

// Layout of one stats record; numguard.STAT_FIELDS names the same fields in the same order.
enum StatField : int {
  kAbsMin = 0,
  kAbsMax = 1,
  kMinNonzero = 2,
  kNan = 3,
  kPosInf = 4,
  kNegInf = 5,
  kZero = 6,
  kSubnormal = 7,
};
constexpr int kNumStats = 8;
constexpr const char* kStatFieldNames[kNumStats] = {"abs_min", "abs_max", "min_nonzero", "nan",
                                                    "pos_inf", "neg_inf", "zero",    "subnormal"};

// Layout of the recording state tensor (int64[kStateSize]) next to a ring.
enum StateField : int {
  kTripped = 0,            // 1 once any recorded tensor held NaN/Inf; recording then stops
  kFirstTripPosition = 1,  // position of the first record with NaN/Inf, -1 while none
  kHeadroomHit = 2,        // 1 once a low-precision tensor's abs max passed the headroom fraction
  kFirstHeadroomPosition = 3,
};
constexpr int kStateSize = 4;
// numguard.schema.STATE_FIELDS; the extension reports these names and numguard.ops compares them.
constexpr const char* kStateFieldNames[kStateSize] = {"tripped", "first_trip_position", "headroom_hit",
                                                      "first_headroom_position"};

// Element types the kernels read; one per recordable torch dtype (numguard.schema.RECORDABLE_DTYPES
// order). Floating kinds come first (is_float_kind).
enum class ElementKind : uint8_t {
  kFloat64,
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat8E4M3FN,
  kFloat8E5M2,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kUInt8,
  kUInt16,
  kUInt32,
  kUInt64,
  kBool,
};

NUMGUARD_HD constexpr bool is_float_kind(ElementKind kind) {
  return static_cast<int>(kind) <= static_cast<int>(ElementKind::kFloat8E5M2);
}

// finfo.max of the low-precision dtypes whose headroom record_ checks; 0 for the others. The
// extension reports these with its dtype table and numguard.ops compares them with
// numguard.schema at load, so a wrong constant here disables the native kernels, loudly.
NUMGUARD_HD constexpr double headroom_limit(ElementKind kind) {
  return kind == ElementKind::kFloat16         ? 65504.0
         : kind == ElementKind::kBFloat16      ? 3.3895313892515355e38
         : kind == ElementKind::kFloat8E4M3FN ? 448.0
         : kind == ElementKind::kFloat8E5M2   ? 57344.0
                                               : 0.0;
}

// Bit-level description of a floating format (see NOTE: [magnitude bits]).
struct FloatFormat {
  uint64_t sign_mask;     // the sign bit
  uint64_t finite_limit;  // magnitude bits >= this are not finite
  uint64_t inf_bits;      // magnitude bits of infinity (only meaningful when has_inf)
  uint64_t min_normal;    // magnitude bits of finfo.tiny; nonzero magnitudes below are subnormal
  int mantissa_bits;
  int exponent_bias;
  bool has_inf;
};

// IEEE-like formats: all-ones exponent is Inf (zero mantissa) or NaN.
NUMGUARD_HD constexpr FloatFormat ieee_format(int exponent_bits, int mantissa_bits) {
  return FloatFormat{
      uint64_t{1} << (exponent_bits + mantissa_bits),
      ((uint64_t{1} << exponent_bits) - 1) << mantissa_bits,
      ((uint64_t{1} << exponent_bits) - 1) << mantissa_bits,
      uint64_t{1} << mantissa_bits,
      mantissa_bits,
      (1 << (exponent_bits - 1)) - 1,
      true};
}

constexpr FloatFormat kFloat64Format = ieee_format(11, 52);
constexpr FloatFormat kFloat32Format = ieee_format(8, 23);
constexpr FloatFormat kFloat16Format = ieee_format(5, 10);
constexpr FloatFormat kBFloat16Format = ieee_format(8, 7);
constexpr FloatFormat kFloat8E5M2Format = ieee_format(5, 2);
// e4m3fn ("finite, NaN"): no infinities; only magnitude 0x7F (S.1111.111) is NaN, so the
// all-ones exponent with other mantissas holds finite values up to 448.
constexpr FloatFormat kFloat8E4M3FNFormat = FloatFormat{0x80, 0x7F, 0x7F, 0x08, 3, 7, false};

// Exact decode of a finite magnitude into a double (every supported format embeds in fp64).
NUMGUARD_HD double decode_magnitude(uint64_t bits, const FloatFormat& f) {
  const uint64_t mantissa = bits & ((uint64_t{1} << f.mantissa_bits) - 1);
  const int exponent = static_cast<int>(bits >> f.mantissa_bits);
  double scale = 1.0;  // 2^(exponent - bias - mantissa_bits), built without libm for the device
  int e = (exponent == 0 ? 1 : exponent) - f.exponent_bias - f.mantissa_bits;
  double step = e < 0 ? 0.5 : 2.0;
  for (int n = e < 0 ? -e : e; n != 0; n >>= 1) {
    if (n & 1) scale *= step;
    step *= step;
  }
  const uint64_t significand = exponent == 0 ? mantissa : (mantissa | (uint64_t{1} << f.mantissa_bits));
  // significand < 2^53, so the conversion is exact; scale is a power of two, so is the product
  // (a subnormal fp64 result is reached in one multiply only when it is representable).
  return static_cast<double>(significand) * scale;
}

NUMGUARD_HD double positive_infinity() {
  return __builtin_huge_val();
}

// Partial stats of floating values, over magnitude bits. Merging partials in any order gives the
// same result (NOTE: [magnitude bits]).
struct FloatStatsAccum {
  uint64_t min_abs;      // over finite values; starts above every finite magnitude
  uint64_t max_abs;      // over finite values; starts at 0
  uint64_t min_nonzero;  // over finite non-zero values; starts above every finite magnitude
  int64_t nan;
  int64_t pos_inf;
  int64_t neg_inf;
  int64_t zero;
  int64_t subnormal;

  NUMGUARD_HD void init() {
    min_abs = ~uint64_t{0};
    max_abs = 0;
    min_nonzero = ~uint64_t{0};
    nan = pos_inf = neg_inf = zero = subnormal = 0;
  }

  // Full bookkeeping for one value given by its raw bits.
  NUMGUARD_HD void add(uint64_t raw, const FloatFormat& f) {
    const uint64_t mag = raw & (f.sign_mask - 1);
    if (mag < f.finite_limit) {
      min_abs = mag < min_abs ? mag : min_abs;
      max_abs = mag > max_abs ? mag : max_abs;
      if (mag == 0) {
        ++zero;
      } else {
        min_nonzero = mag < min_nonzero ? mag : min_nonzero;
        subnormal += mag < f.min_normal ? 1 : 0;
      }
    } else if (f.has_inf && mag == f.inf_bits) {
      if (raw & f.sign_mask) {
        ++neg_inf;
      } else {
        ++pos_inf;
      }
    } else {
      ++nan;
    }
  }

  // Fold in the result of a block whose values were all normal, finite and non-zero: such a block
  // needs only the min and max magnitude (the fast path of the CPU and CUDA kernels).
  NUMGUARD_HD void add_normal_range(uint64_t block_min, uint64_t block_max) {
    min_abs = block_min < min_abs ? block_min : min_abs;
    max_abs = block_max > max_abs ? block_max : max_abs;
    min_nonzero = block_min < min_nonzero ? block_min : min_nonzero;
  }

  // Fold in `n` zeros counted by a fast path (a zero is finite: the smallest magnitude).
  NUMGUARD_HD void add_zeros(int64_t n) {
    if (n <= 0) return;
    zero += n;
    min_abs = 0;
  }

  NUMGUARD_HD void merge(const FloatStatsAccum& o) {
    min_abs = o.min_abs < min_abs ? o.min_abs : min_abs;
    max_abs = o.max_abs > max_abs ? o.max_abs : max_abs;
    min_nonzero = o.min_nonzero < min_nonzero ? o.min_nonzero : min_nonzero;
    nan += o.nan;
    pos_inf += o.pos_inf;
    neg_inf += o.neg_inf;
    zero += o.zero;
    subnormal += o.subnormal;
  }

  // Counts are multiplied by `repeat` for tensors whose stride-0 dims repeat each value.
  NUMGUARD_HD void finalize(const FloatFormat& f, int64_t repeat, double* out) const {
    const bool any_finite = min_abs < f.finite_limit;
    const bool any_nonzero = min_nonzero < f.finite_limit;
    out[kAbsMin] = any_finite ? decode_magnitude(min_abs, f) : positive_infinity();
    out[kAbsMax] = any_finite ? decode_magnitude(max_abs, f) : 0.0;
    out[kMinNonzero] = any_nonzero ? decode_magnitude(min_nonzero, f) : positive_infinity();
    out[kNan] = static_cast<double>(nan * repeat);
    out[kPosInf] = static_cast<double>(pos_inf * repeat);
    out[kNegInf] = static_cast<double>(neg_inf * repeat);
    out[kZero] = static_cast<double>(zero * repeat);
    out[kSubnormal] = static_cast<double>(subnormal * repeat);
  }
};

// Partial stats of integer and bool values, over unsigned magnitudes (|INT64_MIN| fits).
struct IntStatsAccum {
  uint64_t min_abs;
  uint64_t max_abs;
  uint64_t min_nonzero;
  int64_t count;  // values seen: tells an empty partial from a real UINT64_MAX magnitude
  int64_t zero;

  NUMGUARD_HD void init() {
    min_abs = ~uint64_t{0};
    max_abs = 0;
    min_nonzero = ~uint64_t{0};
    count = 0;
    zero = 0;
  }

  NUMGUARD_HD void add_magnitude(uint64_t mag) {
    min_abs = mag < min_abs ? mag : min_abs;
    max_abs = mag > max_abs ? mag : max_abs;
    ++count;
    if (mag == 0) {
      ++zero;
    } else {
      min_nonzero = mag < min_nonzero ? mag : min_nonzero;
    }
  }

  // n bools of which `zeros` are false. A bool is 0 or 1 whatever non-zero byte stores it, so
  // bools are counted, never read as magnitudes.
  NUMGUARD_HD void add_bools(int64_t n, int64_t zeros) {
    if (n <= 0) return;
    const uint64_t least = zeros > 0 ? 0 : 1;
    min_abs = least < min_abs ? least : min_abs;
    if (n > zeros) {
      max_abs = max_abs > 1 ? max_abs : 1;
      min_nonzero = 1 < min_nonzero ? 1 : min_nonzero;
    }
    count += n;
    zero += zeros;
  }

  NUMGUARD_HD void merge(const IntStatsAccum& o) {
    min_abs = o.min_abs < min_abs ? o.min_abs : min_abs;
    max_abs = o.max_abs > max_abs ? o.max_abs : max_abs;
    min_nonzero = o.min_nonzero < min_nonzero ? o.min_nonzero : min_nonzero;
    count += o.count;
    zero += o.zero;
  }

  NUMGUARD_HD void finalize(int64_t repeat, double* out) const {
    out[kAbsMin] = count > 0 ? static_cast<double>(min_abs) : positive_infinity();
    out[kAbsMax] = count > 0 ? static_cast<double>(max_abs) : 0.0;
    out[kMinNonzero] = count > zero ? static_cast<double>(min_nonzero) : positive_infinity();
    out[kNan] = 0.0;
    out[kPosInf] = 0.0;
    out[kNegInf] = 0.0;
    out[kZero] = static_cast<double>(zero * repeat);
    out[kSubnormal] = 0.0;
  }
};

template <typename T>
NUMGUARD_HD uint64_t int_magnitude(T v) {
  // Unsigned negation keeps |INT64_MIN| = 2^63 exact.
  return v < T(0) ? uint64_t{0} - static_cast<uint64_t>(static_cast<int64_t>(v)) : static_cast<uint64_t>(v);
}

// The record of empty tensors: no finite values, all counts zero.
NUMGUARD_HD void empty_record(double* out) {
  out[kAbsMin] = positive_infinity();
  out[kAbsMax] = 0.0;
  out[kMinNonzero] = positive_infinity();
  for (int i = kNan; i < kNumStats; ++i) out[i] = 0.0;
}

NUMGUARD_HD bool record_is_nonfinite(const double* rec) {
  return rec[kNan] + rec[kPosInf] + rec[kNegInf] > 0.0;
}

// NOTE: [concurrent recording]
// Frames recorded on different CUDA streams (a side stream, a graph replayed there) can run at
// the same time and update one state. On the device a flag is claimed with a compare-and-swap, so
// exactly one record sets it and its position: the first to get there in time. On one stream, and
// on the CPU, that is the first in program order. A frame already being recorded when another
// stream's frame trips is still written, at its own positions; frames that start later are not.
NUMGUARD_HD bool state_is_set(const int64_t* state, int field) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const volatile int64_t*>(state + field) != 0;  // another kernel may set it
#else
  return state[field] != 0;
#endif
}

// Sets state[flag] and, for the one caller that set it, state[position_field] = position.
NUMGUARD_HD void claim_first(int64_t* state, int flag, int position_field, int64_t position) {
  if (state_is_set(state, flag)) return;
#ifdef __CUDA_ARCH__
  if (atomicCAS(reinterpret_cast<unsigned long long*>(state + flag), 0ull, 1ull) != 0ull) return;
#else
  state[flag] = 1;
#endif
  state[position_field] = position;
}

// NOTE: [context records]
// A frame's first `context` records are the call's inputs. In watch() a value a module takes and
// does not pass on (an attention mask's -inf, a log(0) it throws away) is context, not a trip:
// its NaN/Inf trips the ring only when a later record of the same frame (an output, the weight
// flag) holds NaN/Inf too, and the trip then points at the first non-finite record, as before.
// context 0 (the default; Transformers' rule in the drop-in) trips on any record.
NUMGUARD_HD bool frame_trips(const double* records, int64_t n, int64_t context) {
  for (int64_t i = context < 0 ? 0 : context; i < n; ++i) {
    if (record_is_nonfinite(records + i * kNumStats)) return true;
  }
  return false;
}

// Trips and headroom flags of a frame's records at positions position + i (NOTE: [concurrent
// recording], [context records]); update_recording_state below, after checking the ring is not frozen.
NUMGUARD_HD void note_records(int64_t* state, const double* records, const double* max_values, int64_t n,
                              int64_t position, double headroom, int64_t context = 0) {
  const bool trips = context <= 0 || frame_trips(records, n, context);
  for (int64_t i = 0; i < n; ++i) {
    const double* rec = records + i * kNumStats;
    if (trips && record_is_nonfinite(rec)) claim_first(state, kTripped, kFirstTripPosition, position + i);
    if (headroom > 0.0 && max_values[i] > 0.0 && rec[kAbsMax] > headroom * max_values[i]) {
      claim_first(state, kHeadroomHit, kFirstHeadroomPosition, position + i);
    }
  }
}

// Recording: given a frame's finished records, decide what is written and how state changes.
// Shared by the CPU and CUDA `record_` so that freeze-on-trip means the same on both.
//   state      int64[kStateSize]
//   records    [n][kNumStats] finished records of this frame, in order
//   max_values per record: finfo.max of a low-precision tensor, or 0 when headroom is not checked
//   context    how many leading records are context (NOTE: [context records])
// Returns true when the frame's records are to be written (the ring was not tripped before it).
NUMGUARD_HD bool update_recording_state(int64_t* state, const double* records, const double* max_values,
                                        int64_t n, int64_t position, double headroom, int64_t context = 0) {
  if (state_is_set(state, kTripped)) return false;  // frozen
  note_records(state, records, max_values, n, position, headroom, context);
  return true;
}

}  // namespace numguard
