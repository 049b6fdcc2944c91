// CPU kernel of numguard::quant_stats (schema: csrc/ops.cpp; meaning: numguard.quant). The math is
// the shared header's (numguard/quant.h: NOTE: [quant rounding], [quant block scale]); the loops
// are the instruction-set level's (quant_impl.inc, chosen at run time with the stats kernels':
// dispatch.cpp, NUMGUARD_CPU_ISA).
//
// The tensor is read as float32 in chunks of kQuantChunkElements (whole sub-blocks, whole blocks),
// reduced in parallel and merged in chunk order. Every field but sq_error is exact, and sq_error
// is summed in an order fixed by the element indices alone (NOTE: [quant lanes]), so the record
// is the same for any thread count and instruction-set level.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "numguard/host_checks.h"
#include "numguard/quant.h"
#include "quant_ops.h"
#include "reduce_kernels.h"

namespace numguard {
namespace cpu {
namespace {

// Below this many elements in one call, everything runs on the calling thread.
constexpr int64_t kQuantParallelMinElements = 1 << 17;

// How a per-tensor scale reaches v (QuantRun::Float8Mode).
int float8_mode(float scale) {
  if (scale == 1.0f) return QuantRun::kUnitScale;
  int exponent = 0;
  const float mantissa = std::frexp(scale, &exponent);
  // A normal power of two whose reciprocal is one too: the dequantized error (q - v) / scale is exact.
  return mantissa == 0.5f && std::isnormal(scale) && std::isnormal(1.0f / scale) ? QuantRun::kPowerOfTwoScale
                                                                                : QuantRun::kGeneralScale;
}

// The values the kernels read, flat in row-major order: x itself when it is a contiguous float32,
// bfloat16 or float16 tensor (NOTE: [quant inputs]), else a float32 copy.
struct QuantValues {
  at::Tensor holder;
  const void* data = nullptr;
  int64_t n = 0;
  int input = QuantRun::kFloat32;

  explicit QuantValues(const at::Tensor& x) {
    const at::ScalarType t = x.scalar_type();
    const bool direct = x.is_contiguous() && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
    holder = direct ? x : x.detach().reshape({-1}).to(at::kFloat).contiguous();
    input = !direct || t == at::kFloat ? QuantRun::kFloat32
                                       : (t == at::kBFloat16 ? QuantRun::kBFloat16 : QuantRun::kFloat16);
    data = holder.const_data_ptr();
    n = holder.numel();
  }
  const void* at(int64_t i) const { return static_cast<const char*>(data) + i * quant_input_size(input); }
};

// reduce(lo, hi) over the chunks of n elements: on the calling thread for small inputs, else on
// at::parallel_for (each chunk fills its own partial; the caller merges them in order).
template <typename Reduce>
void over_chunks(int64_t n, int64_t chunks, const Reduce& reduce) {
  if (n < kQuantParallelMinElements || chunks <= 1) {
    reduce(0, chunks);
  } else {
    at::parallel_for(0, chunks, 1, reduce);
  }
}

// The record of the values under `run`, in chunks on at::parallel_for, merged in order.
QuantAccum quant_reduce(const QuantValues& values, const QuantRun& run) {
  QuantAccum total;
  total.init();
  const int64_t n = values.n;
  if (n == 0) return total;
  const int64_t chunks = (n + kQuantChunkElements - 1) / kQuantChunkElements;
  std::vector<QuantPartial> parts(chunks);
  const KernelTable& kernels = active_kernels();
  auto reduce = [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t begin = c * kQuantChunkElements;
      const int64_t len = std::min(n - begin, kQuantChunkElements);
      parts[c].init();
      kernels.quant(values.at(begin), len, run, parts[c]);
    }
  };
  over_chunks(n, chunks, reduce);
  bool saturated = false;
  for (int64_t c = 0; c < chunks; ++c) {  // chunk order
    parts[c].acc.sq_error = parts[c].lane_sum();
    saturated |= parts[c].acc.saturated_blocks > 0;
    total.merge(parts[c].acc);
  }
  if (quant_per_tensor(run.format)) {  // one block of any size, one scale
    total.blocks = 1;
    total.saturated_blocks = saturated;
    total.exp_min = total.exp_max = floor_log2(run.scale);
    if (run.mode == QuantRun::kPrescaled) {  // the squares back in x's units
      const double s = static_cast<double>(run.scale);
      total.sq_error = total.sq_error / (s * s);
    }
  }
  return total;
}

// The largest finite |x| of the values (0 when there is none), by the amax kernel of the active
// level: one max per element, memory-bound; a second pass only where a NaN or Inf was seen
// (`any_nonfinite`).
float finite_amax(const QuantValues& values, bool* any_nonfinite) {
  const int64_t n = values.n;
  const int64_t chunks = (n + kQuantChunkElements - 1) / kQuantChunkElements;
  std::vector<uint32_t> parts(chunks);
  const KernelTable& kernels = active_kernels();
  auto top = [&](bool finite_only) {
    over_chunks(n, chunks, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        const int64_t begin = c * kQuantChunkElements;
        parts[c] = kernels.quant_amax(values.at(begin), std::min(n - begin, kQuantChunkElements), values.input,
                                      finite_only);
      }
    });
    uint32_t bits = 0;
    for (const uint32_t b : parts) bits = b > bits ? b : bits;
    return bits;
  };
  uint32_t bits = top(false);
  *any_nonfinite = bits >= 0x7F800000u;
  if (*any_nonfinite) bits = top(true);
  float amax;
  std::memcpy(&amax, &bits, sizeof amax);
  return amax;
}

// quant_stats' parameters (NVFP4 without a scale: g from the tensor's amax, one more pass; or
// from `known_amax`, the largest finite |x| when the caller has it).
QuantRun make_quant_run(int64_t format, double scale, bool has_scale, const QuantValues& values,
                        const float* known_amax = nullptr) {
  QuantRun run{};
  run.format = format;
  run.input = values.input;
  run.f = quant_element(format);
  run.scale = 1.0f;
  run.mode = QuantRun::kUnitScale;
  if (quant_per_tensor(format)) {
    run.scale = static_cast<float>(has_scale ? scale : 1.0);
    run.mode = float8_mode(run.scale);
  } else if (format == kQuantNvfp4 && has_scale) {
    run.scale = static_cast<float>(scale);
  } else if (format == kQuantNvfp4) {
    bool any_nonfinite = false;
    run.scale = nvfp4_global_scale(known_amax != nullptr ? *known_amax : finite_amax(values, &any_nonfinite));
  }
  return run;
}

// watch(quant=)'s measurement of one tensor whose largest finite |x| and NaN/Inf presence are
// known: current scaling for the per-tensor formats, NVFP4's global scale from that amax.
QuantAccum quant_watch_known(int64_t format, const QuantValues& values, float amax, bool any_nonfinite) {
  QuantRun run = make_quant_run(format, 1.0, false, values, &amax);
  if (!quant_per_tensor(format)) return quant_reduce(values, run);
  run.scale = quant_current_scale(amax, any_nonfinite, run.f.max_value);
  // v = x * 1 is x: the unit pass (which finds amax itself) is the prescaled one
  run.mode = run.scale == 1.0f ? QuantRun::kUnitScale : QuantRun::kPrescaled;
  QuantAccum total = quant_reduce(values, run);
  if (run.mode == QuantRun::kPrescaled) total.amax = amax;  // the prescaled pass leaves amax to its scale's pass
  return total;
}

// watch(quant=)'s measurement of one tensor: its amax by a pass of its own (MX needs none).
QuantAccum quant_watch_one(int64_t format, const QuantValues& values) {
  if (format != kQuantNvfp4 && !quant_per_tensor(format)) {
    return quant_reduce(values, make_quant_run(format, 1.0, false, values));
  }
  bool any_nonfinite = false;
  const float amax = finite_amax(values, &any_nonfinite);
  return quant_watch_known(format, values, amax, any_nonfinite);
}

at::Tensor quant_stats_cpu(const at::Tensor& x, int64_t format, double scale, bool has_scale) {
  TORCH_CHECK_VALUE(format >= kQuantFloat8E4M3 && format <= kQuantNvfp4, "numguard: unknown quant format code ",
                    format);
  const QuantValues values(x);
  const QuantRun run = make_quant_run(format, scale, has_scale, values);
  const QuantAccum total = quant_reduce(values, run);
  at::Tensor out = at::empty({kNumQuantFields}, x.options().dtype(at::kDouble).device(at::kCPU));
  double* o = out.mutable_data_ptr<double>();
  total.write(o);
  return out;
}

at::Tensor quant_watch_cpu(const at::Tensor& sums, int64_t row, at::TensorList xs, int64_t format) {
  TORCH_CHECK_VALUE(format >= kQuantFloat8E4M3 && format <= kQuantNvfp4, "numguard: unknown quant format code ",
                    format);
  check_quant_watch_args(sums, row, xs);
  at::Tensor records = at::empty({static_cast<int64_t>(xs.size()), kNumQuantFields}, sums.options());
  double* out = records.mutable_data_ptr<double>();
  double* sums_row = sums.mutable_data_ptr<double>() + row * kQuantSummedFields;
  for (size_t i = 0; i < xs.size(); ++i) {
    quant_watch_one(format, QuantValues(xs[i])).write(out + i * kNumQuantFields);
    quant_add_to_sums(sums_row, out + i * kNumQuantFields);
  }
  return records;
}

}  // namespace

void quant_watch_from_stats(int64_t format, const at::Tensor& x, float amax, bool any_nonfinite, double* record,
                            double* sums_row) {
  quant_watch_known(format, QuantValues(x), amax, any_nonfinite).write(record);
  quant_add_to_sums(sums_row, record);
}

}  // namespace cpu
}  // namespace numguard

TORCH_LIBRARY_IMPL(numguard, CPU, m) {
  m.impl("quant_stats", &numguard::cpu::quant_stats_cpu);
  m.impl("quant_watch_", &numguard::cpu::quant_watch_cpu);
}
