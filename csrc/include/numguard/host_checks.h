// Host-side preparation shared by the CPU and CUDA ops: which dtypes are recorded and how, the
// input rule and its error messages, ring/state validation, and the stride analysis that lets a
// tensor be read without a copy. Reduction logic lives in stats_reduce.h; this header is the ATen
// side and is never compiled for the device.
//
// The input rule and its messages are numguard.ops.check_tensor's, word for word, with torch's
// Python names for dtypes and layouts, so that both backends fail the same way (tested).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <string>
#include <utility>

#include "numguard/graph_record.h"
#include "numguard/stats_reduce.h"

namespace numguard {

// ---------------------------------------------------------------------------------------------
// Names as Python prints them

// Argument `what[index]` ("xs[3]"), or `what` alone when index < 0 ("x").
inline std::string arg_name(const char* what, int64_t index) {
  return index < 0 ? std::string(what) : std::string(what) + "[" + std::to_string(index) + "]";
}

// A dtype's name in torch's Python spelling without "torch." (ScalarType::Half -> "float16").
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "float64";
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kByte: return "uint8";
    case at::kComplexHalf: return "complex32";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: break;
  }
  // The other names are c10's in lower case (BFloat16 -> bfloat16, Float8_e4m3fnuz, QInt8, Bits8...).
  std::string name = c10::toString(t);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  return name;
}

inline std::string layout_name(at::Layout layout) {
  switch (layout) {
    case at::kStrided: return "torch.strided";
    case at::kSparse: return "torch.sparse_coo";
    case at::kSparseCsr: return "torch.sparse_csr";
    case at::kSparseCsc: return "torch.sparse_csc";
    case at::kSparseBsr: return "torch.sparse_bsr";
    case at::kSparseBsc: return "torch.sparse_bsc";
    case at::kMkldnn: return "torch._mkldnn";
    case at::kJagged: return "torch.jagged";
    default: return c10::str(layout);
  }
}

// ---------------------------------------------------------------------------------------------
// Dtypes

// What the kernels need to know of a recordable dtype.
struct DtypeInfo {
  ElementKind kind;
  int elem_size;
  const FloatFormat* format;  // nullptr for integer and bool kinds
};

// The recordable dtypes, in numguard.schema.RECORDABLE_DTYPES order (the extension reports them
// and numguard.ops compares).
constexpr at::ScalarType kRecordableTypes[] = {
    at::kDouble, at::kFloat,  at::kHalf,   at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2,
    at::kChar,   at::kShort,  at::kInt,    at::kLong,     at::kByte,          at::kUInt16,
    at::kUInt32, at::kUInt64, at::kBool};

// Fills *info and returns true for a recordable dtype; false for any other.
inline bool recordable_dtype(at::ScalarType t, DtypeInfo* info) {
  switch (t) {
    case at::kDouble: *info = {ElementKind::kFloat64, 8, &kFloat64Format}; return true;
    case at::kFloat: *info = {ElementKind::kFloat32, 4, &kFloat32Format}; return true;
    case at::kHalf: *info = {ElementKind::kFloat16, 2, &kFloat16Format}; return true;
    case at::kBFloat16: *info = {ElementKind::kBFloat16, 2, &kBFloat16Format}; return true;
    case at::kFloat8_e4m3fn: *info = {ElementKind::kFloat8E4M3FN, 1, &kFloat8E4M3FNFormat}; return true;
    case at::kFloat8_e5m2: *info = {ElementKind::kFloat8E5M2, 1, &kFloat8E5M2Format}; return true;
    case at::kChar: *info = {ElementKind::kInt8, 1, nullptr}; return true;
    case at::kShort: *info = {ElementKind::kInt16, 2, nullptr}; return true;
    case at::kInt: *info = {ElementKind::kInt32, 4, nullptr}; return true;
    case at::kLong: *info = {ElementKind::kInt64, 8, nullptr}; return true;
    case at::kByte: *info = {ElementKind::kUInt8, 1, nullptr}; return true;
    case at::kUInt16: *info = {ElementKind::kUInt16, 2, nullptr}; return true;
    case at::kUInt32: *info = {ElementKind::kUInt32, 4, nullptr}; return true;
    case at::kUInt64: *info = {ElementKind::kUInt64, 8, nullptr}; return true;
    case at::kBool: *info = {ElementKind::kBool, 1, nullptr}; return true;
    default: return false;
  }
}

// "float64, float32, ..." for error messages.
inline std::string supported_dtypes() {
  std::string out;
  for (at::ScalarType t : kRecordableTypes) out += (out.empty() ? "" : ", ") + dtype_name(t);
  return out;
}

// Largest finite value of a recordable dtype (finfo.max / iinfo.max, as a double).
inline double dtype_max(const DtypeInfo& info) {
  if (info.format != nullptr) return decode_magnitude(info.format->finite_limit - 1, *info.format);
  if (info.kind == ElementKind::kBool) return 1.0;
  const bool is_signed = info.kind == ElementKind::kInt8 || info.kind == ElementKind::kInt16 ||
                         info.kind == ElementKind::kInt32 || info.kind == ElementKind::kInt64;
  const int bits = 8 * info.elem_size - (is_signed ? 1 : 0);
  return static_cast<double>(bits == 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1);
}

// Smallest positive normal value (finfo.tiny); 0 for integer and bool dtypes.
inline double dtype_tiny(const DtypeInfo& info) {
  return info.format != nullptr ? decode_magnitude(info.format->min_normal, *info.format) : 0.0;
}

// ---------------------------------------------------------------------------------------------
// The input rule (numguard.ops.check_tensor; the same order, so the same error wins). TORCH_CHECK
// builds its message only when a check fails: no string work per tensor otherwise.

// Everything but the device; returns how the kernels read x.
inline DtypeInfo check_input(const at::Tensor& x, const char* what, int64_t index) {
  TORCH_CHECK_VALUE(x.defined(), "numguard: ", arg_name(what, index), " is an undefined tensor; pass a real tensor");
  TORCH_CHECK_VALUE(!x.is_nested(), "numguard: ", arg_name(what, index), " is a nested tensor (layout ",
                    layout_name(x.layout()), "); only dense (strided) tensors are supported: pass its tensors (",
                    arg_name(what, index), ".unbind()) one by one");
  TORCH_CHECK_VALUE(x.layout() == at::kStrided, "numguard: ", arg_name(what, index), " has layout ",
                    layout_name(x.layout()), "; only dense (strided) tensors are supported: pass ",
                    arg_name(what, index), ".to_dense()");
  TORCH_CHECK_TYPE(!x.is_quantized(), "numguard: ", arg_name(what, index), " is a quantized tensor (torch.",
                   dtype_name(x.scalar_type()), "); only unquantized tensors are supported: pass ",
                   arg_name(what, index), ".dequantize()");
  DtypeInfo info{};
  if (recordable_dtype(x.scalar_type(), &info)) return info;
  TORCH_CHECK_TYPE(!x.is_complex(), "numguard: ", arg_name(what, index), " has complex dtype torch.",
                   dtype_name(x.scalar_type()), "; stats are defined for real tensors: pass torch.view_as_real(",
                   arg_name(what, index), ") to check its real and imaginary parts");
  TORCH_CHECK_TYPE(false, "numguard: ", arg_name(what, index), " has dtype torch.", dtype_name(x.scalar_type()),
                   ", which numguard does not support; supported dtypes: ", supported_dtypes());
  return info;  // unreachable
}

// Mixed devices in one call: name the first tensor that differs from xs[0].
inline void check_same_device(at::TensorList xs, const char* what) {
  for (size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK_VALUE(xs[i].defined(), "numguard: ", arg_name(what, i), " is an undefined tensor; pass a real tensor");
    TORCH_CHECK_VALUE(xs[i].device() == xs[0].device(), "numguard: ", arg_name(what, i), " is on ", xs[i].device(),
                      " but ", arg_name(what, 0), " is on ", xs[0].device(),
                      "; all tensors of one call must be on one device: split the call per device");
  }
}

// The ring and state of record_ (numguard.ops.new_ring) on `device_type`; `contiguous`: the kernel
// addresses them as flat arrays.
inline void check_ring_and_state(const at::Tensor& ring, const at::Tensor& state, at::DeviceType device_type,
                                 bool contiguous) {
  TORCH_CHECK(ring.defined() && ring.device().type() == device_type && ring.layout() == at::kStrided,
              "numguard: ring must be a dense ", c10::DeviceTypeName(device_type), " tensor here, got ",
              ring.defined() ? c10::str(ring.device(), " ", layout_name(ring.layout())) : std::string("undefined"));
  TORCH_CHECK(ring.scalar_type() == at::kDouble && ring.dim() == 2 && ring.size(0) >= 1 && ring.size(1) == kNumStats,
              "numguard: ring must be float64[R, ", kNumStats, "] with R >= 1 (see numguard.ops.new_ring), got ",
              ring.scalar_type(), ring.sizes());
  TORCH_CHECK(state.defined() && state.device() == ring.device() && state.layout() == at::kStrided,
              "numguard: state must be a dense tensor on the ring's device (", ring.device(), "), got ",
              state.defined() ? c10::str(state.device(), " ", layout_name(state.layout())) : std::string("undefined"));
  TORCH_CHECK(state.scalar_type() == at::kLong && state.dim() == 1 && state.size(0) == kStateSize,
              "numguard: state must be int64[", kStateSize, "] (see numguard.ops.new_ring), got ", state.scalar_type(),
              state.sizes());
  TORCH_CHECK(!contiguous || (ring.is_contiguous() && state.is_contiguous()),
              "numguard: ring and state must be contiguous here, got strides ", ring.strides(), " and ",
              state.strides(), "; pass a pair made by numguard.ops.new_ring");
}

// Every recorded tensor on the ring's device (checked before the tensors themselves: a tensor on
// another device is named as such, whatever else is wrong with it).
inline void check_on_ring_device(at::TensorList xs, const at::Tensor& ring) {
  for (size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK_VALUE(xs[i].defined() && xs[i].device() == ring.device(), "numguard: ", arg_name("xs", i), " is on ",
                      xs[i].defined() ? c10::str(xs[i].device()) : std::string("(undefined)"), " but the ring is on ",
                      ring.device(), "; record tensors into a ring on their own device");
  }
}

// quant_watch_'s running sums and inputs (csrc/ops.cpp): float64[R, 6], contiguous, a row inside
// it, floating tensors on its device.
inline void check_quant_watch_args(const at::Tensor& sums, int64_t row, at::TensorList xs) {
  TORCH_CHECK_VALUE(sums.scalar_type() == at::kDouble && sums.dim() == 2 && sums.size(1) == 6 && sums.is_contiguous(),
                    "numguard: quant_watch_'s sums must be a contiguous float64 tensor of shape [rows, 6], got ",
                    sums.scalar_type(), " of shape ", sums.sizes());
  TORCH_CHECK_VALUE(row >= 0 && row < sums.size(0), "numguard: quant_watch_ row ", row, " is outside sums' ",
                    sums.size(0), " rows; grow sums first");
  for (size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK_VALUE(xs[i].defined() && xs[i].device() == sums.device(), "numguard: ", arg_name("xs", i), " is on ",
                      xs[i].defined() ? c10::str(xs[i].device()) : std::string("(undefined)"), " but sums is on ",
                      sums.device(), "; measure tensors into sums on their own device");
    TORCH_CHECK_VALUE(at::isFloatingType(xs[i].scalar_type()) && xs[i].scalar_type() != at::kDouble,
                      "numguard: ", arg_name("xs", i), " is ", xs[i].scalar_type(),
                      "; quant_watch_ measures float32, float16, bfloat16 and float8 tensors");
  }
}

// record_'s what-if arguments (csrc/ops.cpp): the measured xs by index, then quant_watch_'s rule
// for the sums and tensors, and `records` (when given) float64[len(quant_xs), 10] on their device.
// Returns the measured tensors.
inline std::vector<at::Tensor> check_record_quant_args(const at::Tensor& sums, int64_t row, int64_t format,
                                                       int64_t num_formats, at::IntArrayRef quant_xs,
                                                       at::TensorList xs, const at::Tensor& records) {
  TORCH_CHECK_VALUE(format >= 0 && format < num_formats, "numguard: unknown quant format code ", format);
  std::vector<at::Tensor> measured;
  measured.reserve(quant_xs.size());
  for (size_t j = 0; j < quant_xs.size(); ++j) {
    const int64_t k = quant_xs[j];
    TORCH_CHECK_VALUE(k >= 0 && k < static_cast<int64_t>(xs.size()), "numguard: quant_xs[", j, "] = ", k,
                      " is not an index of xs (", xs.size(), " tensors)");
    measured.push_back(xs[k]);
  }
  check_quant_watch_args(sums, row, measured);
  if (records.defined()) {
    TORCH_CHECK_VALUE(records.scalar_type() == at::kDouble && records.is_contiguous() && records.dim() == 2 &&
                          records.size(0) == static_cast<int64_t>(quant_xs.size()) && records.size(1) == 10 &&
                          records.device() == sums.device(),
                      "numguard: record_'s quant_records must be a contiguous float64 tensor of shape [",
                      quant_xs.size(), ", 10] on ", sums.device(), ", got ", records.scalar_type(), " of shape ",
                      records.sizes(), " on ", records.device());
  }
  return measured;
}

// ---------------------------------------------------------------------------------------------
// Stride analysis

// NOTE: [layouts]
// Stats do not depend on element order. Dims of size 1 are dropped; dims of stride 0 (expanded)
// are dropped too and their sizes multiply the counts at finalize (`repeat`), since they only
// repeat the same values. The rest are ordered by stride, outermost first, and adjacent dims that
// address memory as one are merged. A non-overlapping and dense tensor (contiguous, transposed,
// channels_last, any permutation) collapses to one dim of stride 1: the dense span of `numel`
// elements from its data pointer. Anything else (slices with gaps, overlapping views) keeps its
// merged dims and is walked in place too: by the CPU kernels, and by the CUDA kernel up to its
// kMaxStridedDims merged dims (NOTE: [strided reads] in csrc/cuda/stats_device.cuh).
struct StrideLayout {
  int64_t numel = 0;   // elements visited (stride-0 dims excluded)
  int64_t repeat = 1;  // product of the sizes of stride-0 dims
  c10::SmallVector<int64_t, 6> sizes;    // merged dims, outermost first; empty when dense
  c10::SmallVector<int64_t, 6> strides;  // in elements
  bool dense() const { return sizes.empty(); }
};

inline StrideLayout analyze_strides(const at::Tensor& x) {
  StrideLayout out;
  if (x.numel() == 0) return out;
  if (x.is_contiguous()) {  // the common case, without sorting dims: one dense span
    out.numel = x.numel();
    return out;
  }
  c10::SmallVector<std::pair<int64_t, int64_t>, 6> dims;  // (stride, size)
  for (int64_t d = 0; d < x.dim(); ++d) {
    const int64_t size = x.size(d);
    const int64_t stride = x.stride(d);
    if (size == 1) continue;
    if (stride == 0) {
      out.repeat *= size;
      continue;
    }
    dims.emplace_back(stride, size);
  }
  // Outermost (largest stride) first. PyTorch strides are never negative.
  std::stable_sort(dims.begin(), dims.end(),
                   [](const std::pair<int64_t, int64_t>& a, const std::pair<int64_t, int64_t>& b) {
                     return a.first > b.first;
                   });
  int64_t numel = 1;
  for (const auto& d : dims) {
    if (!out.sizes.empty() && out.strides.back() == d.first * d.second) {
      // The previous (outer) dim steps exactly over this one: merge them.
      out.sizes.back() *= d.second;
      out.strides.back() = d.first;
    } else {
      out.sizes.push_back(d.second);
      out.strides.push_back(d.first);
    }
    numel *= d.second;
  }
  out.numel = numel;
  if (out.sizes.empty() || (out.sizes.size() == 1 && out.strides[0] == 1)) {
    out.sizes.clear();
    out.strides.clear();
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Element alignment

// NOTE: [element alignment]
// A tensor made by from_blob or DLPack may start at an address that is not a multiple of its
// element size. The kernels load whole elements (on CUDA, a scalar head up to 16-byte alignment
// and then 16-byte vectors, which assumes whole-element steps), and a misaligned load kills the
// CUDA context. Such a tensor is read from a copy of its bytes at an aligned address, with the
// same sizes and strides; the bytes are copied as bytes, which needs no alignment. The copy is
// made on the current stream and must outlive the launches that read it.
inline bool is_element_aligned(const at::Tensor& x) {
  return x.numel() == 0 || reinterpret_cast<uintptr_t>(x.const_data_ptr()) % x.element_size() == 0;
}

inline at::Tensor element_aligned(const at::Tensor& x) {
  if (is_element_aligned(x)) return x;
  int64_t extent = 1;  // elements from the first to the last one the strides reach, inclusive
  for (int64_t d = 0; d < x.dim(); ++d) extent += (x.size(d) - 1) * x.stride(d);
  const int64_t bytes = extent * static_cast<int64_t>(x.element_size());
  const auto byte_options = at::TensorOptions().dtype(at::kByte).device(x.device());
  const at::Tensor source = at::from_blob(const_cast<void*>(x.const_data_ptr()), {bytes}, byte_options);
  at::Tensor copy = at::empty({bytes}, byte_options);
  copy.copy_(source);
  return copy.view(x.scalar_type()).as_strided(x.sizes(), x.strides());
}

// ---------------------------------------------------------------------------------------------
// record_at_cursor_'s cursor and log (numguard/graph_record.h), on the ring's device.

inline void check_cursor_and_log(const at::Tensor& cursor, const at::Tensor& log, const at::Tensor& ring) {
  TORCH_CHECK(cursor.defined() && cursor.device() == ring.device() && cursor.scalar_type() == at::kLong &&
                  cursor.dim() == 1 && cursor.size(0) == kGraphCursorSize && cursor.is_contiguous(),
              "numguard: cursor must be a contiguous int64[", kGraphCursorSize, "] on the ring's device (",
              ring.device(), "), got ", cursor.defined() ? c10::str(cursor.scalar_type(), cursor.sizes(), " on ",
                                                                  cursor.device()) : std::string("undefined"));
  TORCH_CHECK(log.defined() && log.device() == ring.device() && log.scalar_type() == at::kLong && log.dim() == 2 &&
                  log.size(0) >= 1 && log.size(1) == kGraphLogWidth && log.is_contiguous(),
              "numguard: log must be a contiguous int64[L, ", kGraphLogWidth, "] with L >= 1 on the ring's device (",
              ring.device(), "), got ", log.defined() ? c10::str(log.scalar_type(), log.sizes(), " on ", log.device())
                                                       : std::string("undefined"));
}

}  // namespace numguard
