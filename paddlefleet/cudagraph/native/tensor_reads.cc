// Tensor reads for the per-call checks, compiled against the installed Paddle's headers
// (NOTE [ Compiled tensor reads ] in native/__init__.py).
//
// Each function answers exactly what the Python reads it replaces answer, or None where it cannot
// tell (an uninitialized, undefined or non-dense tensor, a 4-D tensor whose shape Paddle's layout
// autotune may permute, a place other than CPU or GPU, a dtype missing from the table): the caller
// then reads the tensor in Python as before, errors included.
#include <Python.h>
#include <structmember.h>

#include <cstddef>
#include <cstdint>
#include <exception>

#include <new>
#include <string>
#include <vector>

#include "paddle/phi/api/include/api.h"
#include "paddle/phi/api/include/tensor.h"
#include "paddle/phi/core/ddim.h"

// Paddle's getters of grad mode and autocast (public members of paddle::imperative::Tracer and a function of
// paddle/fluid/imperative/tracer.h, a header Paddle does not ship), bound to their symbols: weak, so that a
// Paddle without one loads this module and leaves state() to Python. The getters take the current tracer.
bool tracer_has_grad(const void* tracer) __asm__("_ZNK6paddle10imperative6Tracer7HasGradEv") __attribute__((weak));
int tracer_amp_level(const void* tracer) __asm__("_ZNK6paddle10imperative6Tracer11GetAmpLevelEv")
    __attribute__((weak));
std::string tracer_amp_dtype(const void* tracer) __asm__("_ZNK6paddle10imperative6Tracer11GetAmpDtypeB5cxx11Ev")
    __attribute__((weak));
// const std::shared_ptr<Tracer>& GetCurrentTracer(): the reference's first word is the tracer.
void* const* current_tracer() __asm__("_ZN6paddle10imperative16GetCurrentTracerEv") __attribute__((weak));

namespace {

// The object layout of Paddle's eager Tensor (paddle/utils/pybind.h of the same Paddle).
struct TensorObject {
  PyObject_HEAD paddle::Tensor tensor;
  PyObject* weakrefs;
};

PyTypeObject* tensor_type = nullptr;  // paddle.Tensor
PyObject* dtype_ints = nullptr;       // tuple: phi DataType code -> int(t.dtype), or None
PyObject* cpu_key = nullptr;          // "cpu": place_key of a CPU place
PyObject* stop_gradient_name = nullptr;

enum Read { kUnknown = -1, kNo = 0, kYes = 1 };

// The readable tensor behind ``obj``, or nullptr (not a tensor, or nothing this file reads).
const paddle::Tensor* readable(PyObject* obj) {
  if (tensor_type == nullptr || !PyObject_TypeCheck(obj, tensor_type)) return nullptr;
  const paddle::Tensor& t = reinterpret_cast<TensorObject*>(obj)->tensor;
  try {
    if (!t.defined() || !t.is_dense_tensor() || !t.initialized()) return nullptr;
    if (t.dims().size() == 4) return nullptr;  // the layout autotune may permute a 4-D shape
  } catch (...) {
    return nullptr;
  }
  return &t;
}

// place_key(t.place) (io/static_inputs.py) as a new reference, or nullptr for another place.
PyObject* place_key(const paddle::Tensor& t) {
  const phi::Place& place = t.place();
  switch (place.GetType()) {
    case phi::AllocationType::GPU:
      return PyLong_FromLong(place.GetDeviceId());
    case phi::AllocationType::CPU:
      Py_INCREF(cpu_key);
      return cpu_key;
    default:
      return nullptr;
  }
}

// int(t.dtype) as a borrowed reference, or nullptr.
PyObject* dtype_int(const paddle::Tensor& t) {
  Py_ssize_t code = static_cast<Py_ssize_t>(t.dtype());
  if (code < 0 || code >= PyTuple_GET_SIZE(dtype_ints)) return nullptr;
  PyObject* value = PyTuple_GET_ITEM(dtype_ints, code);
  return value == Py_None ? nullptr : value;
}

// t.stop_gradient as Py_True/Py_False (borrowed: the singletons), or nullptr with an error set.
PyObject* stop_gradient(PyObject* obj) {
  PyObject* value = PyObject_GetAttr(obj, stop_gradient_name);
  if (value == nullptr) return nullptr;
  Py_DECREF(value);  // a bool singleton: still alive
  return value;
}

// The key part (shape, int(dtype), place_key, stop_gradient) of ``obj`` as KeyMaker.key makes it,
// a new reference; Py_None (new reference) where it cannot tell; nullptr with an error set.
PyObject* meta_of(PyObject* obj) {
  const paddle::Tensor* t = readable(obj);
  if (t == nullptr) Py_RETURN_NONE;
  PyObject* dtype = dtype_int(*t);  // borrowed
  if (dtype == nullptr) Py_RETURN_NONE;
  PyObject* place = nullptr;
  PyObject* shape = nullptr;
  try {
    place = place_key(*t);
    if (place == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;
    }
    const auto& dims = t->dims();
    int rank = dims.size();
    shape = PyTuple_New(rank);
    for (int i = 0; shape != nullptr && i < rank; ++i) {
      PyObject* d = PyLong_FromLongLong(dims[i]);
      if (d == nullptr) Py_CLEAR(shape);
      else PyTuple_SET_ITEM(shape, i, d);
    }
  } catch (...) {
    Py_XDECREF(shape);
    Py_XDECREF(place);
    Py_RETURN_NONE;
  }
  PyObject* sg = shape == nullptr ? nullptr : stop_gradient(obj);  // borrowed
  PyObject* meta = sg == nullptr ? nullptr : PyTuple_New(4);
  if (meta == nullptr) {
    Py_XDECREF(shape);
    Py_DECREF(place);
    return nullptr;
  }
  Py_INCREF(dtype);
  Py_INCREF(sg);
  PyTuple_SET_ITEM(meta, 0, shape);
  PyTuple_SET_ITEM(meta, 1, dtype);
  PyTuple_SET_ITEM(meta, 2, place);
  PyTuple_SET_ITEM(meta, 3, sg);
  return meta;
}

// Whether ``obj`` has the key part ``meta`` (KeyMaker.is_key_of's per-tensor test, host marks
// aside): kYes, kNo, kUnknown; an error (-2) with a Python error set.
int matches(PyObject* obj, PyObject* meta) {
  if (!PyTuple_Check(meta) || PyTuple_GET_SIZE(meta) != 4) return kNo;
  const paddle::Tensor* t = readable(obj);
  if (t == nullptr) return kUnknown;
  PyObject* sg = stop_gradient(obj);
  if (sg == nullptr) return -2;
  if (sg != PyTuple_GET_ITEM(meta, 3)) return kNo;
  try {
    PyObject* shape = PyTuple_GET_ITEM(meta, 0);
    const auto& dims = t->dims();
    int rank = dims.size();
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != rank) return kNo;
    for (int i = 0; i < rank; ++i) {
      PyObject* d = PyTuple_GET_ITEM(shape, i);
      if (!PyLong_CheckExact(d)) return kUnknown;
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(d, &overflow);
      if (overflow != 0) return kUnknown;
      if (v != dims[i]) return kNo;
    }
    PyObject* dtype = dtype_int(*t);
    if (dtype == nullptr) return kUnknown;
    if (dtype != PyTuple_GET_ITEM(meta, 1)) {  // the table's ints are the keys' own objects mostly
      int eq = PyObject_RichCompareBool(dtype, PyTuple_GET_ITEM(meta, 1), Py_EQ);
      if (eq < 0) return -2;
      if (!eq) return kNo;
    }
    const phi::Place& place = t->place();
    PyObject* want = PyTuple_GET_ITEM(meta, 2);
    switch (place.GetType()) {
      case phi::AllocationType::GPU: {
        if (!PyLong_CheckExact(want)) return kNo;
        long id = PyLong_AsLong(want);
        if (id == -1 && PyErr_Occurred()) return -2;
        return id == place.GetDeviceId() ? kYes : kNo;
      }
      case phi::AllocationType::CPU: {
        if (want == cpu_key) return kYes;
        int eq = PyObject_RichCompareBool(want, cpu_key, Py_EQ);
        if (eq < 0) return -2;
        return eq ? kYes : kNo;
      }
      default:
        return kUnknown;
    }
  } catch (...) {
    return kUnknown;
  }
}

PyObject* py_setup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyType_Check(args[0]) || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "setup(tensor_type, dtype_ints: tuple)");
    return nullptr;
  }
  Py_INCREF(args[0]);
  Py_INCREF(args[1]);
  Py_XSETREF(dtype_ints, args[1]);
  PyTypeObject* old = tensor_type;
  tensor_type = reinterpret_cast<PyTypeObject*>(args[0]);
  Py_XDECREF(reinterpret_cast<PyObject*>(old));
  Py_RETURN_NONE;
}

// dtype_code(tensor_type, t): the DataType code of ``t`` (to make the table setup() takes), or None.
PyObject* py_dtype_code(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyType_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "dtype_code(tensor_type, tensor)");
    return nullptr;
  }
  PyObject* obj = args[1];
  if (!PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(args[0]))) Py_RETURN_NONE;
  const paddle::Tensor& t = reinterpret_cast<TensorObject*>(obj)->tensor;
  try {
    if (!t.defined()) Py_RETURN_NONE;
    return PyLong_FromLong(static_cast<long>(t.dtype()));
  } catch (...) {
    Py_RETURN_NONE;
  }
}

PyObject* py_meta(PyObject*, PyObject* obj) { return meta_of(obj); }

// metas(tensors): the tuple of meta() of a sequence of tensors, or None if any is None.
PyObject* py_metas(PyObject*, PyObject* seq) {
  PyObject* fast = PySequence_Fast(seq, "metas() takes a sequence of tensors");
  if (fast == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  PyObject* out = PyTuple_New(n);
  if (out == nullptr) {
    Py_DECREF(fast);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* m = meta_of(items[i]);
    if (m == nullptr || m == Py_None) {
      Py_DECREF(out);
      Py_DECREF(fast);
      return m;  // nullptr (error) or None (a new reference)
    }
    PyTuple_SET_ITEM(out, i, m);
  }
  Py_DECREF(fast);
  return out;
}

// match(tensors, metas): True, False, or None where a tensor cannot be read here.
PyObject* py_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "match(tensors: tuple, metas: tuple)");
    return nullptr;
  }
  if (!PyTuple_Check(args[0]) || !PyTuple_Check(args[1])) Py_RETURN_NONE;  // read in Python
  Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
  if (n != PyTuple_GET_SIZE(args[1])) Py_RETURN_FALSE;
  bool unknown = false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    int r = matches(PyTuple_GET_ITEM(args[0], i), PyTuple_GET_ITEM(args[1], i));
    if (r == -2) return nullptr;
    if (r == kNo) Py_RETURN_FALSE;
    if (r == kUnknown) unknown = true;
  }
  if (unknown) Py_RETURN_NONE;
  Py_RETURN_TRUE;
}

// data_ptr(t): t.data_ptr() for an initialized dense tensor, else None (Python gives None or 0 there, by version).
PyObject* py_data_ptr(PyObject*, PyObject* obj) {
  if (tensor_type == nullptr || !PyObject_TypeCheck(obj, tensor_type)) Py_RETURN_NONE;
  const paddle::Tensor& t = reinterpret_cast<TensorObject*>(obj)->tensor;
  try {
    if (!t.defined() || !t.is_dense_tensor() || !t.initialized()) Py_RETURN_NONE;
    return PyLong_FromLongLong(reinterpret_cast<int64_t>(t.data()));
  } catch (...) {
    Py_RETURN_NONE;
  }
}

// empty_like_each(tensors): for a list of tensors, a list of new tensors, each holding memory of the same shape, dtype
// and place, unfilled: what ``_C_ops.empty(t.shape, t.dtype, t.place)`` makes for each (Paddle's own empty() API,
// the Python objects made as Paddle's ToPyObject makes an op's output), without a Python call per tensor. None where
// one of them cannot be read here or Paddle's empty() fails (the caller makes them in Python, errors included).
PyObject* py_empty_like_each(PyObject*, PyObject* tensors) {
  if (!PyList_CheckExact(tensors) || tensor_type == nullptr) Py_RETURN_NONE;
  Py_ssize_t n = PyList_GET_SIZE(tensors);
  std::vector<paddle::Tensor> made;
  made.reserve(n);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      const paddle::Tensor* t = readable(PyList_GET_ITEM(tensors, i));
      if (t == nullptr) Py_RETURN_NONE;
      const auto& dims = t->dims();
      std::vector<int64_t> shape(dims.size());
      for (int d = 0; d < dims.size(); ++d) shape[d] = dims[d];
      made.push_back(paddle::experimental::empty(shape, t->dtype(), t->place()));
    }
  } catch (...) {
    Py_RETURN_NONE;
  }
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = tensor_type->tp_alloc(tensor_type, 0);
    if (obj == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    new (&reinterpret_cast<TensorObject*>(obj)->tensor) paddle::Tensor();
    reinterpret_cast<TensorObject*>(obj)->tensor = made[i];
    PyList_SET_ITEM(out, i, obj);
  }
  return out;
}

// moved(homes): the index of the first home (parameters dict, name, param, stop_gradient, data
// pointer) whose parameter was replaced, moved or (un)frozen; -1 for none; None where a parameter
// cannot be read here (ParamSet.moved reads it in Python).
PyObject* py_moved(PyObject*, PyObject* homes) {
  if (!PyTuple_Check(homes)) Py_RETURN_NONE;
  Py_ssize_t n = PyTuple_GET_SIZE(homes);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* home = PyTuple_GET_ITEM(homes, i);
    if (!PyTuple_Check(home) || PyTuple_GET_SIZE(home) != 5) Py_RETURN_NONE;
    PyObject* params = PyTuple_GET_ITEM(home, 0);
    PyObject* p = PyTuple_GET_ITEM(home, 2);
    if (!PyDict_Check(params)) Py_RETURN_NONE;
    PyObject* now = PyDict_GetItemWithError(params, PyTuple_GET_ITEM(home, 1));
    if (now == nullptr && PyErr_Occurred()) return nullptr;
    if (now != p) return PyLong_FromSsize_t(i);
    if (tensor_type == nullptr || !PyObject_TypeCheck(p, tensor_type)) Py_RETURN_NONE;
    const paddle::Tensor& t = reinterpret_cast<TensorObject*>(p)->tensor;
    long long ptr;
    try {
      if (!t.defined() || !t.is_dense_tensor() || !t.initialized()) Py_RETURN_NONE;
      ptr = reinterpret_cast<int64_t>(t.data());
    } catch (...) {
      Py_RETURN_NONE;
    }
    PyObject* want = PyTuple_GET_ITEM(home, 4);
    if (!PyLong_CheckExact(want)) Py_RETURN_NONE;
    int overflow = 0;
    long long w = PyLong_AsLongLongAndOverflow(want, &overflow);
    if (overflow != 0) Py_RETURN_NONE;
    if (w != ptr) return PyLong_FromSsize_t(i);
    PyObject* sg = stop_gradient(p);
    if (sg == nullptr) return nullptr;
    if (sg != PyTuple_GET_ITEM(home, 3)) return PyLong_FromSsize_t(i);
  }
  return PyLong_FromLong(-1);
}

// The tensor of ``obj`` where it is a defined tensor (its version counter and state can be read), else nullptr.
paddle::Tensor* defined(PyObject* obj) {
  if (tensor_type == nullptr || !PyObject_TypeCheck(obj, tensor_type)) return nullptr;
  paddle::Tensor& t = reinterpret_cast<TensorObject*>(obj)->tensor;
  try {
    if (!t.defined() || !t.is_dense_tensor()) return nullptr;
  } catch (...) {
    return nullptr;
  }
  return &t;
}

// An exact int's value in ``out``; false for anything else (the caller then answers None).
bool exact_int(PyObject* obj, long long* out) {
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(obj, &overflow);
  return overflow == 0 && !(*out == -1 && PyErr_Occurred());
}

// versions(views): [v._inplace_version() for v in views], or None where one is not a defined dense tensor.
PyObject* py_versions(PyObject*, PyObject* seq) {
  PyObject* fast = PySequence_Fast(seq, "versions() takes a sequence of tensors");
  if (fast == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  PyObject* out = PyList_New(n);
  if (out == nullptr) {
    Py_DECREF(fast);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    paddle::Tensor* t = defined(items[i]);
    PyObject* v = nullptr;
    if (t != nullptr) {
      try {
        v = PyLong_FromUnsignedLong(t->current_inplace_version());
      } catch (...) {
        v = nullptr;
      }
    }
    if (v == nullptr) {
      Py_DECREF(out);
      Py_DECREF(fast);
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;
    }
    PyList_SET_ITEM(out, i, v);
  }
  Py_DECREF(fast);
  return out;
}

// Whether every view of ``views_arg`` still has its data pointer (``ptrs_arg``) and in-place version, or, with
// ``ptrs_arg`` nullptr, is freed (holds no memory) with its version: kYes, kNo, kUnknown (a view or value that
// cannot be read here), -2 with a Python error set.
int views_hold(PyObject* views_arg, PyObject* ptrs_arg, PyObject* versions_arg) {
  PyObject* views = PySequence_Fast(views_arg, "takes sequences");
  if (views == nullptr) return -2;
  PyObject* ptrs = ptrs_arg == nullptr ? nullptr : PySequence_Fast(ptrs_arg, "takes sequences");
  PyObject* versions = PySequence_Fast(versions_arg, "takes sequences");
  int result = -2;
  if (versions != nullptr && (ptrs_arg == nullptr || ptrs != nullptr)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(views);
    bool short_values =
        PySequence_Fast_GET_SIZE(versions) < n || (ptrs != nullptr && PySequence_Fast_GET_SIZE(ptrs) < n);
    result = short_values ? kUnknown : kYes;
    for (Py_ssize_t i = 0; i < n && result == kYes; ++i) {
      paddle::Tensor* t = defined(PySequence_Fast_GET_ITEM(views, i));
      long long ptr = 0, version;
      if (t == nullptr || !exact_int(PySequence_Fast_GET_ITEM(versions, i), &version) ||
          (ptrs != nullptr && !exact_int(PySequence_Fast_GET_ITEM(ptrs, i), &ptr))) {
        result = kUnknown;
        break;
      }
      try {
        bool initialized = t->initialized();
        if (ptrs != nullptr && !initialized) {  // its data_ptr() is None or 0 by Paddle version: Python compares
          result = kUnknown;
          break;
        }
        bool kept = ptrs == nullptr ? !initialized : reinterpret_cast<int64_t>(t->data()) == ptr;
        if (!kept || static_cast<long long>(t->current_inplace_version()) != version) result = kNo;
      } catch (...) {
        result = kUnknown;
      }
    }
  }
  Py_XDECREF(versions);
  Py_XDECREF(ptrs);
  Py_DECREF(views);
  return PyErr_Occurred() ? -2 : result;
}

PyObject* answer(int result) {
  if (result == -2) return nullptr;
  if (result == kUnknown) Py_RETURN_NONE;
  return PyBool_FromLong(result == kYes);
}

// unchanged(views, ptrs, versions): GradPlan's _unchanged; None where a view cannot be read here.
PyObject* py_unchanged(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "unchanged(views, ptrs, versions)");
    return nullptr;
  }
  return answer(views_hold(args[0], args[1], args[2]));
}

// freed_unchanged(views, versions): GradPlan._repointed's precondition; None where a view cannot be read here.
PyObject* py_freed_unchanged(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "freed_unchanged(views, versions)");
    return nullptr;
  }
  return answer(views_hold(args[0], nullptr, args[1]));
}

// ptrs_hold(tensors, ptrs): whether ``list(map(Tensor.data_ptr, tensors)) == ptrs`` (``ptrs`` a list of ints), read
// from the C++ tensors: True, False, or None where a tensor cannot be read here and no other one differs (read in
// Python). A tensor whose pointer differs answers False whatever the others are, as the list comparison does.
PyObject* py_ptrs_hold(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "ptrs_hold(tensors, ptrs)");
    return nullptr;
  }
  if (!PyList_CheckExact(args[1]) || tensor_type == nullptr) Py_RETURN_NONE;
  PyObject* fast = PySequence_Fast(args[0], "ptrs_hold() takes a sequence of tensors");
  if (fast == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  int result = n == PyList_GET_SIZE(args[1]) ? kYes : kNo;
  for (Py_ssize_t i = 0; i < n && result != kNo; ++i) {
    long long want;
    if (!exact_int(PyList_GET_ITEM(args[1], i), &want) || !PyObject_TypeCheck(items[i], tensor_type)) {
      result = kUnknown;
      continue;
    }
    const paddle::Tensor& t = reinterpret_cast<TensorObject*>(items[i])->tensor;
    try {
      if (!t.defined() || !t.is_dense_tensor() || !t.initialized()) {
        result = kUnknown;
        continue;
      }
      if (reinterpret_cast<int64_t>(t.data()) != want) result = kNo;
    } catch (...) {
      result = kUnknown;
    }
  }
  Py_DECREF(fast);
  if (PyErr_Occurred()) return nullptr;
  return answer(result);
}

// flags_hold(tensors, flags): whether ``list(map(attrgetter("stop_gradient"), tensors)) == flags`` (``flags`` a list
// of bools): True or False, read through the same attribute; None where a flag is not a bool (compared in Python).
PyObject* py_flags_hold(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "flags_hold(tensors, flags)");
    return nullptr;
  }
  if (!PyList_CheckExact(args[1])) Py_RETURN_NONE;
  PyObject* fast = PySequence_Fast(args[0], "flags_hold() takes a sequence of tensors");
  if (fast == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  int result = n == PyList_GET_SIZE(args[1]) ? kYes : kNo;
  for (Py_ssize_t i = 0; i < n && result == kYes; ++i) {
    PyObject* want = PyList_GET_ITEM(args[1], i);
    if (!PyBool_Check(want)) {
      result = kUnknown;
      break;
    }
    PyObject* now = PyObject_GetAttr(items[i], stop_gradient_name);
    if (now == nullptr) {
      result = -2;
      break;
    }
    if (now != want) result = PyBool_Check(now) ? kNo : kUnknown;
    Py_DECREF(now);
  }
  Py_DECREF(fast);
  return answer(result);
}

// ---------------------------------------------------------------- the call's state
// (paddle.is_grad_enabled(), amp_state()) of core/keys.py and core/state.py: grad mode, and the autocast level
// (its int) and dtype, read from Paddle's tracer in C++. Python reads them through pybind properties of the tracer
// object, ~1 us each alone and 3-4 us inside a call.

PyObject* global_var = nullptr;    // paddle.base.framework.global_var: its _dygraph_tracer_ None -> Python answers
PyObject* tracer_name = nullptr;   // "_dygraph_tracer_"
std::string amp_dtype_seen;        // the autocast dtype of amp_seen
long amp_level_seen = 0;           // and its level
PyObject* amp_seen = nullptr;      // (level, dtype) of the last read
PyObject* states_seen[2] = {nullptr, nullptr};  // (False, amp_seen), (True, amp_seen)

// Whether this Paddle has every getter state() calls (weak symbols: null where missing).
bool getters_bound() {
  return tracer_has_grad != nullptr && tracer_amp_level != nullptr && tracer_amp_dtype != nullptr &&
         current_tracer != nullptr;
}

// setup_state(global_var): True where this Paddle has every getter state() calls, else False.
PyObject* py_setup_state(PyObject*, PyObject* arg) {
  Py_INCREF(arg);
  Py_XSETREF(global_var, arg);
  return PyBool_FromLong(getters_bound());
}

// The current (grad enabled, (int(amp level), amp dtype)) of state(), a borrowed reference; nullptr with
// ``*unknown`` set where it cannot tell (no tracer, a getter missing or failing), nullptr with an error set.
PyObject* current_state(bool* unknown) {
  *unknown = true;
  if (global_var == nullptr || !getters_bound()) return nullptr;
  PyObject* python_tracer = PyObject_GetAttr(global_var, tracer_name);
  if (python_tracer == nullptr) {
    *unknown = false;
    return nullptr;
  }
  bool none = python_tracer == Py_None;
  Py_DECREF(python_tracer);
  if (none) return nullptr;
  bool grad;
  long level;
  std::string dtype;
  try {
    void* const* current = current_tracer();
    if (current == nullptr || *current == nullptr) return nullptr;
    grad = tracer_has_grad(*current);
    level = tracer_amp_level(*current);
    dtype = tracer_amp_dtype(*current);
  } catch (...) {
    return nullptr;
  }
  *unknown = false;
  bool same = amp_seen != nullptr && level == amp_level_seen && dtype == amp_dtype_seen;
  if (!same) {
    PyObject* level_int = PyLong_FromLong(level);
    PyObject* dtype_str = PyUnicode_FromStringAndSize(dtype.data(), static_cast<Py_ssize_t>(dtype.size()));
    PyObject* amp = level_int == nullptr || dtype_str == nullptr ? nullptr : PyTuple_Pack(2, level_int, dtype_str);
    Py_XDECREF(level_int);
    Py_XDECREF(dtype_str);
    if (amp == nullptr) return nullptr;
    PyObject* off = PyTuple_Pack(2, Py_False, amp);
    PyObject* on = PyTuple_Pack(2, Py_True, amp);
    if (off == nullptr || on == nullptr) {
      Py_DECREF(amp);
      Py_XDECREF(off);
      Py_XDECREF(on);
      return nullptr;
    }
    Py_XSETREF(amp_seen, amp);
    Py_XSETREF(states_seen[0], off);
    Py_XSETREF(states_seen[1], on);
    amp_dtype_seen = dtype;
    amp_level_seen = level;
  }
  return states_seen[grad ? 1 : 0];
}

// state(): (grad enabled, (int(amp level), amp dtype)), or None (no tracer, a getter missing or failing).
PyObject* py_state(PyObject*, PyObject*) {
  bool unknown;
  PyObject* result = current_state(&unknown);
  if (result == nullptr) {
    if (unknown) Py_RETURN_NONE;
    return nullptr;
  }
  Py_INCREF(result);
  return result;
}

// ---------------------------------------------------------------- a call against a key
// key_of(args, metas, grad, amp, layers, training): KeyMaker.is_key_of of a call of positional arguments whose
// key's argument part is the positional form with ``metas`` and whose state is (grad, amp, training), the
// training flags those of ``layers``, read in one call: True, False, or None where a tensor or the state cannot
// be read here (the caller reads them in Python). A non-tensor argument answers False (the call has another form).
PyObject* training_name = nullptr;  // "training"

// Whether the call of the ``n`` positional ``call`` arguments is of the key whose argument metas are ``metas`` and
// whose state is (grad, amp, training), with ``layers``' training flags: kYes, kNo, kUnknown (read in Python), -2
// with an error set.
int key_matches(PyObject* const* call, Py_ssize_t n, PyObject* metas, PyObject* grad, PyObject* amp_want,
                PyObject* layers, PyObject* training) {
  if (tensor_type == nullptr || !PyTuple_Check(metas) || !PyList_Check(layers) || !PyTuple_Check(training))
    return kUnknown;
  if (n != PyTuple_GET_SIZE(metas)) return kNo;
  bool unknown = false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyObject_TypeCheck(call[i], tensor_type)) return kNo;
    int r = matches(call[i], PyTuple_GET_ITEM(metas, i));
    if (r == -2 || r == kNo) return r;
    if (r == kUnknown) unknown = true;
  }
  if (unknown) return kUnknown;
  bool no_state;
  PyObject* state = current_state(&no_state);  // borrowed
  if (state == nullptr) return no_state ? kUnknown : -2;
  if (PyTuple_GET_ITEM(state, 0) != grad) return kNo;
  PyObject* amp = PyTuple_GET_ITEM(state, 1);
  if (amp != amp_want) {
    int eq = PyObject_RichCompareBool(amp, amp_want, Py_EQ);
    if (eq <= 0) return eq < 0 ? -2 : kNo;
  }
  Py_ssize_t m = PyList_GET_SIZE(layers);
  if (m != PyTuple_GET_SIZE(training)) return kNo;
  for (Py_ssize_t j = 0; j < m && j < PyList_GET_SIZE(layers); ++j) {
    PyObject* layer = PyList_GET_ITEM(layers, j);
    Py_INCREF(layer);  // the list may change while the attribute is read
    PyObject* flag = PyObject_GetAttr(layer, training_name);
    Py_DECREF(layer);
    if (flag == nullptr) return -2;
    PyObject* want = PyTuple_GET_ITEM(training, j);
    int eq = flag == want ? 1 : PyObject_RichCompareBool(flag, want, Py_EQ);
    Py_DECREF(flag);
    if (eq <= 0) return eq < 0 ? -2 : kNo;
  }
  return PyList_GET_SIZE(layers) == m ? kYes : kUnknown;  // changed while read: Python reads again
}

PyObject* py_key_of(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "key_of(args, metas, grad, amp, layers, training)");
    return nullptr;
  }
  if (!PyTuple_Check(args[0])) Py_RETURN_NONE;  // read in Python
  int r = key_matches(&PyTuple_GET_ITEM(args[0], 0), PyTuple_GET_SIZE(args[0]), args[1], args[2], args[3], args[4],
                      args[5]);
  return answer(r);
}

// ---------------------------------------------------------------- the front door of a Layer graphed in place
// Front(target): what a Layer graphed in place holds as its forward, in front of its wrapper ``target`` (a
// Lifecycle): NOTE [ The front door ] in core/front.py. A call reads ``target._keyless`` and, where it is a keyless
// rule ``(reason, when, Decision, tally)`` whose ``when`` is None or when() is true, and ``target._eager_parts``
// is ``(fn, owner weakref, calls)`` with the owner alive, adds one to the tally's and to calls' first item and
// returns fn(owner, *args, **kwargs), as the wrapper's own pass-through does; so does a call its known key takes
// (front_fast). Every other call is target(*args, **kwargs), or target._dispatched(*args, **kwargs) where the front
// asked what target's __call__ asks first and was told no. Every other attribute is the target's (read, set,
// deleted).

struct FrontObject {
  PyObject_HEAD PyObject* target;
  vectorcallfunc vectorcall;
  PyObject* weakrefs;
};

PyObject* one = nullptr;               // 1
PyObject* keyless_name = nullptr;      // "_keyless"
PyObject* eager_parts_name = nullptr;  // "_eager_parts"
PyObject* known_name = nullptr;        // "_known_eager"
PyObject* tally_name = nullptr;        // "tally"
PyObject* take_name = nullptr;         // "take"
PyObject* gate_name = nullptr;  // "gate"
PyObject* phase_name = nullptr;  // "phase"
PyObject* fallback_reason_name = nullptr;  // "fallback_reason"
PyObject* nested_name = nullptr;  // "nested"
PyObject* registered_name = nullptr;  // "registered"
PyObject* run_name = nullptr;  // "run"
PyObject* key_name = nullptr;  // "key"
PyObject* latest_name = nullptr;  // "_latest"
PyObject* tick_name = nullptr;  // "_tick"
PyObject* last_used_name = nullptr;  // "last_used"
PyObject* graphs_name = nullptr;  // "graphs"
PyObject* backward_pending_name = nullptr;  // "backward_pending"
PyObject* move_to_end_name = nullptr;  // "move_to_end"
PyObject* entries_name = nullptr;  // "_entries"
PyObject* options_name = nullptr;  // "options"
PyObject* max_graphs_name = nullptr;  // "max_graphs"
PyObject* last_refusal_name = nullptr;  // "_last_refusal"
PyObject* dispatched_name = nullptr;  // "_dispatched"

// cell[0] += 1 for a one-item list; -1 with an error set.
int bump(PyObject* cell) {
  if (!PyList_CheckExact(cell) || PyList_GET_SIZE(cell) < 1) {
    PyErr_SetString(PyExc_TypeError, "a tally is a one-item list");
    return -1;
  }
  PyObject* next = PyNumber_Add(PyList_GET_ITEM(cell, 0), one);
  if (next == nullptr) return -1;
  return PyList_SetItem(cell, 0, next);  // steals next, releases the old count
}

// The owner of ``parts`` = target._eager_parts ``(fn, owner weakref, calls)`` as a new reference, or nullptr (no
// parts, the owner collected; an error set only where reading failed).
PyObject* live_owner(PyObject* parts) {
  if (!PyTuple_CheckExact(parts) || PyTuple_GET_SIZE(parts) != 3 || !PyWeakref_Check(PyTuple_GET_ITEM(parts, 1)))
    return nullptr;
  PyObject* owner = PyWeakref_GetObject(PyTuple_GET_ITEM(parts, 1));  // borrowed; Py_None once collected
  if (owner == nullptr || owner == Py_None) return nullptr;
  Py_INCREF(owner);
  return owner;
}

// tally[0] += 1, calls[0] += 1, then fn(owner, *args, **kwargs): a call run eagerly without a Decision.
PyObject* run_counted(PyObject* tally, PyObject* parts, PyObject* owner, PyObject* const* args, Py_ssize_t nargs,
                      PyObject* kwnames) {
  if (bump(tally) < 0 || bump(PyTuple_GET_ITEM(parts, 2)) < 0) return nullptr;
  Py_ssize_t n = nargs + (kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames));
  PyObject* small[8];
  PyObject** stack = n + 1 > 8 ? static_cast<PyObject**>(PyMem_Malloc((n + 1) * sizeof(PyObject*))) : small;
  if (stack == nullptr) return PyErr_NoMemory();
  stack[0] = owner;
  for (Py_ssize_t i = 0; i < n; ++i) stack[i + 1] = args[i];
  PyObject* result = PyObject_Vectorcall(PyTuple_GET_ITEM(parts, 0), stack, nargs + 1, kwnames);
  if (stack != small) PyMem_Free(stack);
  return result;
}

// Places.refused_again (core/budgets.py) in C: 1 when ``key`` (no entry) is remembered in ``waiting`` (the refused
// keys' latest call ticks) and admit would refuse it again now (every place of ``entries`` taken under
// ``max_graphs``, no key it may displace), its call then remembered at ``tick`` as refused_again remembers it; 0
// when it is not waiting or may get a place; -1 with an error set. ``warmup``, ``replay``: the phases that hold a
// place.
int refused_again(PyObject* waiting, PyObject* entries, PyObject* key, PyObject* tick, PyObject* max_graphs,
                  PyObject* warmup, PyObject* replay) {
  if (!PyDict_Check(waiting) || !PyDict_Check(entries)) {
    PyErr_SetString(PyExc_TypeError, "refused_again: waiting and entries are dicts");
    return -1;
  }
  PyObject* ticks = PyDict_GetItemWithError(waiting, key);  // borrowed
  if (ticks == nullptr) return PyErr_Occurred() ? -1 : 0;
  if (!PyTuple_Check(ticks) || PyTuple_GET_SIZE(ticks) < 1) {
    PyErr_SetString(PyExc_TypeError, "refused_again: a refused key's ticks are a non-empty tuple");
    return -1;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(ticks);
  PyObject* last = PyTuple_GET_ITEM(ticks, n - 1);
  PyObject* before = n > 1 ? PyTuple_GET_ITEM(ticks, n - 2) : nullptr;
  Py_INCREF(ticks);  // the loop below runs Python (backward_pending) that could change waiting
  Py_ssize_t live = 0;
  int verdict = -2;  // -2: every place taken, none displaced
  PyObject* values = PyDict_Values(entries);  // a list: the entries stay alive and in place while they are read
  if (values == nullptr) verdict = -1;
  for (Py_ssize_t i = 0; verdict == -2 && i < PyList_GET_SIZE(values); ++i) {
    PyObject* entry = PyList_GET_ITEM(values, i);
    PyObject* phase = PyObject_GetAttr(entry, phase_name);
    if (phase == nullptr) { verdict = -1; break; }
    bool holds = phase == warmup || phase == replay;
    Py_DECREF(phase);
    if (!holds) continue;
    ++live;
    PyObject* graphs = PyObject_GetAttr(entry, graphs_name);
    PyObject* used = graphs == nullptr ? nullptr : PyObject_GetAttr(entry, last_used_name);
    if (used == nullptr) { Py_XDECREF(graphs); verdict = -1; break; }
    int le;
    if (graphs == Py_None) {  // a key in warmup it displaces
      le = PyObject_RichCompareBool(used, last, Py_LE);
      if (le != 0) verdict = le < 0 ? -1 : 0;
    } else if (before != nullptr) {
      le = PyObject_RichCompareBool(used, before, Py_LE);
      if (le < 0) {
        verdict = -1;
      } else if (le > 0) {
        PyObject* pending = PyObject_CallMethodNoArgs(entry, backward_pending_name);
        int busy = pending == nullptr ? -1 : PyObject_IsTrue(pending);
        Py_XDECREF(pending);
        if (busy < 0) verdict = -1;
        else if (busy == 0) verdict = 0;  // a key holding graphs it displaces
      }
    }
    Py_DECREF(used);
    Py_DECREF(graphs);
  }
  Py_XDECREF(values);
  if (verdict == -2) {
    PyObject* count = PyLong_FromSsize_t(live);
    int fewer = count == nullptr ? -1 : PyObject_RichCompareBool(count, max_graphs, Py_LT);
    Py_XDECREF(count);
    verdict = fewer < 0 ? -1 : fewer > 0 ? 0 : 1;
  }
  if (verdict == 1) {  // remembered: the latest refused key last, its two latest calls
    PyObject* moved = PyObject_CallMethodOneArg(waiting, move_to_end_name, key);
    PyObject* pair = moved == nullptr ? nullptr : PyTuple_Pack(2, last, tick);
    if (pair == nullptr || PyObject_SetItem(waiting, key, pair) < 0) verdict = -1;
    Py_XDECREF(pair);
    Py_XDECREF(moved);
  }
  Py_DECREF(ticks);
  return verdict;
}

PyObject* py_refused_again(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError,
                    "refused_again(waiting, entries, key, tick, max_graphs, warmup, replay) takes 7 arguments");
    return nullptr;
  }
  int r = refused_again(args[0], args[1], args[2], args[3], args[4], args[5], args[6]);
  if (r < 0) return nullptr;
  return PyBool_FromLong(r);
}

// take(target, args) of the front's known key read in C from ``known.gate`` (NOTE [ The front door ] in
// core/front.py): 1 (taken, the wrapper's books kept), 0 (not this key's call now: nothing was changed), 2 (this
// file cannot tell: the caller asks Python's take), -1 with an error set. A KnownEager's gate is (entry, FALLBACK,
// fallback reason, ...), a KnownRefused's (None, key, (waiting, body, WARMUP, REPLAY, reason), ...), both then with
// this thread's nesting, the saved-tensors hooks state, the stale outputs, the host marks, what idle() reads (None:
// always idle; an object whose ``run`` is None when idle; False: ask Python), the positional specs by count, the
// tracked Layers.
int known_take(PyObject* known, PyObject* target, PyObject* const* args, Py_ssize_t nargs) {
  PyObject* gate = PyObject_GetAttr(known, gate_name);
  if (gate == nullptr) return -1;
  int verdict = 2;
  PyObject* phase = nullptr;
  PyObject* reason = nullptr;
  PyObject* nested = nullptr;
  PyObject* run = nullptr;
  PyObject* key = nullptr;
  PyObject* latest = nullptr;
  PyObject* tick = nullptr;
  PyObject* next = nullptr;
  PyObject* entries = nullptr;
  PyObject* options = nullptr;
  PyObject* max_graphs = nullptr;
  do {
    if (!PyTuple_CheckExact(gate) || PyTuple_GET_SIZE(gate) != 10) break;
    PyObject* entry = PyTuple_GET_ITEM(gate, 0);  // None: a key refused under max_graphs, without an entry
    PyObject* refused = nullptr;                  // its (waiting, body, WARMUP, REPLAY, reason)
    if (entry == Py_None) {
      refused = PyTuple_GET_ITEM(gate, 2);
      if (!PyTuple_CheckExact(refused) || PyTuple_GET_SIZE(refused) != 5) break;
    } else {
      if ((phase = PyObject_GetAttr(entry, phase_name)) == nullptr) { verdict = -1; break; }
      if (phase != PyTuple_GET_ITEM(gate, 1)) { verdict = 0; break; }
      if ((reason = PyObject_GetAttr(entry, fallback_reason_name)) == nullptr) { verdict = -1; break; }
      if (reason != PyTuple_GET_ITEM(gate, 2)) { verdict = 0; break; }
    }
    if ((nested = PyObject_GetAttr(PyTuple_GET_ITEM(gate, 3), nested_name)) == nullptr) { verdict = -1; break; }
    if (!PyLong_CheckExact(nested)) break;
    if (PyLong_AsLong(nested) != 0) { verdict = 0; break; }
    PyObject* hooks_state = PyTuple_GET_ITEM(gate, 4);
    PyObject* stale = PyTuple_GET_ITEM(gate, 5);
    PyObject* marks = PyTuple_GET_ITEM(gate, 6);
    if (!PyDict_CheckExact(hooks_state) || !PyDict_CheckExact(stale) || !PyDict_CheckExact(marks)) break;
    PyObject* registered = PyDict_GetItemWithError(hooks_state, registered_name);  // borrowed
    if (registered == nullptr) { verdict = PyErr_Occurred() ? -1 : 2; break; }
    if (registered != Py_False) { verdict = registered == Py_True ? 0 : 2; break; }
    if (PyDict_GET_SIZE(stale) != 0) { verdict = 0; break; }
    if (PyDict_GET_SIZE(marks) != 0) break;  // a tensor marked host: Python reads the marks
    PyObject* idle = PyTuple_GET_ITEM(gate, 7);
    if (idle == Py_False) break;
    if (idle != Py_None) {
      if ((run = PyObject_GetAttr(idle, run_name)) == nullptr) { verdict = -1; break; }
      if (run != Py_None) { verdict = 0; break; }
    }
    if (refused != nullptr) {
      key = PyTuple_GET_ITEM(gate, 1);
      Py_INCREF(key);
    } else if ((key = PyObject_GetAttr(entry, key_name)) == nullptr) {
      verdict = -1;
      break;
    }
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 3) break;
    if (PyTuple_GET_ITEM(key, 0) != Py_False) { verdict = PyTuple_GET_ITEM(key, 0) == Py_True ? 0 : 2; break; }
    PyObject* arguments = PyTuple_GET_ITEM(key, 1);
    PyObject* state = PyTuple_GET_ITEM(key, 2);
    if (!PyTuple_Check(arguments) || PyTuple_GET_SIZE(arguments) != 2 || !PyTuple_Check(state) ||
        PyTuple_GET_SIZE(state) != 3 || !PyDict_CheckExact(PyTuple_GET_ITEM(gate, 8)))
      break;
    PyObject* metas = PyTuple_GET_ITEM(arguments, 1);
    if (!PyTuple_Check(metas) || PyTuple_GET_SIZE(metas) != nargs) { verdict = PyTuple_Check(metas) ? 0 : 2; break; }
    PyObject* count = PyLong_FromSsize_t(nargs);
    if (count == nullptr) { verdict = -1; break; }
    PyObject* form = PyDict_GetItemWithError(PyTuple_GET_ITEM(gate, 8), count);  // borrowed
    Py_DECREF(count);
    if (form == nullptr || form != PyTuple_GET_ITEM(arguments, 0)) { verdict = PyErr_Occurred() ? -1 : 2; break; }
    int r = key_matches(args, nargs, metas, PyTuple_GET_ITEM(state, 0), PyTuple_GET_ITEM(state, 1),
                        PyTuple_GET_ITEM(gate, 9), PyTuple_GET_ITEM(state, 2));
    if (r == -2) { verdict = -1; break; }
    if (r != kYes) { verdict = r == kNo ? 0 : 2; break; }
    if ((tick = PyObject_GetAttr(target, tick_name)) == nullptr) { verdict = -1; break; }
    if (refused != nullptr) {
      // still without an entry, and refused again (its call remembered): what dispatch() reads before a new entry
      if ((entries = PyObject_GetAttr(target, entries_name)) == nullptr) { verdict = -1; break; }
      if (!PyDict_Check(entries)) break;
      int held = PyDict_Contains(entries, key);
      if (held != 0) { verdict = held < 0 ? -1 : 0; break; }
      if ((options = PyObject_GetAttr(PyTuple_GET_ITEM(refused, 1), options_name)) == nullptr ||
          (max_graphs = PyObject_GetAttr(options, max_graphs_name)) == nullptr) {
        verdict = -1;
        break;
      }
      int again = refused_again(PyTuple_GET_ITEM(refused, 0), entries, key, tick, max_graphs,
                                PyTuple_GET_ITEM(refused, 2), PyTuple_GET_ITEM(refused, 3));
      if (again <= 0) { verdict = again; break; }
      verdict = PyObject_SetAttr(target, last_refusal_name, PyTuple_GET_ITEM(refused, 4)) < 0 ? -1 : 1;
      break;
    }
    // the books dispatch keeps (_used): the wrapper's tick, the entry's last use, the entry last and the latest
    if ((latest = PyObject_GetAttr(target, latest_name)) == nullptr) { verdict = -1; break; }
    if (latest != entry && ((entries = PyObject_GetAttr(target, entries_name)) == nullptr || !PyDict_Check(entries))) {
      verdict = entries == nullptr ? -1 : 2;
      break;
    }
    if ((next = PyNumber_Add(tick, one)) == nullptr) { verdict = -1; break; }
    if (PyObject_SetAttr(target, tick_name, next) < 0 || PyObject_SetAttr(entry, last_used_name, next) < 0) {
      verdict = -1;
      break;
    }
    verdict = 1;
    if (latest != entry) {
      PyObject* moved = PyObject_CallMethodOneArg(entries, move_to_end_name, key);
      if (moved == nullptr || PyObject_SetAttr(target, latest_name, entry) < 0) verdict = -1;
      Py_XDECREF(moved);
    }
  } while (false);
  Py_XDECREF(max_graphs);
  Py_XDECREF(options);
  Py_XDECREF(entries);
  Py_XDECREF(next);
  Py_XDECREF(tick);
  Py_XDECREF(latest);
  Py_XDECREF(key);
  Py_XDECREF(run);
  Py_XDECREF(nested);
  Py_XDECREF(reason);
  Py_XDECREF(phase);
  Py_DECREF(gate);
  return verdict;
}

// Whether a keyless rule's condition holds, read from its ``gate`` (core/pass_through.py's ``condition_gate``: this
// thread's nesting, the saved-tensors hooks' state, the stale outputs, and for a rule that reads the environment
// ``(os module, os.environ as it was, its mapping, the encoded variable name)``, else None): 1 (it holds), 0 (it does
// not), 2 (this file cannot tell: the caller asks ``when()``), -1 with an error set.
PyObject* environ_name = nullptr;  // "environ"

int keyless_holds(PyObject* gate) {
  if (!PyTuple_CheckExact(gate) || PyTuple_GET_SIZE(gate) != 4) return 2;
  PyObject* nested = PyObject_GetAttr(PyTuple_GET_ITEM(gate, 0), nested_name);
  if (nested == nullptr) return -1;
  int verdict = 1;
  if (!PyLong_CheckExact(nested)) {
    verdict = 2;
  } else {
    int overflow = 0;
    long depth = PyLong_AsLongAndOverflow(nested, &overflow);
    verdict = overflow != 0 || depth != 0 ? 0 : 1;
  }
  Py_DECREF(nested);
  if (verdict != 1) return verdict;
  PyObject* hooks_state = PyTuple_GET_ITEM(gate, 1);
  PyObject* stale = PyTuple_GET_ITEM(gate, 2);
  if (!PyDict_CheckExact(hooks_state) || !PyDict_CheckExact(stale)) return 2;
  PyObject* registered = PyDict_GetItemWithError(hooks_state, registered_name);  // borrowed
  if (registered == nullptr) return PyErr_Occurred() ? -1 : 2;
  if (registered != Py_False) return registered == Py_True ? 0 : 2;
  if (PyDict_GET_SIZE(stale) != 0) return 0;
  PyObject* env = PyTuple_GET_ITEM(gate, 3);
  if (env == Py_None) return 1;
  if (!PyTuple_CheckExact(env) || PyTuple_GET_SIZE(env) != 4 || !PyDict_CheckExact(PyTuple_GET_ITEM(env, 2))) return 2;
  PyObject* now = PyObject_GetAttr(PyTuple_GET_ITEM(env, 0), environ_name);
  if (now == nullptr) return -1;
  bool same = now == PyTuple_GET_ITEM(env, 1);  // a test may put another mapping in its place: Python reads it
  Py_DECREF(now);
  if (!same) return 2;
  PyObject* value = PyDict_GetItemWithError(PyTuple_GET_ITEM(env, 2), PyTuple_GET_ITEM(env, 3));  // borrowed
  if (value == nullptr) return PyErr_Occurred() ? -1 : 1;
  Py_INCREF(value);
  int set = PyObject_IsTrue(value);
  Py_DECREF(value);
  return set < 0 ? -1 : set ? 0 : 1;
}

PyObject* py_keyless_holds(PyObject*, PyObject* gate) {
  int r = keyless_holds(gate);
  if (r < 0) return nullptr;
  if (r == 2) Py_RETURN_NONE;
  return PyBool_FromLong(r);
}

// The result of a call the front runs itself (the wrapper's own answer, without its Python), or nullptr: with an
// error set where it failed, else the call goes to the wrapper. A keyless rule whose ``when`` is None or true runs the
// call as the wrapper's pass-through does (NOTE [ Pass-through wrappers ]); without a rule, a call of positional
// arguments that the known key takes (known_take from its gate, or ``take(target, args)`` itself where the gate
// cannot tell; either keeps the wrapper's books: NOTE [ Calls of a key that runs eagerly ] in core/dispatch.py) runs
// as the wrapper runs it. ``*asked`` is set where the front asked what the wrapper's __call__ asks first (the rule's
// ``when``, the known key's take) and the answer was no: the wrapper then goes straight to dispatch().
PyObject* front_fast(PyObject* target, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, bool* asked) {
  *asked = false;
  PyObject* keyless = PyObject_GetAttr(target, keyless_name);
  if (keyless == nullptr) return nullptr;
  PyObject* tally = nullptr;  // borrowed from keyless or known
  PyObject* known = nullptr;
  PyObject* parts = nullptr;
  PyObject* owner = nullptr;
  PyObject* result = nullptr;
  bool run = false;
  Py_ssize_t size = PyTuple_CheckExact(keyless) ? PyTuple_GET_SIZE(keyless) : 0;
  if (size == 4 || size == 5) {  // (reason, when, Decision, tally[, gate of when])
    PyObject* when = PyTuple_GET_ITEM(keyless, 1);
    int holds = 1;
    if (when != Py_None) {
      holds = size == 5 ? keyless_holds(PyTuple_GET_ITEM(keyless, 4)) : 2;
      if (holds == 2) {
        PyObject* answer = PyObject_CallNoArgs(when);
        holds = answer == nullptr ? -1 : PyObject_IsTrue(answer);
        Py_XDECREF(answer);
      }
    }
    if (holds > 0) {
      parts = PyObject_GetAttr(target, eager_parts_name);
      owner = parts == nullptr ? nullptr : live_owner(parts);
      tally = PyTuple_GET_ITEM(keyless, 3);
      run = owner != nullptr;
    }
    *asked = holds == 0;
  } else if (keyless == Py_None && (kwnames == nullptr || PyTuple_GET_SIZE(kwnames) == 0)) {
    known = PyObject_GetAttr(target, known_name);
    if (known == Py_None) *asked = true;
    if (known != nullptr && known != Py_None) {
      parts = PyObject_GetAttr(target, eager_parts_name);
      owner = parts == nullptr ? nullptr : live_owner(parts);  // before take(), which keeps the books
      tally = owner == nullptr ? nullptr : PyObject_GetAttr(known, tally_name);
      int taken = tally == nullptr ? 0 : known_take(known, target, args, nargs);
      if (taken == 2) {  // Python's take decides (and keeps the books)
        PyObject* call = PyTuple_New(nargs);
        for (Py_ssize_t i = 0; call != nullptr && i < nargs; ++i) {
          Py_INCREF(args[i]);
          PyTuple_SET_ITEM(call, i, args[i]);
        }
        PyObject* took =
            call == nullptr ? nullptr : PyObject_CallMethodObjArgs(known, take_name, target, call, nullptr);
        Py_XDECREF(call);
        taken = took == nullptr ? -1 : PyObject_IsTrue(took);
        Py_XDECREF(took);
      }
      run = taken == 1;
      *asked = taken == 0 && tally != nullptr;  // without parts or tally the wrapper asks again and runs it
      if (tally != nullptr) Py_DECREF(tally);  // still held by known
    }
  }
  if (run && !PyErr_Occurred()) result = run_counted(tally, parts, owner, args, nargs, kwnames);
  Py_XDECREF(owner);
  Py_XDECREF(parts);
  Py_XDECREF(known);
  Py_DECREF(keyless);
  return result;
}

PyObject* front_target(PyObject* self);

PyObject* front_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* target = front_target(self);  // null only once the collector cleared the front (then it raises)
  if (target == nullptr) return nullptr;
  Py_INCREF(target);  // a call may replace the Layer's forward, dropping this front
  bool asked;
  PyObject* result = front_fast(target, args, PyVectorcall_NARGS(nargsf), kwnames, &asked);
  if (result == nullptr && !PyErr_Occurred()) {
    PyObject* rest = asked ? PyObject_GetAttr(target, dispatched_name) : nullptr;  // the wrapper past its asks
    if (rest == nullptr && asked && PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
    if (rest != nullptr) {
      result = PyObject_Vectorcall(rest, args, nargsf, kwnames);
      Py_DECREF(rest);
    } else if (!PyErr_Occurred()) {
      result = PyObject_Vectorcall(target, args, nargsf, kwnames);
    }
  }
  Py_DECREF(target);
  return result;
}

PyObject* front_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* target;
  if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "Front(target) takes no keyword arguments");
    return nullptr;
  }
  if (!PyArg_UnpackTuple(args, "Front", 1, 1, &target)) return nullptr;
  if (!PyCallable_Check(target)) {
    PyErr_SetString(PyExc_TypeError, "Front(target): target must be callable");
    return nullptr;
  }
  FrontObject* self = PyObject_GC_New(FrontObject, type);
  if (self == nullptr) return nullptr;
  Py_INCREF(target);
  self->target = target;
  self->vectorcall = front_call;
  self->weakrefs = nullptr;
  PyObject_GC_Track(self);
  return reinterpret_cast<PyObject*>(self);
}

int front_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<FrontObject*>(self)->target);
  return 0;
}

int front_clear(PyObject* self) {
  Py_CLEAR(reinterpret_cast<FrontObject*>(self)->target);
  return 0;
}

void front_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  if (reinterpret_cast<FrontObject*>(self)->weakrefs != nullptr) PyObject_ClearWeakRefs(self);
  front_clear(self);
  PyObject_GC_Del(self);
}

PyObject* front_target(PyObject* self) {
  PyObject* target = reinterpret_cast<FrontObject*>(self)->target;
  if (target == nullptr) {
    PyErr_SetString(PyExc_ReferenceError, "the front's wrapper is gone");
    return nullptr;
  }
  return target;
}

PyObject* front_getattro(PyObject* self, PyObject* name) {
  PyObject* found = PyObject_GenericGetAttr(self, name);  // the front's own: __class__, _front_target, ...
  if (found != nullptr || !PyErr_ExceptionMatches(PyExc_AttributeError)) return found;
  PyErr_Clear();
  PyObject* target = front_target(self);
  return target == nullptr ? nullptr : PyObject_GetAttr(target, name);
}

int front_setattro(PyObject* self, PyObject* name, PyObject* value) {
  PyObject* target = front_target(self);
  return target == nullptr ? -1 : PyObject_SetAttr(target, name, value);
}

PyObject* front_repr(PyObject* self) {
  PyObject* target = front_target(self);
  return target == nullptr ? nullptr : PyObject_Repr(target);
}

PyObject* front_get_target(PyObject* self, void*) {
  PyObject* target = front_target(self);
  Py_XINCREF(target);
  return target;
}

PyObject* front_get_doc(PyObject* self, void*) {
  PyObject* target = front_target(self);
  return target == nullptr ? nullptr : PyObject_GetAttrString(target, "__doc__");
}

// __deepcopy__(memo): a front in front of the target's copy (NOTE [ Copies of a graphed Layer ] in block/graphed.py).
PyObject* front_deepcopy(PyObject* self, PyObject* memo) {
  PyObject* target = front_target(self);
  if (target == nullptr) return nullptr;
  PyObject* copy = PyObject_CallMethod(target, "__deepcopy__", "O", memo);
  if (copy == nullptr) return nullptr;
  PyObject* wrapped = PyObject_CallOneArg(reinterpret_cast<PyObject*>(Py_TYPE(self)), copy);
  Py_DECREF(copy);
  return wrapped;
}

// __reduce__(): (core.front.unpickled, (target,)): the wrapper pickled as itself (once, however many of its
// bound methods the Layer holds too), a front made again in front of it where the loading process can.
PyObject* front_reduce(PyObject* self, PyObject*) {
  PyObject* target = front_target(self);
  if (target == nullptr) return nullptr;
  PyObject* module = PyImport_ImportModule("paddlefleet.cudagraph.core.front");
  if (module == nullptr) return nullptr;
  PyObject* remake = PyObject_GetAttrString(module, "unpickled");
  Py_DECREF(module);
  if (remake == nullptr) return nullptr;
  return Py_BuildValue("(N(O))", remake, target);
}

PyMethodDef front_methods[] = {
    {"__deepcopy__", front_deepcopy, METH_O, "A front in front of a copy of the wrapper."},
    {"__reduce__", front_reduce, METH_NOARGS, "(core.front.unpickled, (the wrapper,))."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef front_getset[] = {
    {"_front_target", front_get_target, nullptr, "The wrapper this front calls.", nullptr},
    {"__doc__", front_get_doc, nullptr, "The wrapper's docstring.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject* front_type = nullptr;

PyMemberDef front_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(FrontObject, vectorcall), READONLY, nullptr},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(FrontObject, weakrefs), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject* make_front_type() {
  PyType_Slot slots[] = {
      {Py_tp_members, front_members},
      {Py_tp_new, reinterpret_cast<void*>(front_new)},
      {Py_tp_dealloc, reinterpret_cast<void*>(front_dealloc)},
      {Py_tp_traverse, reinterpret_cast<void*>(front_traverse)},
      {Py_tp_clear, reinterpret_cast<void*>(front_clear)},
      {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
      {Py_tp_getattro, reinterpret_cast<void*>(front_getattro)},
      {Py_tp_setattro, reinterpret_cast<void*>(front_setattro)},
      {Py_tp_repr, reinterpret_cast<void*>(front_repr)},
      {Py_tp_methods, front_methods},
      {Py_tp_getset, front_getset},
      {0, nullptr}};
  PyType_Spec spec = {"_tensor_reads.Front", sizeof(FrontObject), 0,
                      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL, slots};
  return reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));
}

PyMethodDef methods[] = {
    {"setup_state", py_setup_state, METH_O,
     "setup_state(global_var): True where the tracer's getters state() calls are bound, else False."},
    {"state", py_state, METH_NOARGS, "(grad enabled, (int(amp level), amp dtype)), or None (read in Python)."},
    {"setup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_setup)), METH_FASTCALL,
     "setup(tensor_type, dtype_ints): the Tensor type and the table of int(t.dtype) by DataType code."},
    {"dtype_code", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_dtype_code)), METH_FASTCALL,
     "dtype_code(tensor_type, t): the DataType code of a tensor (for the table), or None."},
    {"meta", py_meta, METH_O, "(shape, int(dtype), place_key, stop_gradient) of a tensor, or None."},
    {"metas", py_metas, METH_O, "meta() of each tensor of a sequence, or None if any is None."},
    {"match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_match)), METH_FASTCALL,
     "match(tensors, metas): True, False, or None (read in Python)."},
    {"data_ptr", py_data_ptr, METH_O, "t.data_ptr() of an initialized dense tensor, or None."},
    {"keyless_holds", py_keyless_holds, METH_O,
     "Whether a keyless rule's condition holds, from its gate: True, False, or None (ask when())."},
    {"empty_like_each", py_empty_like_each, METH_O,
     "A new unfilled tensor like each tensor of a list (shape, dtype, place), or None (made in Python)."},
    {"moved", py_moved, METH_O, "The first moved home's index, -1, or None (read in Python)."},
    {"versions", py_versions, METH_O, "[v._inplace_version() for v in views], or None."},
    {"ptrs_hold", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_ptrs_hold)), METH_FASTCALL,
     "ptrs_hold(tensors, ptrs): whether each tensor has its data pointer: True, False, or None (read in Python)."},
    {"flags_hold", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_flags_hold)), METH_FASTCALL,
     "flags_hold(tensors, flags): whether each tensor has its stop_gradient: True, False, or None."},
    {"unchanged", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_unchanged)), METH_FASTCALL,
     "unchanged(views, ptrs, versions): True, False, or None (read in Python)."},
    {"key_of", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_key_of)), METH_FASTCALL,
     "key_of(args, metas, grad, amp, layers, training): True, False, or None (read in Python)."},
    {"refused_again", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_refused_again)), METH_FASTCALL,
     "refused_again(waiting, entries, key, tick, max_graphs, warmup, replay): Places.refused_again, True or False."},
    {"freed_unchanged", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_freed_unchanged)),
     METH_FASTCALL, "freed_unchanged(views, versions): True, False, or None (read in Python)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tensor_reads", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__tensor_reads() {
  cpu_key = PyUnicode_InternFromString("cpu");
  stop_gradient_name = PyUnicode_InternFromString("stop_gradient");
  tracer_name = PyUnicode_InternFromString("_dygraph_tracer_");
  training_name = PyUnicode_InternFromString("training");
  one = PyLong_FromLong(1);
  keyless_name = PyUnicode_InternFromString("_keyless");
  eager_parts_name = PyUnicode_InternFromString("_eager_parts");
  known_name = PyUnicode_InternFromString("_known_eager");
  tally_name = PyUnicode_InternFromString("tally");
  take_name = PyUnicode_InternFromString("take");
  gate_name = PyUnicode_InternFromString("gate");
  phase_name = PyUnicode_InternFromString("phase");
  fallback_reason_name = PyUnicode_InternFromString("fallback_reason");
  nested_name = PyUnicode_InternFromString("nested");
  registered_name = PyUnicode_InternFromString("registered");
  run_name = PyUnicode_InternFromString("run");
  key_name = PyUnicode_InternFromString("key");
  latest_name = PyUnicode_InternFromString("_latest");
  tick_name = PyUnicode_InternFromString("_tick");
  last_used_name = PyUnicode_InternFromString("last_used");
  graphs_name = PyUnicode_InternFromString("graphs");
  backward_pending_name = PyUnicode_InternFromString("backward_pending");
  move_to_end_name = PyUnicode_InternFromString("move_to_end");
  entries_name = PyUnicode_InternFromString("_entries");
  options_name = PyUnicode_InternFromString("options");
  max_graphs_name = PyUnicode_InternFromString("max_graphs");
  last_refusal_name = PyUnicode_InternFromString("_last_refusal");
  dispatched_name = PyUnicode_InternFromString("_dispatched");
  environ_name = PyUnicode_InternFromString("environ");
  if (cpu_key == nullptr || stop_gradient_name == nullptr || tracer_name == nullptr || training_name == nullptr ||
      one == nullptr || keyless_name == nullptr || eager_parts_name == nullptr || known_name == nullptr ||
      tally_name == nullptr || take_name == nullptr || gate_name == nullptr || phase_name == nullptr ||
      fallback_reason_name == nullptr || nested_name == nullptr || registered_name == nullptr ||
      run_name == nullptr || key_name == nullptr || latest_name == nullptr || tick_name == nullptr ||
      last_used_name == nullptr || graphs_name == nullptr || backward_pending_name == nullptr ||
      move_to_end_name == nullptr || entries_name == nullptr || options_name == nullptr ||
      max_graphs_name == nullptr || last_refusal_name == nullptr || dispatched_name == nullptr ||
      environ_name == nullptr)
    return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  front_type = make_front_type();
  if (front_type == nullptr || PyModule_AddObject(m, "Front", reinterpret_cast<PyObject*>(front_type)) < 0) {
    Py_XDECREF(reinterpret_cast<PyObject*>(front_type));
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
