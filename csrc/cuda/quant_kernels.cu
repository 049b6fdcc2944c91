// CUDA implementation of numguard::quant_stats and numguard::quant_watch_ (schemas: csrc/ops.cpp;
// the math: numguard/quant.h; which lane reads what and how partials merge: quant_device.cuh,
// NOTE: [quant tiles]). Everything runs on the current stream and nothing waits on the device:
// where a scale depends on the tensor (NVFP4's global scale, watch(quant=)'s current scale), one
// pass writes the tensor's amax to device memory and the measuring pass reads it there.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "numguard/host_checks.h"
#include "numguard/quant.h"
#include "quant_device.cuh"

namespace numguard {
namespace cuda {
namespace {

// Where the measuring pass takes its scale: the host's number, or a rule applied to the amax the
// amax pass left in device memory.
enum ScaleSource : int { kHostScale = 0, kNvfp4GlobalScale = 1, kCurrentScale = 2 };

// Device scratch of one tensor's measurement (zeroed before the amax pass).
struct AmaxScratch {
  unsigned int amax_bits;  // float32 bits of the largest finite |x|
  unsigned int nonfinite;  // any NaN/Inf
};

__global__ void quant_amax_kernel(const float* __restrict__ data, int64_t n, AmaxScratch* scratch) {
  unsigned int top = 0, bad = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float x = data[i];
    if (quant_finite(x)) {
      const unsigned int bits = __float_as_uint(fabsf(x));
      top = bits > top ? bits : top;
    } else {
      bad = 1;
    }
  }
  top = __reduce_max_sync(0xffffffffu, top);
  bad = __reduce_or_sync(0xffffffffu, bad);
  if ((threadIdx.x & 31) == 0) {
    if (top != 0) atomicMax(&scratch->amax_bits, top);
    if (bad != 0) atomicOr(&scratch->nonfinite, 1u);
  }
}

__device__ __forceinline__ float resolve_scale(int source, float host_scale, const AmaxScratch* scratch,
                                               float fmax) {
  if (source == kHostScale) return host_scale;
  const float amax = __uint_as_float(scratch->amax_bits);
  if (source == kNvfp4GlobalScale) return nvfp4_global_scale(amax);
  return quant_current_scale(amax, scratch->nonfinite != 0, fmax);
}

__device__ __forceinline__ double shuffle_down(double v, int offset) {
  return __shfl_down_sync(0xffffffffu, v, offset);
}
__device__ __forceinline__ int64_t shuffle_down(int64_t v, int offset) {
  return __shfl_down_sync(0xffffffffu, static_cast<long long>(v), offset);
}
__device__ __forceinline__ int shuffle_down(int v, int offset) { return __shfl_down_sync(0xffffffffu, v, offset); }
__device__ __forceinline__ float shuffle_down(float v, int offset) {
  return __shfl_down_sync(0xffffffffu, v, offset);
}

__device__ __forceinline__ QuantAccum shuffle_down(const QuantAccum& a, int offset) {
  QuantAccum o;
  o.nonfinite = shuffle_down(a.nonfinite, offset);
  o.nonzero = shuffle_down(a.nonzero, offset);
  o.underflow = shuffle_down(a.underflow, offset);
  o.saturated = shuffle_down(a.saturated, offset);
  o.blocks = shuffle_down(a.blocks, offset);
  o.saturated_blocks = shuffle_down(a.saturated_blocks, offset);
  o.amax = shuffle_down(a.amax, offset);
  o.sq_error = shuffle_down(a.sq_error, offset);
  o.exp_min = shuffle_down(a.exp_min, offset);
  o.exp_max = shuffle_down(a.exp_max, offset);
  return o;
}

// One partial per CUDA block (NOTE: [quant tiles], [quant block merge]).
__global__ void __launch_bounds__(kQuantThreads) quant_measure_kernel(const float* __restrict__ data, int64_t n,
                                                                      int64_t format, int mode, int source,
                                                                      float host_scale,
                                                                      const AmaxScratch* scratch,
                                                                      QuantAccum* partials) {
  const QuantElement f = quant_element(format);
  const float scale = resolve_scale(source, host_scale, scratch, f.max_value);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int block_lanes = format == kQuantNvfp4 ? 16 : 32;
  const unsigned int block_mask = quant_block_lane_mask(format, lane);
  QuantAccum acc;
  acc.init();
  const int64_t tiles = (n + kQuantTile - 1) / kQuantTile;
  const QuantBlockScale tensor_scale = quant_block_scale(format, 0.0f, scale);
  for (int64_t tile = quant_first_tile(blockIdx.x, warp); tile < tiles; tile += quant_tile_step(gridDim.x)) {
    const int64_t i = tile * kQuantTile + lane;
    const bool valid = i < n;
    const float x = valid ? data[i] : 0.0f;
    QuantBlockScale b = tensor_scale;
    if (!quant_per_tensor(format)) {  // the block amax: a max over the block's lanes
      unsigned int bits = __float_as_uint(quant_finite_abs(x));
      for (int offset = block_lanes / 2; offset > 0; offset >>= 1) {
        const unsigned int other = __shfl_xor_sync(0xffffffffu, bits, offset);
        bits = other > bits ? other : bits;
      }
      b = quant_block_scale(format, __uint_as_float(bits), scale);
    }
    const bool saturated = quant_lane_element(acc, format, f, b, mode, x, valid);
    const bool block_saturated = (__ballot_sync(0xffffffffu, saturated) & block_mask) != 0;
    quant_lane_block(acc, format, b, valid && quant_block_leader(format, lane), block_saturated);
  }
  for (int offset = 16; offset > 0; offset >>= 1) acc.merge(shuffle_down(acc, offset));
  __shared__ QuantAccum warp_accs[kQuantWarps];
  if (lane == 0) warp_accs[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int offset = kQuantWarps / 2; offset > 0; offset >>= 1) {
      for (int w = 0; w < offset; ++w) warp_accs[w].merge(warp_accs[w + offset]);
    }
    partials[blockIdx.x] = warp_accs[0];
  }
}

// Merges the partials in block order and writes the record (or, for quant_watch_, adds the
// summed fields into a row of running sums and writes the tensor's record).
__global__ void quant_finish_kernel(const QuantAccum* partials, int blocks, int64_t n, int64_t format, int mode,
                                    int source, float host_scale, const AmaxScratch* scratch, double* record,
                                    double* sums) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  QuantAccum total;
  total.init();
  for (int b = 0; b < blocks; ++b) total.merge(partials[b]);
  const float scale = resolve_scale(source, host_scale, scratch, quant_element(format).max_value);
  quant_finish_record(total, format, n, scale, mode);
  total.write(record);
  if (sums != nullptr) quant_add_to_sums(sums, record);
}

// A tensor's float32 values, flat in row-major order, on the current stream (a copy unless x is a
// contiguous float32 tensor).
at::Tensor float32_values(const at::Tensor& x) { return x.detach().reshape({-1}).to(at::kFloat).contiguous(); }

// Enqueues one tensor's measurement; record: float64[kNumQuantFields] on the device.
void measure(const at::Tensor& x, int64_t format, int mode, int source, float host_scale, double* record,
             double* sums, std::vector<at::Tensor>& keep_alive) {
  const at::Tensor values = float32_values(x);
  keep_alive.push_back(values);
  const int64_t n = values.numel();
  const float* data = n > 0 ? values.const_data_ptr<float>() : nullptr;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor scratch = at::zeros({static_cast<int64_t>(sizeof(AmaxScratch))}, x.options().dtype(at::kByte));
  keep_alive.push_back(scratch);
  AmaxScratch* amax = reinterpret_cast<AmaxScratch*>(scratch.data_ptr());
  const int64_t blocks = quant_grid_blocks(n);
  if (source != kHostScale && n > 0) {
    quant_amax_kernel<<<static_cast<unsigned>(blocks), kQuantThreads, 0, stream>>>(data, n, amax);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::Tensor partials =
      at::empty({blocks * static_cast<int64_t>(sizeof(QuantAccum))}, x.options().dtype(at::kByte));
  keep_alive.push_back(partials);
  QuantAccum* parts = reinterpret_cast<QuantAccum*>(partials.data_ptr());
  quant_measure_kernel<<<static_cast<unsigned>(blocks), kQuantThreads, 0, stream>>>(data, n, format, mode, source,
                                                                                     host_scale, amax, parts);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  quant_finish_kernel<<<1, 32, 0, stream>>>(parts, static_cast<int>(blocks), n, format, mode, source, host_scale,
                                            amax, record, sums);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_format(int64_t format) {
  TORCH_CHECK_VALUE(format >= kQuantFloat8E4M3 && format <= kQuantNvfp4, "numguard: unknown quant format code ",
                    format);
}

at::Tensor quant_stats_cuda(const at::Tensor& x, int64_t format, double scale, bool has_scale) {
  check_format(format);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({kNumQuantFields}, x.options().dtype(at::kDouble));
  std::vector<at::Tensor> keep_alive;
  int source = kHostScale;
  float host_scale = static_cast<float>(has_scale ? scale : 1.0);
  if (format == kQuantNvfp4 && !has_scale) source = kNvfp4GlobalScale;
  measure(x, format, kQuantDequantize, source, host_scale, out.mutable_data_ptr<double>(), nullptr, keep_alive);
  return out;
}

at::Tensor quant_watch_cuda(const at::Tensor& sums, int64_t row, at::TensorList xs, int64_t format) {
  check_format(format);
  check_quant_watch_args(sums, row, xs);
  const c10::cuda::CUDAGuard guard(sums.device());
  at::Tensor records = at::empty({static_cast<int64_t>(xs.size()), kNumQuantFields}, sums.options());
  std::vector<at::Tensor> keep_alive;
  const bool per_tensor = quant_per_tensor(format);
  for (size_t i = 0; i < xs.size(); ++i) {
    const int source = per_tensor ? kCurrentScale : (format == kQuantNvfp4 ? kNvfp4GlobalScale : kHostScale);
    measure(xs[i], format, per_tensor ? kQuantPrescaled : kQuantDequantize, source, 1.0f,
            records.mutable_data_ptr<double>() + i * kNumQuantFields,
            sums.mutable_data_ptr<double>() + row * sums.size(1), keep_alive);
  }
  return records;
}

}  // namespace
}  // namespace cuda
}  // namespace numguard

TORCH_LIBRARY_IMPL(numguard, CUDA, m) {
  m.impl("quant_stats", &numguard::cuda::quant_stats_cuda);
  m.impl("quant_watch_", &numguard::cuda::quant_watch_cuda);
}
