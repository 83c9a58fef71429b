/* The per-call check of the Python state a compiled entry read, as one C loop (guards/state.py).
 *
 * StateCheck(owners, dicts, tags, objects, types, empties)() is True when
 *   - the i-th dict, read as owners[i].__dict__ for the first len(owners), still has the version tag
 *     tags[i] (CPython's ma_version_tag: every insert, delete or new value gives a dict a new tag, and
 *     no two dicts share one, so another dict in its place fails too),
 *   - each of objects is of the type at its place in types, and
 *   - each of empties (a dict or OrderedDict: the constructor refuses anything else) is empty.
 * A few nanoseconds a value, where a Python pass costs a call each. dict_version(d) is a dict's tag.
 * watch_switches(state) makes this thread's profile function a C one that notes the calls of torch's
 * switch getters alone (guards/reads.py: while an ATen op is dispatched under the read recording).
 * take_profile() takes this thread's profiler: a Python one's function (what sys.getprofile() returns),
 * or a C one (cProfile on 3.11, torch.profiler's Python tracer) whole, as a CProfile, which restore()
 * installs again and which, called as a Python profile function, passes the event on (scoped.py).
 * Built only where CPython keeps ma_version_tag (3.11 to 3.13); elsewhere the module is not built and
 * guards/state.py checks in Python. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

#if PY_VERSION_HEX >= 0x030E0000
#error "CPython 3.14 has no ma_version_tag: aotgrad checks its state guards in Python there"
#endif

#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

static inline uint64_t tag_of(PyObject *d) { return ((PyDictObject *)d)->ma_version_tag; }

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *owners, *dicts, *objects, *types, *empties;   /* tuples */
    uint64_t *tags;
} StateCheck;

static int
all_of(PyObject *t, int (*ok)(PyObject *), const char *what)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++)
        if (!ok(PyTuple_GET_ITEM(t, i))) {
            PyErr_Format(PyExc_TypeError, "StateCheck: item %zd of %s is not one", i, what);
            return 0;
        }
    return 1;
}

static int is_dict(PyObject *o) { return PyDict_Check(o); }
static int is_type(PyObject *o) { return PyType_Check(o); }
static PyObject *ordered_dict;      /* collections.OrderedDict */
static int is_plain_dict(PyObject *o) { return PyDict_CheckExact(o) || (PyObject *)Py_TYPE(o) == ordered_dict; }

static int holds(StateCheck *self);

static PyObject *
StateCheck_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "StateCheck() takes no arguments");
        return NULL;
    }
    int ok = holds((StateCheck *)self);
    if (ok < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

static PyObject *
StateCheck_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *owners, *dicts, *tags, *objects, *types, *empties;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!", &PyTuple_Type, &owners, &PyTuple_Type, &dicts,
                          &PyTuple_Type, &tags, &PyTuple_Type, &objects, &PyTuple_Type, &types,
                          &PyTuple_Type, &empties))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(dicts);
    if (PyTuple_GET_SIZE(owners) > n || PyTuple_GET_SIZE(tags) != n
            || PyTuple_GET_SIZE(objects) != PyTuple_GET_SIZE(types)) {
        PyErr_SetString(PyExc_ValueError, "StateCheck: owners, dicts, tags, objects and types do not match");
        return NULL;
    }
    if (!all_of(dicts, is_dict, "dicts") || !all_of(types, is_type, "types")
            || !all_of(empties, is_plain_dict, "empties (a dict or an OrderedDict)"))
        return NULL;
    StateCheck *self = (StateCheck *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->tags = PyMem_Malloc(sizeof(uint64_t) * (n ? n : 1));
    if (self->tags == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        self->tags[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(tags, i));
        if (PyErr_Occurred()) {
            Py_DECREF(self);
            return NULL;
        }
    }
    self->vectorcall = StateCheck_vectorcall;
    self->owners = Py_NewRef(owners);
    self->dicts = Py_NewRef(dicts);
    self->objects = Py_NewRef(objects);
    self->types = Py_NewRef(types);
    self->empties = Py_NewRef(empties);
    return (PyObject *)self;
}

/* 1 where every value holds, 0 where one does not, -1 with an exception set. */
static int
holds(StateCheck *self)
{
    Py_ssize_t n_owners = PyTuple_GET_SIZE(self->owners), n = PyTuple_GET_SIZE(self->dicts);
    for (Py_ssize_t i = 0; i < n_owners; i++) {
        PyObject *d = PyObject_GenericGetDict(PyTuple_GET_ITEM(self->owners, i), NULL);
        if (d == NULL)
            return -1;
        int same = PyDict_Check(d) && tag_of(d) == self->tags[i];
        Py_DECREF(d);
        if (!same)
            return 0;
    }
    for (Py_ssize_t i = n_owners; i < n; i++)
        if (tag_of(PyTuple_GET_ITEM(self->dicts, i)) != self->tags[i])
            return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->objects); i++)
        if ((PyObject *)Py_TYPE(PyTuple_GET_ITEM(self->objects, i)) != PyTuple_GET_ITEM(self->types, i))
            return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->empties); i++)
        if (PyDict_GET_SIZE(PyTuple_GET_ITEM(self->empties, i)) != 0)
            return 0;
    return 1;
}

static int
StateCheck_traverse(StateCheck *self, visitproc visit, void *arg)
{
    Py_VISIT(self->owners);
    Py_VISIT(self->dicts);
    Py_VISIT(self->objects);
    Py_VISIT(self->types);
    Py_VISIT(self->empties);
    return 0;
}

static int
StateCheck_clear(StateCheck *self)
{
    Py_CLEAR(self->owners);
    Py_CLEAR(self->dicts);
    Py_CLEAR(self->objects);
    Py_CLEAR(self->types);
    Py_CLEAR(self->empties);
    return 0;
}

static void
StateCheck_dealloc(StateCheck *self)
{
    PyObject_GC_UnTrack(self);
    StateCheck_clear(self);
    PyMem_Free(self->tags);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject StateCheckType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aotgrad.guards._tags.StateCheck",
    .tp_basicsize = sizeof(StateCheck),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "StateCheck(owners, dicts, tags, objects, types, empties)(): whether the state still holds",
    .tp_new = StateCheck_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(StateCheck, vectorcall),
    .tp_traverse = (traverseproc)StateCheck_traverse,
    .tp_clear = (inquiry)StateCheck_clear,
    .tp_dealloc = (destructor)StateCheck_dealloc,
};

static PyObject *
dict_version(PyObject *module, PyObject *d)
{
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "dict_version: not a dict");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(tag_of(d));
}

/* The profile function watch_switches installs: a call of one of state[0] (a frozenset of builtin
 * functions) is appended to the list state[1]; every other event costs a branch. */
static int
switch_profile(PyObject *state, PyFrameObject *frame, int what, PyObject *arg)
{
    if (what != PyTrace_C_CALL)
        return 0;
    int has = PySet_Contains(PyTuple_GET_ITEM(state, 0), arg);
    if (has < 0) {      /* an unhashable callable: not a getter */
        PyErr_Clear();
        return 0;
    }
    return has ? PyList_Append(PyTuple_GET_ITEM(state, 1), arg) : 0;
}

/* watch_switches(state): this thread's profile function becomes switch_profile over state, a tuple
 * (getters, found) (a subclass: reads.SwitchWatch, which sys.getprofile() then returns and which, called
 * as a Python profile function, does the same), noting into the list found each call of one of getters
 * (a frozenset); sys.setprofile puts another back. */
static PyObject *
watch_switches(PyObject *module, PyObject *state)
{
    if (!PyTuple_Check(state) || PyTuple_GET_SIZE(state) != 2 || !PyFrozenSet_Check(PyTuple_GET_ITEM(state, 0))
            || !PyList_Check(PyTuple_GET_ITEM(state, 1))) {
        PyErr_SetString(PyExc_TypeError, "watch_switches: state must be a tuple (frozenset, list)");
        return NULL;
    }
    PyEval_SetProfile(switch_profile, state);      /* holds its own reference */
    Py_RETURN_NONE;
}

/* A profile function written in C and its object, taken from this thread (its c_profilefunc and
 * c_profileobj): sys.getprofile() shows the object alone, which is not a profile function, so what
 * saves and puts back the profile through sys could not put it back. */
typedef struct {
    PyObject_HEAD
    Py_tracefunc func;
    PyObject *obj;
} CProfile;

static Py_tracefunc python_profile;     /* sys.setprofile's trampoline to a Python function */
static PyObject *event_names[8];        /* "call", "exception", ... by PyTrace_ number */

static void
cprofile_dealloc(CProfile *self)
{
    Py_XDECREF(self->obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
cprofile_restore(CProfile *self, PyObject *unused)
{
    PyEval_SetProfile(self->func, self->obj);
    Py_RETURN_NONE;
}

/* Called as a Python profile function (frame, event, arg): the event goes to the C function. */
static PyObject *
cprofile_call(CProfile *self, PyObject *args, PyObject *kwds)
{
    PyObject *frame, *event, *arg;
    if (!PyArg_ParseTuple(args, "OUO", &frame, &event, &arg))
        return NULL;
    if (!PyFrame_Check(frame)) {
        PyErr_SetString(PyExc_TypeError, "CProfile: not a frame");
        return NULL;
    }
    for (int what = 0; what < 8; what++) {
        if (PyUnicode_Compare(event, event_names[what]) == 0) {
            if (self->func(self->obj, (PyFrameObject *)frame, what, arg) != 0)
                return NULL;
            break;
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef cprofile_methods[] = {
    {"restore", (PyCFunction)cprofile_restore, METH_NOARGS, "install this profiler in this thread again"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CProfileType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aotgrad.guards._tags.CProfile",
    .tp_basicsize = sizeof(CProfile),
    .tp_dealloc = (destructor)cprofile_dealloc,
    .tp_call = (ternaryfunc)cprofile_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = cprofile_methods,
};

/* take_profile(): None, the Python function sys.setprofile installed (or watch_switches' state), or a
 * CProfile holding a C profiler. */
static PyObject *
take_profile(PyObject *module, PyObject *unused)
{
    PyThreadState *ts = PyThreadState_Get();
    if (ts->c_profilefunc == NULL)
        Py_RETURN_NONE;
    if (ts->c_profilefunc == python_profile || ts->c_profilefunc == switch_profile)
        return Py_NewRef(ts->c_profileobj != NULL ? ts->c_profileobj : Py_None);
    CProfile *p = PyObject_New(CProfile, &CProfileType);
    if (p == NULL)
        return NULL;
    p->func = ts->c_profilefunc;
    p->obj = Py_XNewRef(ts->c_profileobj);
    return (PyObject *)p;
}

/* Which C function sys.setprofile installs for a Python one: set one for a moment, read it, put back
 * what was there. */
static int
find_python_profile(void)
{
    PyThreadState *ts = PyThreadState_Get();
    Py_tracefunc func = ts->c_profilefunc;
    PyObject *obj = Py_XNewRef(ts->c_profileobj);
    PyObject *sys = PyImport_ImportModule("sys");
    PyObject *builtins = PyEval_GetBuiltins();
    PyObject *len = builtins != NULL ? PyDict_GetItemString(builtins, "len") : NULL;
    PyObject *r = sys != NULL && len != NULL ? PyObject_CallMethod(sys, "setprofile", "O", len) : NULL;
    Py_XDECREF(sys);
    if (r != NULL)
        python_profile = ts->c_profilefunc;
    Py_XDECREF(r);
    PyEval_SetProfile(func, obj);
    Py_XDECREF(obj);
    return r != NULL ? 0 : -1;
}

static PyMethodDef methods[] = {
    {"dict_version", dict_version, METH_O, "dict_version(d): d's version tag"},
    {"watch_switches", watch_switches, METH_O,
     "watch_switches(state): this thread's profile function notes calls of state[0] in state[1]"},
    {"take_profile", take_profile, METH_NOARGS, "take_profile(): this thread's profiler, a C one whole"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tags", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__tags(void)
{
    PyObject *collections = PyImport_ImportModule("collections");
    if (collections == NULL)
        return NULL;
    ordered_dict = PyObject_GetAttrString(collections, "OrderedDict");
    Py_DECREF(collections);
    if (ordered_dict == NULL || PyType_Ready(&StateCheckType) < 0 || PyType_Ready(&CProfileType) < 0)
        return NULL;
    static const char *names[8] = {"call", "exception", "line", "return", "c_call", "c_exception", "c_return",
                                   "opcode"};
    for (int i = 0; i < 8; i++)
        if ((event_names[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    if (find_python_profile() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "StateCheck", (PyObject *)&StateCheckType) < 0
            || PyModule_AddObjectRef(m, "CProfile", (PyObject *)&CProfileType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
