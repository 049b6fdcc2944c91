// The CPU reduction kernels compiled for the avx512 instruction-set level (loop bodies in
// reduce_impl.inc; the level is chosen at run time by dispatch.cpp).
#include "reduce_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,popcnt,prefer-vector-width=512")
#define NUMGUARD_ISA_NAMESPACE isa_avx512
#define NUMGUARD_ISA_NAME "avx512"
#define NUMGUARD_ISA_LEVEL 2  // quant_impl.inc: 0 baseline, 1 avx2, 2 avx512
#include "reduce_impl.inc"
#undef NUMGUARD_ISA_NAMESPACE
#undef NUMGUARD_ISA_NAME
#undef NUMGUARD_ISA_LEVEL
#pragma GCC pop_options

const numguard::cpu::KernelTable& numguard::cpu::avx512_kernels() {
  return isa_avx512::kTable;
}
#else
// Not an x86 build: this level does not exist; dispatch never selects it.
const numguard::cpu::KernelTable& numguard::cpu::avx512_kernels() {
  return baseline_kernels();
}
#endif
