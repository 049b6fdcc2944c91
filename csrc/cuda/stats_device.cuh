// numguard's per-thread CUDA scanning logic: element formats, what a thread does with one element
// or one 16-byte vector, and how a block's threads share a chunk. Kept apart from the kernels
// (stats_kernels.cu) and free of CUDA runtime and ATen headers, so that tests can compile it for
// the host with a few stand-ins for CUDA built-ins and check it element by element against the
// shared header (tests/test_cuda_build.py).
#pragma once

#include <cstdint>
#include <type_traits>

#include "numguard/stats_reduce.h"

namespace numguard {
namespace cuda {
namespace device {

// ---------------------------------------------------------------------------------------------
// Element formats. Namespace-scope constexpr structs cannot be read from device code, so each
// format is rebuilt here from the shared header's constexpr builder (checked equal below).

__device__ __forceinline__ FloatFormat float8_e4m3fn_format() {
  return FloatFormat{0x80, 0x7F, 0x7F, 0x08, 3, 7, false};
}

static_assert(kFloat8E4M3FNFormat.sign_mask == 0x80 && kFloat8E4M3FNFormat.finite_limit == 0x7F &&
                  kFloat8E4M3FNFormat.inf_bits == 0x7F && kFloat8E4M3FNFormat.min_normal == 0x08 &&
                  kFloat8E4M3FNFormat.mantissa_bits == 3 && kFloat8E4M3FNFormat.exponent_bias == 7 &&
                  !kFloat8E4M3FNFormat.has_inf,
              "float8_e4m3fn_format() must match kFloat8E4M3FNFormat");

// Traits of a floating element: storage type, lane masks and the format.
template <typename StorageT, int kExponentBits, int kMantissaBits>
struct IeeeElement {
  using Storage = StorageT;
  static constexpr uint64_t kMagnitudeMask = (uint64_t{1} << (kExponentBits + kMantissaBits)) - 1;
  static constexpr uint64_t kMinNormal = uint64_t{1} << kMantissaBits;
  static constexpr uint64_t kFiniteLimit = ((uint64_t{1} << kExponentBits) - 1) << kMantissaBits;
  __device__ __forceinline__ static FloatFormat format() { return ieee_format(kExponentBits, kMantissaBits); }
};

struct E4M3FNElement {
  using Storage = uint8_t;
  static constexpr uint64_t kMagnitudeMask = 0x7F;
  static constexpr uint64_t kMinNormal = 0x08;
  static constexpr uint64_t kFiniteLimit = 0x7F;
  __device__ __forceinline__ static FloatFormat format() { return float8_e4m3fn_format(); }
};

using Float64Element = IeeeElement<uint64_t, 11, 52>;
using Float32Element = IeeeElement<uint32_t, 8, 23>;
using Float16Element = IeeeElement<uint16_t, 5, 10>;
using BFloat16Element = IeeeElement<uint16_t, 8, 7>;
using Float8E5M2Element = IeeeElement<uint8_t, 5, 2>;

static_assert(Float32Element::kFiniteLimit == kFloat32Format.finite_limit &&
                  Float32Element::kMinNormal == kFloat32Format.min_normal &&
                  Float16Element::kFiniteLimit == kFloat16Format.finite_limit &&
                  BFloat16Element::kMinNormal == kBFloat16Format.min_normal &&
                  Float8E5M2Element::kFiniteLimit == kFloat8E5M2Format.finite_limit &&
                  Float64Element::kMinNormal == kFloat64Format.min_normal,
              "element traits must match the shared formats");

// ---------------------------------------------------------------------------------------------
// Visitors: what a thread does with one element (scalar) or one 16-byte vector.

// NOTE: [vector fast path]
// For a 16-byte vector the thread first takes the unsigned max of its lanes' magnitude bits, the
// min of its non-zero lanes' and the count of its zero lanes (packed SIMD for 8- and 16-bit lanes).
// When that min >= min_normal and max < finite_limit, every lane is zero or normal and finite, so
// the vector changes only the running min/max magnitude and the zero count: that is all the work
// done for typical data, ReLU outputs with their many zeros included. Any other vector (a
// subnormal, Inf or NaN among its lanes) goes lane by lane through the shared FloatStatsAccum::add.
template <typename E>
struct FloatVisitor {
  using Storage = typename E::Storage;
  FloatStatsAccum acc;
  uint64_t fast_min;  // over the fast path's non-zero lanes
  uint64_t fast_max;
  int64_t fast_zero;  // the fast path's zero lanes

  __device__ __forceinline__ void init() {
    acc.init();
    fast_min = ~uint64_t{0};
    fast_max = 0;
    fast_zero = 0;
  }

  __device__ __forceinline__ void scalar(Storage raw) { acc.add(static_cast<uint64_t>(raw), E::format()); }

  __device__ __forceinline__ void slow_vector(const uint4& v) {
    union {
      uint4 vec;
      Storage lanes[16 / sizeof(Storage)];
    } u;
    u.vec = v;
    const FloatFormat f = E::format();
#pragma unroll
    for (int i = 0; i < static_cast<int>(16 / sizeof(Storage)); ++i) acc.add(static_cast<uint64_t>(u.lanes[i]), f);
  }

  __device__ __forceinline__ void vector(const uint4& v) {
    uint64_t lo, hi;  // min magnitude of the non-zero lanes (all ones when none), max magnitude
    int zeros;
    if constexpr (sizeof(Storage) == 1) {
      const uint32_t m = static_cast<uint32_t>(E::kMagnitudeMask) * 0x01010101u;
      const uint32_t a = v.x & m, b = v.y & m, c = v.z & m, d = v.w & m;
      // A zero lane's comparison mask is all ones: or-ed in, it never wins the min.
      const uint32_t za = __vcmpeq4(a, 0u), zb = __vcmpeq4(b, 0u), zc = __vcmpeq4(c, 0u), zd = __vcmpeq4(d, 0u);
      zeros = (__popc(za) + __popc(zb) + __popc(zc) + __popc(zd)) / 8;
      uint32_t mn = __vminu4(__vminu4(a | za, b | zb), __vminu4(c | zc, d | zd));
      uint32_t mx = __vmaxu4(__vmaxu4(a, b), __vmaxu4(c, d));
      mn = __vminu4(mn, mn >> 16);
      mx = __vmaxu4(mx, mx >> 16);
      mn = __vminu4(mn, mn >> 8);
      mx = __vmaxu4(mx, mx >> 8);
      lo = mn & 0xFF;
      hi = mx & 0xFF;
    } else if constexpr (sizeof(Storage) == 2) {
      const uint32_t m = static_cast<uint32_t>(E::kMagnitudeMask) * 0x00010001u;
      const uint32_t a = v.x & m, b = v.y & m, c = v.z & m, d = v.w & m;
      const uint32_t za = __vcmpeq2(a, 0u), zb = __vcmpeq2(b, 0u), zc = __vcmpeq2(c, 0u), zd = __vcmpeq2(d, 0u);
      zeros = (__popc(za) + __popc(zb) + __popc(zc) + __popc(zd)) / 16;
      const uint32_t mn = __vminu2(__vminu2(a | za, b | zb), __vminu2(c | zc, d | zd));
      const uint32_t mx = __vmaxu2(__vmaxu2(a, b), __vmaxu2(c, d));
      lo = min(mn & 0xFFFFu, mn >> 16);
      hi = max(mx & 0xFFFFu, mx >> 16);
    } else if constexpr (sizeof(Storage) == 4) {
      const uint32_t m = static_cast<uint32_t>(E::kMagnitudeMask);
      const uint32_t a = v.x & m, b = v.y & m, c = v.z & m, d = v.w & m;
      constexpr uint32_t kNone = ~0u;
      zeros = (a == 0) + (b == 0) + (c == 0) + (d == 0);
      lo = min(min(a ? a : kNone, b ? b : kNone), min(c ? c : kNone, d ? d : kNone));
      hi = max(max(a, b), max(c, d));
    } else {
      const uint64_t a = ((static_cast<uint64_t>(v.y) << 32) | v.x) & E::kMagnitudeMask;
      const uint64_t b = ((static_cast<uint64_t>(v.w) << 32) | v.z) & E::kMagnitudeMask;
      constexpr uint64_t kNone = ~uint64_t{0};
      zeros = (a == 0) + (b == 0);
      const uint64_t a_nz = a ? a : kNone, b_nz = b ? b : kNone;
      lo = a_nz < b_nz ? a_nz : b_nz;
      hi = a < b ? b : a;
    }
    if (lo >= E::kMinNormal && hi < E::kFiniteLimit) {
      fast_min = lo < fast_min ? lo : fast_min;  // all-zero vectors leave it (their lo is all ones)
      fast_max = hi > fast_max ? hi : fast_max;
      fast_zero += zeros;
    } else {
      slow_vector(v);
    }
  }

  __device__ __forceinline__ FloatStatsAccum result() {
    if (fast_max != 0) acc.add_normal_range(fast_min, fast_max);
    acc.add_zeros(fast_zero);
    return acc;
  }
};

// Integers and bool: values, as unsigned magnitudes (no non-finite, no fast path needed). bool is
// read as its byte, any non-zero byte being true.
template <typename T, bool kIsBool = false>
struct IntVisitor {
  using Storage = T;
  IntStatsAccum acc;

  __device__ __forceinline__ void init() { acc.init(); }

  __device__ __forceinline__ void scalar(T v) {
    if constexpr (kIsBool) {
      acc.add_magnitude(v != 0 ? 1 : 0);
    } else if constexpr (std::is_unsigned<T>::value) {
      acc.add_magnitude(static_cast<uint64_t>(v));
    } else {
      acc.add_magnitude(int_magnitude(v));
    }
  }

  __device__ __forceinline__ void vector(const uint4& v) {
    union {
      uint4 vec;
      T lanes[16 / sizeof(T)];
    } u;
    u.vec = v;
#pragma unroll
    for (int i = 0; i < static_cast<int>(16 / sizeof(T)); ++i) scalar(u.lanes[i]);
  }

  __device__ __forceinline__ IntStatsAccum result() { return acc; }
};

// ---------------------------------------------------------------------------------------------
// Scanning a chunk: scalar head up to 16-byte alignment, unrolled vector body, scalar tail.

constexpr int kUnroll = 4;  // vectors in flight per thread

// Thread threadIdx.x of a block of kThreads threads scans its share of the n elements at p.
template <int kThreads, typename Visitor, typename Storage>
__device__ __forceinline__ void scan_chunk(const Storage* p, int64_t n, Visitor& vis) {
  constexpr int kLanes = 16 / sizeof(Storage);
  const int tid = threadIdx.x;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  int64_t head = static_cast<int64_t>(((16 - (addr & 15)) & 15) / sizeof(Storage));
  if (head > n) head = n;
  if (tid < head) vis.scalar(p[tid]);
  const uint4* vec = reinterpret_cast<const uint4*>(p + head);
  const int64_t num_vec = (n - head) / kLanes;
  for (int64_t base = tid; base < num_vec; base += static_cast<int64_t>(kUnroll) * kThreads) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = base + static_cast<int64_t>(u) * kThreads;
      if (k < num_vec) r[u] = __ldg(vec + k);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + static_cast<int64_t>(u) * kThreads < num_vec) vis.vector(r[u]);
    }
  }
  for (int64_t i = head + num_vec * kLanes + tid; i < n; i += kThreads) vis.scalar(p[i]);
}

// ---------------------------------------------------------------------------------------------
// Reading a non-dense view in place (NOTE: [strided reads]).

// NOTE: [strided reads]
// A view that the stride analysis cannot collapse to one dense span (a slice with gaps, a column,
// an overlapping as_strided; NOTE: [layouts] in numguard/host_checks.h) is read where it lies: its
// merged dims, innermost first, travel in the launch table, and a block maps each logical element
// index of its chunk (row-major over the merged dims) to a memory offset. Long rows (at least one
// element per thread) are walked row by row, the whole block on one row, so unit-stride rows keep
// the 16-byte vector loads and the fast path; short rows take one offset per element, with 32-bit
// division whenever the chunk's indices fit. Only a view with more merged dims than
// kMaxStridedDims is still copied to a dense temporary first (ops_cuda.cu).
constexpr int kMaxStridedDims = 6;

struct StridedDims {
  int64_t sizes[kMaxStridedDims];    // innermost first
  int64_t strides[kMaxStridedDims];  // in elements, >= 0
  int32_t dims;                      // 1..kMaxStridedDims
};

// Memory offset (elements) of index i over dims [first, dims) of L: each dim but the outermost by
// division, the outermost by multiplication. Unrolled over kMaxStridedDims, so that L (a kernel
// argument) is only read at constant indices.
template <typename Index>
__device__ __forceinline__ int64_t strided_offset(const StridedDims& L, Index i, int first) {
  int64_t offset = 0;
#pragma unroll
  for (int d = 0; d < kMaxStridedDims; ++d) {
    if (d < first || d >= L.dims) continue;
    if (d == L.dims - 1) {
      offset += static_cast<int64_t>(i) * L.strides[d];
    } else {
      const Index size = static_cast<Index>(L.sizes[d]);
      const Index q = i / size;
      offset += static_cast<int64_t>(i - q * size) * L.strides[d];
      i = q;
    }
  }
  return offset;
}

// Thread threadIdx.x of a block of kThreads threads scans its share of logical elements
// [begin, begin + count) of the view at base with merged dims L.
template <int kThreads, typename Visitor, typename Storage>
__device__ __forceinline__ void scan_strided(const Storage* base, const StridedDims& L, int64_t begin, int64_t count,
                                             Visitor& vis) {
  const int64_t inner = L.sizes[0];
  const int64_t inner_stride = L.strides[0];
  const int tid = threadIdx.x;
  if (inner >= kThreads) {
    int64_t row = begin / inner;
    int64_t col = begin - row * inner;
    for (int64_t left = count; left > 0; ++row, col = 0) {
      const int64_t take = inner - col < left ? inner - col : left;
      const Storage* p = base + strided_offset<uint64_t>(L, static_cast<uint64_t>(row), 1) + col * inner_stride;
      if (inner_stride == 1) {
        scan_chunk<kThreads>(p, take, vis);
      } else {
        for (int64_t j = tid; j < take; j += kThreads) vis.scalar(p[j * inner_stride]);
      }
      left -= take;
    }
  } else if (begin + count + kThreads <= (int64_t{1} << 32)) {  // no index wraps past 2^32 - 1
    const uint32_t end = static_cast<uint32_t>(begin + count);
    for (uint32_t i = static_cast<uint32_t>(begin) + tid; i < end; i += kThreads) {
      vis.scalar(base[strided_offset<uint32_t>(L, i, 0)]);
    }
  } else {
    const uint64_t end = static_cast<uint64_t>(begin + count);
    for (uint64_t i = static_cast<uint64_t>(begin) + tid; i < end; i += kThreads) {
      vis.scalar(base[strided_offset<uint64_t>(L, i, 0)]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The multi-tensor launch shape (NOTE: [multi-tensor table] in stats_launch.cuh).

// Elements per block and number of blocks of one tensor: a large tensor spreads over about one
// wave of blocks (`wave` blocks fit on the device at once), a small one is read by one block, and
// an empty one owns one block too (which reads nothing), since a tensor's last block writes its
// record (NOTE: [one launch per frame]). Chunks are whole 16-byte multiples, so every chunk of a
// dense tensor has the same alignment.
struct ChunkPlan {
  int64_t chunk;   // elements per block (>= 1)
  int64_t blocks;  // >= 1
};

inline ChunkPlan plan_chunks(int64_t numel, int64_t element_size, int64_t wave, int64_t min_chunk_bytes) {
  if (numel <= 0) return ChunkPlan{1, 1};
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t bytes = numel * element_size;
  int64_t chunk_bytes = ceil_div(bytes, wave > 0 ? wave : 1);
  if (chunk_bytes < min_chunk_bytes) chunk_bytes = min_chunk_bytes;
  chunk_bytes = ceil_div(chunk_bytes, 16) * 16;
  const int64_t chunk = chunk_bytes / element_size > 0 ? chunk_bytes / element_size : 1;
  return ChunkPlan{chunk, ceil_div(numel, chunk)};
}

// The tensor that block b of a launch reads: the last one whose first block is <= b.
template <typename BlockStarts>
__device__ __forceinline__ int locate_block(const BlockStarts& block_start, int num_tensors, int32_t b) {
  int lo = 0, hi = num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (block_start[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// ---------------------------------------------------------------------------------------------
// Partials and the last block of a tensor (NOTE: [one launch per frame] in stats_kernels.cu).

// One block's partial stats: a FloatStatsAccum or an IntStatsAccum, 64 bytes.
constexpr int kPartialWords = 8;
union Partial {
  FloatStatsAccum f;
  IntStatsAccum i;
  unsigned long long words[kPartialWords];
};
static_assert(sizeof(Partial) == kPartialWords * sizeof(int64_t), "a partial is 64 bytes");

// A partial another block wrote, read past this SM's L1 (after the acquire fence).
__device__ __forceinline__ Partial load_partial(const Partial* p) {
  Partial out;
#pragma unroll
  for (int w = 0; w < kPartialWords; ++w) out.words[w] = __ldcg(p->words + w);
  return out;
}

// Thread threadIdx.x's share of the merge of `count` partials from `first`, as Accum (a
// FloatStatsAccum or an IntStatsAccum); a block reduction of the per-thread results completes it
// (merges are exact in any order: NOTE: [magnitude bits]).
template <int kThreads, typename Accum>
__device__ __forceinline__ Accum merge_partials(const Partial* first, int64_t count) {
  Accum acc;
  acc.init();
  for (int64_t i = threadIdx.x; i < count; i += kThreads) {
    const Partial p = load_partial(first + i);
    if constexpr (std::is_same<Accum, FloatStatsAccum>::value) {
      acc.merge(p.f);
    } else {
      acc.merge(p.i);
    }
  }
  return acc;
}

// One arrival of `expected` at a launch counter (called by one thread per block). True for the
// last arrival, which also wraps the counter back to zero (atomicInc's wrap-around), so a counter
// is zero again after every launch that used it (NOTE: [launch counters] in ops_cuda.cu).
__device__ __forceinline__ bool last_to_arrive(unsigned int* counter, unsigned int expected) {
  return atomicInc(counter, expected - 1) == expected - 1;
}

}  // namespace device
}  // namespace cuda
}  // namespace numguard
