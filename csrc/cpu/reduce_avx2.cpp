// The CPU reduction kernels compiled for the avx2 instruction-set level (loop bodies in
// reduce_impl.inc; the level is chosen at run time by dispatch.cpp).
#include "reduce_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,popcnt")
#define NUMGUARD_ISA_NAMESPACE isa_avx2
#define NUMGUARD_ISA_NAME "avx2"
#define NUMGUARD_ISA_LEVEL 1  // quant_impl.inc: 0 baseline, 1 avx2, 2 avx512
#include "reduce_impl.inc"
#undef NUMGUARD_ISA_NAMESPACE
#undef NUMGUARD_ISA_NAME
#undef NUMGUARD_ISA_LEVEL
#pragma GCC pop_options

const numguard::cpu::KernelTable& numguard::cpu::avx2_kernels() {
  return isa_avx2::kTable;
}
#else
// Not an x86 build: this level does not exist; dispatch never selects it.
const numguard::cpu::KernelTable& numguard::cpu::avx2_kernels() {
  return baseline_kernels();
}
#endif
