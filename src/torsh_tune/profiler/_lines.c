/*
 * torsh_tune.profiler._lines: the record writer's lines, written in C.
 *
 * `record_lines(records, prefixes, offset, fixed_map)` gives, for each queued record, the line
 * `profiler.writer._line` writes for it, character for character, or None where it cannot be
 * sure of that (the writer's Python path then writes that one, or says why it cannot):
 *
 * - a synchronous host-clock call the c10d capture kept as a tuple, (call site, step, seq, bytes,
 *   perf_counter at issue, at return), is
 *   PREFIX"step":S,"seq":Q,"bytes":B,"wire_bytes":B,"t_issue":T0,"blocked_s":D,"duration_s":D,"t_complete":T1}
 *   with PREFIX `prefixes[site]` (`SharedFields.prefix`), T0 and T1 `t + offset` with 7 decimals
 *   and D = t1 - t0 with 9;
 * - a dict record is its shared fields' JSON (`_s`, a non-empty SharedFields: its `json`), then
 *   its own fields in order as json.JSONEncoder(separators=(",", ":")) writes them (None, bools,
 *   ints, float reprs, NaN and Infinity, strs of printable ASCII without quote or backslash, lists
 *   and tuples of those), and after them its floats in fixed point: those with -1e15 < x < 1e15
 *   whose key `fixed_map` (writer._FIXED_POINT) gives 7 or 9 decimals. A key `fixed_map` does not
 *   know yet, a str to escape, a nested dict, an int beyond 64 bits: None.
 *
 * Fixed point is the correctly rounded decimal of the binary value (round half to even), as
 * Python's `format(x, ".7f")`, by exact integer arithmetic on the double's mantissa. In CPython a
 * float turned into text goes through dtoa's big-number path for a 17-digit Unix time, and a
 * step record's ~15 of them with its dict walk cost ~8 us; here ~1 us (BENCHMARKS.md). No state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

static const uint64_t POW10[10] = {1ULL, 10ULL, 100ULL, 1000ULL, 10000ULL, 100000ULL, 1000000ULL,
                                   10000000ULL, 100000000ULL, 1000000000ULL};

/* Decimal digits of v at out; returns how many. */
static int put_uint(char *out, uint64_t v) {
    char tmp[24];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (int i = 0; i < n; i++)
        out[i] = tmp[n - 1 - i];
    return n;
}

static int put_fixed_abs(char *out, double x, int digits);

/*
 * x with `digits` (<= 9) decimals, correctly rounded (half to even) from its exact binary value,
 * at out; returns the characters written, or -1 when x is not a finite number in [0, 2^53) (the
 * caller falls back to Python). x = M * 2^E exactly, M < 2^53: the integer part is M >> -E and the
 * fraction's digits are round(frac * 10^digits / 2^-E), in 128-bit integers.
 */
static int put_fixed(char *out, double x, int digits) { /* digits: 1..9 */
    if (!(x >= 0.0) || !(x < 9007199254740992.0) || signbit(x))
        return -1;
    return put_fixed_abs(out, x, digits);
}

/* Any finite |x| < 2^53, signed as Python writes it ("-0.000000000" for -0.0 and for a negative that rounds to 0). */
static int put_fixed_signed(char *out, double x, int digits) {
    if (!isfinite(x) || !(fabs(x) < 9007199254740992.0))
        return -1;
    if (signbit(x)) {
        out[0] = '-';
        return 1 + put_fixed_abs(out + 1, -x, digits);
    }
    return put_fixed_abs(out, x, digits);
}

static int put_fixed_abs(char *out, double x, int digits) {
    uint64_t ipart = 0, q = 0;
    if (x != 0.0) {
        int e;
        double m = frexp(x, &e); /* x = m * 2^e, m in [0.5, 1) */
        uint64_t M = (uint64_t)ldexp(m, 53);
        int sh = 53 - e; /* x = M * 2^-sh */
        if (sh <= 0) {
            ipart = M << (-sh);
        } else if (sh > 120) {
            /* x < 2^53 * 2^-121 = 2^-68: zero at 9 decimals and below */
        } else {
            uint64_t frac = sh >= 64 ? M : (M & ((1ULL << sh) - 1));
            ipart = sh >= 64 ? 0 : M >> sh;
            unsigned __int128 p = (unsigned __int128)frac * POW10[digits]; /* < 2^83 */
            unsigned __int128 one = (unsigned __int128)1 << sh;
            q = (uint64_t)(p >> sh);
            unsigned __int128 r = p & (one - 1), half = one >> 1;
            if (r > half || (r == half && (q & 1)))
                q++;
            if (q == POW10[digits]) {
                q = 0;
                ipart++;
            }
        }
    }
    int n = put_uint(out, ipart);
    out[n++] = '.';
    for (int i = digits - 1; i >= 0; i--) {
        out[n + i] = (char)('0' + q % 10);
        q /= 10;
    }
    return n + digits;
}

/* A non-negative exact int (not a bool) below 2^63, or -1. */
static long long as_count(PyObject *v) {
    if (!PyLong_CheckExact(v))
        return -1;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || x < 0) {
        PyErr_Clear();
        return -1;
    }
    return x;
}

static int as_time(PyObject *v, double *out) {
    if (!PyFloat_CheckExact(v))
        return -1;
    *out = PyFloat_AS_DOUBLE(v);
    return isfinite(*out) ? 0 : -1;
}

/* A growable byte buffer: each line is written at its start. */
typedef struct {
    char *p;
    Py_ssize_t len, cap;
} Buf;

static int reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap)
        return 0;
    Py_ssize_t cap = (b->len + extra) * 2;
    char *grown = PyMem_Realloc(b->p, (size_t)cap);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = grown;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const char *s, Py_ssize_t n) {
    if (reserve(b, n) < 0)
        return -1;
    memcpy(b->p + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

enum { OK = 0, DECLINE = 1, FAIL = -1 };

static const char K_STEP[] = "\"step\":", K_SEQ[] = ",\"seq\":", K_BYTES[] = ",\"bytes\":",
                  K_WIRE[] = ",\"wire_bytes\":", K_ISSUE[] = ",\"t_issue\":", K_BLOCKED[] = ",\"blocked_s\":",
                  K_DURATION[] = ",\"duration_s\":", K_COMPLETE[] = ",\"t_complete\":";

#define PUT(lit)                                  \
    do {                                          \
        memcpy(p, lit, sizeof(lit) - 1);          \
        p += sizeof(lit) - 1;                     \
    } while (0)

/* A host call's line, into b; DECLINE where the tuple is not the capture's (the Python path writes it). */
static int call_line(Buf *b, PyObject *call, PyObject *prefixes, double offset) {
    if (!PyTuple_CheckExact(call) || PyTuple_GET_SIZE(call) != 6)
        return DECLINE;
    long long site = as_count(PyTuple_GET_ITEM(call, 0));
    long long step = as_count(PyTuple_GET_ITEM(call, 1));
    long long seq = as_count(PyTuple_GET_ITEM(call, 2));
    long long nbytes = as_count(PyTuple_GET_ITEM(call, 3));
    double t0, t1;
    if (site < 0 || step < 0 || seq < 0 || nbytes < 0 || site >= PyList_GET_SIZE(prefixes) ||
        as_time(PyTuple_GET_ITEM(call, 4), &t0) || as_time(PyTuple_GET_ITEM(call, 5), &t1))
        return DECLINE;
    PyObject *prefix = PyList_GET_ITEM(prefixes, site);
    if (!PyUnicode_Check(prefix) || !PyUnicode_IS_ASCII(prefix))
        return DECLINE;
    Py_ssize_t plen = PyUnicode_GET_LENGTH(prefix);
    if (reserve(b, plen + 512) < 0) /* the fields' names (~90) and 8 numbers of at most 27 characters each */
        return FAIL;
    char *p = b->p + b->len;
    memcpy(p, PyUnicode_DATA(prefix), (size_t)plen);
    p += plen;
    char d[40];
    int dn = put_fixed(d, t1 - t0, 9);
    PUT(K_STEP);
    p += put_uint(p, (uint64_t)step);
    PUT(K_SEQ);
    p += put_uint(p, (uint64_t)seq);
    PUT(K_BYTES);
    p += put_uint(p, (uint64_t)nbytes);
    PUT(K_WIRE);
    p += put_uint(p, (uint64_t)nbytes);
    PUT(K_ISSUE);
    int n = put_fixed(p, t0 + offset, 7);
    if (n < 0 || dn < 0)
        return DECLINE;
    p += n;
    PUT(K_BLOCKED);
    memcpy(p, d, (size_t)dn);
    p += dn;
    PUT(K_DURATION);
    memcpy(p, d, (size_t)dn);
    p += dn;
    PUT(K_COMPLETE);
    n = put_fixed(p, t1 + offset, 7);
    if (n < 0)
        return DECLINE;
    p += n;
    *p++ = '}';
    b->len = p - b->p;
    return OK;
}

/* -- any other record (a dict): what writer._encode_record and _line write ----------------------- */

/* A str json writes as it is between quotes (printable ASCII, no quote, no backslash); DECLINE for any other. */
static int put_plain(Buf *b, PyObject *s) {
    if (!PyUnicode_CheckExact(s) || !PyUnicode_IS_ASCII(s))
        return DECLINE;
    const unsigned char *c = PyUnicode_1BYTE_DATA(s);
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    for (Py_ssize_t i = 0; i < n; i++)
        if (c[i] < 0x20 || c[i] > 0x7e || c[i] == '"' || c[i] == '\\')
            return DECLINE;
    if (reserve(b, n + 2) < 0)
        return FAIL;
    b->p[b->len++] = '"';
    memcpy(b->p + b->len, c, (size_t)n);
    b->len += n;
    b->p[b->len++] = '"';
    return OK;
}

/* A value as json.JSONEncoder writes it: None, bools, ints, floats (their repr), plain strs, lists and tuples of
 * those; DECLINE for anything else (the writer's Python path encodes it, or says why it cannot). */
static int put_value(Buf *b, PyObject *v, int depth) {
    if (v == Py_None)
        return put(b, "null", 4);
    if (v == Py_True)
        return put(b, "true", 4);
    if (v == Py_False)
        return put(b, "false", 5);
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return DECLINE;
        }
        if (reserve(b, 24) < 0)
            return FAIL;
        if (x < 0) {
            b->p[b->len++] = '-';
            b->len += put_uint(b->p + b->len, (uint64_t)0 - (uint64_t)x);
        } else {
            b->len += put_uint(b->p + b->len, (uint64_t)x);
        }
        return OK;
    }
    if (PyFloat_CheckExact(v)) {
        double x = PyFloat_AS_DOUBLE(v);
        if (isnan(x))
            return put(b, "NaN", 3);
        if (isinf(x))
            return x > 0 ? put(b, "Infinity", 8) : put(b, "-Infinity", 9);
        PyObject *r = PyObject_Repr(v);
        if (r == NULL)
            return FAIL;
        int rc = put(b, (const char *)PyUnicode_1BYTE_DATA(r), PyUnicode_GET_LENGTH(r));
        Py_DECREF(r);
        return rc;
    }
    if (PyUnicode_CheckExact(v))
        return put_plain(b, v);
    if ((PyList_CheckExact(v) || PyTuple_CheckExact(v)) && depth < 4) {
        PyObject *seq = v; /* borrowed items below: nothing runs Python code while they are read */
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (put(b, "[", 1) < 0)
            return FAIL;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i && put(b, ",", 1) < 0)
                return FAIL;
            int rc = put_value(b, PySequence_Fast_GET_ITEM(seq, i), depth + 1);
            if (rc != OK)
                return rc;
        }
        return put(b, "]", 1);
    }
    return DECLINE;
}

/* How many decimals `key`'s float takes (writer._FIXED_POINT: 7, 9, or 0 for json's repr); -1 when the map does
 * not know the key yet (the Python path learns it). */
static int digits_of(PyObject *fixed_map, PyObject *key) {
    PyObject *d = PyDict_GetItemWithError(fixed_map, key);
    if (d == NULL)
        return -1;
    long digits = PyLong_AsLong(d);
    if (digits == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return (int)digits;
}

/* A dict record's line, into b; DECLINE where the Python path must write it. The record's own fields in its
 * order, its fixed-point floats (-1e15 < x < 1e15, the key's digits 7 or 9) after the rest, the shared fields'
 * JSON (`_s`, a non-empty SharedFields) first. */
static int record_line(Buf *b, PyObject *record, PyObject *fixed_map) {
    if (!PyDict_CheckExact(record))
        return DECLINE;
    PyObject *shared = PyDict_GetItemString(record, "_s");
    if (put(b, "{", 1) < 0)
        return FAIL;
    int comma = 0;
    if (shared != NULL && PyDict_Check(shared) && PyDict_GET_SIZE(shared) > 0) {
        PyObject *json = PyObject_GetAttrString(shared, "json");
        if (json == NULL) {
            PyErr_Clear();
            return DECLINE;
        }
        int ascii = PyUnicode_CheckExact(json) && PyUnicode_IS_ASCII(json);
        int rc = ascii ? put(b, (const char *)PyUnicode_1BYTE_DATA(json), PyUnicode_GET_LENGTH(json)) : DECLINE;
        comma = ascii && PyUnicode_GET_LENGTH(json) > 0;
        Py_DECREF(json);
        if (rc != OK)
            return rc;
    }
    for (int pass = 0; pass < 2; pass++) { /* 0: the rest, as json writes them; 1: the fixed-point floats */
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(record, &pos, &key, &value)) {
            if (!PyUnicode_CheckExact(key))
                return DECLINE;
            if (PyUnicode_GET_LENGTH(key) == 2 && PyUnicode_CompareWithASCIIString(key, "_s") == 0)
                continue;
            int digits = 0;
            if (PyFloat_CheckExact(value)) {
                double x = PyFloat_AS_DOUBLE(value);
                if (x > -1e15 && x < 1e15) {
                    digits = digits_of(fixed_map, key);
                    if (digits < 0)
                        return DECLINE;
                }
            }
            int fixed = digits == 7 || digits == 9;
            if (fixed != pass)
                continue;
            if (comma && put(b, ",", 1) < 0)
                return FAIL;
            comma = 1;
            int rc = put_plain(b, key);
            if (rc != OK)
                return rc;
            if (put(b, ":", 1) < 0)
                return FAIL;
            if (fixed) {
                if (reserve(b, 40) < 0)
                    return FAIL;
                int n = put_fixed_signed(b->p + b->len, PyFloat_AS_DOUBLE(value), digits);
                if (n < 0)
                    return DECLINE;
                b->len += n;
            } else if ((rc = put_value(b, value, 0)) != OK) {
                return rc;
            }
        }
    }
    return put(b, "}", 1);
}

static PyObject *record_lines(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *records, *prefixes, *fixed_map;
    double offset;
    if (!PyArg_ParseTuple(args, "O!O!dO!:record_lines", &PyList_Type, &records, &PyList_Type, &prefixes, &offset,
                          &PyDict_Type, &fixed_map))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(records);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    Buf b = {PyMem_Malloc(1024), 0, 1024};
    if (b.p == NULL) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *record = PyList_GET_ITEM(records, i), *line;
        b.len = 0;
        int rc = PyTuple_CheckExact(record) ? call_line(&b, record, prefixes, offset)
                                            : record_line(&b, record, fixed_map);
        line = rc == OK ? PyUnicode_DecodeASCII(b.p, b.len, NULL) : rc == DECLINE ? Py_NewRef(Py_None) : NULL;
        if (line == NULL) {
            PyMem_Free(b.p);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, line);
    }
    PyMem_Free(b.p);
    return out;
}

static PyObject *fixed(PyObject *self, PyObject *args) {
    (void)self;
    double x;
    int digits;
    if (!PyArg_ParseTuple(args, "di:fixed", &x, &digits))
        return NULL;
    if (digits < 1 || digits > 9) {
        PyErr_SetString(PyExc_ValueError, "digits must be 1..9");
        return NULL;
    }
    char out[40];
    int n = put_fixed(out, x, digits);
    if (n < 0)
        Py_RETURN_NONE;
    return PyUnicode_DecodeASCII(out, n, NULL);
}

static PyMethodDef METHODS[] = {
    {"record_lines", record_lines, METH_VARARGS,
     "record_lines(records, prefixes, offset, fixed_map) -> list of str or None: the records' JSON lines (writer._line)."},
    {"fixed", fixed, METH_VARARGS,
     "fixed(x, digits) -> str or None: format(x, f'.{digits}f') for x in [0, 2**53), None otherwise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_lines", NULL, 0, METHODS, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__lines(void) { return PyModule_Create(&MODULE); }
