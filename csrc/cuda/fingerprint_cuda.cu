// CUDA implementation of numguard::multi_tensor_fingerprint (NOTE: [fingerprint] in
// numguard/fingerprint.h). Up to kFingerprintBatch tensors per launch: their pointers and sizes
// travel as a kernel argument (no host->device copy); blockIdx.y picks the tensor, the blocks along
// x stride over its elements, each block reduces its threads' wrapping sums and adds the result
// into the tensor's slot with one atomicAdd (order-free mod 2^64). Never waits on the device.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "numguard/host_checks.h"
#include "numguard/fingerprint.h"

namespace numguard {
namespace cuda {
namespace {

constexpr int kFingerprintBatch = 48;  // tensors per launch (the argument stays well under 4 KB)
constexpr int kFingerprintThreads = 256;
constexpr int64_t kFingerprintElemsPerBlock = 16 * 1024;
constexpr int kFingerprintMaxBlocksX = 1024;

struct FingerprintBatch {
  const void* data[kFingerprintBatch];
  int64_t numel[kFingerprintBatch];
  int elem_size[kFingerprintBatch];
  bool is_bool[kFingerprintBatch];
};

__device__ __forceinline__ uint64_t load_bits(const void* data, int elem_size, bool is_bool, int64_t i) {
  switch (elem_size) {
    case 1: {
      const uint8_t v = static_cast<const uint8_t*>(data)[i];
      return is_bool ? (v != 0 ? 1 : 0) : v;
    }
    case 2: return static_cast<const uint16_t*>(data)[i];
    case 4: return static_cast<const uint32_t*>(data)[i];
    default: return static_cast<const uint64_t*>(data)[i];
  }
}

__global__ void fingerprint_kernel(FingerprintBatch batch, unsigned long long* out) {
  const int t = blockIdx.y;
  const int64_t n = batch.numel[t];
  const void* data = batch.data[t];
  const int elem_size = batch.elem_size[t];
  const bool is_bool = batch.is_bool[t];
  uint64_t sum = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    sum += fingerprint_element(load_bits(data, elem_size, is_bool, i), static_cast<uint64_t>(i));
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  __shared__ uint64_t warp_sums[kFingerprintThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t block = 0;
    for (int w = 0; w < kFingerprintThreads / 32; ++w) block += warp_sums[w];
    if (block != 0) atomicAdd(out + t, static_cast<unsigned long long>(block));
  }
}

at::Tensor multi_tensor_fingerprint_cuda(at::TensorList xs) {
  std::vector<DtypeInfo> infos;
  infos.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) infos.push_back(check_input(xs[i], "xs", static_cast<int64_t>(i)));
  check_same_device(xs, "xs");
  TORCH_CHECK_VALUE(!xs.empty(), "numguard: xs holds no tensor; pass at least one");
  const c10::cuda::CUDAGuard guard(xs[0].device());
  at::Tensor out = at::zeros({static_cast<int64_t>(xs.size())}, xs[0].options().dtype(at::kLong));
  auto stream = c10::cuda::getCurrentCUDAStream();
  std::vector<at::Tensor> keep_alive;  // contiguous copies live until the launches are enqueued
  for (size_t first = 0; first < xs.size(); first += kFingerprintBatch) {
    const size_t count = std::min(xs.size() - first, static_cast<size_t>(kFingerprintBatch));
    FingerprintBatch batch{};
    int64_t most = 0;
    for (size_t j = 0; j < count; ++j) {
      const at::Tensor& x = xs[first + j];
      const at::Tensor aligned = element_aligned(x);  // NOTE: [element alignment]
      at::Tensor dense = aligned.is_contiguous() ? aligned : aligned.contiguous();
      keep_alive.push_back(dense);
      batch.data[j] = dense.numel() ? dense.const_data_ptr() : nullptr;
      batch.numel[j] = dense.numel();
      batch.elem_size[j] = infos[first + j].elem_size;
      batch.is_bool[j] = infos[first + j].kind == ElementKind::kBool;
      most = std::max(most, dense.numel());
    }
    if (most == 0) continue;
    const int64_t blocks = std::min<int64_t>(kFingerprintMaxBlocksX,
                                             (most + kFingerprintElemsPerBlock - 1) / kFingerprintElemsPerBlock);
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(count));
    fingerprint_kernel<<<grid, kFingerprintThreads, 0, stream>>>(
        batch, reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()) + first);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace numguard

TORCH_LIBRARY_IMPL(numguard, CUDA, m) {
  m.impl("multi_tensor_fingerprint", &numguard::cuda::multi_tensor_fingerprint_cuda);
}
