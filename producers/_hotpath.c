/* dask_blackbox.producers._hotpath: the scheduler plugin's ``transition`` hook, in C.
 *
 * What it is. ``Hook(tasks, records, transport, buffer, extend_fields, push, slow)``
 * is a callable that the scheduler plugin puts in place of its ``transition`` method
 * (an attribute of the plugin instance: Dask calls ``plugin.transition(key, start,
 * finish, stimulus_id=..., **kwargs)`` on the event loop, for every transition).
 * It does exactly what the Python hook's fast case does
 * (``BlackboxSchedulerPlugin.transition`` in scheduler.py), without a Python frame:
 *
 *   a call with three positional arguments and ``stimulus_id`` as its only keyword
 *   (a transition that carried nothing but what Dask's ``transition_log`` records),
 *   whose key is in ``tasks`` (``Scheduler.tasks``), while ``records``
 *   (``Scheduler.transition_log``) holds a record and the buffer has room
 *   (``len(buffer) + transport._held_events < transport.room``), calls
 *   ``extend_fields`` with the five fields (0, 1, 2, 4, 5: key, start, finish,
 *   stimulus_id, timestamp; ``transport.RECORD_FIELDS``) of the last record, then
 *   ``push`` with the task's ``group``; and returns None.
 *
 * Every other call (Dask's kwargs, an unknown key, an empty or disabled log, no
 * room, a record that is not a tuple of six or more, an attribute that cannot be
 * read) goes to ``slow`` with the same arguments: the Python hook, which handles all
 * cases, the fast one included. So the buffer gets the same items in the same
 * order either way (``tests/test_hotpath.py`` compares them on a real Scheduler).
 *
 * Nothing here blocks, performs I/O, or runs a user's code: ``tasks`` is a dict,
 * ``records`` and ``buffer`` deques, ``extend_fields`` and ``push`` their bound
 * methods, and the attributes read are plain instance attributes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *tasks;
    PyObject *records;
    PyObject *transport;
    PyObject *buffer;
    PyObject *extend_fields;
    PyObject *push;
    PyObject *slow;
} Hook;

static PyObject *s_stimulus_id, *s_group, *s_held_events, *s_room;

/* transport.<name> as a C integer; -1 with an exception set if it cannot be read */
static Py_ssize_t
int_attribute(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    return n;
}

/* Buffer the record's fields and the task's group; 1 done, 0 not a fast case
 * (no exception set), -1 an error (exception set). */
static int
fast_case(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames == NULL || PyTuple_GET_SIZE(kwnames) != 1)
        return 0;
    PyObject *kw = PyTuple_GET_ITEM(kwnames, 0);
    if (kw != s_stimulus_id &&
            !(PyUnicode_CheckExact(kw) && PyUnicode_Compare(kw, s_stimulus_id) == 0))
        return 0;
    PyObject *ts = PyDict_GetItemWithError(self->tasks, args[0]);  /* borrowed */
    if (ts == NULL) {
        PyErr_Clear();  /* unknown (or unhashable) key: the Python hook decides */
        return 0;
    }
    Py_ssize_t n_records = PyObject_Length(self->records);
    if (n_records <= 0) {
        PyErr_Clear();
        return 0;
    }
    Py_ssize_t buffered = PyObject_Length(self->buffer);
    Py_ssize_t held = buffered < 0 ? -1 : int_attribute(self->transport, s_held_events);
    Py_ssize_t room = PyErr_Occurred() ? -1 : int_attribute(self->transport, s_room);
    if (PyErr_Occurred()) {  /* any of the three unreadable: the Python hook decides */
        PyErr_Clear();
        return 0;
    }
    if (buffered + held >= room)
        return 0;  /* the Python hook recomputes the room, or drops and counts */
    Py_INCREF(ts);
    PyObject *record = PySequence_GetItem(self->records, n_records - 1);
    if (record == NULL || !PyTuple_Check(record) || PyTuple_GET_SIZE(record) < 6) {
        Py_DECREF(ts);
        Py_XDECREF(record);
        PyErr_Clear();
        return 0;
    }
    PyObject *group = PyObject_GetAttr(ts, s_group);
    Py_DECREF(ts);
    if (group == NULL) {
        Py_DECREF(record);
        PyErr_Clear();
        return 0;
    }
    PyObject *fields = PyTuple_Pack(
        5, PyTuple_GET_ITEM(record, 0), PyTuple_GET_ITEM(record, 1),
        PyTuple_GET_ITEM(record, 2), PyTuple_GET_ITEM(record, 4), PyTuple_GET_ITEM(record, 5));
    Py_DECREF(record);
    if (fields == NULL) {
        Py_DECREF(group);
        return -1;
    }
    /* the fields first: the sender takes them once it sees the group */
    PyObject *done = PyObject_CallOneArg(self->extend_fields, fields);
    Py_DECREF(fields);
    if (done == NULL) {
        Py_DECREF(group);
        return -1;
    }
    Py_DECREF(done);
    done = PyObject_CallOneArg(self->push, group);
    Py_DECREF(group);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 1;
}

static PyObject *
hook_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Hook *self = (Hook *)op;
    int done = fast_case(self, args, nargsf, kwnames);
    if (done > 0)
        Py_RETURN_NONE;
    if (done < 0)
        return NULL;
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static int
hook_init(PyObject *op, PyObject *args, PyObject *kwds)
{
    Hook *self = (Hook *)op;
    PyObject *tasks, *records, *transport, *buffer, *extend_fields, *push, *slow;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Hook() takes positional arguments only");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!OOOOOO:Hook", &PyDict_Type, &tasks, &records, &transport,
                          &buffer, &extend_fields, &push, &slow))
        return -1;
    Py_INCREF(tasks); Py_XSETREF(self->tasks, tasks);
    Py_INCREF(records); Py_XSETREF(self->records, records);
    Py_INCREF(transport); Py_XSETREF(self->transport, transport);
    Py_INCREF(buffer); Py_XSETREF(self->buffer, buffer);
    Py_INCREF(extend_fields); Py_XSETREF(self->extend_fields, extend_fields);
    Py_INCREF(push); Py_XSETREF(self->push, push);
    Py_INCREF(slow); Py_XSETREF(self->slow, slow);
    return 0;
}

static PyObject *
hook_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Hook *self = (Hook *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->vectorcall = hook_vectorcall;
    return (PyObject *)self;
}

static int
hook_traverse(PyObject *op, visitproc visit, void *arg)
{
    Hook *self = (Hook *)op;
    Py_VISIT(self->tasks);
    Py_VISIT(self->records);
    Py_VISIT(self->transport);
    Py_VISIT(self->buffer);
    Py_VISIT(self->extend_fields);
    Py_VISIT(self->push);
    Py_VISIT(self->slow);
    return 0;
}

static int
hook_clear(PyObject *op)
{
    Hook *self = (Hook *)op;
    Py_CLEAR(self->tasks);
    Py_CLEAR(self->records);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->extend_fields);
    Py_CLEAR(self->push);
    Py_CLEAR(self->slow);
    return 0;
}

static void
hook_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    hook_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyObject *
hook_call(PyObject *op, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(op, args, kwargs);
}

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dask_blackbox.producers._hotpath.Hook",
    .tp_doc = "The scheduler plugin's transition hook (see the module's source).",
    .tp_basicsize = sizeof(Hook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Hook, vectorcall),
    .tp_call = hook_call,
    .tp_new = hook_new,
    .tp_init = hook_init,
    .tp_traverse = hook_traverse,
    .tp_clear = hook_clear,
    .tp_dealloc = hook_dealloc,
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_hotpath",
    "The scheduler plugin's transition hook in C (see producers/_hotpath.c).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    s_stimulus_id = PyUnicode_InternFromString("stimulus_id");
    s_group = PyUnicode_InternFromString("group");
    s_held_events = PyUnicode_InternFromString("_held_events");
    s_room = PyUnicode_InternFromString("room");
    if (!s_stimulus_id || !s_group || !s_held_events || !s_room)
        return NULL;
    if (PyType_Ready(&HookType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&HookType);
    if (PyModule_AddObject(m, "Hook", (PyObject *)&HookType) < 0) {
        Py_DECREF(&HookType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
