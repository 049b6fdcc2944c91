"""numguard's CUDA kernels: registered for every op when the extension was built with them; their
per-thread scanning logic (csrc/cuda/stats_device.cuh) compiled for the host and checked element by
element against the shared header, on any machine with a C++ compiler; and, on a machine with a GPU,
record_ captured in a CUDA graph keeps freeze-on-trip across replays.

Set NUMGUARD_EXPECT_CUDA_KERNELS=1 to turn "built without CUDA kernels" from a skip into a failure
(scripts/check_cuda_build.sh does, so the CUDA build check can never pass by skipping).
"""
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

import numguard
from numguard import ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = ("tensor_stats", "multi_tensor_stats", "record_", "record_at_cursor_")
EXPECT_CUDA_KERNELS = os.environ.get("NUMGUARD_EXPECT_CUDA_KERNELS", "0") == "1"


def _cuda_architectures():
    """The CUDA architectures compiled into the extension, or a reason why there are none."""
    native = ops.native_module()
    if native is None:
        return [], f"the native extension is not loaded ({ops.fallback_reason()})"
    archs = list(native.cuda_architectures())
    if not archs:
        return [], (f"the extension was built without CUDA kernels (torch {torch.__version__}, "
                    f"torch.version.cuda={torch.version.cuda!r}); build with NUMGUARD_BUILD_CUDA=1 "
                    "against a CUDA build of torch to include them")
    return archs, None


def _require_cuda_kernels():
    archs, reason = _cuda_architectures()
    if reason is not None:
        if EXPECT_CUDA_KERNELS:
            pytest.fail(f"NUMGUARD_EXPECT_CUDA_KERNELS=1 but {reason}")
        pytest.skip(reason)
    return archs


def _require_gpu():
    _require_cuda_kernels()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible: the CUDA kernels are built but cannot run here")


def test_cuda_architectures_are_named_like_sm_xy():
    archs = _require_cuda_kernels()
    assert archs == sorted(set(archs), key=archs.index)  # no duplicates
    for arch in archs:
        assert arch.startswith("sm_") and arch[3:].isdigit(), archs


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_cuda_and_cpu_kernels(op):
    _require_cuda_kernels()
    name = f"numguard::{op}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), f"{name} has no CUDA kernel"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"), f"{name} has no CPU kernel"


@pytest.mark.parametrize("op", OPS)
def test_non_dense_cuda_tensors_reach_numguard_kernels(op):
    """Sparse, quantized and nested CUDA tensors get numguard's error (csrc/unsupported.cpp), not
    the dispatcher's "Could not run": checked on the dispatch table, so also without a GPU."""
    if ops.native_module() is None:
        pytest.skip(f"the native extension is not loaded ({ops.fallback_reason()})")
    name = f"numguard::{op}"
    for key in ("SparseCUDA", "SparseCsrCUDA", "QuantizedCUDA", "NestedTensorCUDA", "AutogradNestedTensor"):
        assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, key), f"{name}: nothing for {key}"


def test_native_backend_serves_the_ops():
    _require_cuda_kernels()
    assert numguard.backend() == "native"


# ------------------------------------------------------------------------------------------------
# The device scanning logic, emulated on the host: every thread of a block runs scan_chunk in turn
# (16-byte vector body, scalar head and tail, the normal-value fast path) and the per-thread results
# are merged; the result must equal the shared header's per-element FloatStatsAccum::add /
# IntStatsAccum::add_magnitude over the same elements, for every dtype, size and misalignment. Also
# whole multi-tensor launches: chunk plans and the block -> (tensor, chunk) lookup over lists with
# empty tensors, each tensor's merged blocks against the tensor's reference.

EMULATION_PRELUDE = r"""
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

// Host stand-ins for the CUDA built-ins that stats_device.cuh uses.
#define __device__
#define __host__
#define __forceinline__ inline
struct uint4 { unsigned int x, y, z, w; };
struct ThreadIndex { unsigned int x; };
static ThreadIndex threadIdx;
inline uint4 __ldg(const uint4* p) { return *p; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
template <class T> inline T max(T a, T b) { return a < b ? b : a; }
inline unsigned lanewise(unsigned a, unsigned b, int bits, bool take_min) {
  unsigned out = 0, mask = (1u << bits) - 1;
  for (int s = 0; s < 32; s += bits) {
    unsigned x = (a >> s) & mask, y = (b >> s) & mask;
    out |= ((take_min ? (x < y ? x : y) : (x < y ? y : x)) & mask) << s;
  }
  return out;
}
inline unsigned __vminu2(unsigned a, unsigned b) { return lanewise(a, b, 16, true); }
inline unsigned __vmaxu2(unsigned a, unsigned b) { return lanewise(a, b, 16, false); }
inline unsigned __vminu4(unsigned a, unsigned b) { return lanewise(a, b, 8, true); }
inline unsigned __vmaxu4(unsigned a, unsigned b) { return lanewise(a, b, 8, false); }
inline unsigned lanewise_eq(unsigned a, unsigned b, int bits) {
  unsigned out = 0, mask = (1u << bits) - 1;
  for (int s = 0; s < 32; s += bits) out |= (((a >> s) & mask) == ((b >> s) & mask) ? mask : 0u) << s;
  return out;
}
inline unsigned __vcmpeq2(unsigned a, unsigned b) { return lanewise_eq(a, b, 16); }
inline unsigned __vcmpeq4(unsigned a, unsigned b) { return lanewise_eq(a, b, 8); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned long long __ldcg(const unsigned long long* p) { return *p; }
inline unsigned atomicInc(unsigned* p, unsigned limit) {  // one block at a time: no interleaving here
  const unsigned old = *p;
  *p = old >= limit ? 0u : old + 1u;
  return old;
}

#include "stats_device.cuh"

using namespace numguard;
using namespace numguard::cuda::device;

static int failures = 0;
static long checks = 0;
static std::mt19937_64 rng(1234);

template <class Storage>
Storage float_value(int pattern, const FloatFormat& f) {
  const uint64_t sign = (rng() & 1) ? f.sign_mask : 0;
  const uint64_t normal = f.min_normal + rng() % (f.finite_limit - f.min_normal);
  if (pattern == 0) return static_cast<Storage>(sign | normal);
  if (pattern == 2) return static_cast<Storage>(rng());
  if (pattern == 3) return static_cast<Storage>(rng() % 2 ? sign : normal);  // ReLU-like: half +-0
  if (pattern == 4) return static_cast<Storage>(rng() % 64 ? 0 : normal);    // almost all zeros
  switch (rng() % 16) {  // pattern 1: mostly normal, some of every special value
    case 0: return static_cast<Storage>(sign);                                         // +-0
    case 1: return static_cast<Storage>(sign | (1 + rng() % (f.min_normal - 1)));      // subnormal
    case 2: return static_cast<Storage>(sign | f.inf_bits);                            // inf (NaN for e4m3fn)
    case 3: return static_cast<Storage>(sign | (f.sign_mask - 1));                     // NaN
    case 4: return static_cast<Storage>(sign | (f.finite_limit - 1));                  // largest finite
    default: return static_cast<Storage>(sign | normal);
  }
}

"""

SCAN_EMULATION = EMULATION_PRELUDE + r"""

template <int kThreads, class Visitor, class Accum, class Storage, class RefAdd>
void check(const char* name, const char* pattern, const Storage* p, int64_t n, int offset, RefAdd ref_add) {
  Accum total;
  total.init();
  for (unsigned t = 0; t < kThreads; ++t) {
    threadIdx.x = t;
    Visitor v;
    v.init();
    scan_chunk<kThreads>(p, n, v);
    total.merge(v.result());
  }
  Accum ref;
  ref.init();
  for (int64_t i = 0; i < n; ++i) ref_add(ref, p[i]);
  ++checks;
  if (std::memcmp(&total, &ref, sizeof(Accum)) != 0) {
    if (++failures <= 10)
      std::printf("MISMATCH %s pattern=%s n=%lld offset=%d threads=%d\n", name, pattern, (long long)n, offset, kThreads);
  }
}

const int64_t kSizes[] = {0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 255, 256, 257, 1023, 1024, 1025,
                          4095, 4096, 4097, 16389, 70001};

template <class Visitor, class Accum, class Storage, class Fill, class RefAdd>
void run(const char* name, Fill fill, RefAdd ref_add) {
  std::vector<uint4> buffer(70001 * sizeof(Storage) / 16 + 8);
  unsigned char* base = reinterpret_cast<unsigned char*>(buffer.data());
  const char* names[] = {"normal", "mixed", "random-bits", "half-zeros", "mostly-zeros"};
  for (int pattern = 0; pattern < 5; ++pattern) {
    for (int64_t n : kSizes) {
      for (int offset = 0; offset < static_cast<int>(16 / sizeof(Storage)); ++offset) {
        Storage* p = reinterpret_cast<Storage*>(base + offset * sizeof(Storage));
        for (int64_t i = 0; i < n; ++i) p[i] = fill(pattern);
        check<256, Visitor, Accum>(name, names[pattern], p, n, offset, ref_add);
        if (n <= 4097) check<32, Visitor, Accum>(name, names[pattern], p, n, offset, ref_add);
      }
    }
  }
}

template <class E>
void run_float(const char* name) {
  using Storage = typename E::Storage;
  const FloatFormat f = E::format();
  run<FloatVisitor<E>, FloatStatsAccum, Storage>(
      name, [&](int pattern) { return float_value<Storage>(pattern, f); },
      [&](FloatStatsAccum& a, Storage raw) { a.add(static_cast<uint64_t>(raw), f); });
}

template <class T, bool kIsBool = false>
void run_int(const char* name) {
  run<IntVisitor<T, kIsBool>, IntStatsAccum, T>(
      name, [](int pattern) { return static_cast<T>(pattern == 1 ? rng() % 3 : rng()); },
      [](IntStatsAccum& a, T v) {
        if (kIsBool) a.add_magnitude(v != 0 ? 1 : 0);
        else a.add_magnitude(int_magnitude(v));
      });
}

// A multi-tensor launch: chunk plans, the block -> (tensor, chunk) lookup, per-block scans merged
// per tensor, against the reference of each whole tensor.
template <class E>
void run_table(const char* name, int64_t wave, int64_t min_chunk_bytes) {
  using Storage = typename E::Storage;
  const FloatFormat f = E::format();
  const int num_tensors = 1 + static_cast<int>(rng() % 40);
  std::vector<std::vector<uint4>> buffers(num_tensors);
  std::vector<const Storage*> data(num_tensors);
  std::vector<int64_t> numel(num_tensors), chunk(num_tensors);
  std::vector<int32_t> block_start(num_tensors + 1);
  int32_t blocks = 0;
  for (int t = 0; t < num_tensors; ++t) {
    numel[t] = (rng() % 4 == 0) ? 0 : static_cast<int64_t>(rng() % 20000);
    buffers[t].resize(numel[t] * sizeof(Storage) / 16 + 2);
    Storage* p = reinterpret_cast<Storage*>(buffers[t].data()) + rng() % (16 / sizeof(Storage));
    for (int64_t i = 0; i < numel[t]; ++i) p[i] = float_value<Storage>(1, f);
    data[t] = p;
    const ChunkPlan plan = plan_chunks(numel[t], sizeof(Storage), wave, min_chunk_bytes);
    chunk[t] = plan.chunk;
    block_start[t] = blocks;
    blocks += static_cast<int32_t>(plan.blocks);
  }
  block_start[num_tensors] = blocks;
  std::vector<FloatStatsAccum> got(num_tensors);
  for (auto& a : got) a.init();
  bool covered = true;
  for (int32_t b = 0; b < blocks; ++b) {
    const int t = locate_block(block_start, num_tensors, b);
    const int64_t begin = static_cast<int64_t>(b - block_start[t]) * chunk[t];
    const int64_t count = numel[t] - begin < chunk[t] ? numel[t] - begin : chunk[t];
    // every block reads something, but the one block of an empty tensor
    if (b < block_start[t] || b >= block_start[t + 1] || (count <= 0 && numel[t] > 0)) covered = false;
    for (unsigned th = 0; th < 32; ++th) {
      threadIdx.x = th;
      FloatVisitor<E> v;
      v.init();
      scan_chunk<32>(data[t] + begin, count, v);
      got[t].merge(v.result());
    }
  }
  for (int t = 0; t < num_tensors; ++t) {
    FloatStatsAccum ref;
    ref.init();
    for (int64_t i = 0; i < numel[t]; ++i) ref.add(static_cast<uint64_t>(data[t][i]), f);
    ++checks;
    if (!covered || std::memcmp(&got[t], &ref, sizeof(ref)) != 0) {
      if (++failures <= 10)
        std::printf("MISMATCH table %s tensor %d of %d numel=%lld wave=%lld\n", name, t, num_tensors,
                    (long long)numel[t], (long long)wave);
    }
  }
}

int main() {
  for (int round = 0; round < 20; ++round) {
    for (int64_t wave : {1, 7, 396}) {
      run_table<Float32Element>("float32", wave, 64);
      run_table<Float16Element>("float16", wave, 32 * 1024);
      run_table<Float8E5M2Element>("float8_e5m2", wave, 16);
    }
  }
  run_float<Float64Element>("float64");
  run_float<Float32Element>("float32");
  run_float<Float16Element>("float16");
  run_float<BFloat16Element>("bfloat16");
  run_float<E4M3FNElement>("float8_e4m3fn");
  run_float<Float8E5M2Element>("float8_e5m2");
  run_int<int8_t>("int8");
  run_int<uint8_t>("uint8");
  run_int<int16_t>("int16");
  run_int<uint16_t>("uint16");
  run_int<int32_t>("int32");
  run_int<uint32_t>("uint32");
  run_int<int64_t>("int64");
  run_int<uint64_t>("uint64");
  run_int<uint8_t, true>("bool");
  std::printf("checked %ld scans, %d mismatches\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
"""


# Views read in place (NOTE: [strided reads]) and the one-launch finish (NOTE: [one launch per
# frame]), emulated the same way: scan_strided's offsets over random layouts (gaps, overlaps, long
# and short rows, unit and other inner strides, misaligned rows, chunks straddling rows, indices
# past 2^32) against an independent odometer walk; and a whole launch run block by block in random
# orders, through the launch counters, which must finalize each tensor once, after all of its
# partials, complete the launch once, after every record, and leave the counters zero for the next.
LAUNCH_EMULATION = EMULATION_PRELUDE + r"""
// The logical elements [begin, begin + count) of layout L, by a coordinate odometer.
template <class Storage>
void odometer_add(const Storage* base, const StridedDims& L, int64_t begin, int64_t count, const FloatFormat& f,
                  FloatStatsAccum& ref) {
  int64_t coord[kMaxStridedDims] = {};
  int64_t rest = begin;
  for (int d = 0; d + 1 < L.dims; ++d) {
    coord[d] = rest % L.sizes[d];
    rest /= L.sizes[d];
  }
  coord[L.dims - 1] = rest;
  for (int64_t k = 0; k < count; ++k) {
    int64_t off = 0;
    for (int d = 0; d < L.dims; ++d) off += coord[d] * L.strides[d];
    ref.add(static_cast<uint64_t>(base[off]), f);
    for (int d = 0; d < L.dims; ++d) {
      if (++coord[d] < L.sizes[d] || d == L.dims - 1) break;
      coord[d] = 0;
    }
  }
}

template <int kThreads, class E>
FloatStatsAccum scan_strided_block(const typename E::Storage* base, const StridedDims& L, int64_t begin,
                                   int64_t count) {
  FloatStatsAccum total;
  total.init();
  for (unsigned t = 0; t < kThreads; ++t) {
    threadIdx.x = t;
    FloatVisitor<E> v;
    v.init();
    scan_strided<kThreads>(base, L, begin, count, v);
    total.merge(v.result());
  }
  return total;
}

template <int kThreads, class E>
void check_strided(const char* name, const typename E::Storage* base, const StridedDims& L, int64_t begin,
                   int64_t count, int64_t chunk) {
  const FloatFormat f = E::format();
  FloatStatsAccum got;
  got.init();
  for (int64_t b = begin; b < begin + count; b += chunk) {
    got.merge(scan_strided_block<kThreads, E>(base, L, b, std::min(chunk, begin + count - b)));
  }
  FloatStatsAccum ref;
  ref.init();
  odometer_add(base, L, begin, count, f, ref);
  ++checks;
  if (std::memcmp(&got, &ref, sizeof(ref)) != 0 && ++failures <= 10) {
    std::printf("MISMATCH strided %s threads=%d dims=%d inner=%lld/%lld begin=%lld count=%lld chunk=%lld\n", name,
                kThreads, L.dims, (long long)L.sizes[0], (long long)L.strides[0], (long long)begin,
                (long long)count, (long long)chunk);
  }
}

template <class E>
void run_strided(const char* name) {
  using Storage = typename E::Storage;
  const FloatFormat f = E::format();
  std::vector<uint4> buffer((1 << 24) / 16 + 4);
  Storage* memory = reinterpret_cast<Storage*>(buffer.data());
  const int64_t capacity = static_cast<int64_t>(buffer.size() * 16 / sizeof(Storage)) - 16;
  for (int64_t i = 0; i < capacity + 16; ++i) memory[i] = float_value<Storage>(1, f);
  for (int round = 0; round < 300; ++round) {
    StridedDims L{};
    L.dims = 1 + static_cast<int>(rng() % kMaxStridedDims);
    int64_t numel = 1, extent = 1;
    for (int d = 0; d < L.dims; ++d) {
      const int kind = static_cast<int>(rng() % 4);
      L.sizes[d] = d == 0 && kind < 2 ? 200 + rng() % 1200 : 2 + rng() % (L.dims > 3 ? 5 : 40);
      if (d == 0) {
        L.strides[d] = kind % 2 == 0 ? 1 : 2 + rng() % 3;
      } else {  // a gap after the inner extent, or an overlap into it
        L.strides[d] = rng() % 3 == 0 ? 1 + rng() % extent : extent + 1 + rng() % 9;
      }
      numel *= L.sizes[d];
      extent += (L.sizes[d] - 1) * L.strides[d];
    }
    if (extent > capacity / 2 || numel > 400000) continue;
    const Storage* base = memory + rng() % (16 / sizeof(Storage) + 1);  // rows at every alignment
    const int64_t odd_chunk = 1 + static_cast<int64_t>(rng() % 5000);
    const int64_t chunks[] = {numel, odd_chunk, 16 * (1 + static_cast<int64_t>(rng() % 300))};
    for (int64_t chunk : chunks) {
      check_strided<256, E>(name, base, L, 0, numel, chunk);
      if (numel < 60000) check_strided<32, E>(name, base, L, 0, numel, chunk);
    }
  }
  // Logical indices past 2^32 (an overlapping view of few bytes): the 64-bit path, and the edge
  // where the 32-bit one would wrap.
  StridedDims big{};
  big.dims = 3;
  big.sizes[0] = 5, big.sizes[1] = int64_t{1} << 20, big.sizes[2] = int64_t{1} << 14;
  big.strides[0] = 1, big.strides[1] = 1, big.strides[2] = 1;
  const int64_t two32 = int64_t{1} << 32;
  for (int64_t begin : {two32 - 256 - 1000, two32 - 600, two32 - 1000, two32 + 12345, 5 * (two32 << 2) - 3000}) {
    check_strided<256, E>(name, memory, big, begin, 1000 - (begin == two32 - 600 ? 500 : 0), 1000);
  }
  StridedDims rows = big;  // the same indices over long rows
  rows.sizes[0] = 4096, rows.sizes[1] = int64_t{1} << 10;
  for (int64_t begin : {two32 - 5000, two32 + 77}) check_strided<256, E>(name, memory, rows, begin, 9000, 9000);
}

// A launch of float32 tensors run block by block in a random order, as the kernel runs them: each
// block stores its partial, then arrives at its tensor's counter; the last arrival merges the
// tensor's partials into its record and arrives at the launch counter; the last of those would run
// the frame's step.
void run_launch(std::vector<unsigned>& counters, int round) {
  using E = Float32Element;
  const FloatFormat f = E::format();
  const int num_tensors = 1 + static_cast<int>(rng() % 72);
  std::vector<std::vector<uint32_t>> data(num_tensors);
  std::vector<int64_t> chunk(num_tensors);
  std::vector<int32_t> block_start(num_tensors + 1);
  int32_t blocks = 0;
  const int64_t wave = 1 + rng() % 64;
  for (int t = 0; t < num_tensors; ++t) {
    data[t].resize(rng() % 5 == 0 ? 0 : rng() % 9000);
    for (auto& v : data[t]) v = float_value<uint32_t>(1, f);
    const ChunkPlan plan = plan_chunks(static_cast<int64_t>(data[t].size()), 4, wave, 64);
    chunk[t] = plan.chunk;
    block_start[t] = blocks;
    blocks += static_cast<int32_t>(plan.blocks);
  }
  block_start[num_tensors] = blocks;
  std::vector<Partial> workspace(blocks);
  std::vector<char> stored(blocks, 0);
  std::vector<int> finalized(num_tensors, 0);
  std::vector<FloatStatsAccum> records(num_tensors);
  int launches_done = 0;
  bool early = false;
  std::vector<int32_t> order(blocks);
  for (int32_t b = 0; b < blocks; ++b) order[b] = b;
  std::shuffle(order.begin(), order.end(), rng);
  for (int32_t b : order) {
    const int t = locate_block(block_start, num_tensors, b);
    const int64_t begin = static_cast<int64_t>(b - block_start[t]) * chunk[t];
    const int64_t left = static_cast<int64_t>(data[t].size()) - begin;
    const int64_t count = left < chunk[t] ? (left > 0 ? left : 0) : chunk[t];
    FloatStatsAccum partial;
    partial.init();
    for (unsigned th = 0; th < 32; ++th) {
      threadIdx.x = th;
      FloatVisitor<E> v;
      v.init();
      scan_chunk<32>(data[t].data() + begin, count, v);
      partial.merge(v.result());
    }
    workspace[b].f = partial;
    stored[b] = 1;
    if (!last_to_arrive(&counters[t], static_cast<unsigned>(block_start[t + 1] - block_start[t]))) continue;
    for (int32_t k = block_start[t]; k < block_start[t + 1]; ++k) early |= !stored[k];
    FloatStatsAccum merged;
    merged.init();
    for (unsigned th = 0; th < 32; ++th) {
      threadIdx.x = th;
      merged.merge(merge_partials<32, FloatStatsAccum>(workspace.data() + block_start[t],
                                                     block_start[t + 1] - block_start[t]));
    }
    records[t] = merged;
    ++finalized[t];
    if (!last_to_arrive(&counters[72], static_cast<unsigned>(num_tensors))) continue;
    for (int k = 0; k < num_tensors; ++k) early |= finalized[k] != 1;
    ++launches_done;
  }
  bool right = launches_done == 1 && !early;
  for (int t = 0; t < num_tensors; ++t) {
    FloatStatsAccum ref;
    ref.init();
    for (uint32_t v : data[t]) ref.add(v, f);
    right &= finalized[t] == 1 && std::memcmp(&records[t], &ref, sizeof(ref)) == 0;
  }
  for (unsigned c : counters) right &= c == 0;
  ++checks;
  if (!right && ++failures <= 10) {
    std::printf("MISMATCH launch round %d: %d tensors, %d blocks, launch completed %d times%s\n", round, num_tensors,
                blocks, launches_done, early ? ", a step ran before its inputs were all written" : "");
  }
}

int main() {
  run_strided<Float32Element>("float32");
  run_strided<Float16Element>("float16");
  run_strided<Float8E5M2Element>("float8_e5m2");
  run_strided<Float64Element>("float64");
  std::vector<unsigned> counters(73, 0);  // zeroed once, reused by every launch
  for (int round = 0; round < 400; ++round) run_launch(counters, round);
  std::printf("checked %ld scans and launches, %d mismatches\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
"""


def _run_emulation(tmp_path, name, source_text):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler (c++/g++, or CXX) to compile the device logic for the host")
    source = tmp_path / f"{name}.cpp"
    source.write_text(source_text)
    exe = tmp_path / name
    build = subprocess.run([cxx, "-std=c++17", "-O2", f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc' / 'cuda'}",
                            str(source), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " 0 mismatches" in run.stdout, run.stdout[-4000:]


def test_device_scan_logic_matches_the_shared_header_on_the_host(tmp_path):
    _run_emulation(tmp_path, "scan_emulation", SCAN_EMULATION)


def test_strided_reads_and_launch_counters_on_the_host(tmp_path):
    _run_emulation(tmp_path, "launch_emulation", LAUNCH_EMULATION)


# ------------------------------------------------------------------------------------------------
# On a GPU.

def _state_list(state):
    return [int(v) for v in state.cpu()]


def test_record_in_cuda_graph_freezes_on_trip_across_replays():
    _require_gpu()
    device = torch.device("cuda")
    ring, state = ops.new_ring(4, device)
    x = torch.ones(1000, device=device, dtype=torch.float16)
    y = torch.zeros(4099, device=device, dtype=torch.float32)

    # Warm up on a side stream (allocator pools, lazy init), as CUDA graph capture requires.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        numguard.record_(ring, state, [x, y], 0, 0.5)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        numguard.record_(ring, state, [x, y], 0, 0.5)

    ring.zero_()
    ops.reset_state(state)
    graph.replay()
    torch.cuda.synchronize()
    eager = numguard.multi_tensor_stats([x, y])
    assert torch.equal(ring[:2], eager)
    assert _state_list(state) == [0, -1, 0, -1]

    y[4098] = float("nan")  # the tripping frame itself is written
    graph.replay()
    torch.cuda.synchronize()
    assert _state_list(state) == [1, 1, 0, -1]
    assert ring[1, 3].item() == 1.0  # nan count of y
    frozen = ring.clone()

    # Later replays leave the ring and the state as they were, whatever the data.
    y[4098] = 0.0
    y[0] = float("-inf")
    x[0] = 40000.0  # above 0.5 * finfo(float16).max: no headroom flag once frozen
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ring, frozen)
    assert _state_list(state) == [1, 1, 0, -1]

    # Untripped again, the same graph records the new values and flags the headroom.
    ops.reset_state(state)
    graph.replay()
    torch.cuda.synchronize()
    assert _state_list(state) == [1, 1, 1, 0]
    assert torch.equal(ring[:2], numguard.multi_tensor_stats([x, y]))


def test_ops_do_not_synchronize_with_the_host():
    _require_gpu()
    device = torch.device("cuda")
    xs = [torch.randn(n, device=device) for n in (0, 1, 4097, 1 << 20)]
    ring, state = ops.new_ring(8, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        single = numguard.tensor_stats(xs[2])
        many = numguard.multi_tensor_stats(xs)
        numguard.record_(ring, state, xs, 3, 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(many[2], single)
    assert torch.equal(ring[3:7], many)
