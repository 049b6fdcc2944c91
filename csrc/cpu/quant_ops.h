// The CPU measurement of watch(quant=), also called by record_ (csrc/cpu/stats_ops.cpp) when a
// frame's outputs are measured in the same call as their stats.
#pragma once

#include <ATen/ATen.h>

namespace numguard {
namespace cpu {

// The record of `x` under `format` with current scaling (quant_watch_'s), written to record[10]
// and its leading fields added into sums_row[6]. `amax` (x's largest finite |x|) and
// `any_nonfinite` come from x's stats record, so no pass of its own finds them.
void quant_watch_from_stats(int64_t format, const at::Tensor& x, float amax, bool any_nonfinite, double* record,
                            double* sums_row);

}  // namespace cpu
}  // namespace numguard
