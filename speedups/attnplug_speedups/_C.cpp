// attnplug-speedups: the per-layer check of PagedBackend._forward's planned path, compiled.
//
// layer_ok(q, k, v, expect, forward) answers in one call what the skeleton's Python per-layer check asks
// with ten attribute reads (two write counters, then q/k/v's shapes, dtypes and devices). It answers True only
// when that check would pass; whenever it cannot tell (a tensor subclass, a wrapper or Python-dispatch tensor,
// an inference tensor among the counters, any argument of another type) it answers False and the skeleton runs
// its Python check, which decides. It reads metadata only: no tensor data, no allocation; nothing torch might
// throw leaves it (caught: "cannot tell").
#include <Python.h>

#include <typeinfo>

#include <torch/csrc/autograd/python_variable.h>

namespace {

PyTypeObject* tensor_type = nullptr;  // torch.Tensor, exactly (subclasses take the Python check)

// the plain dense TensorImpl of an exact torch.Tensor (nullptr otherwise)
inline c10::TensorImpl* plain_impl(PyObject* obj) {
  if (Py_TYPE(obj) != tensor_type) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl == nullptr || typeid(*impl) != typeid(c10::TensorImpl) || impl->is_python_dispatch() ||
      impl->has_symbolic_sizes_strides())
    return nullptr;
  return impl;
}

// [tokens, heads, dim] of the expected scalar type on the expected device type
inline bool matches(PyObject* obj, int64_t tokens, int64_t heads, int64_t dim, int64_t scalar, int64_t device) {
  c10::TensorImpl* impl = plain_impl(obj);
  if (impl == nullptr || impl->dim() != 3) return false;
  c10::IntArrayRef s = impl->sizes();
  return s[0] == tokens && s[1] == heads && s[2] == dim &&
         static_cast<int64_t>(impl->dtype().toScalarType()) == scalar &&
         static_cast<int64_t>(impl->device_type()) == device;
}

constexpr Py_ssize_t kExpect = 8;  // heads/dim of q, k, v; scalar type; device type

PyObject* layer_ok_impl(PyObject* const* args, Py_ssize_t nargs);

// every torch call below is guarded by the checks before it; a C++ exception from torch all the same (a tensor
// this helper did not foresee) must not cross the C API and end the process: it answers "cannot tell"
PyObject* layer_ok(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return layer_ok_impl(args, nargs);
  } catch (...) {
    Py_RETURN_FALSE;
  }
}

PyObject* layer_ok_impl(PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "layer_ok(q, k, v, expect, forward) takes 5 arguments (%zd given)", nargs);
    return nullptr;
  }
  PyObject* expect = args[3];
  PyObject* forward = args[4];
  if (!PyBytes_CheckExact(expect) || PyBytes_GET_SIZE(expect) != kExpect * 8 || !PyTuple_CheckExact(forward) ||
      PyTuple_GET_SIZE(forward) < 1 || PyTuple_GET_SIZE(forward) % 2 != 1)
    Py_RETURN_FALSE;
  int64_t e[kExpect];
  memcpy(e, PyBytes_AS_STRING(expect), sizeof(e));
  // forward: (tokens, counter tensor, version, counter tensor, version, ...)
  PyObject* tok = PyTuple_GET_ITEM(forward, 0);
  if (!PyLong_CheckExact(tok)) Py_RETURN_FALSE;
  int overflow = 0;
  const int64_t tokens = PyLong_AsLongLongAndOverflow(tok, &overflow);
  if (overflow != 0 || tokens <= 0) Py_RETURN_FALSE;
  for (Py_ssize_t j = 1; j < PyTuple_GET_SIZE(forward); j += 2) {
    c10::TensorImpl* impl = plain_impl(PyTuple_GET_ITEM(forward, j));
    PyObject* ver = PyTuple_GET_ITEM(forward, j + 1);
    if (impl == nullptr || impl->is_inference() || !PyLong_CheckExact(ver)) Py_RETURN_FALSE;
    const long long want = PyLong_AsLongLongAndOverflow(ver, &overflow);
    if (overflow != 0 || want < 0 || static_cast<long long>(impl->version_counter().current_version()) != want)
      Py_RETURN_FALSE;
  }
  if (matches(args[0], tokens, e[0], e[1], e[6], e[7]) && matches(args[1], tokens, e[2], e[3], e[6], e[7]) &&
      matches(args[2], tokens, e[4], e[5], e[6], e[7]))
    Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

// expectation(q, q_heads, q_dim, k_heads, k_dim, v_heads, v_dim) -> bytes: what layer_ok compares, with q's
// scalar type and device type (q: a query that just passed the full check)
PyObject* expectation(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_Format(PyExc_TypeError, "expectation(q, q_heads, q_dim, k_heads, k_dim, v_heads, v_dim) takes 7 "
                 "arguments (%zd given)", nargs);
    return nullptr;
  }
  int64_t e[kExpect];
  for (int j = 0; j < 6; ++j) {
    e[j] = PyLong_AsLongLong(args[1 + j]);
    if (e[j] == -1 && PyErr_Occurred()) return nullptr;
  }
  try {
    c10::TensorImpl* impl = plain_impl(args[0]);
    if (impl == nullptr) Py_RETURN_NONE;  // a query this helper does not read: no expectation, the Python check
    e[6] = static_cast<int64_t>(impl->dtype().toScalarType());
    e[7] = static_cast<int64_t>(impl->device_type());
  } catch (...) {  // (as layer_ok: nothing thrown crosses the C API)
    Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(e), sizeof(e));
}

PyMethodDef methods[] = {
    {"layer_ok", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(layer_ok)), METH_FASTCALL,
     "layer_ok(q, k, v, expect, forward) -> bool: True only when the skeleton's per-layer Python check would pass "
     "(forward: (tokens, counter, version, ...); expect: from expectation())"},
    {"expectation", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(expectation)), METH_FASTCALL,
     "expectation(q, q_heads, q_dim, k_heads, k_dim, v_heads, v_dim) -> bytes | None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "attnplug_speedups._C",
                      "The skeleton's per-layer check, compiled (attnplug-speedups).", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) return nullptr;
  PyObject* tensor = PyObject_GetAttrString(torch, "Tensor");
  Py_DECREF(torch);
  if (tensor == nullptr) return nullptr;
  if (!PyType_Check(tensor)) {
    Py_DECREF(tensor);
    PyErr_SetString(PyExc_ImportError, "attnplug_speedups: torch.Tensor is not a type");
    return nullptr;
  }
  tensor_type = reinterpret_cast<PyTypeObject*>(tensor);  // kept for the process's life
  return PyModule_Create(&module);
}
