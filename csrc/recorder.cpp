// The host side of recording one frame: the fast path of numguard.inspector.ring.FrameRing.record.
//
// Per watched module call the Python side used to read half a dozen attributes of every tensor,
// look each one up in a dict of tensors already recorded this batch, and go through Python's op
// dispatch for the one record_ launch. Here that is one call: tensors are unpacked without
// Python attribute reads, the reuse table is keyed by TensorImpl, and record_ is called through
// the C++ dispatcher (same kernels, same device, still no host sync).
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpu/stats_ops.h"
#include "numguard/host_checks.h"

namespace py = pybind11;

namespace numguard {
namespace {

using RecordSignature = void(const at::Tensor&, const at::Tensor&, at::TensorList, int64_t, double, int64_t,
                             const std::optional<at::Tensor>&, int64_t, int64_t, at::IntArrayRef,
                             const std::optional<at::Tensor>&);

// A tensor already recorded this batch. The weak reference keeps the TensorImpl's memory (not its
// data) from being reused while it is in the table, so a key that matches is the same tensor.
struct SeenTensor {
  c10::weak_intrusive_ptr<c10::TensorImpl> ref;
  int64_t version;
  int64_t position;
  bool context;  // recorded as a call's input (NOTE: [context records]): not reused for an output
};

// Whether the record_ kernel takes `x` as it is; anything else goes through the Python side's
// sanitize (other device, unrecordable dtype, sparse / nested / quantized, Python tensor
// subclasses such as DTensor, meta).
bool records_directly(const at::Tensor& x, const c10::Device& device) {
  DtypeInfo info{};
  if (!recordable_dtype(x.scalar_type(), &info)) return false;
  if (x.layout() != at::kStrided || x.device() != device || x.is_nested()) return false;
  return !x.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python);
}

// The dtypes and shapes of an owner's last frame: a module called with the same structure again
// (the usual case) shares the same tuples instead of building new ones per call.
struct FrameMeta {
  py::object owner;  // keeps the key alive
  std::vector<at::ScalarType> types;
  std::vector<int64_t> sizes;  // per tensor: its dim, then its sizes
  py::tuple dtypes;
  py::tuple shapes;

  bool matches(c10::ArrayRef<const at::Tensor*> xs) const {
    if (xs.size() != types.size()) return false;
    size_t k = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
      const at::Tensor& x = *xs[i];
      if (x.scalar_type() != types[i] || x.is_nested()) return false;
      const auto dims = x.sym_sizes();
      if (k >= sizes.size() || sizes[k] != static_cast<int64_t>(dims.size())) return false;
      ++k;
      for (const auto& d : dims) {
        if (d.is_heap_allocated() || k >= sizes.size() || sizes[k] != d.as_int_unchecked()) return false;
        ++k;
      }
    }
    return k == sizes.size();
  }

  void remember(c10::ArrayRef<const at::Tensor*> xs) {
    types.clear();
    sizes.clear();
    for (const at::Tensor* x : xs) {
      types.push_back(x->scalar_type());
      if (x->is_nested()) {
        sizes.push_back(-1);  // never matches: a nested tensor has no single shape
        continue;
      }
      const auto dims = x->sym_sizes();
      sizes.push_back(static_cast<int64_t>(dims.size()));
      for (const auto& d : dims) sizes.push_back(d.is_heap_allocated() ? -1 : d.as_int_unchecked());
    }
  }
};

constexpr size_t kMetaLimit = 4096;  // owners whose last frame's metadata is kept

py::tuple shape_of(const at::Tensor& x) {
  if (x.is_nested()) return py::tuple();  // no single shape
  const auto sizes = x.sym_sizes();
  py::tuple out(sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    const auto& s = sizes[d];
    out[d] = s.is_heap_allocated() ? py::int_(s.guard_int(__FILE__, __LINE__)) : py::int_(s.as_int_unchecked());
  }
  return out;
}

// The fields of numguard.inspector.frames.Frame, in the order record_frame builds its tuples: a
// Frame that gained, lost or reordered a field fails here, when the recorder is made, instead of
// filling wrong fields at the first frame.
constexpr const char* kFrameFields[] = {"owner", "batch", "start", "labels", "kinds", "dtypes", "shapes",
                                        "section", "batch_start", "n_records", "with_weights", "hf",
                                        "positions", "lowest"};
constexpr Py_ssize_t kFrameFieldCount = sizeof(kFrameFields) / sizeof(kFrameFields[0]);

void check_frame_fields(const py::object& frame_type) {
  std::vector<std::string> fields;
  if (py::hasattr(frame_type, "_fields")) {
    for (const py::handle& f : py::tuple(frame_type.attr("_fields"))) fields.push_back(py::str(f));
  }
  std::string expected;
  for (const char* f : kFrameFields) expected += std::string(expected.empty() ? "" : ", ") + f;
  std::string got;
  for (const std::string& f : fields) got += (got.empty() ? "" : ", ") + f;
  TORCH_CHECK(got == expected, "numguard: the native frame recorder builds Frame(", expected,
              ") but numguard.inspector.frames.Frame has (", got,
              "); rebuild the extension from the same source as the Python package");
}

// What recording a frame's tensors gives the Frame (see FrameRecorder::record).
struct Recorded {
  py::tuple dtypes, shapes, positions;
  int64_t n = 0;   // records written
  int64_t lo = 0;  // lowest position referred to
};

class FrameRecorder {
 public:
  FrameRecorder(at::Tensor ring, at::Tensor state, py::list frames, py::list frame_starts, py::object frame_type,
                py::object sanitize, py::object grow, int64_t seen_limit)
      : frames_(std::move(frames)),
        frame_starts_(std::move(frame_starts)),
        frame_type_(std::move(frame_type)),
        sanitize_(std::move(sanitize)),
        grow_(std::move(grow)),
        seen_limit_(seen_limit) {
    TORCH_CHECK(PyType_Check(frame_type_.ptr()) && PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(frame_type_.ptr()),
                                                                     &PyTuple_Type),
                "numguard: FrameRecorder needs a tuple type for its frames");
    check_frame_fields(frame_type_);
    set_ring(std::move(ring), std::move(state));
  }

  // The ring's bookkeeping (numguard.inspector.ring.FrameRing reads and sets these).
  int64_t pos = 0;           // where the next record goes
  int64_t window_lo = 0;     // oldest ring position a held frame refers to
  int64_t hf_calls = 0;      // module frames recorded (Transformers' total_calls)
  py::object pending_start = py::int_(0);  // "Starting batch number" of the next module frame, or None

  // Records one frame (see FrameRing.record) and appends its Frame to the frames list. `state`
  // (a tensor or None): the recording state to update instead of the ring's own; such a frame
  // neither reuses records nor is reused (every tensor of it is recorded, and recorded again by
  // the frames that follow, so their own state sees it). `fresh`: reuse no earlier record (NOTE:
  // [fresh frames]). `context`: how many leading xs are the call's inputs (NOTE: [context records]).
  void record_frame(const py::handle& owner, const py::list& xs, const py::object& labels, const py::object& kinds,
                    const py::object& section, bool hf, bool weights, int64_t batch,
                    const py::object& state = py::none(), bool fresh = false, int64_t context = 0) {
    if (!state.is_none()) {
      if (!THPVariable_Check(state.ptr())) throw py::type_error("numguard: state must be a tensor or None");
      state_override_ = THPVariable_Unpack(state.ptr());
    }
    struct Restore {
      FrameRecorder& r;
      ~Restore() {
        r.state_override_.reset();
        r.labels_ = r.kinds_ = py::handle();
      }
    } restore{*this};
    labels_ = labels;  // for sanitize's warnings, for the duration of this call
    kinds_ = kinds;
    // Interned once and never released (no destructor running after the interpreter is gone).
    static const py::handle kFlag = PyUnicode_InternFromString("flag");
    static const py::handle kFlagBatch = PyUnicode_InternFromString("flag_batch");
    static const py::handle kWidx = PyUnicode_InternFromString("widx");
    static const py::handle kHeadroom = PyUnicode_InternFromString("headroom");
    py::object flag = py::none();
    bool with_weights = false;
    if (weights) {
      py::object owner_flag = owner.attr(kFlag);
      if (!owner_flag.is_none() && owner.attr(kFlagBatch).cast<int64_t>() != batch) {
        // The module's weight flag (NaN when one of its weights is non-finite), first call of the batch.
        owner.attr(kFlagBatch) = py::int_(batch);
        flag = owner_flag;
      }
      with_weights = PyObject_IsTrue(owner.attr(kWidx).ptr()) == 1;
    }
    const double headroom = owner.attr(kHeadroom).cast<double>();
    const int64_t start = pos;
    Recorded got = record_tensors(xs, flag, start, headroom, window_lo, PyList_GET_SIZE(frames_.ptr()) > 0, owner,
                                  !state_override_.defined(), fresh, context);
    const int64_t n = got.n;
    const int64_t lo = got.lo;
    pos = start + n;
    py::object batch_start = py::none();
    if (hf) {
      ++hf_calls;
      batch_start = pending_start;
      pending_start = py::none();
    }
    // After record: a growth may have dropped frames and moved window_lo.
    if (PyList_GET_SIZE(frames_.ptr()) == 0 || lo < window_lo) window_lo = lo;
    py::int_ start_obj(start);  // one int object for the Frame and frame_starts
    PyObject* items[] = {owner.ptr(), py::int_(batch).release().ptr(), start_obj.ptr(),
                         labels.ptr(), kinds.ptr(), got.dtypes.ptr(), got.shapes.ptr(), section.ptr(),
                         batch_start.ptr(), py::int_(n).release().ptr(), py::bool_(with_weights).release().ptr(),
                         py::bool_(hf).release().ptr(), got.positions.ptr(), py::int_(lo).release().ptr()};
    constexpr Py_ssize_t kFields = sizeof(items) / sizeof(items[0]);
    static_assert(kFields == kFrameFieldCount, "one item per field of kFrameFields");
    // Owned references for the borrowed ones; the released ones are already owned.
    for (Py_ssize_t i : {0, 2, 3, 4, 5, 6, 7, 8, 12}) Py_INCREF(items[i]);
    auto* type = reinterpret_cast<PyTypeObject*>(frame_type_.ptr());
    PyObject* frame = type->tp_alloc(type, kFields);
    if (frame == nullptr) {
      for (PyObject* item : items) Py_DECREF(item);
      throw py::error_already_set();
    }
    for (Py_ssize_t i = 0; i < kFields; ++i) PyTuple_SET_ITEM(frame, i, items[i]);
    // NOTE: [untracked frames] A frame refers to its owner and to immutable tuples, and nothing
    // it holds refers back to frames: it can never be part of a reference cycle. Left tracked,
    // the thousands of frames a ring holds made the garbage collector's passes a large share of
    // the recording cost.
    PyObject_GC_UnTrack(frame);
    py::object owned = py::reinterpret_steal<py::object>(frame);
    frames_.append(owned);
    frame_starts_.append(start_obj);
  }

  // The steady-state module hook (numguard.inspector.hooks): one positional tensor in, one tensor
  // out, no keyword arguments, inside an open batch of the root's forward. Records the frame and
  // returns true; anything else returns false and the Python hook handles the call. `batch` is
  // the inspector's hooks.BatchState: its public `closed`, `open`, `depth` and `done` are read,
  // never written.
  bool module_call(const py::handle& owner, const py::handle& batch, const py::handle& args,
                   const py::handle& kwargs, const py::handle& output) {
    if (fast_labels_.is_none()) return false;
    if (kwargs.ptr() != Py_None && (!PyDict_Check(kwargs.ptr()) || PyDict_GET_SIZE(kwargs.ptr()) != 0)) return false;
    if (!PyTuple_Check(args.ptr()) || PyTuple_GET_SIZE(args.ptr()) != 1) return false;
    PyObject* input = PyTuple_GET_ITEM(args.ptr(), 0);
    auto* tensor_type = reinterpret_cast<PyTypeObject*>(THPVariableClass);
    if (Py_TYPE(input) != tensor_type || Py_TYPE(output.ptr()) != tensor_type) return false;
    static const py::handle kClosed = PyUnicode_InternFromString("closed");
    static const py::handle kBatchOpen = PyUnicode_InternFromString("open");
    static const py::handle kDepth = PyUnicode_InternFromString("depth");
    static const py::handle kBatchesDone = PyUnicode_InternFromString("done");
    static const py::handle kOff = PyUnicode_InternFromString("off");
    static const py::handle kIsTop = PyUnicode_InternFromString("is_top");
    if (is_true(owner, kOff) || is_true(batch, kClosed) || !is_true(batch, kBatchOpen)) return false;
    if (batch.attr(kDepth).cast<int64_t>() <= 0) return false;  // a call outside the root's forward
    const int64_t batch_number = batch.attr(kBatchesDone).cast<int64_t>();
    static const py::handle kQuantRow = PyUnicode_InternFromString("quant_row");
    quant_took_ = quant_took_output_ = py::none();
    struct QuantCall {
      FrameRecorder& r;
      ~QuantCall() { r.quant_row_ = -1; }
    } quant_call{*this};
    if (quant_format_ >= 0) quant_row_ = owner.attr(kQuantRow).cast<int64_t>();
    py::list xs(2);
    PyList_SET_ITEM(xs.ptr(), 0, py::reinterpret_borrow<py::object>(input).release().ptr());
    PyList_SET_ITEM(xs.ptr(), 1, py::reinterpret_borrow<py::object>(output).release().ptr());
    record_frame(owner, xs, fast_labels_, fast_kinds_, fast_section_, true, true, batch_number, py::none(),
                 is_true(owner, kIsTop), fast_context_);
    return true;
  }

  // What module_call's frames carry (frames.ONE_IN_ONE_OUT_LABELS / _KINDS, "forward"), and
  // whether their input is context (1) or trips like the output (0).
  void set_fast_path(py::object labels, py::object kinds, py::object section, int64_t context) {
    fast_labels_ = std::move(labels);
    fast_kinds_ = std::move(kinds);
    fast_section_ = std::move(section);
    fast_context_ = context;
  }

  // watch(quant=) (numguard.inspector.quant_watch, NOTE: [quant in the stats call]): the output of
  // a module_call whose owner has a quant_row >= 0 is measured under `format` (a QUANT_FORMATS
  // code) by the record_ call that records it, into sums[quant_row] (float64[R, 6] on the ring's
  // device), when it is a fresh float32, float16 or bfloat16 tensor recorded on the main ring.
  // sums None: off.
  void set_quant(const py::object& sums, int64_t format) {
    if (sums.is_none()) {
      quant_sums_ = at::Tensor();
      quant_format_ = -1;
      return;
    }
    if (!THPVariable_Check(sums.ptr())) throw py::type_error("numguard: quant sums must be a tensor or None");
    quant_sums_ = THPVariable_Unpack(sums.ptr());
    quant_format_ = format;
  }

  // The record (float64[10]) of `output` when the last module_call measured it, else None; once.
  py::object quant_took(const py::handle& output) {
    py::object took = py::none();
    if (!quant_took_.is_none() && quant_took_output_.ptr() == output.ptr()) took = quant_took_;
    quant_took_ = quant_took_output_ = py::none();
    return took;
  }

  // The ring after a growth or a move (the Python side owns both tensors).
  void set_ring(at::Tensor ring, at::Tensor state) {
    ring_ = std::move(ring);
    state_ = std::move(state);
    device_ = ring_.device();
    size_ = ring_.size(0);
  }

  // NOTE: [one ring per device] (numguard/inspector/ring.py): a tensor on another device is
  // recorded there, into that device's side ring (slot k >= 1, same rows as the main ring), made
  // on first use by `factory(key) -> (ring, state)`; the runs written there are kept for the
  // Python side's merge (take_routed).
  void set_side_factory(py::object factory) { side_factory_ = std::move(factory); }
  // Tests only: `router(x) -> key or None` makes tensors stand for another device's.
  void set_router(py::object router) { router_ = std::move(router); }
  void set_side(int64_t slot, at::Tensor ring, at::Tensor state) {
    TORCH_CHECK(slot >= 1 && slot <= static_cast<int64_t>(sides_.size()), "numguard: no side ring ", slot);
    sides_[slot - 1] = Side{std::move(ring), std::move(state)};
  }
  void clear_sides() {
    sides_.clear();
    side_by_device_.clear();
    side_by_key_ = py::dict();
    routed_.clear();
  }
  // (slot, start, count) triples, flattened, of the records written to side rings since the last call.
  py::list take_routed() {
    py::list out;
    for (int64_t v : routed_) out.append(py::int_(v));
    routed_.clear();
    return out;
  }

  void clear_seen() { seen_.clear(); }
  int64_t seen_count() const { return static_cast<int64_t>(seen_.size()); }

  // Records `xs` (tensors) and `flag` (a tensor or None) at ring position `pos`: tensors unchanged
  // since an earlier frame of the batch are not recorded again. Returns (dtypes, shapes, positions,
  // records written, lowest position referred to), the fields of the Frame the caller appends.
  py::tuple record(const py::list& xs, const py::object& flag, int64_t pos, double headroom, int64_t window_lo,
                   bool has_frames, const py::handle& owner = py::handle(), bool reuse = true) {
    Recorded got = record_tensors(xs, flag, pos, headroom, window_lo, has_frames, owner, reuse);
    return py::make_tuple(got.dtypes, got.shapes, got.positions, got.n, got.lo);
  }

  // NOTE: [fresh frames] A write through `.data` (or into `.data` under no_grad) changes a tensor's
  // values without moving its version counter, so a record reused for it can be stale. The frames
  // that end a check (the root's, a top module's) are therefore recorded afresh: whatever reaches
  // the output is read at least once after its last write. Their records are still reusable.
  Recorded record_tensors(const py::list& xs, const py::object& flag, int64_t pos, double headroom,
                          int64_t window_lo, bool has_frames, const py::handle& owner, bool reuse,
                          bool afresh = false, int64_t context = 0) {
    const size_t count = xs.size();
    // Small vectors: a frame has a handful of tensors, and this runs once per module call.
    c10::SmallVector<const at::Tensor*, 8> tensors(count);
    c10::SmallVector<int64_t, 8> at_positions;
    std::vector<at::Tensor> fresh;
    c10::SmallVector<size_t, 8> fresh_index;  // index into xs of each fresh tensor
    fresh.reserve(count + 1);
    int64_t lo = pos;
    bool clean = true;
    std::vector<int> slots;  // per record: 0 the main ring, k side ring k
    slots.reserve(count + 1);
    bool routed = false;
    int64_t fresh_context = 0;  // fresh records that are context: a prefix of `fresh`
    for (size_t i = 0; i < count; ++i) {
      const bool is_context = static_cast<int64_t>(i) < context;
      PyObject* obj = PyList_GET_ITEM(xs.ptr(), i);
      if (!THPVariable_Check(obj)) throw py::type_error(c10::str("numguard: xs[", i, "] is not a tensor"));
      const at::Tensor& x = THPVariable_Unpack(obj);
      tensors[i] = &x;
      c10::TensorImpl* impl = x.unsafeGetTensorImpl();
      int64_t at = -1;
      if (reuse && !afresh && !impl->is_inference()) {
        auto hit = seen_.find(impl);
        if (hit != seen_.end() && !hit->second.ref.expired() &&
            hit->second.version == static_cast<int64_t>(impl->version_counter().current_version()) &&
            (is_context || !hit->second.context)) {  // a value passed on is judged as an output
          at = hit->second.position;
          if (at < lo) lo = at;
        }
      }
      if (at < 0) {
        at = pos + static_cast<int64_t>(fresh.size());
        fresh.push_back(x);
        fresh_index.push_back(i);
        if (is_context) ++fresh_context;
        if (clean) {
          // A frame with a state of its own (reuse off) keeps everything on the main ring.
          const int slot = reuse ? slot_for(obj, x) : (records_directly(x, device_) ? 0 : -1);
          if (slot < 0) clean = false;
          slots.push_back(slot);
          routed = routed || slot > 0;
        }
      }
      at_positions.push_back(at);
    }
    py::tuple dtypes, shapes;
    describe(owner, tensors, &dtypes, &shapes);
    if (!clean) routed = false;
    std::vector<at::Tensor> batch = clean ? fresh : sanitized(xs, fresh_index, owner);
    if (!flag.is_none()) {
      slots.push_back(0);  // the weight table's flag lives on the main device
      if (!THPVariable_Check(flag.ptr())) throw py::type_error("numguard: flag must be a tensor or None");
      at_positions.push_back(pos + static_cast<int64_t>(batch.size()));
      batch.push_back(THPVariable_Unpack(flag.ptr()));
    }
    const int64_t n = static_cast<int64_t>(batch.size());
    // module_call's output, xs[1], measured by watch(quant=) in the same call when it is fresh here
    int64_t quant_index = -1;
    if (quant_row_ >= 0 && clean && !routed && !state_override_.defined()) {
      for (size_t j = 0; j < fresh_index.size(); ++j) {
        if (fresh_index[j] == 1 && slots[j] == 0 && quant_measures(fresh[j])) quant_index = static_cast<int64_t>(j);
      }
    }
    if (n > 0) {
      const int64_t window = (!has_frames || lo < window_lo) ? lo : window_lo;
      if (pos + n - window > size_) grow_(pos + n - window);  // calls set_ring
      try {
        if (routed) {
          launch_routed(batch, slots, pos, headroom, fresh_context);
        } else if (quant_index >= 0) {
          launch_measured(batch, pos, headroom, fresh_context, quant_index, PyList_GET_ITEM(xs.ptr(), 1));
        } else {
          launch(batch, pos, headroom, fresh_context);
        }
      } catch (const std::exception&) {
        quant_took_ = quant_took_output_ = py::none();  // the Python side measures what a failed call did not
        if (routed || !clean || !any_needs_values(fresh)) throw;
        // What only the op can reject (e.g. meta tensors on the ring's device) is recorded through
        // sanitize instead of losing the frame.
        std::vector<at::Tensor> again = sanitized(xs, fresh_index, owner);
        std::copy(again.begin(), again.end(), batch.begin());
        launch(batch, pos, headroom, fresh_context);
      }
      if (static_cast<int64_t>(seen_.size()) > seen_limit_) seen_.clear();
      for (size_t j = 0; reuse && j < fresh.size(); ++j) {
        c10::TensorImpl* impl = fresh[j].unsafeGetTensorImpl();
        // No version counter (inference), or recorded through a copy of its parts (a Python
        // subclass, whose parts change without moving its own counter): never reused.
        if (impl->is_inference() || impl->key_set().has(c10::DispatchKey::Python)) continue;
        seen_.insert_or_assign(impl, SeenTensor{c10::weak_intrusive_ptr<c10::TensorImpl>(fresh[j].getIntrusivePtr()),
                                                static_cast<int64_t>(impl->version_counter().current_version()),
                                                pos + static_cast<int64_t>(j),
                                                static_cast<int64_t>(j) < fresh_context});
      }
    }
    py::tuple positions(at_positions.size());
    for (size_t i = 0; i < at_positions.size(); ++i) {
      PyTuple_SET_ITEM(positions.ptr(), i, PyLong_FromLongLong(at_positions[i]));
    }
    PyObject_GC_UnTrack(positions.ptr());  // ints only (NOTE: [untracked frames])
    return Recorded{std::move(dtypes), std::move(shapes), std::move(positions), n, lo};
  }

  // The dtypes and shapes tuples of a frame: the owner's previous ones when they still hold.
  void describe(const py::handle& owner, c10::ArrayRef<const at::Tensor*> tensors, py::tuple* dtypes,
                py::tuple* shapes) {
    FrameMeta* meta = nullptr;
    if (owner.ptr() != nullptr) {
      auto found = meta_.find(owner.ptr());
      if (found != meta_.end()) {
        meta = &found->second;
        if (meta->matches(tensors)) {
          *dtypes = meta->dtypes;
          *shapes = meta->shapes;
          return;
        }
      }
    }
    py::tuple d(tensors.size());
    py::tuple sh(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      PyTuple_SET_ITEM(d.ptr(), i, py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(tensors[i]->scalar_type()))).release().ptr());
      PyTuple_SET_ITEM(sh.ptr(), i, shape_of(*tensors[i]).release().ptr());
    }
    *dtypes = d;
    *shapes = sh;
    if (owner.ptr() == nullptr) return;
    if (meta == nullptr) {
      if (meta_.size() >= kMetaLimit) meta_.clear();
      meta = &meta_[owner.ptr()];
      meta->owner = py::reinterpret_borrow<py::object>(owner);
    }
    meta->remember(tensors);
    meta->dtypes = d;
    meta->shapes = sh;
  }

 private:
  void launch(const std::vector<at::Tensor>& batch, int64_t pos, double headroom, int64_t context) {
    launch_on(ring_, state_override_.defined() ? state_override_ : state_, batch, pos, headroom, context);
  }

  // Whether watch(quant=)'s fold takes `x` (the dtypes its kernels read as they are; float64 and
  // real float8 casts are the Python side's).
  bool quant_measures(const at::Tensor& x) const {
    const at::ScalarType t = x.scalar_type();
    return (t == at::kFloat || t == at::kHalf || t == at::kBFloat16) && x.numel() > 0 && quant_sums_.defined() &&
           quant_sums_.device() == device_ && quant_row_ < quant_sums_.size(0);
  }

  // launch, with batch[index] (the Python object `output`) measured by watch(quant=) too.
  void launch_measured(const std::vector<at::Tensor>& batch, int64_t pos, double headroom, int64_t context,
                       int64_t index, PyObject* output) {
    const at::Tensor& state = state_override_.defined() ? state_override_ : state_;
    at::Tensor records = at::empty({1, 10}, quant_sums_.options());
    const int64_t which[] = {index};
    const std::optional<at::Tensor> sums(quant_sums_), out(records);
    if (ring_.is_cpu()) {
      cpu::record_cpu(ring_, state, batch, pos, headroom, context, sums, quant_row_, quant_format_, which, out);
    } else {
      record_op().call(ring_, state, batch, pos, headroom, context, sums, quant_row_, quant_format_, which, out);
    }
    quant_took_ = py::reinterpret_steal<py::object>(THPVariable_Wrap(records[0]));
    quant_took_output_ = py::reinterpret_borrow<py::object>(output);
  }

  static const c10::TypedOperatorHandle<RecordSignature>& record_op() {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("numguard::record_", "").typed<RecordSignature>();
    return op;
  }

  static void launch_on(const at::Tensor& ring, const at::Tensor& state, const std::vector<at::Tensor>& batch,
                        int64_t pos, double headroom, int64_t context) {
    if (ring.is_cpu()) {
      cpu::record_cpu(ring, state, batch, pos, headroom, context);
      return;
    }
    record_op().call(ring, state, batch, pos, headroom, context, std::nullopt, 0, -1, {}, std::nullopt);
  }

  // One record_ per run of records bound for the same ring (NOTE: [one ring per device]).
  void launch_routed(const std::vector<at::Tensor>& batch, const std::vector<int>& slots, int64_t pos,
                     double headroom, int64_t context) {
    size_t i = 0;
    while (i < batch.size()) {
      size_t j = i + 1;
      while (j < batch.size() && slots[j] == slots[i]) ++j;
      const std::vector<at::Tensor> run(batch.begin() + i, batch.begin() + j);
      const int64_t start = pos + static_cast<int64_t>(i);
      // The run's share of the frame's leading context records.
      const int64_t run_context = std::clamp<int64_t>(context - static_cast<int64_t>(i), 0,
                                                      static_cast<int64_t>(j - i));
      if (slots[i] == 0) {
        launch(run, start, headroom, run_context);
      } else {
        const Side& side = sides_[slots[i] - 1];
        launch_on(side.ring, side.state, run, start, headroom, run_context);
        routed_.insert(routed_.end(), {slots[i], start, static_cast<int64_t>(j - i)});
      }
      i = j;
    }
  }

  // Where `x` (the Python object `obj`) is recorded: 0 the main ring, k >= 1 side ring k, -1
  // through the Python side's sanitize (copied to the main device, as anything not recordable as it is).
  int slot_for(PyObject* obj, const at::Tensor& x) {
    if (!router_.is_none()) {
      py::object key = router_(py::handle(obj));
      if (!key.is_none()) {
        if (!records_directly(x, x.device())) return -1;
        if (side_by_key_.contains(key)) return side_by_key_[key].cast<int>();
        const int slot = add_side(key);
        side_by_key_[key] = py::int_(slot);
        return slot;
      }
    }
    const c10::Device device = x.device();
    if (device == device_) return records_directly(x, device_) ? 0 : -1;
    if (device.is_meta() || !records_directly(x, device)) return -1;
    auto found = side_by_device_.find(device);
    if (found != side_by_device_.end()) return found->second;
    const int slot = add_side(py::cast(device));
    side_by_device_[device] = slot;  // -1 too: not asked again
    return slot;
  }

  int add_side(const py::object& key) {
    if (side_factory_.is_none()) return -1;
    try {
      py::tuple got = side_factory_(key);
      sides_.push_back(Side{THPVariable_Unpack(got[0].ptr()), THPVariable_Unpack(got[1].ptr())});
    } catch (py::error_already_set&) {
      return -1;  // no side ring: this device's tensors are copied to the main one, as before
    }
    return static_cast<int>(sides_.size());
  }

  static bool is_true(const py::handle& obj, const py::handle& name) {
    py::object value = obj.attr(name);
    const int truth = PyObject_IsTrue(value.ptr());
    if (truth < 0) throw py::error_already_set();
    return truth == 1;
  }

  static bool any_needs_values(const std::vector<at::Tensor>& xs) {
    for (const auto& x : xs) {
      if (x.is_meta() || x.is_nested() || x.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python)) return true;
    }
    return false;
  }

  // The Python side's sanitize of xs[index]; `where` (owner, labels, kinds, index) lets it name a
  // tensor it cannot read.
  std::vector<at::Tensor> sanitized(const py::list& xs, c10::ArrayRef<size_t> index, const py::handle& owner) {
    py::list originals(index.size());
    py::tuple at(index.size());
    for (size_t j = 0; j < index.size(); ++j) {
      originals[j] = xs[index[j]];
      at[j] = py::int_(index[j]);
    }
    auto or_none = [](const py::handle& h) { return h.ptr() ? py::reinterpret_borrow<py::object>(h) : py::none(); };
    py::object out = sanitize_(originals, py::make_tuple(or_none(owner), or_none(labels_), or_none(kinds_), at));
    std::vector<at::Tensor> tensors;
    tensors.reserve(index.size() + 1);
    for (py::handle t : out) tensors.push_back(THPVariable_Unpack(t.ptr()));
    return tensors;
  }

  py::list frames_;
  py::list frame_starts_;
  py::object frame_type_;
  at::Tensor ring_;
  at::Tensor state_;
  at::Tensor state_override_;  // for the duration of one record_frame call
  py::handle labels_, kinds_;  // likewise (borrowed)
  c10::Device device_{at::kCPU};
  int64_t size_ = 0;
  py::object fast_labels_ = py::none();
  py::object fast_kinds_ = py::none();
  py::object fast_section_ = py::none();
  int64_t fast_context_ = 0;
  py::object sanitize_;
  py::object grow_;
  int64_t seen_limit_;
  std::unordered_map<c10::TensorImpl*, SeenTensor> seen_;
  struct Side {
    at::Tensor ring;
    at::Tensor state;
  };
  std::vector<Side> sides_;  // slot k is sides_[k - 1]
  std::unordered_map<c10::Device, int> side_by_device_;
  py::dict side_by_key_;  // router keys (tests)
  py::object side_factory_ = py::none();
  py::object router_ = py::none();
  std::vector<int64_t> routed_;  // (slot, start, count) since the last take_routed
  std::unordered_map<PyObject*, FrameMeta> meta_;  // by owner
  at::Tensor quant_sums_;      // watch(quant=)'s running sums on the ring's device (undefined: off)
  int64_t quant_format_ = -1;
  int64_t quant_row_ = -1;     // the row of the module_call being recorded (-1: not measured)
  py::object quant_took_ = py::none();  // the record of the last measured output
  py::object quant_took_output_ = py::none();  // that output
};

}  // namespace

void bind_frame_recorder(py::module& module) {
  py::class_<FrameRecorder>(module, "FrameRecorder",
                            "The fast path of numguard.inspector.ring.FrameRing.record (see csrc/recorder.cpp).")
      .def(py::init<at::Tensor, at::Tensor, py::list, py::list, py::object, py::object, py::object, int64_t>(),
           py::arg("ring"), py::arg("state"), py::arg("frames"), py::arg("frame_starts"), py::arg("frame_type"),
           py::arg("sanitize"), py::arg("grow"), py::arg("seen_limit"))
      .def_readwrite("pos", &FrameRecorder::pos)
      .def_readwrite("window_lo", &FrameRecorder::window_lo)
      .def_readwrite("hf_calls", &FrameRecorder::hf_calls)
      .def_readwrite("pending_start", &FrameRecorder::pending_start)
      .def("record_frame", &FrameRecorder::record_frame, py::arg("owner"), py::arg("xs"), py::arg("labels"),
           py::arg("kinds"), py::arg("section"), py::arg("hf"), py::arg("weights"), py::arg("batch"),
           py::arg("state") = py::none(), py::arg("fresh") = false, py::arg("context") = 0)
      .def("module_call", &FrameRecorder::module_call, py::arg("owner"), py::arg("batch"), py::arg("args"),
           py::arg("kwargs"), py::arg("output"))
      .def("set_fast_path", &FrameRecorder::set_fast_path, py::arg("labels"), py::arg("kinds"), py::arg("section"),
           py::arg("context"))
      .def("set_ring", &FrameRecorder::set_ring)
      .def("set_quant", &FrameRecorder::set_quant, py::arg("sums"), py::arg("format"))
      .def("quant_took", &FrameRecorder::quant_took, py::arg("output"))
      .def("set_side_factory", &FrameRecorder::set_side_factory)
      .def("set_router", &FrameRecorder::set_router)
      .def("set_side", &FrameRecorder::set_side)
      .def("clear_sides", &FrameRecorder::clear_sides)
      .def("take_routed", &FrameRecorder::take_routed)
      .def("clear_seen", &FrameRecorder::clear_seen)
      .def("seen_count", &FrameRecorder::seen_count)
      .def("record", &FrameRecorder::record);
}

}  // namespace numguard
