// The CPU record_ kernel, also called directly by the frame recorder (csrc/recorder.cpp) for a
// ring on the CPU: numguard's own recording needs none of the dispatcher's work.
#pragma once

#include <ATen/ATen.h>

namespace numguard {
namespace cpu {

void record_cpu(const at::Tensor& ring, const at::Tensor& state, at::TensorList xs, int64_t position,
                double headroom, int64_t context = 0);

}  // namespace cpu
}  // namespace numguard
