// The host side of the per-batch weight table (numguard.inspector.weights.WeightTable.record):
// the steady-state batch, where the watched modules hold the same parameter objects, with the
// same dtypes and on the same device, as when the table's layout was built.
//
// In Python, walking every module's parameters to confirm that, picking the watched ones and
// handing them to the op took about as long as the stats launch itself (a list of hundreds of
// tensors converted per batch). Here one call walks the `_parameters` dicts, compares parameter
// identities with the remembered walk and calls multi_tensor_stats through the dispatcher. Any
// difference returns None, and the Python side rebuilds the layout as before.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/python_variable.h>

#include <vector>

namespace py = pybind11;

namespace numguard {
namespace {

class ParameterWalk {
 public:
  // The stats [W, 8] of the remembered watched parameters, or None when the walk differs.
  py::object stats(const py::list& owners) {
    if (!valid_ || !walk(owners, &current_) || current_ != walked_) return py::none();
    std::vector<at::Tensor> tensors;
    tensors.reserve(positions_.size());
    for (size_t i = 0; i < positions_.size(); ++i) {
      PyObject* obj = current_[positions_[i]];
      if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
          !PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(THPVariableClass))) {
        return py::none();
      }
      const at::Tensor& p = THPVariable_Unpack(obj);
      if (p.scalar_type() != dtypes_[i] || p.device() != device_ || p.layout() != at::kStrided ||
          p.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python)) {
        return py::none();
      }
      tensors.push_back(p);
    }
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("numguard::multi_tensor_stats", "")
                               .typed<at::Tensor(at::TensorList)>();
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;  // numguard's own bookkeeping: no autograd
      out = op.call(tensors);
    }
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
  }

  // Remember the current walk and which of its entries (`positions`) are the watched parameters.
  void remember(const py::list& owners, const std::vector<int64_t>& positions) {
    valid_ = false;
    walked_.clear();
    if (!walk(owners, &walked_)) return;
    dtypes_.clear();
    for (int64_t i : positions) {
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(walked_.size()), "numguard: parameter position ", i,
                  " outside the walk of ", walked_.size());
      PyObject* obj = walked_[i];
      if (!THPVariable_Check(obj)) return;
      const at::Tensor& p = THPVariable_Unpack(obj);
      if (dtypes_.empty()) device_ = p.device();
      dtypes_.push_back(p.scalar_type());
    }
    positions_ = positions;
    valid_ = !positions_.empty();
  }

  void forget() { valid_ = false; }

 private:
  // Every value of every live owner's module `_parameters` (None included), in owner order: the
  // same walk as WeightTable.record's fingerprint. Identities only (borrowed, compared, never
  // dereferenced after the GIL is released). False when an owner's module is not a plain module.
  static bool walk(const py::list& owners, std::vector<PyObject*>* out) {
    static const py::handle kRef = PyUnicode_InternFromString("ref");
    static const py::handle kParameters = PyUnicode_InternFromString("_parameters");
    out->clear();
    for (py::handle owner : owners) {
      py::object ref = owner.attr(kRef);
      if (ref.is_none()) continue;
      py::object module = ref();
      if (module.is_none()) continue;
      py::object params = module.attr(kParameters);
      if (!PyDict_Check(params.ptr())) return false;
      PyObject* key;
      PyObject* value;
      Py_ssize_t pos = 0;
      while (PyDict_Next(params.ptr(), &pos, &key, &value)) out->push_back(value);
    }
    return true;
  }

  bool valid_ = false;
  std::vector<PyObject*> walked_;
  std::vector<PyObject*> current_;
  std::vector<int64_t> positions_;
  std::vector<at::ScalarType> dtypes_;
  c10::Device device_{at::kCPU};
};

}  // namespace

void bind_parameter_walk(py::module& module) {
  py::class_<ParameterWalk>(module, "ParameterWalk",
                            "The steady-state path of numguard.inspector.weights.WeightTable.record "
                            "(see csrc/weights.cpp).")
      .def(py::init<>())
      .def("stats", &ParameterWalk::stats, py::arg("owners"))
      .def("remember", &ParameterWalk::remember, py::arg("owners"), py::arg("positions"))
      .def("forget", &ParameterWalk::forget);
}

}  // namespace numguard
