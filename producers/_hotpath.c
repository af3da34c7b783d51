/* dask_blackbox.producers._hotpath: the scheduler plugin's ``transition`` hook, in C,
 * and the tape it writes transitions to.
 *
 * ``Tape()``: the transitions the hook buffered, as rows in ``marshal``'s format
 * (version 4), back to back, in the order they were written:
 *
 *   - a plain row ``(key, start, finish, stimulus_id, ts)``: the five fields
 *     (``transport.RECORD_FIELDS``) of the ``Scheduler.transition_log`` record of a
 *     transition that carried nothing else;
 *   - a carried row ``(key, start, finish, stimulus_id, ts, worker, nbytes, typename,
 *     startstops)``: a transition whose kwargs hold no error (processing->memory),
 *     its values as Dask passed them (None where absent), ``ts`` its record's.
 *
 * ``tape.take(n)`` returns the ``marshal`` bytes of ``(shared, rows)``: ``rows`` the
 * list of the ``n`` oldest rows (equal to what was written, in order), ``shared``
 * the strings the rows refer to instead of holding them (Dask's task states, the
 * keys and actions of startstops: see ``shared_text``), and forgets those rows;
 * ``len(tape)`` is the number of rows held; ``tape.append(row)`` writes a tuple of
 * 5 or 9 values (tests, and the encoder's own check); ``tape.clear()``. Once every
 * row is taken, memory beyond KEEP_BYTES (and KEEP_ROWS offsets) is given back
 * (``sys.getsizeof(tape)`` says what it holds). A value is written only if it is,
 * all the way down, an exact None, bool, int (64 bits), float, str, bytes, tuple,
 * list or dict (nested at most MAX_DEPTH deep): what marshal writes for it, byte
 * for byte, but for its references. A row with any other value is not written
 * (``append`` raises ValueError, the hook hands the call to the Python method).
 * The rows hold no Python object: nothing the garbage collector tracks, nothing
 * that keeps a task's objects alive.
 *
 * ``Hook(tasks, records, transport, buffer, tape, push, slow)`` is a callable that
 * the scheduler plugin puts in place of its ``transition`` method (an attribute of
 * the plugin instance: Dask calls ``plugin.transition(key, start, finish,
 * stimulus_id=..., **kwargs)`` on the event loop, for every transition). A call
 *
 *   with three positional arguments and a ``stimulus_id`` keyword, whose other
 *   keywords (if any) name no error (``exception_text``, ``exception``,
 *   ``traceback_text``, ``cause``), whose key is in ``tasks`` (``Scheduler.tasks``),
 *   while ``records`` (``Scheduler.transition_log``) holds a record and the buffer
 *   has room (``len(buffer) + transport._held_events < transport.room``),
 *
 * writes its row to ``tape`` (plain if it had no other keyword: the record's
 * fields; carried otherwise: the call's key, start, finish and stimulus_id, the
 * record's timestamp and the keywords ``worker``, ``nbytes``, ``typename`` and
 * ``startstops``), then calls ``push`` (``buffer.append``) with the task's
 * ``group``, and returns None. The group in the buffer keeps the row's place among
 * the other items; the sender takes one row from the tape for each.
 *
 * Every other call (an error, an unknown key, an empty or disabled log, no room, a
 * value the tape does not write, an attribute that cannot be read) goes to
 * ``slow`` with the same arguments: the Python hook, which offers the transition
 * as an item of the buffer (it never writes to the tape itself). So each
 * transition is in the buffer once, in Dask's order, and its event is the same
 * either way (``tests/test_hotpath.py`` compares them on a real Scheduler).
 *
 * Nothing here blocks, performs I/O, or runs a user's code: ``tasks`` is a dict,
 * ``records`` and ``buffer`` deques, ``push`` a bound method of the buffer, the
 * attributes read are plain instance attributes, and only exact builtin types are
 * looked into.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>

#define MAX_DEPTH 16
/* What an empty tape keeps allocated (more is given back once all is taken). */
#define KEEP_BYTES (8 << 20)
#define KEEP_ROWS (1 << 16)

/* ------------------------------------------------------------------ the tape */

typedef struct {
    PyObject_HEAD
    char *data;            /* rows, from data[head] to data[len] */
    Py_ssize_t head, len, cap;
    Py_ssize_t *ends;      /* ends[i]: the end offset of row i, rows first..n-1 */
    Py_ssize_t first, n, ncap;
} Tape;

static PyTypeObject TapeType;

/* Strings a row refers to rather than holds (marshal's references): Dask's task
 * states and the keys and actions of its startstops. ``take`` puts them first, as
 * the tuple the references point into; a str is written as a reference only if it
 * is the interned object itself (Dask's literals, msgpack's dict keys). */
static const char *const shared_text[] = {
    "released", "waiting", "processing", "memory", "forgotten", "erred", "queued",
    "no-worker", "action", "start", "stop", "compute", "transfer", "source",
    "disk-read", "disk-write",
};
#define N_SHARED ((int)(sizeof(shared_text) / sizeof(shared_text[0])))
static PyObject *shared[N_SHARED];
/* marshal's bytes of ``(shared, `` (the rows' list follows): built at import */
static char *preamble;
static Py_ssize_t preamble_size;

static int
reserve(Tape *t, Py_ssize_t extra)
{
    if (t->len + extra <= t->cap)
        return 0;
    if (t->head > 0 && t->head >= t->len / 2) {  /* compact: the taken rows go */
        memmove(t->data, t->data + t->head, t->len - t->head);
        for (Py_ssize_t i = t->first; i < t->n; i++)
            t->ends[i] -= t->head;
        t->len -= t->head;
        t->head = 0;
        if (t->len + extra <= t->cap)
            return 0;
    }
    Py_ssize_t cap = t->cap ? t->cap : 1 << 16;
    while (cap < t->len + extra)
        cap *= 2;
    char *data = PyMem_Realloc(t->data, cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->data = data;
    t->cap = cap;
    return 0;
}

/* No row held: start over, and give back memory beyond what a busy second needs
 * (a tape grown while the sender was behind does not keep its size). */
static void
forget_all(Tape *t)
{
    t->first = t->n = 0;
    t->head = t->len = 0;
    if (t->cap > KEEP_BYTES) {
        PyMem_Free(t->data);
        t->data = NULL;
        t->cap = 0;
    }
    if (t->ncap > KEEP_ROWS) {
        PyMem_Free(t->ends);
        t->ends = NULL;
        t->ncap = 0;
    }
}

static inline int
put(Tape *t, const void *bytes, Py_ssize_t size)
{
    if (reserve(t, size) < 0)
        return -1;
    memcpy(t->data + t->len, bytes, size);
    t->len += size;
    return 0;
}

static inline int
put_byte(Tape *t, char c)
{
    if (t->len >= t->cap && reserve(t, 1) < 0)
        return -1;
    t->data[t->len++] = c;
    return 0;
}

static inline int
put_int32(Tape *t, char type, int32_t v)
{
    unsigned char b[5];
    uint32_t u = (uint32_t)v;
    b[0] = (unsigned char)type;
    b[1] = u & 0xff; b[2] = (u >> 8) & 0xff; b[3] = (u >> 16) & 0xff; b[4] = (u >> 24) & 0xff;
    return put(t, b, 5);
}

/* A type and a size: one byte after ``small`` below 256, else four after ``large``. */
static int
put_size(Tape *t, char small, char large, Py_ssize_t size)
{
    if (size < 256) {
        unsigned char head[2] = {(unsigned char)small, (unsigned char)size};
        return put(t, head, 2);
    }
    return size > INT32_MAX ? -1 : put_int32(t, large, (int32_t)size);
}

/* marshal's TYPE_LONG: the count of 15-bit digits (negative for a negative
 * number), then the digits, least significant first, two bytes each */
static int
put_long(Tape *t, long long v)
{
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    unsigned char digits[2 * 5];
    int32_t n = 0;
    while (u) {
        digits[2 * n] = u & 0xff;
        digits[2 * n + 1] = (u >> 8) & 0x7f;
        u >>= 15;
        n++;
    }
    if (put_int32(t, 'l', v < 0 ? -n : n) < 0)
        return -1;
    return put(t, digits, 2 * n);
}

static int
put_str(Tape *t, PyObject *o)
{
    if (PyUnicode_CHECK_INTERNED(o))
        for (int i = 0; i < N_SHARED; i++)
            if (o == shared[i])
                return put_int32(t, 'r', i);
    if (PyUnicode_READY(o) < 0)
        return -1;
    if (PyUnicode_IS_ASCII(o)) {
        Py_ssize_t size = PyUnicode_GET_LENGTH(o);
        if (put_size(t, 'z', 'a', size) < 0)
            return -1;
        return put(t, PyUnicode_DATA(o), size);
    }
    /* not ASCII: its UTF-8 (strict: a lone surrogate is not written), in a
     * temporary object, not the cached UTF-8 a str keeps once asked for it */
    PyObject *utf8 = PyUnicode_AsUTF8String(o);
    if (utf8 == NULL)
        return -1;
    Py_ssize_t size = PyBytes_GET_SIZE(utf8);
    int r = size > INT32_MAX ? -1 : put_int32(t, 'u', (int32_t)size);
    if (r == 0)
        r = put(t, PyBytes_AS_STRING(utf8), size);
    Py_DECREF(utf8);
    return r;
}

static int put_value(Tape *t, PyObject *o, int depth);

/* Write ``size`` values, each at ``depth``; -1 as put_value. */
static int
put_items(Tape *t, PyObject *const *items, Py_ssize_t size, int depth)
{
    for (Py_ssize_t i = 0; i < size; i++)
        if (put_value(t, items[i], depth) < 0)
            return -1;
    return 0;
}

/* Write ``o``; -1 if it cannot be (an exception may be set: the caller clears). */
static int
put_value(Tape *t, PyObject *o, int depth)
{
    PyTypeObject *type = Py_TYPE(o);
    if (o == Py_None)
        return put_byte(t, 'N');
    if (type == &PyUnicode_Type)
        return put_str(t, o);
    if (type == &PyFloat_Type) {
        unsigned char b[9];
        b[0] = 'g';
        if (PyFloat_Pack8(PyFloat_AS_DOUBLE(o), (char *)b + 1, 1) < 0)
            return -1;
        return put(t, b, 9);
    }
    if (type == &PyLong_Type) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred()))
            return -1;
        if (v >= INT32_MIN && v <= INT32_MAX)
            return put_int32(t, 'i', (int32_t)v);
        return put_long(t, v);
    }
    if (o == Py_True)
        return put_byte(t, 'T');
    if (o == Py_False)
        return put_byte(t, 'F');
    if (depth >= MAX_DEPTH)
        return -1;
    if (type == &PyTuple_Type) {
        Py_ssize_t size = PyTuple_GET_SIZE(o);
        if (put_size(t, ')', '(', size) < 0)
            return -1;
        return put_items(t, &PyTuple_GET_ITEM(o, 0), size, depth + 1);
    }
    if (type == &PyList_Type) {
        Py_ssize_t size = PyList_GET_SIZE(o);
        if (size > INT32_MAX || put_int32(t, '[', (int32_t)size) < 0)
            return -1;
        /* no Python code runs while it is written: the list cannot change */
        return put_items(t, ((PyListObject *)o)->ob_item, size, depth + 1);
    }
    if (type == &PyDict_Type) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        if (put_byte(t, '{') < 0)
            return -1;
        while (PyDict_Next(o, &pos, &k, &v))
            if (put_value(t, k, depth + 1) < 0 || put_value(t, v, depth + 1) < 0)
                return -1;
        return put_byte(t, '0');
    }
    if (type == &PyBytes_Type) {
        Py_ssize_t size = PyBytes_GET_SIZE(o);
        if (size > INT32_MAX || put_int32(t, 's', (int32_t)size) < 0)
            return -1;
        return put(t, PyBytes_AS_STRING(o), size);
    }
    return -1;
}

/* Write a row of ``size`` (5 or 9) values; 1 written, 0 a value it does not
 * write (the tape as it was, no exception set), -1 out of memory. */
static int
put_row(Tape *t, PyObject *const *values, Py_ssize_t size)
{
    if (t->n >= t->ncap) {
        if (t->first > 0 && t->first >= t->n / 2) {
            memmove(t->ends, t->ends + t->first, (t->n - t->first) * sizeof(Py_ssize_t));
            t->n -= t->first;
            t->first = 0;
        } else {
            Py_ssize_t ncap = t->ncap ? 2 * t->ncap : 4096;
            Py_ssize_t *ends = PyMem_Realloc(t->ends, ncap * sizeof(Py_ssize_t));
            if (ends == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->ends = ends;
            t->ncap = ncap;
        }
    }
    Py_ssize_t start = t->len - t->head;  /* from the head: a compaction moves both */
    unsigned char head[2] = {')', (unsigned char)size};
    int ok = put(t, head, 2) == 0;
    for (Py_ssize_t i = 0; ok && i < size; i++)
        ok = put_value(t, values[i], 0) == 0;
    if (!ok) {
        t->len = t->head + start;
        if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_MemoryError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    t->ends[t->n++] = t->len;
    return 1;
}

/* Forget the newest row (written, then not buffered). */
static void
unput_row(Tape *t)
{
    t->n--;
    t->len = t->n > t->first ? t->ends[t->n - 1] : t->head;
}

static PyObject *
tape_append(PyObject *op, PyObject *row)
{
    if (!PyTuple_CheckExact(row) || (PyTuple_GET_SIZE(row) != 5 && PyTuple_GET_SIZE(row) != 9)) {
        PyErr_SetString(PyExc_TypeError, "Tape.append() takes a tuple of 5 or 9 values");
        return NULL;
    }
    int done = put_row((Tape *)op, &PyTuple_GET_ITEM(row, 0), PyTuple_GET_SIZE(row));
    if (done < 0)
        return NULL;
    if (done == 0) {
        PyErr_SetString(PyExc_ValueError, "a value of the row is not one the tape writes");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
tape_take(PyObject *op, PyObject *arg)
{
    Tape *t = (Tape *)op;
    Py_ssize_t k = PyLong_AsSsize_t(arg);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    if (k < 0 || k > t->n - t->first || k > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "take(%zd): the tape holds %zd rows", k, t->n - t->first);
        return NULL;
    }
    Py_ssize_t end = k ? t->ends[t->first + k - 1] : t->head;
    PyObject *out = PyBytes_FromStringAndSize(NULL, preamble_size + 5 + end - t->head);
    if (out == NULL)
        return NULL;
    char *b = PyBytes_AS_STRING(out);
    memcpy(b, preamble, preamble_size);
    b += preamble_size;
    uint32_t u = (uint32_t)k;
    b[0] = '[';
    b[1] = u & 0xff; b[2] = (u >> 8) & 0xff; b[3] = (u >> 16) & 0xff; b[4] = (u >> 24) & 0xff;
    if (end > t->head)  /* an empty tape may have no memory at all */
        memcpy(b + 5, t->data + t->head, end - t->head);
    t->first += k;
    t->head = end;
    if (t->first == t->n)  /* all taken: start over */
        forget_all(t);
    return out;
}

static PyObject *
tape_clear(PyObject *op, PyObject *unused)
{
    forget_all((Tape *)op);
    Py_RETURN_NONE;
}

static PyObject *
tape_sizeof(PyObject *op, PyObject *unused)
{
    Tape *t = (Tape *)op;
    return PyLong_FromSsize_t(Py_TYPE(op)->tp_basicsize + t->cap + t->ncap * sizeof(Py_ssize_t));
}

static Py_ssize_t
tape_length(PyObject *op)
{
    Tape *t = (Tape *)op;
    return t->n - t->first;
}

static void
tape_dealloc(PyObject *op)
{
    Tape *t = (Tape *)op;
    PyMem_Free(t->data);
    PyMem_Free(t->ends);
    Py_TYPE(op)->tp_free(op);
}

static PyMethodDef tape_methods[] = {
    {"append", tape_append, METH_O, "Write a row (a tuple of 5 or 9 values)."},
    {"take", tape_take, METH_O, "The marshal bytes of (shared strings, the n oldest rows); forgets those rows."},
    {"clear", tape_clear, METH_NOARGS, "Forget every row."},
    {"__sizeof__", tape_sizeof, METH_NOARGS, "Bytes allocated, rows and their offsets included."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods tape_as_sequence = {.sq_length = tape_length};

static PyTypeObject TapeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dask_blackbox.producers._hotpath.Tape",
    .tp_doc = "Transitions as rows in marshal's format (see the module's source).",
    .tp_basicsize = sizeof(Tape),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = tape_dealloc,
    .tp_methods = tape_methods,
    .tp_as_sequence = &tape_as_sequence,
};

/* ------------------------------------------------------------------ the hook */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *tasks;
    PyObject *records;
    PyObject *transport;
    PyObject *buffer;
    PyObject *tape;
    PyObject *push;
    PyObject *slow;
} Hook;

enum { K_STIMULUS_ID, K_WORKER, K_NBYTES, K_TYPENAME, K_STARTSTOPS, N_CARRIED,
       K_ERROR = N_CARRIED, N_NAMES = N_CARRIED + 4 };
static const char *const names_text[N_NAMES] = {
    "stimulus_id", "worker", "nbytes", "typename", "startstops",
    "exception_text", "exception", "traceback_text", "cause",
};
static PyObject *names[N_NAMES];
static Py_hash_t name_hashes[N_NAMES];
static PyObject *s_group, *s_held_events, *s_room;

/* The index in ``names`` of a keyword, or -1: by identity (interned keywords),
 * else by hash and then equality (Dask's kwargs come from messages). */
static int
name_index(PyObject *kw)
{
    for (int i = 0; i < N_NAMES; i++)
        if (kw == names[i])
            return i;
    if (!PyUnicode_CheckExact(kw))
        return -1;
    Py_hash_t h = PyObject_Hash(kw);
    if (h == -1) {
        PyErr_Clear();
        return -1;
    }
    for (int i = 0; i < N_NAMES; i++)
        if (h == name_hashes[i] && PyUnicode_Compare(kw, names[i]) == 0)
            return i;
    return -1;
}

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

/* Write the call's row and buffer the task's group; 1 done, 0 not a case of
 * this hook (no exception set), -1 an error (exception set). */
static int
fast_case(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames == NULL)
        return 0;
    PyObject *carried[N_CARRIED] = {NULL, NULL, NULL, NULL, NULL};
    Py_ssize_t n_kw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < n_kw; i++) {
        int index = name_index(PyTuple_GET_ITEM(kwnames, i));
        if (index >= K_ERROR)
            return 0;  /* an error: the sender reads it from Dask's kwargs */
        if (index >= 0)
            carried[index] = args[3 + i];
    }
    if (carried[K_STIMULUS_ID] == NULL)
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
    int done;
    if (n_kw == 1) {  /* a plain row: the record's fields */
        PyObject *row[5] = {
            PyTuple_GET_ITEM(record, 0), PyTuple_GET_ITEM(record, 1),
            PyTuple_GET_ITEM(record, 2), PyTuple_GET_ITEM(record, 4),
            PyTuple_GET_ITEM(record, 5)};
        done = put_row((Tape *)self->tape, row, 5);
    } else {  /* a carried row */
        PyObject *row[9] = {
            args[0], args[1], args[2], carried[K_STIMULUS_ID], PyTuple_GET_ITEM(record, 5),
            carried[K_WORKER] ? carried[K_WORKER] : Py_None,
            carried[K_NBYTES] ? carried[K_NBYTES] : Py_None,
            carried[K_TYPENAME] ? carried[K_TYPENAME] : Py_None,
            carried[K_STARTSTOPS] ? carried[K_STARTSTOPS] : Py_None};
        done = put_row((Tape *)self->tape, row, 9);
    }
    Py_DECREF(record);
    if (done <= 0) {
        Py_DECREF(group);
        return done;  /* 0: a value the tape does not write, the Python hook offers it */
    }
    /* the row first: the sender takes it once it sees the group */
    PyObject *pushed = PyObject_CallOneArg(self->push, group);
    Py_DECREF(group);
    if (pushed == NULL) {
        unput_row((Tape *)self->tape);  /* not buffered: neither is its row */
        return -1;
    }
    Py_DECREF(pushed);
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
    PyObject *tasks, *records, *transport, *buffer, *tape, *push, *slow;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Hook() takes positional arguments only");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!OOOO!OO:Hook", &PyDict_Type, &tasks, &records, &transport,
                          &buffer, &TapeType, &tape, &push, &slow))
        return -1;
    Py_INCREF(tasks); Py_XSETREF(self->tasks, tasks);
    Py_INCREF(records); Py_XSETREF(self->records, records);
    Py_INCREF(transport); Py_XSETREF(self->transport, transport);
    Py_INCREF(buffer); Py_XSETREF(self->buffer, buffer);
    Py_INCREF(tape); Py_XSETREF(self->tape, tape);
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
    Py_VISIT(self->tape);
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
    Py_CLEAR(self->tape);
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
    "The scheduler plugin's transition hook and its tape, in C (see producers/_hotpath.c).",
    -1, NULL,
};

static int
add_type(PyObject *m, PyTypeObject *type, const char *name)
{
    if (PyType_Ready(type) < 0)
        return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(m, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    for (int i = 0; i < N_NAMES; i++) {
        if ((names[i] = PyUnicode_InternFromString(names_text[i])) == NULL)
            return NULL;
        if ((name_hashes[i] = PyObject_Hash(names[i])) == -1)
            return NULL;
    }
    /* the preamble: a 2-tuple, its first item the tuple of the shared strings, each
     * flagged as a reference (marshal's FLAG_REF, 0x80) in order: references 0..N-1 */
    preamble_size = 4;
    for (int i = 0; i < N_SHARED; i++) {
        if ((shared[i] = PyUnicode_InternFromString(shared_text[i])) == NULL)
            return NULL;
        preamble_size += 2 + (Py_ssize_t)strlen(shared_text[i]);
    }
    if ((preamble = PyMem_Malloc(preamble_size)) == NULL)
        return PyErr_NoMemory();
    char *b = preamble;
    *b++ = ')'; *b++ = 2; *b++ = ')'; *b++ = (char)N_SHARED;
    for (int i = 0; i < N_SHARED; i++) {
        size_t size = strlen(shared_text[i]);
        *b++ = (char)('Z' | 0x80);  /* an interned short ASCII str, a reference */
        *b++ = (char)size;
        memcpy(b, shared_text[i], size);
        b += size;
    }
    s_group = PyUnicode_InternFromString("group");
    s_held_events = PyUnicode_InternFromString("_held_events");
    s_room = PyUnicode_InternFromString("room");
    if (!s_group || !s_held_events || !s_room)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    if (add_type(m, &TapeType, "Tape") < 0 || add_type(m, &HookType, "Hook") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
