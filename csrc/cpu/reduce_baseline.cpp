// The CPU reduction kernels compiled for the baseline instruction-set level (loop bodies in
// reduce_impl.inc; the level is chosen at run time by dispatch.cpp).
#include "reduce_kernels.h"

#pragma GCC push_options
// x86-64 baseline (SSE2): whatever the compiler flags allow, no target pragma.
#define NUMGUARD_ISA_NAMESPACE isa_baseline
#define NUMGUARD_ISA_NAME "baseline"
#define NUMGUARD_ISA_LEVEL 0  // quant_impl.inc: 0 baseline, 1 avx2, 2 avx512
#include "reduce_impl.inc"
#undef NUMGUARD_ISA_NAMESPACE
#undef NUMGUARD_ISA_NAME
#undef NUMGUARD_ISA_LEVEL
#pragma GCC pop_options

const numguard::cpu::KernelTable& numguard::cpu::baseline_kernels() {
  return isa_baseline::kTable;
}
