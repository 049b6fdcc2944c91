// The CPU record_ kernel, also called directly by the frame recorder (csrc/recorder.cpp) for a
// ring on the CPU: numguard's own recording needs none of the dispatcher's work.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace numguard {
namespace cpu {

// With `quant_sums`, xs[quant_xs] are also measured as record_'s schema says (csrc/ops.cpp).
void record_cpu(const at::Tensor& ring, const at::Tensor& state, at::TensorList xs, int64_t position,
                double headroom, int64_t context = 0, const std::optional<at::Tensor>& quant_sums = std::nullopt,
                int64_t quant_row = 0, int64_t quant_format = -1, at::IntArrayRef quant_xs = {},
                const std::optional<at::Tensor>& quant_records = std::nullopt);

}  // namespace cpu
}  // namespace numguard
