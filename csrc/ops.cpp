// Every numguard op schema, declared once. Device files only register implementations
// (csrc/cpu: TORCH_LIBRARY_IMPL(numguard, CPU, m); csrc/cuda: TORCH_LIBRARY_IMPL(numguard, CUDA, m)).
//
// The Python module `numguard._C` exists so that importing it runs these static registrations; its
// only functions are host-side helpers that are not tensor ops.
#include <torch/extension.h>

#include <iterator>
#include <string>
#include <tuple>
#include <vector>

#include "numguard/build_info.h"
#include "numguard/host_checks.h"
#include "numguard/fingerprint.h"
#include "numguard/stats_reduce.h"

TORCH_LIBRARY(numguard, m) {
  // float64[8] record of x (see numguard.STAT_FIELDS). Never synchronizes with the host.
  m.def("tensor_stats(Tensor x) -> Tensor");
  // float64[len(xs), 8]: one record per tensor, in one pass per tensor (one launch on CUDA).
  m.def("multi_tensor_stats(Tensor[] xs) -> Tensor");
  // Write the records of xs into ring[(position + i) % ring.size(0)] unless state says the ring
  // is tripped (frozen); then trip it if any record holds NaN/Inf, and flag low-precision tensors
  // whose abs max exceeds headroom * finfo.max (headroom <= 0 disables that check). The first
  // `context` xs are context: they trip only with a later one (NOTE: [context records]).
  // ring: float64[R, 8]; state: int64[4] (see StateField in numguard/stats_reduce.h).
  // With quant_sums (watch(quant=), NOTE: [quant in the stats call]): the tensors xs[quant_xs] are
  // also measured as quant_watch_(quant_sums, quant_row, xs[quant_xs], quant_format) measures them,
  // their records written to quant_records (float64[len(quant_xs), 10]) when given, in the same
  // call, frozen ring or not.
  m.def("record_(Tensor(a!) ring, Tensor(b!) state, Tensor[] xs, int position, float headroom, int context=0, "
        "Tensor(c!)? quant_sums=None, int quant_row=0, int quant_format=-1, int[] quant_xs=[], "
        "Tensor(d!)? quant_records=None) -> ()");

  // float64[10] record (numguard.QUANT_FIELDS) of what casting x to a low-precision format would do
  // (format: the index of numguard.schema.QUANT_FORMATS; scale used when has_scale). Never
  // synchronizes with the host.
  m.def("quant_stats(Tensor x, int format, float scale, bool has_scale) -> Tensor");
  // watch(quant=)'s measurement of one module call: the record of each of xs under the format
  // with current scaling (per-tensor formats: fmax / amax of the tensor, v = x * scale measured
  // at scale 1 and the squares divided by scale^2; block formats: their own scales), returned as
  // float64[len(xs), 10], and their leading fields (nonfinite .. sq_error) added into
  // sums[row] (float64[R, 6], on the tensors' device). Never synchronizes with the host.
  m.def("quant_watch_(Tensor(a!) sums, int row, Tensor[] xs, int format) -> Tensor");

  // --- replica fingerprints (NOTE: [fingerprint] in numguard/fingerprint.h) ---
  // int64[len(xs)] on the tensors' device: the exact 64-bit digest of each tensor's bits (uint64
  // stored as int64), in one pass (one launch per 64 tensors on CUDA). Never synchronizes.
  m.def("multi_tensor_fingerprint(Tensor[] xs) -> Tensor");
  // record_ for a frame recorded inside a compiled graph (or a captured CUDA graph): the frame
  // starts at cursor[0], not at a host position; unless the ring is frozen, the call logs
  // (slot, start, cursor[2]) at log row cursor[1] mod L and advances cursor[0] by len(xs) and
  // cursor[1] by 1. cursor: int64[3], log: int64[L, 3] (see numguard/graph_record.h).
  m.def("record_at_cursor_(Tensor(a!) ring, Tensor(b!) state, Tensor(c!) cursor, Tensor(d!) log, Tensor[] xs, "
        "int slot, float headroom, int context=0) -> ()");
}

namespace numguard {
void bind_frame_recorder(pybind11::module& module);  // csrc/recorder.cpp
void bind_history(pybind11::module& module);         // csrc/history.cpp
void bind_parameter_walk(pybind11::module& module);  // csrc/weights.cpp
}  // namespace numguard

namespace {

// The layout this build computes with, for numguard.ops to compare with numguard.schema at load.
std::vector<std::string> stat_fields() {
  return {std::begin(numguard::kStatFieldNames), std::end(numguard::kStatFieldNames)};
}

std::vector<std::string> state_layout() {
  return {std::begin(numguard::kStateFieldNames), std::end(numguard::kStateFieldNames)};
}

// (name, max, tiny, headroom limit) of each recordable dtype, max and tiny decoded from the very
// formats the kernels use (tiny 0 for integers and bool; limit 0 where headroom is not checked).
std::vector<std::tuple<std::string, double, double, double>> dtypes() {
  std::vector<std::tuple<std::string, double, double, double>> out;
  for (at::ScalarType t : numguard::kRecordableTypes) {
    numguard::DtypeInfo info{};
    numguard::recordable_dtype(t, &info);
    out.emplace_back(numguard::dtype_name(t), numguard::dtype_max(info), numguard::dtype_tiny(info),
                     numguard::headroom_limit(info.kind));
  }
  return out;
}

// (version, index step, mixer constants) of the fingerprint this build computes, for numguard.ops
// to compare with numguard.schema.FINGERPRINT_LAYOUT at load.
std::vector<int64_t> fingerprint_layout() {
  return {numguard::kFingerprintVersion, static_cast<int64_t>(numguard::kFingerprintIndexStep),
          static_cast<int64_t>(numguard::kFingerprintMix1), static_cast<int64_t>(numguard::kFingerprintMix2)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "numguard native kernels (ops are registered under torch.ops.numguard)";
  module.def("cpu_capabilities", &numguard::cpu_capabilities,
             "Instruction sets the CPU kernels were built for and which one this CPU runs.");
  module.def("cuda_architectures", &numguard::cuda_architectures,
             "CUDA architectures the kernels were compiled for (empty without CUDA kernels).");
  module.def("stat_fields", &stat_fields, "Field names of a stats record, in order (numguard.schema.STAT_FIELDS).");
  module.def("state_layout", &state_layout,
             "Field names of the recording state, in order (numguard.schema.STATE_FIELDS).");
  module.def("dtypes", &dtypes,
             "(name, max, tiny, headroom limit) of each dtype the kernels record (numguard.schema.DTYPES).");
  numguard::bind_frame_recorder(module);
  numguard::bind_history(module);
  numguard::bind_parameter_walk(module);
  module.def("fingerprint_layout", &fingerprint_layout,
             "(version, index step, mixer constants) of the fingerprint (numguard.schema.FINGERPRINT_LAYOUT).");
}
