/*
 * pigeon.client._speedups: the sync producer's send_async hot path in C.
 *
 * Optional.  When this module is not built (no compiler where pigeon-client was
 * installed) or PIGEON_NO_SPEEDUPS is set, Producer.send_async is the plain Python method
 * and nothing else changes.  See pigeon/client/_fast.py.
 *
 * A PlainSender is one producer's send_async.  It does in C what Producer.send_async and
 * ProducerLogic.add_plain do for the one case that matters at a million messages a
 * second: a bytes value alone (no keyword), to a producer of one partition without a
 * schema, whose lock is free, with room left in a batch already open.  Every check is
 * made before anything changes; any other call, and any state it does not expect, goes
 * to the Python method unchanged.  The Python code is the reference: this file reads
 * and writes the same attributes (ProducerLogic.add_plain points here), and the tests
 * send through both and compare.
 *
 * It keeps the producer's objects that do not change while it is open (its lock, handle,
 * ProducerLogic, ProducerCore and BatchBuilder, checked on each call where they could),
 * the instance dicts of the first three and the BatchBuilder's slot offsets: a message
 * costs dict and slot reads, not attribute lookups.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>

/* a slot of a class with __slots__ (BatchBuilder, MessageFuture): an object pointer at a
   fixed offset */
static int
slot_offset(PyTypeObject *type, const char *name, Py_ssize_t *out)
{
    PyObject *key = PyUnicode_FromString(name);
    if (key == NULL)
        return -1;
    PyObject *descr = _PyType_Lookup(type, key); /* borrowed */
    Py_DECREF(key);
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
        ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, name);
        return -1;
    }
    *out = ((PyMemberDescrObject *)descr)->d_member->offset;
    return 0;
}

#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

typedef struct {
    PyObject_HEAD
    PyObject *producer;    /* a weak reference */
    PyObject *func;        /* the Python send_async (unbound) */
    PyObject *acquire, *release; /* the producer's lock's, bound */
    Py_ssize_t max_pending;
    PyObject *handle, *handle_dict, *logic, *logic_dict, *core, *core_dict, *builder;
    Py_ssize_t o_extras, o_values, o_end, o_max_messages, o_max_bytes;
    PyObject *future_type; /* MessageFuture, and the offsets of its two slots */
    Py_ssize_t o_batch, o_index;
    Py_ssize_t plain_slack;
    PyObject *dict; /* __wrapped__, __doc__ ... (functools.update_wrapper) */
    vectorcallfunc vectorcall;
} PlainSender;

/* interned names */
static PyObject *s_lock, *s_handle, *s_max_pending, *s_closed, *s_outstanding, *s_logic,
    *s_single, *s_count, *s_plain_max, *s_plain_room, *s_batch_bytes, *s_builder,
    *s_state, *s_seal, *s_clock, *s_due, *s_acquire,
    *s_release, *s_send_async;
static PyObject *zero;

/* 1 and the value of an int in an instance dict; 0: missing or not an exact int */
static int
dict_ssize(PyObject *dict, PyObject *name, Py_ssize_t *out)
{
    PyObject *v = PyDict_GetItemWithError(dict, name); /* borrowed */
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyLong_CheckExact(v))
        return 0;
    *out = PyLong_AsSsize_t(v);
    if (*out == -1 && PyErr_Occurred())
        return -1;
    return 1;
}

static int
dict_set_ssize(PyObject *dict, PyObject *name, Py_ssize_t value)
{
    PyObject *v = PyLong_FromSsize_t(value);
    if (v == NULL)
        return -1;
    int r = PyDict_SetItem(dict, name, v);
    Py_DECREF(v);
    return r;
}

/* Producer.send_async(value) of a bytes value alone, under the producer's lock.
   1: sent (*out: its future); 0: not this path, nothing changed; -1: error */
static int
send_plain(PlainSender *self, PyObject *value, PyObject **out)
{
    PyObject *got, *r, *v, *state = NULL, *future = NULL, *index = NULL;
    Py_ssize_t size = PyBytes_GET_SIZE(value);
    Py_ssize_t outstanding, count, plain_max, plain_room, batch_bytes, end, max_messages,
        max_bytes;
    int status = 0;

    got = PyObject_CallOneArg(self->acquire, Py_False);
    if (got == NULL)
        return -1;
    Py_DECREF(got);
    if (got != Py_True) /* another thread holds it: Python's path waits for it */
        return 0;

    /* every check before anything changes: each one failed sends Python's way */
    PyObject *hd = self->handle_dict, *cd = self->core_dict, *b = self->builder;
    if (PyDict_GetItemWithError(hd, s_closed) != Py_False)
        goto checked;
    if ((status = dict_ssize(hd, s_outstanding, &outstanding)) != 1)
        goto checked;
    status = 0;
    if (outstanding >= self->max_pending)
        goto checked;
    if (PyDict_GetItemWithError(self->logic_dict, s_single) != self->core ||
        PyDict_GetItemWithError(cd, s_builder) != b)
        goto checked;
    if ((status = dict_ssize(cd, s_count, &count)) != 1 ||
        (status = dict_ssize(cd, s_plain_max, &plain_max)) != 1 ||
        (status = dict_ssize(cd, s_plain_room, &plain_room)) != 1 ||
        (status = dict_ssize(cd, s_batch_bytes, &batch_bytes)) != 1)
        goto checked;
    status = 0;
    /* count 0: the first message of a batch sets its deadline (Python's path) */
    if (count == 0 || size > plain_max || batch_bytes + size > plain_room)
        goto checked;
    PyObject *values = SLOT(b, self->o_values), *o;
    if (SLOT(b, self->o_extras) != Py_False || values == NULL || !PyList_CheckExact(values))
        goto checked; /* keys, properties or event times in this batch: Python's */
    o = SLOT(b, self->o_end);
    if (o == NULL || !PyLong_CheckExact(o) || (end = PyLong_AsSsize_t(o)) < 0)
        goto checked;
    o = SLOT(b, self->o_max_messages);
    if (o == NULL || !PyLong_CheckExact(o) || (max_messages = PyLong_AsSsize_t(o)) < 0)
        goto checked;
    o = SLOT(b, self->o_max_bytes);
    if (o == NULL || !PyLong_CheckExact(o) || (max_bytes = PyLong_AsSsize_t(o)) < 0)
        goto checked;
    /* the batch's shared outcome (core.state): without one, Python's path makes it
       (ProducerCore.batch_state() is Python code: calling it here could change the
       builder, whose _values list and _end were read above) */
    state = PyDict_GetItemWithError(cd, s_state);
    if (state == NULL || state == Py_None) {
        state = NULL;
        goto checked;
    }
    Py_INCREF(state);
    status = -1;

    /* the message's future: MessageFuture(state, count) */
    if ((index = PyLong_FromSsize_t(count)) == NULL)
        goto checked;
    PyTypeObject *tp = (PyTypeObject *)self->future_type;
    if ((future = tp->tp_alloc(tp, 0)) == NULL)
        goto checked;
    SLOT(future, self->o_batch) = state; /* MessageFuture.__init__ */
    SLOT(future, self->o_index) = index;
    state = index = NULL;

    /* BatchBuilder.add_value */
    if (PyList_Append(values, value) < 0)
        goto checked;
    end += size;
    if ((v = PyLong_FromSsize_t(end)) == NULL)
        goto checked;
    Py_SETREF(SLOT(b, self->o_end), v);
    int seal = PyList_GET_SIZE(values) >= max_messages || end >= max_bytes;
    /* ProducerLogic.add_plain */
    if (dict_set_ssize(cd, s_count, count + 1) < 0 ||
        dict_set_ssize(cd, s_batch_bytes, batch_bytes + size + self->plain_slack) < 0)
        goto checked;
    if (!seal) {
        PyObject *clock = PyDict_GetItemWithError(self->logic_dict, s_clock);
        if (clock == NULL && PyErr_Occurred())
            goto checked;
        if (clock != NULL && clock != Py_None) {
            PyObject *now = PyObject_CallNoArgs(clock);
            if (now == NULL)
                goto checked;
            PyObject *due = PyDict_GetItemWithError(cd, s_due);
            int late = due == NULL ? -1 : PyObject_RichCompareBool(now, due, Py_GE);
            Py_DECREF(now);
            if (late < 0) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_RuntimeError, "producer batch without a deadline");
                goto checked;
            }
            seal = late; /* due (its timer is late): it leaves now, with this message */
        }
    }
    if (seal) {
        PyObject *args[2] = {self->logic, zero};
        r = PyObject_VectorcallMethod(s_seal, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (r == NULL)
            goto checked;
        Py_DECREF(r);
    }
    /* Producer.send_async */
    if (dict_set_ssize(hd, s_outstanding, outstanding + 1) < 0)
        goto checked;
    *out = future;
    future = NULL;
    status = 1;

checked:
    if (status == 0 && PyErr_Occurred())
        status = -1;
    Py_XDECREF(future);
    Py_XDECREF(index);
    Py_XDECREF(state);
    {
        PyObject *type, *exc, *tb; /* the error being raised, kept over the release */
        PyErr_Fetch(&type, &exc, &tb);
        r = PyObject_CallNoArgs(self->release);
        if (r == NULL) {
            Py_XDECREF(type);
            Py_XDECREF(exc);
            Py_XDECREF(tb);
            if (status == 1)
                Py_CLEAR(*out);
            return -1;
        }
        Py_DECREF(r);
        PyErr_Restore(type, exc, tb);
    }
    return status;
}

static PyObject *
sender_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PlainSender *self = (PlainSender *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (self->producer == NULL) { /* cleared (tp_clear) */
        PyErr_SetString(PyExc_ReferenceError, "the producer is gone");
        return NULL;
    }
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *producer;
    if (PyWeakref_GetRef(self->producer, &producer) < 0)
        return NULL;
#else
    PyObject *producer = PyWeakref_GetObject(self->producer); /* borrowed */
    if (producer == NULL)
        return NULL;
    producer = producer == Py_None ? NULL : Py_NewRef(producer);
#endif
    if (producer == NULL) {
        PyErr_SetString(PyExc_ReferenceError, "the producer is gone");
        return NULL;
    }
    /* the class's send_async now: a patched one (unittest.mock) gets every call */
    PyObject *func = _PyType_Lookup(Py_TYPE(producer), s_send_async); /* borrowed */
    PyObject *result = NULL;
    if (func == NULL)
        func = self->func;
    Py_INCREF(func);
    if (func == self->func && kwnames == NULL && nargs == 1 && PyBytes_CheckExact(args[0])) {
        int r = send_plain(self, args[0], &result);
        if (r != 0)
            goto done; /* sent (result), or an error (NULL) */
    }
    /* every other call: the Python send_async, bound to the producer */
    descrgetfunc get = Py_TYPE(func)->tp_descr_get;
    PyObject *bound = get ? get(func, producer, (PyObject *)Py_TYPE(producer)) : Py_NewRef(func);
    if (bound != NULL) {
        result = PyObject_Vectorcall(bound, args, nargsf, kwnames);
        Py_DECREF(bound);
    }
done:
    Py_DECREF(func);
    Py_DECREF(producer);
    return result;
}

static PyObject *
getattr_dict(PyObject *obj, PyObject *name, PyObject **dict)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return NULL;
    if ((*dict = PyObject_GenericGetDict(v, NULL)) == NULL || !PyDict_CheckExact(*dict)) {
        if (*dict != NULL) {
            Py_CLEAR(*dict);
            PyErr_Format(PyExc_TypeError, "%R has no plain __dict__", v);
        }
        Py_DECREF(v);
        return NULL;
    }
    return v;
}

static PyObject *
sender_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"producer", "func", "future_type", "plain_slack", NULL};
    PyObject *producer, *func, *future_type, *lock = NULL, *v;
    Py_ssize_t plain_slack;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!n:PlainSender", names, &producer,
                                     &func, &PyType_Type, &future_type, &plain_slack))
        return NULL;
    for (PyTypeObject *t = (PyTypeObject *)future_type; t != &PyBaseObject_Type; t = t->tp_base) {
        if (t == NULL || !(t->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
            PyErr_Format(PyExc_TypeError, "future_type must be a class defined in Python, "
                         "over object alone, not %R", future_type);
            return NULL;
        }
    }
    PlainSender *self = (PlainSender *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = sender_vectorcall;
    Py_INCREF(func);
    self->func = func;
    Py_INCREF(future_type);
    self->future_type = future_type;
    self->plain_slack = plain_slack;
    if ((self->producer = PyWeakref_NewRef(producer, NULL)) == NULL)
        goto fail;
    if ((lock = PyObject_GetAttr(producer, s_lock)) == NULL)
        goto fail;
    if ((self->acquire = PyObject_GetAttr(lock, s_acquire)) == NULL ||
        (self->release = PyObject_GetAttr(lock, s_release)) == NULL)
        goto fail;
    if ((v = PyObject_GetAttr(producer, s_max_pending)) == NULL)
        goto fail;
    self->max_pending = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (self->max_pending == -1 && PyErr_Occurred())
        goto fail;
    if ((self->handle = getattr_dict(producer, s_handle, &self->handle_dict)) == NULL ||
        (self->logic = getattr_dict(self->handle, s_logic, &self->logic_dict)) == NULL ||
        (self->core = getattr_dict(self->logic, s_single, &self->core_dict)) == NULL ||
        (self->builder = PyObject_GetAttr(self->core, s_builder)) == NULL)
        goto fail;
    PyTypeObject *bt = Py_TYPE(self->builder);
    if (slot_offset(bt, "_extras", &self->o_extras) < 0 ||
        slot_offset(bt, "_values", &self->o_values) < 0 ||
        slot_offset(bt, "_end", &self->o_end) < 0 ||
        slot_offset(bt, "max_messages", &self->o_max_messages) < 0 ||
        slot_offset(bt, "max_bytes", &self->o_max_bytes) < 0 ||
        slot_offset((PyTypeObject *)future_type, "_batch", &self->o_batch) < 0 ||
        slot_offset((PyTypeObject *)future_type, "_index", &self->o_index) < 0)
        goto fail;
    Py_DECREF(lock);
    return (PyObject *)self;
fail:
    Py_XDECREF(lock);
    Py_DECREF(self);
    return NULL;
}

static int
sender_traverse(PlainSender *self, visitproc visit, void *arg)
{
    Py_VISIT(self->producer);
    Py_VISIT(self->func);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->handle);
    Py_VISIT(self->handle_dict);
    Py_VISIT(self->logic);
    Py_VISIT(self->logic_dict);
    Py_VISIT(self->core);
    Py_VISIT(self->core_dict);
    Py_VISIT(self->builder);
    Py_VISIT(self->future_type);
    Py_VISIT(self->dict);
    return 0;
}

static int
sender_clear(PlainSender *self)
{
    Py_CLEAR(self->producer);
    Py_CLEAR(self->func);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->handle);
    Py_CLEAR(self->handle_dict);
    Py_CLEAR(self->logic);
    Py_CLEAR(self->logic_dict);
    Py_CLEAR(self->core);
    Py_CLEAR(self->core_dict);
    Py_CLEAR(self->builder);
    Py_CLEAR(self->future_type);
    Py_CLEAR(self->dict);
    return 0;
}

static void
sender_dealloc(PlainSender *self)
{
    PyObject_GC_UnTrack(self);
    sender_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}



static PyGetSetDef fast_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict},
    {NULL},
};

static PyTypeObject PlainSenderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pigeon.client._speedups.PlainSender",
    .tp_doc = "One producer's send_async with its hot path in C (see pigeon.client._fast).",
    .tp_basicsize = sizeof(PlainSender),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = sender_new,
    .tp_traverse = (traverseproc)sender_traverse,
    .tp_clear = (inquiry)sender_clear,
    .tp_dealloc = (destructor)sender_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(PlainSender, vectorcall),
    .tp_dictoffset = offsetof(PlainSender, dict),
    .tp_getset = fast_getset,
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pigeon.client._speedups",
    .m_doc = "The sync producer's send_async hot path in C (optional).",
    .m_size = -1,
};

#define INTERN(var, text)                                  \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;

PyMODINIT_FUNC
PyInit__speedups(void)
{
    INTERN(s_lock, "_lock");
    INTERN(s_handle, "_handle");
    INTERN(s_max_pending, "_max_pending");
    INTERN(s_closed, "closed");
    INTERN(s_outstanding, "outstanding");
    INTERN(s_logic, "logic");
    INTERN(s_single, "_single");
    INTERN(s_count, "count");
    INTERN(s_plain_max, "plain_max");
    INTERN(s_plain_room, "plain_room");
    INTERN(s_batch_bytes, "batch_bytes");
    INTERN(s_builder, "builder");
    INTERN(s_state, "state");
    INTERN(s_seal, "seal");
    INTERN(s_clock, "clock");
    INTERN(s_due, "due");
    INTERN(s_acquire, "acquire");
    INTERN(s_release, "release");
    INTERN(s_send_async, "send_async");
    if ((zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    if (PyType_Ready(&PlainSenderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&speedups_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&PlainSenderType);
    if (PyModule_AddObject(m, "PlainSender", (PyObject *)&PlainSenderType) < 0) {
        Py_DECREF(&PlainSenderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
