// The host side of folding confirmed frames into the per-module history
// (numguard.inspector.history.ModuleHistory.fold): which ring elements go to which table cells.
//
// The Python loop it replaces ran at every healthy check, a few list appends per tensor line:
// about 1.5 us per module call of a 200-module model. Here one call walks the Frame tuples
// directly. Same rules, same output order, as ModuleHistory._fold_lines (the pure-torch backend
// and the reference the tests compare with).
#include <torch/extension.h>

#include <cmath>
#include <vector>

namespace py = pybind11;

namespace numguard {
namespace {

// Frame fields (numguard.inspector.frames.Frame), by position.
enum FrameField : Py_ssize_t {
  kOwner = 0, kBatch = 1, kLabels = 3, kKinds = 4, kDtypes = 5, kShapes = 6, kSection = 7, kPositions = 12,
};

// Record columns (numguard.schema.STAT_FIELDS) and history fields (history.FIELDS) used here.
struct FoldLayout {
  int64_t ncols, abs_max, min_nonzero, subnormal;
  int64_t out_max, in_max, min_nz, grad_max, grad_min_nz, grad_sub;
};

bool starts_with(PyObject* s, const char* prefix) {
  if (!PyUnicode_Check(s)) return false;
  const char* text = PyUnicode_AsUTF8(s);
  if (text == nullptr) throw py::error_already_set();
  for (; *prefix != '\0'; ++prefix, ++text) {
    if (*text != *prefix) return false;
  }
  return true;
}

// Whether sequence `labels` has a first item that starts with `prefix`.
bool first_starts_with(PyObject* labels, const char* prefix) {
  const Py_ssize_t n = PySequence_Size(labels);
  if (n < 0) throw py::error_already_set();
  if (n == 0) return false;
  py::object first = py::reinterpret_steal<py::object>(PySequence_GetItem(labels, 0));
  if (!first) throw py::error_already_set();
  return starts_with(first.ptr(), prefix);
}

bool equals(PyObject* s, const char* text) {
  return PyUnicode_Check(s) && PyUnicode_CompareWithASCIIString(s, text) == 0;
}

int64_t as_int(PyObject* o) {
  const int64_t v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// Frames [lo, hi) of `frames`: ring element indexes (`index`), their multipliers (`mult`) and the
// table cells they reduce into (`cells`); updates `slot_batch` (list) and `dtypes` (dict) like the
// Python loop and returns the slots newly taken by a batch.
py::tuple fold_lines(const py::list& frames, int64_t lo, int64_t hi, int64_t ring_size, int64_t oldest,
                     int64_t window, int64_t nfields, const py::list& slot_batch, const py::dict& by_name,
                     const py::dict& dtypes, const py::object& floating, const py::object& one_in_one_out,
                     const std::vector<int64_t>& layout_values) {
  TORCH_CHECK(layout_values.size() == 10, "numguard: fold_lines needs 10 layout values");
  const FoldLayout L{layout_values[0], layout_values[1], layout_values[2], layout_values[3], layout_values[4],
                     layout_values[5], layout_values[6], layout_values[7], layout_values[8], layout_values[9]};
  TORCH_CHECK(ring_size > 0 && window > 0, "numguard: fold_lines needs a ring and a window");
  static const py::handle kIndex = PyUnicode_InternFromString("index");
  static const py::handle kName = PyUnicode_InternFromString("name");
  std::vector<int64_t> index, cells;
  std::vector<double> mult;
  py::list new_slots;
  std::vector<std::pair<int64_t, bool>> lines;
  const Py_ssize_t n_frames = PyList_GET_SIZE(frames.ptr());
  hi = std::min<int64_t>(hi, n_frames);
  for (int64_t i = std::max<int64_t>(lo, 0); i < hi; ++i) {
    PyObject* f = PyList_GET_ITEM(frames.ptr(), i);
    if (!PyTuple_Check(f) || PyTuple_GET_SIZE(f) <= kPositions) throw py::type_error("numguard: not a Frame");
    PyObject* section = PyTuple_GET_ITEM(f, kSection);
    PyObject* labels = PyTuple_GET_ITEM(f, kLabels);
    int64_t row;
    bool forward;
    if (equals(section, "forward")) {
      row = py::handle(PyTuple_GET_ITEM(f, kOwner)).attr(kIndex).cast<int64_t>();
      if (row < 0) continue;
      forward = true;
    } else if (equals(section, "backward") && first_starts_with(labels, "grad_")) {
      py::object name = py::handle(PyTuple_GET_ITEM(f, kOwner)).attr(kName);
      PyObject* found = PyDict_GetItemWithError(by_name.ptr(), name.ptr());
      if (found == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        continue;
      }
      row = as_int(found);
      forward = false;
    } else {
      continue;
    }
    const int64_t batch = as_int(PyTuple_GET_ITEM(f, kBatch));
    const int64_t slot = ((batch % window) + window) % window;
    PyObject* held = PyList_GET_ITEM(slot_batch.ptr(), slot);
    if (held == Py_None || as_int(held) != batch) {
      PyList_SetItem(slot_batch.ptr(), slot, PyLong_FromLongLong(batch));  // steals the new int
      new_slots.append(py::int_(slot));
    }
    const int64_t base = (row * window + slot) * nfields;
    PyObject* positions = PyTuple_GET_ITEM(f, kPositions);
    PyObject* f_dtypes = PyTuple_GET_ITEM(f, kDtypes);
    lines.clear();
    if (labels == one_in_one_out.ptr()) {
      lines.emplace_back(0, false);  // input[0]
      lines.emplace_back(1, true);   // output
    } else {
      PyObject* kinds = PyTuple_GET_ITEM(f, kKinds);
      const Py_ssize_t n = std::min(PySequence_Size(labels), PySequence_Size(kinds));
      if (n < 0) throw py::error_already_set();
      int64_t t = 0;
      for (Py_ssize_t j = 0; j < n; ++j) {
        py::object kind = py::reinterpret_steal<py::object>(PySequence_GetItem(kinds, j));
        if (!kind) throw py::error_already_set();
        if ((as_int(kind.ptr()) & 3) != 0) continue;  // not a TENSOR line
        py::object label = py::reinterpret_steal<py::object>(PySequence_GetItem(labels, j));
        if (!label) throw py::error_already_set();
        lines.emplace_back(t++, starts_with(label.ptr(), "output"));
      }
    }
    for (const auto& [t, is_output] : lines) {
      py::object p_obj = py::reinterpret_steal<py::object>(PySequence_GetItem(positions, t));
      py::object dtype = py::reinterpret_steal<py::object>(PySequence_GetItem(f_dtypes, t));
      if (!p_obj || !dtype) throw py::error_already_set();
      const int64_t p = as_int(p_obj.ptr());
      if (p < oldest) continue;
      const int contains = PySet_Contains(floating.ptr(), dtype.ptr());
      if (contains < 0) throw py::error_already_set();
      if (!contains) continue;
      const int64_t r = (((p % ring_size) + ring_size) % ring_size) * L.ncols;
      py::int_ row_key(row);
      if (forward) {
        index.push_back(r + L.abs_max);
        index.push_back(r + L.min_nonzero);
        mult.push_back(1.0);
        mult.push_back(-1.0);
        cells.push_back(base + (is_output ? L.out_max : L.in_max));
        cells.push_back(base + L.min_nz);
        if (is_output && !dtypes.contains(row_key)) {
          py::list kinds_of(2);
          kinds_of[0] = py::str(dtype);
          kinds_of[1] = py::none();
          dtypes[row_key] = kinds_of;
        }
      } else {
        py::object shape = py::reinterpret_steal<py::object>(PySequence_GetItem(PyTuple_GET_ITEM(f, kShapes), t));
        if (!shape) throw py::error_already_set();
        double numel = 1.0;
        for (py::handle d : shape) numel *= static_cast<double>(d.cast<int64_t>());
        index.push_back(r + L.abs_max);
        index.push_back(r + L.min_nonzero);
        index.push_back(r + L.subnormal);
        mult.push_back(1.0);
        mult.push_back(-1.0);
        mult.push_back(numel != 0.0 ? 1.0 / numel : 0.0);
        cells.push_back(base + L.grad_max);
        cells.push_back(base + L.grad_min_nz);
        cells.push_back(base + L.grad_sub);
        PyObject* kinds_of = PyDict_GetItemWithError(dtypes.ptr(), row_key.ptr());  // borrowed
        if (kinds_of == nullptr) {
          if (PyErr_Occurred()) throw py::error_already_set();
          py::list fresh(2);
          fresh[0] = py::none();
          fresh[1] = py::none();
          dtypes[row_key] = fresh;
          kinds_of = fresh.ptr();
        }
        if (PyList_Check(kinds_of) && PyList_GET_ITEM(kinds_of, 1) == Py_None) {
          PyList_SetItem(kinds_of, 1, py::str(dtype).release().ptr());
        }
      }
    }
  }
  const int64_t n = static_cast<int64_t>(mult.size());
  at::Tensor index_t = at::empty({2 * n}, at::kLong);
  at::Tensor mult_t = at::empty({n}, at::kDouble);
  int64_t* out_index = index_t.data_ptr<int64_t>();
  std::copy(index.begin(), index.end(), out_index);
  std::copy(cells.begin(), cells.end(), out_index + n);
  std::copy(mult.begin(), mult.end(), mult_t.data_ptr<double>());
  return py::make_tuple(index_t, mult_t, new_slots);
}

}  // namespace

void bind_history(py::module& module) {
  module.def("fold_lines", &fold_lines,
             "The ring elements, multipliers and table cells of folding frames into the module history "
             "(see csrc/history.cpp).",
             py::arg("frames"), py::arg("lo"), py::arg("hi"), py::arg("ring_size"), py::arg("oldest"),
             py::arg("window"), py::arg("nfields"), py::arg("slot_batch"), py::arg("by_name"), py::arg("dtypes"),
             py::arg("floating"), py::arg("one_in_one_out"), py::arg("layout"));
}

}  // namespace numguard
