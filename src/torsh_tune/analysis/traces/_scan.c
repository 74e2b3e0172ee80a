/*
 * torsh_tune.analysis.traces._scan: a streaming scanner of Kineto (Chrome trace) JSON events.
 *
 * `Scanner.feed(buf, base)` takes bytes that begin inside the traceEvents array, right after
 * the `[` or after the last event a previous call took. It walks the events with a complete,
 * validating JSON tokenizer (strings with every escape, UTF-8 checked, nested values skipped,
 * numbers, literals, whitespace), keeps the fields the analyzers need and stops at the last
 * complete event of `buf` or at the array's closing `]`. Rows are kept for complete ("X") and
 * instant ("i") events only; `thread_name` metadata ("M") events are collected apart.
 * `Scanner.finish()` hands back the columns as bytearrays (numpy wraps them with
 * np.frombuffer), the distinct strings (string columns hold indexes into that list, -1 for
 * absent) and the thread names. `_reader.PyScanner` is the pure-Python twin: same interface,
 * same results.
 *
 * Field rules (shared with PyScanner): a string field (name, cat and the string args) keeps a
 * JSON string and is absent (-1) for any other value; an integer field keeps an integer, the
 * truncated value of a finite float and the value of a string that is a JSON number, and is
 * -1 otherwise or out of the column's range; a float field (ts, dur) takes numbers and numeric
 * strings, NaN otherwise. Duplicate keys: the last one wins (a later "args" replaces every
 * argument). Anything that is not JSON raises ValueError naming the byte offset (`base` +
 * offset in `buf`). No global mutable state: all of it lives in the Scanner object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__SSE2__)
#include <emmintrin.h>
#define SCAN_SSE2 1
#endif

#define MAX_DEPTH 1024

enum { ST_OK = 0, ST_MORE = 1, ST_BAD = 2, ST_NOMEM = 3 };

/* Column layout (EVENT_COLUMNS without input_numel/input_bytes, same order). */
enum {
    C_NAME, C_CAT, C_PH, C_TS, C_DUR, C_PID, C_TID, C_STREAM, C_CORR, C_EXT, C_DEVICE, C_COLL,
    C_IN, C_OUT, C_GROUP, C_SEQ, C_DTYPE, C_PGNAME, C_PGRANKS, NCOLS
};
static const char *const COL_NAMES[NCOLS] = {
    "name_id", "cat_id", "ph", "ts_us", "dur_us", "pid", "tid", "stream", "correlation",
    "external_id", "device", "coll_name_id", "in_nelems", "out_nelems", "group_size", "coll_seq",
    "dtype_id", "pg_name_id", "pg_ranks_id",
};
enum { T_I8, T_I32, T_I64, T_F64 };
static const unsigned char COL_TYPE[NCOLS] = {
    T_I32, T_I32, T_I8, T_F64, T_F64, T_I64, T_I64, T_I32, T_I64, T_I64, T_I32, T_I32,
    T_I64, T_I64, T_I32, T_I64, T_I32, T_I32, T_I32,
};
static const Py_ssize_t TYPE_SIZE[4] = {1, 4, 8, 8};
static const char TYPE_CODE[4] = {'b', 'i', 'q', 'd'};

enum { F_STR, F_INT, F_FLT, F_PH, F_ARGS, F_ARGNAME };
typedef struct {
    const char *key;
    Py_ssize_t len;
    int col;
    int kind;
} Field;
#define FIELD(k, c, t) {k, (Py_ssize_t)sizeof(k) - 1, c, t}
static const Field TOP_FIELDS[] = {
    FIELD("ph", -1, F_PH), FIELD("cat", C_CAT, F_STR), FIELD("name", C_NAME, F_STR),
    FIELD("pid", C_PID, F_INT), FIELD("tid", C_TID, F_INT), FIELD("ts", C_TS, F_FLT),
    FIELD("dur", C_DUR, F_FLT), FIELD("args", -1, F_ARGS),
};
static const Field ARG_FIELDS[] = {
    FIELD("External id", C_EXT, F_INT), FIELD("correlation", C_CORR, F_INT),
    FIELD("stream", C_STREAM, F_INT), FIELD("device", C_DEVICE, F_INT),
    FIELD("In msg nelems", C_IN, F_INT), FIELD("Out msg nelems", C_OUT, F_INT),
    FIELD("Group size", C_GROUP, F_INT), FIELD("Seq", C_SEQ, F_INT),
    FIELD("Collective name", C_COLL, F_STR), FIELD("dtype", C_DTYPE, F_STR),
    FIELD("Process Group Name", C_PGNAME, F_STR), FIELD("Process Group Ranks", C_PGRANKS, F_STR),
    FIELD("name", -1, F_ARGNAME),
};
#define N_TOP ((int)(sizeof(TOP_FIELDS) / sizeof(TOP_FIELDS[0])))
#define N_ARG ((int)(sizeof(ARG_FIELDS) / sizeof(ARG_FIELDS[0])))
static const int ARG_COLS[] = {C_STREAM, C_CORR, C_EXT, C_DEVICE, C_COLL, C_IN, C_OUT, C_GROUP,
                               C_SEQ, C_DTYPE, C_PGNAME, C_PGRANKS};
#define N_ARG_COLS ((int)(sizeof(ARG_COLS) / sizeof(ARG_COLS[0])))

enum { PH_OTHER = -1, PH_X = 0, PH_I = 1, PH_M = 2 };

typedef union {
    int64_t i;
    double f;
} Val;

typedef struct {
    Val v[NCOLS];
    int ph;
    int32_t argname; /* local id of args.name, -1 when absent */
} Event;

typedef struct {
    uint64_t hash;
    Py_ssize_t off, len;
    int detail;
} Entry;

typedef struct {
    PyObject_HEAD
    char *cols[NCOLS];
    Py_ssize_t nrows, cap;
    /* distinct strings, keyed by their UTF-8 bytes (escapes decoded) */
    char *arena;
    Py_ssize_t arena_len, arena_cap;
    Entry *entries;
    Py_ssize_t nentries, entries_cap;
    int32_t *slots; /* open addressing, -1 = empty */
    Py_ssize_t nslots;
    PyObject *prefixes; /* tuple of bytes: names of the events whose text feed() returns */
    PyObject *threads;  /* list of (pid, tid, local id of the thread name) */
    int32_t thread_name_id;
    char *scratch;
    Py_ssize_t scratch_cap;
    int after_event, closed, failed, finished, busy;
    const char *err_at;
    const char *err_msg;
} Scanner;

/* ------------------------------------------------------------------ helpers */

static inline const char *skip_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t'))
        p++;
    return p;
}

static int bad(Scanner *s, const char *at, const char *msg)
{
    s->err_at = at;
    s->err_msg = msg;
    return ST_BAD;
}

static inline int is_hex(unsigned char c)
{
    return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'f');
}

static inline uint32_t hex4(const char *p)
{
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) {
        unsigned char c = (unsigned char)p[k];
        v = (v << 4) | (uint32_t)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    return v;
}

/* One UTF-8 sequence at p (p[0] >= 0x80). Encoded surrogates are accepted, as Python's json
 * does for bytes ("surrogatepass"). */
static int utf8_seq(const unsigned char *p, const unsigned char *end, int *len)
{
    unsigned c = p[0], lo = 0x80, hi = 0xBF;
    int need;
    if (c >= 0xC2 && c <= 0xDF)
        need = 1;
    else if (c == 0xE0) {
        need = 2;
        lo = 0xA0;
    }
    else if (c >= 0xE1 && c <= 0xEF)
        need = 2;
    else if (c == 0xF0) {
        need = 3;
        lo = 0x90;
    }
    else if (c >= 0xF1 && c <= 0xF3)
        need = 3;
    else if (c == 0xF4) {
        need = 3;
        hi = 0x8F;
    }
    else
        return ST_BAD;
    for (int k = 1; k <= need; k++) {
        if (p + k >= end)
            return ST_MORE;
        unsigned b = p[k];
        if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF))
            return ST_BAD;
    }
    *len = need + 1;
    return ST_OK;
}

/* p: just past an opening quote. On ST_OK *close is the closing quote and *esc says whether
 * the string holds a backslash escape. */
static int scan_string(Scanner *s, const char *p, const char *end, const char **close, int *esc)
{
    int has_esc = 0;
#ifdef SCAN_SSE2
    const __m128i quote = _mm_set1_epi8('"'), bslash = _mm_set1_epi8('\\'),
                  space = _mm_set1_epi8(0x20);
#endif
    for (;;) {
#ifdef SCAN_SSE2
        while (end - p >= 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)p);
            /* signed compare: bytes >= 0x80 are negative, so this flags them too */
            __m128i m = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, bslash)),
                                     _mm_cmplt_epi8(v, space));
            unsigned mask = (unsigned)_mm_movemask_epi8(m);
            if (mask) {
                p += __builtin_ctz(mask);
                goto special;
            }
            p += 16;
        }
#endif
        while (p < end) {
            unsigned char c = (unsigned char)*p;
            if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80)
                goto special;
            p++;
        }
        return ST_MORE;
    special:;
        unsigned char c = (unsigned char)*p;
        if (c == '"') {
            *close = p;
            *esc = has_esc;
            return ST_OK;
        }
        if (c == '\\') {
            has_esc = 1;
            if (end - p < 2)
                return ST_MORE;
            switch (p[1]) {
            case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
                p += 2;
                continue;
            case 'u':
                for (int k = 2; k < 6; k++) {
                    if (p + k >= end)
                        return ST_MORE;
                    if (!is_hex((unsigned char)p[k]))
                        return bad(s, p, "invalid \\uXXXX escape");
                }
                p += 6;
                continue;
            default:
                return bad(s, p, "invalid escape in string");
            }
        }
        if (c < 0x20)
            return bad(s, p, "control character in string");
        int len;
        int r = utf8_seq((const unsigned char *)p, (const unsigned char *)end, &len);
        if (r == ST_MORE)
            return ST_MORE;
        if (r != ST_OK)
            return bad(s, p, "invalid UTF-8 in string");
        p += len;
    }
}

static inline char *put_utf8(char *o, uint32_t cp)
{
    if (cp < 0x80)
        *o++ = (char)cp;
    else if (cp < 0x800) {
        *o++ = (char)(0xC0 | (cp >> 6));
        *o++ = (char)(0x80 | (cp & 0x3F));
    }
    else if (cp < 0x10000) { /* lone surrogates too, as Python's json keeps them */
        *o++ = (char)(0xE0 | (cp >> 12));
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *o++ = (char)(0x80 | (cp & 0x3F));
    }
    else {
        *o++ = (char)(0xF0 | (cp >> 18));
        *o++ = (char)(0x80 | ((cp >> 12) & 0x3F));
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *o++ = (char)(0x80 | (cp & 0x3F));
    }
    return o;
}

/* Decode a string body already validated by scan_string into UTF-8 (never longer). */
static Py_ssize_t decode_escapes(const char *p, const char *end, char *out)
{
    char *o = out;
    while (p < end) {
        if (*p != '\\') {
            *o++ = *p++;
            continue;
        }
        char c = p[1];
        p += 2;
        switch (c) {
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            uint32_t cp = hex4(p);
            p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF && end - p >= 6 && p[0] == '\\' && p[1] == 'u') {
                uint32_t lo = hex4(p + 2);
                if (lo >= 0xDC00 && lo <= 0xDFFF) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    p += 6;
                }
            }
            o = put_utf8(o, cp);
            break;
        }
        default: *o++ = c; break; /* " \ / */
        }
    }
    return o - out;
}

static int literal(Scanner *s, const char *p, const char *end, const char *lit, int n)
{
    for (int k = 0; k < n; k++) {
        if (p + k >= end)
            return ST_MORE;
        if (p[k] != lit[k])
            return bad(s, p, "expected a value");
    }
    return ST_OK;
}

/* ------------------------------------------------------------------ numbers */

typedef struct {
    const char *start, *stop; /* token; on ST_BAD stop is the offending byte */
    uint64_t mant;            /* up to 19 significant digits */
    int64_t exp10;
    int neg, int_only, slow;  /* slow: more digits or a larger exponent than the fast path takes */
} Num;

/* A JSON number at p. With eof, `end` ends the number; else reaching it means more may follow. */
static int scan_number(const char *p, const char *end, int eof, Num *n)
{
    uint64_t mant = 0;
    int ndig = 0, frac = 0, slow = 0, int_only = 1;
    int64_t e = 0;
    n->start = p;
    n->neg = 0;
    if (p < end && *p == '-') {
        n->neg = 1;
        p++;
    }
    if (p >= end)
        goto out_of_data;
    if (*p == '0')
        p++;
    else if (*p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9') {
            if (ndig < 19) {
                mant = mant * 10 + (uint64_t)(*p - '0');
                ndig++;
            }
            else
                slow = 1;
            p++;
        }
    }
    else
        goto bad_byte;
    if (p < end && *p == '.') {
        int_only = 0;
        p++;
        if (p >= end)
            goto out_of_data;
        if (!(*p >= '0' && *p <= '9'))
            goto bad_byte;
        while (p < end && *p >= '0' && *p <= '9') {
            if (mant == 0 && *p == '0')
                frac++;
            else if (ndig < 19) {
                mant = mant * 10 + (uint64_t)(*p - '0');
                ndig++;
                frac++;
            }
            else
                slow = 1;
            p++;
        }
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        int eneg = 0;
        int_only = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-')) {
            eneg = *p == '-';
            p++;
        }
        if (p >= end)
            goto out_of_data;
        if (!(*p >= '0' && *p <= '9'))
            goto bad_byte;
        while (p < end && *p >= '0' && *p <= '9') {
            if (e < 100000)
                e = e * 10 + (*p - '0');
            else
                slow = 1;
            p++;
        }
        if (eneg)
            e = -e;
    }
    if (p >= end && !eof)
        return ST_MORE;
    n->stop = p;
    n->mant = mant;
    n->exp10 = e - frac;
    n->int_only = int_only;
    n->slow = slow;
    return ST_OK;
out_of_data:
    n->stop = p;
    return eof ? ST_BAD : ST_MORE;
bad_byte:
    n->stop = p;
    return ST_BAD;
}

static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                                 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* The correctly rounded double of a number (as Python's float() gives); -1 with an exception set
 * on a memory error. */
static int num_to_double(const Num *n, double *out)
{
#if FLT_EVAL_METHOD == 0
    if (!n->slow && n->mant <= ((uint64_t)1 << 53) && n->exp10 >= -22 && n->exp10 <= 22) {
        /* exact operands, one IEEE operation: correctly rounded (Clinger's fast path) */
        double d = (double)n->mant;
        d = n->exp10 >= 0 ? d * POW10[n->exp10] : d / POW10[-n->exp10];
        *out = n->neg ? -d : d;
        return 0;
    }
#endif
    if (n->mant == 0 && !n->slow) {
        *out = n->neg ? -0.0 : 0.0;
        return 0;
    }
    char small[128];
    Py_ssize_t len = n->stop - n->start;
    char *tmp = small;
    if (len >= (Py_ssize_t)sizeof(small)) {
        tmp = PyMem_Malloc((size_t)len + 1);
        if (tmp == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    memcpy(tmp, n->start, (size_t)len);
    tmp[len] = '\0';
    double d = PyOS_string_to_double(tmp, NULL, NULL); /* overflow gives +-inf, like float() */
    if (tmp != small)
        PyMem_Free(tmp);
    if (d == -1.0 && PyErr_Occurred())
        return -1;
    *out = d;
    return 0;
}

/* Integer value of a number: 1 when it fits int64 (floats truncated toward zero), else 0. */
static int num_to_int64(const Num *n, int64_t *out)
{
    if (n->int_only) {
        if (n->slow)
            return 0; /* 20+ digits */
        if (!n->neg) {
            if (n->mant > (uint64_t)INT64_MAX)
                return 0;
            *out = (int64_t)n->mant;
        }
        else {
            if (n->mant > (uint64_t)INT64_MAX + 1)
                return 0;
            *out = n->mant == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)n->mant;
        }
        return 1;
    }
    double d;
    if (num_to_double(n, &d) < 0)
        return -1;
    if (!(d >= -9223372036854775808.0 && d < 9223372036854775808.0))
        return 0;
    *out = (int64_t)d;
    return 1;
}

/* ------------------------------------------------------------------ strings */

static uint64_t hash_bytes(const char *p, Py_ssize_t n)
{
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
        h ^= h >> 31;
        p += 8;
        n -= 8;
    }
    if (n > 0) {
        uint64_t w = 0;
        memcpy(&w, p, (size_t)n);
        h = (h ^ w) * 0x94D049BB133111EBULL;
    }
    h ^= h >> 32;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 29;
    return h;
}

/* Grow the array *buf of *cap items of `size` bytes to hold `need` items (capacity doubling from
 * `first`); on failure *buf and *cap are unchanged and MemoryError is set. */
static int reserve(void **buf, Py_ssize_t *cap, Py_ssize_t need, size_t size, Py_ssize_t first)
{
    if (need <= *cap)
        return 0;
    Py_ssize_t n = *cap ? *cap : first;
    while (n < need)
        n *= 2;
    void *grown = PyMem_Realloc(*buf, (size_t)n * size);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = grown;
    *cap = n;
    return 0;
}

static int grow_slots(Scanner *s)
{
    Py_ssize_t n = s->nslots ? s->nslots * 2 : 1024;
    int32_t *slots = PyMem_Malloc((size_t)n * sizeof(int32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(slots, 0xFF, (size_t)n * sizeof(int32_t));
    size_t mask = (size_t)n - 1;
    for (Py_ssize_t id = 0; id < s->nentries; id++) {
        size_t i = (size_t)s->entries[id].hash & mask;
        while (slots[i] >= 0)
            i = (i + 1) & mask;
        slots[i] = (int32_t)id;
    }
    PyMem_Free(s->slots);
    s->slots = slots;
    s->nslots = n;
    return 0;
}

/* Local id of the UTF-8 string p[:n]; -1 with an exception set on a memory error. */
static int32_t intern(Scanner *s, const char *p, Py_ssize_t n)
{
    uint64_t h = hash_bytes(p, n);
    size_t mask = (size_t)s->nslots - 1, i = (size_t)h & mask;
    for (;;) {
        int32_t id = s->slots[i];
        if (id < 0)
            break;
        const Entry *e = &s->entries[id];
        if (e->hash == h && e->len == n && memcmp(s->arena + e->off, p, (size_t)n) == 0)
            return id;
        i = (i + 1) & mask;
    }
    if (s->nentries >= INT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "too many distinct strings in one trace");
        return -1;
    }
    void *entries = s->entries, *arena = s->arena;
    if (reserve(&entries, &s->entries_cap, s->nentries + 1, sizeof(Entry), 256) < 0)
        return -1;
    s->entries = entries;
    if (reserve(&arena, &s->arena_cap, s->arena_len + n, 1, 1 << 16) < 0)
        return -1;
    s->arena = arena;
    if (n)
        memcpy(s->arena + s->arena_len, p, (size_t)n);
    int32_t id = (int32_t)s->nentries++;
    Entry *e = &s->entries[id];
    e->hash = h;
    e->off = s->arena_len;
    e->len = n;
    e->detail = 0;
    s->arena_len += n;
    Py_ssize_t np = PyTuple_GET_SIZE(s->prefixes);
    for (Py_ssize_t k = 0; k < np; k++) {
        PyObject *pre = PyTuple_GET_ITEM(s->prefixes, k);
        Py_ssize_t plen = PyBytes_GET_SIZE(pre);
        if (plen <= n && memcmp(p, PyBytes_AS_STRING(pre), (size_t)plen) == 0) {
            e->detail = 1;
            break;
        }
    }
    s->slots[i] = id;
    if (s->nentries * 2 > s->nslots && grow_slots(s) < 0)
        return -1;
    return id;
}

static int ensure_scratch(Scanner *s, Py_ssize_t n)
{
    void *buf = s->scratch;
    if (reserve(&buf, &s->scratch_cap, n, 1, 256) < 0)
        return -1;
    s->scratch = buf;
    return 0;
}

/* ------------------------------------------------------------------ values */

/* Skip (and validate) one JSON value at *pp (not whitespace). */
static int skip_value(Scanner *s, const char **pp, const char *end)
{
    char stack[MAX_DEPTH];
    int depth = 0, r, esc;
    const char *p = *pp, *q;
    Num num;
value:
    if (p >= end)
        return ST_MORE;
    switch (*p) {
    case '{':
    case '[': {
        const char open = *p, close = open == '{' ? '}' : ']';
        p = skip_ws(p + 1, end);
        if (p >= end)
            return ST_MORE;
        if (*p == close) {
            p++;
            goto after;
        }
        if (depth == MAX_DEPTH)
            return bad(s, p, "nesting too deep");
        stack[depth++] = open;
        if (open == '{')
            goto key;
        goto value;
    }
    case '"':
        if ((r = scan_string(s, p + 1, end, &q, &esc)) != ST_OK)
            return r;
        p = q + 1;
        goto after;
    case 't':
        if ((r = literal(s, p, end, "true", 4)) != ST_OK)
            return r;
        p += 4;
        goto after;
    case 'f':
        if ((r = literal(s, p, end, "false", 5)) != ST_OK)
            return r;
        p += 5;
        goto after;
    case 'n':
        if ((r = literal(s, p, end, "null", 4)) != ST_OK)
            return r;
        p += 4;
        goto after;
    default:
        if (*p == '-' || (*p >= '0' && *p <= '9')) {
            r = scan_number(p, end, 0, &num);
            if (r == ST_BAD)
                return bad(s, num.stop, "invalid number");
            if (r != ST_OK)
                return r;
            p = num.stop;
            goto after;
        }
        return bad(s, p, "expected a value");
    }
key:
    if (*p != '"')
        return bad(s, p, "expected a string key");
    if ((r = scan_string(s, p + 1, end, &q, &esc)) != ST_OK)
        return r;
    p = skip_ws(q + 1, end);
    if (p >= end)
        return ST_MORE;
    if (*p != ':')
        return bad(s, p, "expected ':'");
    p = skip_ws(p + 1, end);
    goto value;
after:
    if (depth == 0) {
        *pp = p;
        return ST_OK;
    }
    p = skip_ws(p, end);
    if (p >= end)
        return ST_MORE;
    {
        const int in_object = stack[depth - 1] == '{';
        if (*p == ',') {
            p = skip_ws(p + 1, end);
            if (p >= end)
                return ST_MORE;
            if (in_object)
                goto key;
            goto value;
        }
        if (*p == (in_object ? '}' : ']')) {
            p++;
            depth--;
            goto after;
        }
        return bad(s, p, in_object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static void set_absent(const Field *f, Event *ev)
{
    switch (f->kind) {
    case F_STR: case F_INT: ev->v[f->col].i = -1; break;
    case F_FLT: ev->v[f->col].f = NAN; break;
    case F_PH: ev->ph = PH_OTHER; break;
    case F_ARGNAME: ev->argname = -1; break;
    default: break;
    }
}

/* The string at *pp (its opening quote), unescaped: *out points into the buffer, or into the
 * scanner's scratch space when the string has escapes (valid until the next call). */
static int read_string(Scanner *s, const char **pp, const char *end, const char **out, Py_ssize_t *len)
{
    const char *q;
    int esc, r;
    if ((r = scan_string(s, *pp + 1, end, &q, &esc)) != ST_OK)
        return r;
    const char *d = *pp + 1;
    Py_ssize_t n = q - d;
    if (esc) {
        if (ensure_scratch(s, n) < 0)
            return ST_NOMEM;
        n = decode_escapes(d, q, s->scratch);
        d = s->scratch;
    }
    *pp = q + 1;
    *out = d;
    *len = n;
    return ST_OK;
}

static int set_number(const Field *f, const Num *n, Event *ev)
{
    if (f->kind == F_FLT)
        return num_to_double(n, &ev->v[f->col].f) < 0 ? ST_NOMEM : ST_OK;
    if (f->kind != F_INT) {
        set_absent(f, ev);
        return ST_OK;
    }
    int64_t v;
    int ok = num_to_int64(n, &v);
    if (ok < 0)
        return ST_NOMEM;
    if (!ok || (COL_TYPE[f->col] == T_I32 && (v < INT32_MIN || v > INT32_MAX)))
        v = -1;
    ev->v[f->col].i = v;
    return ST_OK;
}

/* The value of a known field at *pp (not whitespace). */
static int parse_field(Scanner *s, const char **pp, const char *end, const Field *f, Event *ev)
{
    const char *p = *pp;
    int r;
    if (*p == '"') {
        const char *d;
        Py_ssize_t n;
        if ((r = read_string(s, pp, end, &d, &n)) != ST_OK)
            return r;
        switch (f->kind) {
        case F_STR:
        case F_ARGNAME: {
            int32_t id = intern(s, d, n);
            if (id < 0)
                return ST_NOMEM;
            if (f->kind == F_STR)
                ev->v[f->col].i = id;
            else
                ev->argname = id;
            return ST_OK;
        }
        case F_PH:
            ev->ph = n != 1 ? PH_OTHER : d[0] == 'X' ? PH_X : d[0] == 'i' ? PH_I : d[0] == 'M' ? PH_M : PH_OTHER;
            return ST_OK;
        default: { /* a number given as a string */
            Num num;
            if (scan_number(d, d + n, 1, &num) == ST_OK && num.stop == d + n)
                return set_number(f, &num, ev);
            set_absent(f, ev);
            return ST_OK;
        }
        }
    }
    if (*p == '-' || (*p >= '0' && *p <= '9')) {
        Num num;
        r = scan_number(p, end, 0, &num);
        if (r == ST_BAD)
            return bad(s, num.stop, "invalid number");
        if (r != ST_OK)
            return r;
        *pp = num.stop;
        return set_number(f, &num, ev);
    }
    set_absent(f, ev);
    return skip_value(s, pp, end);
}

static const Field *find_field(const Field *fields, int nfields, const char *k, Py_ssize_t n)
{
    for (int i = 0; i < nfields; i++)
        if (fields[i].len == n && fields[i].key[0] == k[0] && memcmp(fields[i].key, k, (size_t)n) == 0)
            return &fields[i];
    return NULL;
}

/* The object at *pp (its '{'): the fields of `fields` go to ev, the rest is skipped. */
static int parse_object(Scanner *s, const char **pp, const char *end, const Field *fields, int nfields,
                        Event *ev)
{
    const char *p = skip_ws(*pp + 1, end);
    int r;
    if (p >= end)
        return ST_MORE;
    if (*p == '}') {
        *pp = p + 1;
        return ST_OK;
    }
    for (;;) {
        if (*p != '"')
            return bad(s, p, "expected a string key");
        const char *k;
        Py_ssize_t klen;
        if ((r = read_string(s, &p, end, &k, &klen)) != ST_OK)
            return r;
        const Field *f = find_field(fields, nfields, k, klen);
        p = skip_ws(p, end);
        if (p >= end)
            return ST_MORE;
        if (*p != ':')
            return bad(s, p, "expected ':'");
        p = skip_ws(p + 1, end);
        if (p >= end)
            return ST_MORE;
        if (f == NULL)
            r = skip_value(s, &p, end);
        else if (f->kind == F_ARGS) {
            for (int i = 0; i < N_ARG_COLS; i++)
                ev->v[ARG_COLS[i]].i = -1;
            ev->argname = -1;
            r = *p == '{' ? parse_object(s, &p, end, ARG_FIELDS, N_ARG, ev) : skip_value(s, &p, end);
        }
        else
            r = parse_field(s, &p, end, f, ev);
        if (r != ST_OK)
            return r;
        p = skip_ws(p, end);
        if (p >= end)
            return ST_MORE;
        if (*p == ',') {
            p = skip_ws(p + 1, end);
            if (p >= end)
                return ST_MORE;
            continue;
        }
        if (*p == '}') {
            *pp = p + 1;
            return ST_OK;
        }
        return bad(s, p, "expected ',' or '}'");
    }
}

/* ------------------------------------------------------------------ rows */

static int grow_rows(Scanner *s)
{
    Py_ssize_t cap = s->cap ? s->cap * 2 : 4096;
    for (int c = 0; c < NCOLS; c++) {
        char *col = PyMem_Realloc(s->cols[c], (size_t)(cap * TYPE_SIZE[COL_TYPE[c]]));
        if (col == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->cols[c] = col;
    }
    s->cap = cap;
    return 0;
}

static int emit(Scanner *s, const Event *ev, const char *start, const char *stop, PyObject *details)
{
    if (ev->ph == PH_X || ev->ph == PH_I) {
        if (s->nrows == s->cap && grow_rows(s) < 0)
            return -1;
        Py_ssize_t r = s->nrows;
        for (int c = 0; c < NCOLS; c++) {
            switch (COL_TYPE[c]) {
            case T_I8: ((int8_t *)s->cols[c])[r] = (int8_t)ev->ph; break;
            case T_I32: ((int32_t *)s->cols[c])[r] = (int32_t)ev->v[c].i; break;
            case T_I64: ((int64_t *)s->cols[c])[r] = ev->v[c].i; break;
            default: ((double *)s->cols[c])[r] = ev->v[c].f; break;
            }
        }
        s->nrows++;
        int64_t name = ev->v[C_NAME].i;
        if (name >= 0 && s->entries[name].detail) {
            PyObject *t = Py_BuildValue("(ny#)", r, start, (Py_ssize_t)(stop - start));
            if (t == NULL)
                return -1;
            int rc = PyList_Append(details, t);
            Py_DECREF(t);
            if (rc < 0)
                return -1;
        }
    }
    else if (ev->ph == PH_M && ev->v[C_NAME].i == s->thread_name_id && ev->argname >= 0) {
        PyObject *t = Py_BuildValue("(LLi)", (long long)ev->v[C_PID].i, (long long)ev->v[C_TID].i,
                                    (int)ev->argname);
        if (t == NULL)
            return -1;
        int rc = PyList_Append(s->threads, t);
        Py_DECREF(t);
        if (rc < 0)
            return -1;
    }
    return 0;
}

static void event_init(Event *ev)
{
    for (int c = 0; c < NCOLS; c++) {
        if (COL_TYPE[c] == T_F64)
            ev->v[c].f = NAN;
        else
            ev->v[c].i = -1;
    }
    ev->ph = PH_OTHER;
    ev->argname = -1;
}

/* ------------------------------------------------------------------ type */

static void Scanner_dealloc(Scanner *s)
{
    for (int c = 0; c < NCOLS; c++)
        PyMem_Free(s->cols[c]);
    PyMem_Free(s->arena);
    PyMem_Free(s->entries);
    PyMem_Free(s->slots);
    PyMem_Free(s->scratch);
    Py_XDECREF(s->prefixes);
    Py_XDECREF(s->threads);
    PyTypeObject *tp = Py_TYPE(s);
    tp->tp_free((PyObject *)s);
}

static PyObject *Scanner_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"detail_prefixes", NULL};
    PyObject *given = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:Scanner", kwlist, &given))
        return NULL;
    Scanner *s = (Scanner *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    /* tp_alloc zero-fills: every pointer is NULL, every count 0 */
    Py_ssize_t n = 0;
    PyObject *seq = NULL;
    if (given != NULL && given != Py_None) {
        seq = PySequence_Fast(given, "detail_prefixes must be a sequence of str or bytes");
        if (seq == NULL)
            goto fail;
        n = PySequence_Fast_GET_SIZE(seq);
    }
    s->prefixes = PyTuple_New(n);
    if (s->prefixes == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *b;
        if (PyUnicode_Check(item))
            b = PyUnicode_AsUTF8String(item);
        else if (PyBytes_Check(item)) {
            b = item;
            Py_INCREF(b);
        }
        else {
            PyErr_SetString(PyExc_TypeError, "detail_prefixes must be a sequence of str or bytes");
            goto fail;
        }
        if (b == NULL)
            goto fail;
        PyTuple_SET_ITEM(s->prefixes, i, b);
    }
    Py_CLEAR(seq);
    s->threads = PyList_New(0);
    if (s->threads == NULL || grow_slots(s) < 0)
        goto fail;
    s->thread_name_id = intern(s, "thread_name", 11);
    if (s->thread_name_id < 0)
        goto fail;
    return (PyObject *)s;
fail:
    Py_XDECREF(seq);
    Py_DECREF(s);
    return NULL;
}

PyDoc_STRVAR(feed_doc,
"feed(buf, base=0) -> (consumed, close, details)\n\n"
"Scan the events of `buf` (bytes-like, beginning inside the traceEvents array right after\n"
"the '[' or after the last event a previous call consumed). `consumed`: bytes taken (through\n"
"the last complete event, or the ']'); `close`: offset of the array's ']' in `buf`, -1 while\n"
"the array goes on; `details`: (row, event JSON bytes) of the kept events whose name starts\n"
"with one of the detail prefixes. Raises ValueError naming byte `base` + offset on bad JSON.");

static PyObject *Scanner_feed(Scanner *s, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buf", "base", NULL};
    Py_buffer view;
    Py_ssize_t base = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|n:feed", kwlist, &view, &base))
        return NULL;
    if (s->busy || s->failed || s->finished || s->closed) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError,
                        s->busy ? "Scanner.feed is already running" :
                        s->failed ? "Scanner failed on an earlier call" :
                        s->finished ? "Scanner is finished" : "the traceEvents array is already closed");
        return NULL;
    }
    s->busy = 1;
    const char *buf = view.buf, *end = buf + view.len, *p = buf;
    Py_ssize_t consumed = 0, close = -1;
    PyObject *details = PyList_New(0);
    if (details == NULL)
        goto fail;
    for (;;) {
        const char *q = skip_ws(p, end);
        if (q >= end)
            break;
        if (*q == ']' && !s->after_event) {
            close = q - buf;
            break;
        }
        if (s->after_event) {
            if (*q == ']') {
                close = q - buf;
                break;
            }
            if (*q != ',') {
                bad(s, q, "expected ',' or ']' after an event");
                goto malformed;
            }
            q = skip_ws(q + 1, end);
            if (q >= end)
                break;
        }
        if (*q != '{') {
            bad(s, q, "expected an event object");
            goto malformed;
        }
        Event ev;
        event_init(&ev);
        const char *e = q;
        int r = parse_object(s, &e, end, TOP_FIELDS, N_TOP, &ev);
        if (r == ST_MORE)
            break;
        if (r == ST_BAD)
            goto malformed;
        if (r != ST_OK || emit(s, &ev, q, e, details) < 0)
            goto fail;
        s->after_event = 1;
        p = e;
        consumed = e - buf;
    }
    if (close >= 0) {
        s->closed = 1;
        consumed = close + 1;
    }
    s->busy = 0;
    PyBuffer_Release(&view);
    return Py_BuildValue("nnN", consumed, close, details);
malformed:
    PyErr_Format(PyExc_ValueError, "malformed JSON at byte %zd: %s", base + (s->err_at - buf), s->err_msg);
fail:
    s->failed = 1;
    s->busy = 0;
    Py_XDECREF(details);
    PyBuffer_Release(&view);
    return NULL;
}

PyDoc_STRVAR(finish_doc,
"finish() -> (columns, strings, threads)\n\n"
"`columns`: name -> bytearray (see COLUMNS for the numpy dtype codes); string columns hold\n"
"indexes into `strings` (-1: absent); `threads`: (pid, tid, index of the name in `strings`)\n"
"of each thread_name metadata event, in file order.");

static PyObject *Scanner_finish(Scanner *s, PyObject *Py_UNUSED(ignored))
{
    if (s->busy || s->finished) {
        PyErr_SetString(PyExc_RuntimeError, s->busy ? "Scanner.feed is running" : "Scanner is finished");
        return NULL;
    }
    s->finished = 1;
    PyObject *cols = PyDict_New(), *strings = NULL, *threads;
    if (cols == NULL)
        return NULL;
    for (int c = 0; c < NCOLS; c++) {
        Py_ssize_t size = s->nrows * TYPE_SIZE[COL_TYPE[c]];
        PyObject *col = PyByteArray_FromStringAndSize(size ? s->cols[c] : NULL, size);
        if (col == NULL)
            goto fail;
        int rc = PyDict_SetItemString(cols, COL_NAMES[c], col);
        Py_DECREF(col);
        if (rc < 0)
            goto fail;
        PyMem_Free(s->cols[c]); /* one column copied at a time: peak memory stays low */
        s->cols[c] = NULL;
    }
    strings = PyList_New(s->nentries);
    if (strings == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < s->nentries; i++) {
        PyObject *u = PyUnicode_DecodeUTF8(s->arena + s->entries[i].off, s->entries[i].len, "surrogatepass");
        if (u == NULL)
            goto fail;
        PyList_SET_ITEM(strings, i, u);
    }
    threads = s->threads;
    s->threads = NULL;
    return Py_BuildValue("NNN", cols, strings, threads);
fail:
    Py_DECREF(cols);
    Py_XDECREF(strings);
    return NULL;
}

static PyObject *Scanner_rows(Scanner *s, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(s->nrows);
}

static PyMethodDef Scanner_methods[] = {
    {"feed", (PyCFunction)(void (*)(void))Scanner_feed, METH_VARARGS | METH_KEYWORDS, feed_doc},
    {"finish", (PyCFunction)Scanner_finish, METH_NOARGS, finish_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Scanner_getset[] = {
    {"rows", (getter)Scanner_rows, NULL, "rows kept so far", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Scanner_doc,
"Scanner(detail_prefixes=())\n\n"
"Streaming scanner of one trace's traceEvents array into columns (see the module doc).");

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torsh_tune.analysis.traces._scan.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Scanner_doc,
    .tp_methods = Scanner_methods,
    .tp_getset = Scanner_getset,
    .tp_new = Scanner_new,
};

static struct PyModuleDef scan_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "torsh_tune.analysis.traces._scan",
    .m_doc = "Streaming scanner of Kineto/Chrome trace events into columns.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__scan(void)
{
    if (PyType_Ready(&ScannerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&scan_module);
    if (m == NULL)
        return NULL;
    PyObject *columns = PyTuple_New(NCOLS);
    if (columns == NULL)
        goto fail;
    for (int c = 0; c < NCOLS; c++) {
        PyObject *item = Py_BuildValue("(sC)", COL_NAMES[c], (int)TYPE_CODE[COL_TYPE[c]]);
        if (item == NULL) {
            Py_DECREF(columns);
            goto fail;
        }
        PyTuple_SET_ITEM(columns, c, item);
    }
    if (PyModule_AddObject(m, "COLUMNS", columns) < 0) {
        Py_DECREF(columns);
        goto fail;
    }
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(m, "Scanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(&ScannerType);
        goto fail;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
