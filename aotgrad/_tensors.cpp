// The per-call check of a compiled entry's static tensor inputs (parameters and buffers first) as one
// C++ loop over their TensorImpls (guards/inputs.py, compiled_autograd/guards.py; loaded by _native.py).
//
// TensorCheck(exemplars, sizes, strides, offsets).check(flat) is True when flat has at least
// len(exemplars) items and the i-th
//   - is of exactly the Python type of exemplars[i] (so a tensor: exemplars are tensors),
//   - has exemplars[i]'s dispatch key set, dtype, device (type and index) and requires_grad,
//   - has sizes[i] and strides[i], and storage offset offsets[i] unless that is None.
// What a guard manager's TENSOR_MATCH leaf compares (plus the offset), at about 10 ns a tensor where
// the leaf costs 60: reading TensorImpl fields, with no pybind11 call and no guard-manager tree.
// TensorImpl's layout is this torch's: the module is named for the torch that built it
// (``_tensors_2_13_0_cpu``, AOTGRAD_MODULE), so each torch imports its own build and none another's, and
// says it again (TORCH_VERSION).
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <exception>
#include <vector>

#if !defined(AOTGRAD_TORCH_VERSION) || !defined(AOTGRAD_MODULE)
#error "build with -DAOTGRAD_TORCH_VERSION=<torch.__version__ as a C string> -DAOTGRAD_MODULE=<module name>"
#endif
#define AOTGRAD_STR2(x) #x
#define AOTGRAD_STR(x) AOTGRAD_STR2(x)
#define AOTGRAD_CAT2(a, b) a##b
#define AOTGRAD_CAT(a, b) AOTGRAD_CAT2(a, b)

namespace {

constexpr int64_t kAnyOffset = INT64_MIN;

struct Spec {
    PyTypeObject *type;
    uint64_t keys;
    c10::ScalarType dtype;
    c10::Device device;
    bool requires_grad;
    int64_t offset;
    size_t first, dim;      // sizes and strides: dims[first : first + dim] of each
};

struct TensorCheck {
    PyObject_HEAD
    std::vector<Spec> *specs;
    std::vector<int64_t> *sizes, *strides;
};

bool int_list(PyObject *seq, std::vector<int64_t> &out, size_t *dim) {
    PyObject *fast = PySequence_Fast(seq, "sizes and strides are sequences of ints");
    if (fast == nullptr)
        return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return false;
        }
        out.push_back(v);
    }
    Py_DECREF(fast);
    *dim = static_cast<size_t>(n);
    return true;
}

void clear(TensorCheck *self) {
    if (self->specs != nullptr)
        for (const Spec &s : *self->specs)
            Py_DECREF(s.type);
    delete self->specs;
    delete self->sizes;
    delete self->strides;
    self->specs = nullptr;
    self->sizes = self->strides = nullptr;
}

int TensorCheck_init(TensorCheck *self, PyObject *args, PyObject *kwargs) {
    clear(self);
    PyObject *exemplars, *sizes, *strides, *offsets;
    if (!PyArg_ParseTuple(args, "O!O!O!O!", &PyList_Type, &exemplars, &PyList_Type, &sizes, &PyList_Type,
                          &strides, &PyList_Type, &offsets))
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(exemplars);
    if (PyList_GET_SIZE(sizes) != n || PyList_GET_SIZE(strides) != n || PyList_GET_SIZE(offsets) != n) {
        PyErr_SetString(PyExc_ValueError, "TensorCheck: one size, stride and offset list per exemplar");
        return -1;
    }
    auto specs = new std::vector<Spec>();
    auto all_sizes = new std::vector<int64_t>(), all_strides = new std::vector<int64_t>();
    self->specs = specs;
    self->sizes = all_sizes;
    self->strides = all_strides;
    try {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *t = PyList_GET_ITEM(exemplars, i), *offset = PyList_GET_ITEM(offsets, i);
            if (!THPVariable_Check(t)) {
                PyErr_SetString(PyExc_TypeError, "TensorCheck: exemplars are tensors");
                return -1;
            }
            c10::TensorImpl *impl = THPVariable_Unpack(t).unsafeGetTensorImpl();
            Spec s{Py_TYPE(t), impl->key_set().raw_repr(), impl->dtype().toScalarType(), impl->device(),
                   impl->requires_grad(), kAnyOffset, all_sizes->size(), 0};
            size_t stride_dim = 0;
            if (!int_list(PyList_GET_ITEM(sizes, i), *all_sizes, &s.dim) ||
                !int_list(PyList_GET_ITEM(strides, i), *all_strides, &stride_dim))
                return -1;
            if (stride_dim != s.dim) {
                PyErr_SetString(PyExc_ValueError, "TensorCheck: as many strides as sizes");
                return -1;
            }
            if (offset != Py_None) {
                s.offset = PyLong_AsLongLong(offset);
                if (s.offset == -1 && PyErr_Occurred())
                    return -1;
            }
            Py_INCREF(s.type);
            specs->push_back(s);
        }
    } catch (const std::exception &e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return -1;
    }
    return 0;
}

bool matches(const Spec &s, const int64_t *sizes, const int64_t *strides, PyObject *value) {
    if (Py_TYPE(value) != s.type)
        return false;
    c10::TensorImpl *impl = THPVariable_Unpack(value).unsafeGetTensorImpl();
    if (impl->key_set().raw_repr() != s.keys || impl->dtype().toScalarType() != s.dtype ||
        impl->device() != s.device || impl->requires_grad() != s.requires_grad)
        return false;
    // A tensor with symbolic or custom sizes (a nested tensor's keys differ already) throws here: no match.
    if (impl->dim() != static_cast<int64_t>(s.dim) || impl->sizes() != c10::IntArrayRef(sizes, s.dim) ||
        impl->strides() != c10::IntArrayRef(strides, s.dim))
        return false;
    return s.offset == kAnyOffset || impl->storage_offset() == s.offset;
}

PyObject *TensorCheck_check(TensorCheck *self, PyObject *flat) {
    if (self->specs == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "TensorCheck: not initialised");
        return nullptr;
    }
    PyObject *fast = PySequence_Fast(flat, "TensorCheck.check: a list or tuple");
    if (fast == nullptr)
        return nullptr;
    const std::vector<Spec> &specs = *self->specs;
    bool ok = PySequence_Fast_GET_SIZE(fast) >= static_cast<Py_ssize_t>(specs.size());
    try {
        PyObject **items = PySequence_Fast_ITEMS(fast);
        for (size_t i = 0; ok && i < specs.size(); i++) {
            const Spec &s = specs[i];
            ok = matches(s, self->sizes->data() + s.first, self->strides->data() + s.first, items[i]);
        }
    } catch (const std::exception &) {
        ok = false;         // what the full check then reports
    }
    Py_DECREF(fast);
    return PyBool_FromLong(ok);
}

void TensorCheck_dealloc(TensorCheck *self) {
    clear(self);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free(reinterpret_cast<PyObject *>(self));
    Py_DECREF(type);        // a heap type: each instance holds it
}

PyMethodDef TensorCheck_methods[] = {
    {"check", reinterpret_cast<PyCFunction>(TensorCheck_check), METH_O,
     "check(flat): whether flat's leading tensors still have the exemplars' metadata and layouts"},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot TensorCheck_slots[] = {
    {Py_tp_doc, const_cast<char *>("TensorCheck(exemplars, sizes, strides, offsets)")},
    {Py_tp_new, reinterpret_cast<void *>(PyType_GenericNew)},
    {Py_tp_init, reinterpret_cast<void *>(TensorCheck_init)},
    {Py_tp_dealloc, reinterpret_cast<void *>(TensorCheck_dealloc)},
    {Py_tp_methods, TensorCheck_methods},
    {0, nullptr},
};

PyType_Spec TensorCheck_spec = {"aotgrad." AOTGRAD_STR(AOTGRAD_MODULE) ".TensorCheck", sizeof(TensorCheck), 0, Py_TPFLAGS_DEFAULT,
                                TensorCheck_slots};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, AOTGRAD_STR(AOTGRAD_MODULE), nullptr, -1, nullptr};

}  // namespace

PyMODINIT_FUNC AOTGRAD_CAT(PyInit_, AOTGRAD_MODULE)(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (m == nullptr)
        return nullptr;
    PyObject *type = PyType_FromSpec(&TensorCheck_spec);
    if (type == nullptr || PyModule_AddObject(m, "TensorCheck", type) < 0 ||
        PyModule_AddStringConstant(m, "TORCH_VERSION", AOTGRAD_TORCH_VERSION) < 0) {
        Py_XDECREF(type);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
