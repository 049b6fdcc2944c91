// CPU implementations of numguard's ops: tensor_stats, multi_tensor_stats, record_, record_at_cursor_.
//
// A tensor becomes a `Plan`: its element kind and how to walk its memory without a copy
// (NOTE: [layouts] in numguard/host_checks.h, which also holds the dtype table, the input rule and
// its messages, and the ring/state checks shared with the CUDA ops). The work of one call, over
// all its tensors, is a flat list of fixed-size chunks; chunks run on at::parallel_for and each
// fills its own partial accumulator, and a tensor's partials are merged in chunk order.
// Accumulators merge exactly (NOTE: [magnitude bits] in numguard/stats_reduce.h), so records are
// identical for any thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "numguard/host_checks.h"
#include "numguard/quant.h"
#include "numguard/stats_reduce.h"
#include "quant_ops.h"
#include "reduce_kernels.h"
#include "stats_ops.h"

namespace numguard {
namespace cpu {
namespace {

// A tensor as the CPU kernels walk it (NOTE: [layouts] in numguard/host_checks.h): a dense span
// base[0, numel) when `sizes` is empty, else runs of its innermost merged dim; long unit-stride
// runs are reduced in place, short or strided runs are gathered into a small local buffer first.
// No layout needs a full copy.
struct Plan {
  const char* base = nullptr;
  int64_t numel = 0;   // elements visited (stride-0 dims excluded)
  int64_t repeat = 1;  // product of the sizes of stride-0 dims
  DtypeInfo info{};
  c10::SmallVector<int64_t, 6> sizes;    // empty: dense span base[0, numel)
  c10::SmallVector<int64_t, 6> strides;  // in elements, outermost first
  int64_t chunk_elems = 0;
  int64_t num_chunks = 0;
  at::Tensor aligned_copy;  // holds the bytes of a misaligned tensor (NOTE: [element alignment])
};

Plan make_plan(const at::Tensor& input, const DtypeInfo& info) {
  Plan plan;
  plan.info = info;
  const at::Tensor x = element_aligned(input);
  if (!x.is_same(input)) plan.aligned_copy = x;
  plan.chunk_elems = kChunkBytes / info.elem_size;
  StrideLayout layout = analyze_strides(x);
  if (layout.numel == 0) return plan;  // numel 0, no chunks: the empty record
  plan.base = static_cast<const char*>(x.const_data_ptr());
  plan.numel = layout.numel;
  plan.repeat = layout.repeat;
  plan.sizes = std::move(layout.sizes);
  plan.strides = std::move(layout.strides);
  plan.num_chunks = (plan.numel + plan.chunk_elems - 1) / plan.chunk_elems;
  return plan;
}

struct Partial {
  FloatStatsAccum f;
  IntStatsAccum i;
  void init() {
    f.init();
    i.init();
  }
};

void reduce_contiguous(const KernelTable& k, ElementKind kind, const FloatFormat* fmt, const void* p, int64_t n,
                       Partial& acc) {
  switch (kind) {
    case ElementKind::kFloat64: k.float64(static_cast<const uint64_t*>(p), n, *fmt, acc.f); break;
    case ElementKind::kFloat32: k.float32(static_cast<const uint32_t*>(p), n, *fmt, acc.f); break;
    case ElementKind::kFloat16:
    case ElementKind::kBFloat16: k.float16(static_cast<const uint16_t*>(p), n, *fmt, acc.f); break;
    case ElementKind::kFloat8E4M3FN:
    case ElementKind::kFloat8E5M2: k.float8(static_cast<const uint8_t*>(p), n, *fmt, acc.f); break;
    case ElementKind::kInt8: k.int8(static_cast<const int8_t*>(p), n, acc.i); break;
    case ElementKind::kInt16: k.int16(static_cast<const int16_t*>(p), n, acc.i); break;
    case ElementKind::kInt32: k.int32(static_cast<const int32_t*>(p), n, acc.i); break;
    case ElementKind::kInt64: k.int64(static_cast<const int64_t*>(p), n, acc.i); break;
    case ElementKind::kUInt8: k.uint8(static_cast<const uint8_t*>(p), n, acc.i); break;
    case ElementKind::kUInt16: k.uint16(static_cast<const uint16_t*>(p), n, acc.i); break;
    case ElementKind::kUInt32: k.uint32(static_cast<const uint32_t*>(p), n, acc.i); break;
    case ElementKind::kUInt64: k.uint64(static_cast<const uint64_t*>(p), n, acc.i); break;
    case ElementKind::kBool: k.boolean(static_cast<const uint8_t*>(p), n, acc.i); break;
  }
}

// Walks logical elements [begin, end) of a non-dense plan (NOTE: [layouts]).
template <typename E>
void reduce_strided(const KernelTable& k, const Plan& plan, int64_t begin, int64_t end, Partial& acc) {
  const int nd = static_cast<int>(plan.sizes.size());
  const int inner = nd - 1;
  const E* base = reinterpret_cast<const E*>(plan.base);
  int64_t idx_inline[16] = {};
  std::vector<int64_t> idx_heap;  // only for tensors of more than 16 non-trivial dims
  if (nd > 16) idx_heap.assign(nd, 0);
  int64_t* idx = nd > 16 ? idx_heap.data() : idx_inline;
  int64_t offset = 0;
  int64_t rem = begin;
  for (int d = inner; d >= 0; --d) {
    idx[d] = rem % plan.sizes[d];
    rem /= plan.sizes[d];
    offset += idx[d] * plan.strides[d];
  }
  alignas(64) E buffer[kGatherBytes / sizeof(E)];
  constexpr int64_t kCap = kGatherBytes / sizeof(E);
  int64_t buffered = 0;
  const int64_t inner_size = plan.sizes[inner];
  const int64_t inner_stride = plan.strides[inner];
  for (int64_t pos = begin; pos < end;) {
    const int64_t left_in_row = inner_size - idx[inner];
    const int64_t run = left_in_row < end - pos ? left_in_row : end - pos;
    const E* src = base + offset;
    if (inner_stride == 1 && run >= kDirectRunElements) {
      reduce_contiguous(k, plan.info.kind, plan.info.format, src, run, acc);
    } else {
      for (int64_t j = 0; j < run;) {
        const int64_t take = std::min(run - j, kCap - buffered);
        for (int64_t t = 0; t < take; ++t) buffer[buffered + t] = src[(j + t) * inner_stride];
        buffered += take;
        j += take;
        if (buffered == kCap) {
          reduce_contiguous(k, plan.info.kind, plan.info.format, buffer, buffered, acc);
          buffered = 0;
        }
      }
    }
    pos += run;
    idx[inner] += run;
    offset += run * inner_stride;
    for (int d = inner; d > 0 && idx[d] == plan.sizes[d]; --d) {
      offset -= idx[d] * plan.strides[d];
      idx[d] = 0;
      ++idx[d - 1];
      offset += plan.strides[d - 1];
    }
  }
  if (buffered > 0) reduce_contiguous(k, plan.info.kind, plan.info.format, buffer, buffered, acc);
}

void reduce_chunk(const KernelTable& k, const Plan& plan, int64_t chunk, Partial& acc) {
  const int64_t begin = chunk * plan.chunk_elems;
  const int64_t end = std::min(plan.numel, begin + plan.chunk_elems);
  if (plan.sizes.empty()) {
    reduce_contiguous(k, plan.info.kind, plan.info.format, plan.base + begin * plan.info.elem_size, end - begin,
                      acc);
    return;
  }
  switch (plan.info.elem_size) {
    case 1: reduce_strided<uint8_t>(k, plan, begin, end, acc); break;
    case 2: reduce_strided<uint16_t>(k, plan, begin, end, acc); break;
    case 4: reduce_strided<uint32_t>(k, plan, begin, end, acc); break;
    default: reduce_strided<uint64_t>(k, plan, begin, end, acc); break;
  }
}

void finalize(const Plan& plan, const Partial& acc, double* out) {
  if (plan.numel == 0) {
    empty_record(out);
  } else if (plan.info.format != nullptr) {
    acc.f.finalize(*plan.info.format, plan.repeat, out);
  } else {
    acc.i.finalize(plan.repeat, out);
  }
}

// Records of every plan into out[n][kNumStats]. Allocates two vectors for the whole call.
void compute_records(const std::vector<Plan>& plans, double* out) {
  const int64_t n = static_cast<int64_t>(plans.size());
  std::vector<int64_t> first_chunk(n + 1, 0);
  int64_t total_bytes = 0;
  for (int64_t i = 0; i < n; ++i) {
    first_chunk[i + 1] = first_chunk[i] + plans[i].num_chunks;
    total_bytes += plans[i].numel * plans[i].info.elem_size;
  }
  const int64_t total_chunks = first_chunk[n];
  std::vector<Partial> partials(total_chunks);
  const KernelTable& k = active_kernels();
  auto run = [&](int64_t begin, int64_t end) {
    // The plan holding chunk `begin`: the last i with first_chunk[i] <= begin (skipping empty plans).
    int64_t i = std::upper_bound(first_chunk.begin(), first_chunk.end(), begin) - first_chunk.begin() - 1;
    for (int64_t c = begin; c < end; ++c) {
      while (c >= first_chunk[i + 1]) ++i;
      Partial& acc = partials[c];
      acc.init();
      reduce_chunk(k, plans[i], c - first_chunk[i], acc);
    }
  };
  if (total_bytes < kParallelMinBytes || total_chunks <= 1) {
    run(0, total_chunks);
  } else {
    at::parallel_for(0, total_chunks, 1, run);
  }
  for (int64_t i = 0; i < n; ++i) {
    Partial acc;
    acc.init();
    for (int64_t c = first_chunk[i]; c < first_chunk[i + 1]; ++c) {  // chunk order
      acc.f.merge(partials[c].f);
      acc.i.merge(partials[c].i);
    }
    finalize(plans[i], acc, out + i * kNumStats);
  }
}

std::vector<Plan> make_plans(at::TensorList xs, const char* what) {
  check_same_device(xs, what);
  std::vector<Plan> plans;
  plans.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) plans.push_back(make_plan(xs[i], check_input(xs[i], what, i)));
  return plans;
}

at::Tensor tensor_stats_cpu(const at::Tensor& x) {
  std::vector<Plan> plans;
  plans.push_back(make_plan(x, check_input(x, "x", -1)));
  at::Tensor out = at::empty({kNumStats}, x.options().dtype(at::kDouble));
  compute_records(plans, out.mutable_data_ptr<double>());
  return out;
}

at::Tensor multi_tensor_stats_cpu(at::TensorList xs) {
  const std::vector<Plan> plans = make_plans(xs, "xs");
  at::Tensor out = at::empty({static_cast<int64_t>(xs.size()), kNumStats}, at::TensorOptions().dtype(at::kDouble));
  if (!plans.empty()) compute_records(plans, out.mutable_data_ptr<double>());
  return out;
}

// The shared step of record_ and record_at_cursor_: update `state` over the records of `plans`
// (positions position + i) and write them to the ring, unless it was frozen by an earlier trip.
// `known`: the plans' records when the caller computed them. Returns whether it was not frozen.
bool record_frame(const at::Tensor& ring, const at::Tensor& state, const std::vector<Plan>& plans, int64_t position,
                  double headroom, int64_t context, const double* known = nullptr) {
  auto state_acc = state.accessor<int64_t, 1>();
  if (state_acc[kTripped] != 0) return false;  // frozen: nothing is written, state is final
  const int64_t n = static_cast<int64_t>(plans.size());
  std::vector<double> computed;
  if (known == nullptr) {
    computed.resize(n * kNumStats);
    if (n > 0) compute_records(plans, computed.data());
  }
  const double* records = known != nullptr ? known : computed.data();
  std::vector<double> max_values(n);
  for (int64_t i = 0; i < n; ++i) max_values[i] = headroom_limit(plans[i].info.kind);
  int64_t st[kStateSize];
  for (int j = 0; j < kStateSize; ++j) st[j] = state_acc[j];
  const bool write = update_recording_state(st, records, max_values.data(), n, position, headroom, context);
  for (int j = 0; j < kStateSize; ++j) state_acc[j] = st[j];
  if (!write) return false;
  auto ring_acc = ring.accessor<double, 2>();
  const int64_t rows = ring.size(0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = ring_row(position + i, rows);
    for (int j = 0; j < kNumStats; ++j) ring_acc[row][j] = records[i * kNumStats + j];
  }
  return true;
}

}  // namespace

// NOTE: [quant in the stats call] watch(quant=)'s what-if of a frame's outputs rides on record_:
// the stats pass already finds each tensor's largest finite |x| and its NaN/Inf counts, which are
// what current scaling (and NVFP4's global scale) needs, so the measurement reads the tensor once
// more where quant_watch_ reads it twice. The records are quant_watch_'s bit for bit (the same
// amax: the stats' abs_max is the exact float32 value). A frozen ring still measures: the what-if
// is not the NaN check, and it goes on after a trip as quant_watch_ does.
void record_cpu(const at::Tensor& ring, const at::Tensor& state, at::TensorList xs, int64_t position,
                double headroom, int64_t context, const std::optional<at::Tensor>& quant_sums, int64_t quant_row,
                int64_t quant_format, at::IntArrayRef quant_xs, const std::optional<at::Tensor>& quant_records) {
  check_ring_and_state(ring, state, at::kCPU, /*contiguous=*/false);
  check_on_ring_device(xs, ring);
  const bool quant = quant_sums.has_value() && quant_sums->defined();
  const at::Tensor out_records = quant && quant_records.has_value() ? *quant_records : at::Tensor();
  if (quant) {
    check_record_quant_args(*quant_sums, quant_row, quant_format, kQuantNvfp4 + 1, quant_xs, xs, out_records);
  }
  if (xs.empty()) return;
  const std::vector<Plan> plans = make_plans(xs, "xs");
  if (!quant || quant_xs.empty()) {
    record_frame(ring, state, plans, position, headroom, context);
    return;
  }
  std::vector<double> records(plans.size() * kNumStats);
  compute_records(plans, records.data());
  record_frame(ring, state, plans, position, headroom, context, records.data());
  double* sums_row = quant_sums->mutable_data_ptr<double>() + quant_row * kQuantSummedFields;
  double scratch[kNumQuantFields];
  for (size_t j = 0; j < quant_xs.size(); ++j) {
    const double* stats = records.data() + quant_xs[j] * kNumStats;
    const bool any_nonfinite = stats[kNan] + stats[kPosInf] + stats[kNegInf] > 0.0;
    double* record = out_records.defined() ? out_records.mutable_data_ptr<double>() + j * kNumQuantFields : scratch;
    quant_watch_from_stats(quant_format, xs[quant_xs[j]], static_cast<float>(stats[kAbsMax]), any_nonfinite, record,
                           sums_row);
  }
}

// record_at_cursor_ (csrc/ops.cpp): the frame starts at the cursor's position; a frame recorded
// while the ring is frozen leaves cursor and log as they were.
void record_at_cursor_cpu(const at::Tensor& ring, const at::Tensor& state, const at::Tensor& cursor,
                          const at::Tensor& log, at::TensorList xs, int64_t slot, double headroom,
                          int64_t context) {
  check_ring_and_state(ring, state, at::kCPU, /*contiguous=*/false);
  check_cursor_and_log(cursor, log, ring);
  check_on_ring_device(xs, ring);
  const std::vector<Plan> plans = make_plans(xs, "xs");
  int64_t* cur = cursor.mutable_data_ptr<int64_t>();
  if (!record_frame(ring, state, plans, cur[kCursorPosition], headroom, context)) return;
  const GraphCall call = claim_graph_call(cur, static_cast<int64_t>(plans.size()));
  log_graph_call(call, cur, log.mutable_data_ptr<int64_t>(), log.size(0), slot);
}

}  // namespace cpu
}  // namespace numguard

TORCH_LIBRARY_IMPL(numguard, CPU, m) {
  m.impl("tensor_stats", &numguard::cpu::tensor_stats_cpu);
  m.impl("multi_tensor_stats", &numguard::cpu::multi_tensor_stats_cpu);
  m.impl("record_", &numguard::cpu::record_cpu);
  m.impl("record_at_cursor_", &numguard::cpu::record_at_cursor_cpu);
}
