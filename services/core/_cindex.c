/* services.core._cindex: the compiled hot paths of the prefix index.
 *
 * Two things, both written from their specifications for kvgate:
 *
 * 1. XXH3-64 (xxHash's 64-bit XXH3, every input length, with a seed) and the canonical chained
 *    block keys of services/core/keys.py: key[i] = xxh3_64(block i as LE uint32, seed=key[i-1]).
 *    Tested bit for bit against the `xxhash` package on random inputs (tests/test_cindex.py).
 *
 * 2. KeyTable: an open-addressing hash table (linear probing, backward-shift deletion, no
 *    tombstones) from a uint64 block key to the set of worker slots holding it, kept in one
 *    holder word per key (a bitmask up to 64 slots; past 64, up to 3 slot ids inline or a
 *    pooled bitmask of W words: see "KeyTable" below), with per-slot pair counts and a
 *    live-slot mask.
 *    With LRU tracking on, each touch of a key appends it to a log and stamps the entry with
 *    the log position; the least-recently-stored keys are the log entries whose stamp is still
 *    current, oldest first (stale log entries are skipped and compacted away).
 *
 * Invariants (checked by the property tests against the pure-Python PrefixIndex):
 * - a key is in the table iff its holder word is non-zero;
 * - wide mode: a key's holders are inline iff there are at most 3 of them; every pool entry
 *   in use is referenced by exactly one key;
 * - counts[s] = number of keys whose mask has bit s, for every live slot s; pairs = the sum of
 *   counts over live slots; bits of dead slots are scrubbed by clear_slot before it returns;
 * - with tracking, the current log entries are exactly the table's keys, in LRU order.
 *
 * Not thread-safe (the GIL is held throughout; the index that owns a table is single-threaded).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------
 * XXH3-64
 * ---------------------------------------------------------------------------------------- */

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define PMX_1 0x165667919E3779F9ULL
#define PMX_2 0x9FB21C651E98DF25ULL

#define SECRET_SIZE 192
#define STRIPE_LEN 64
#define SECRET_CONSUME_RATE 8
#define SECRET_LASTACC_START 7
#define SECRET_MERGEACCS_START 11
#define MIDSIZE_STARTOFFSET 3
#define MIDSIZE_LASTOFFSET 17
#define SECRET_SIZE_MIN 136

/* The default secret of the XXH3 specification. */
static const uint8_t k_secret[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define LE64(x) __builtin_bswap64(x)
#define LE32(x) __builtin_bswap32(x)
#else
#define LE64(x) (x)
#define LE32(x) (x)
#endif

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return LE64(v);
}
static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return LE32(v);
}
static inline void wr64(uint8_t *p, uint64_t v) {
    v = LE64(v);
    memcpy(p, &v, 8);
}
static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    h ^= h >> 32;
    return h;
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PMX_1;
    h ^= h >> 32;
    return h;
}

static inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PMX_2;
    h ^= (h >> 35) + len;
    h *= PMX_2;
    h ^= h >> 28;
    return h;
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *sec, uint64_t seed) {
    return mul128_fold64(rd64(in) ^ (rd64(sec) + seed), rd64(in + 8) ^ (rd64(sec + 8) - seed));
}

static uint64_t len_0to16(const uint8_t *in, size_t len, const uint8_t *sec, uint64_t seed) {
    if (len > 8) {
        uint64_t f1 = (rd64(sec + 24) ^ rd64(sec + 32)) + seed;
        uint64_t f2 = (rd64(sec + 40) ^ rd64(sec + 48)) - seed;
        uint64_t lo = rd64(in) ^ f1;
        uint64_t hi = rd64(in + len - 8) ^ f2;
        uint64_t acc = len + __builtin_bswap64(lo) + hi + mul128_fold64(lo, hi);
        return xxh3_avalanche(acc);
    }
    if (len >= 4) {
        seed ^= (uint64_t)__builtin_bswap32((uint32_t)seed) << 32;
        uint32_t in1 = rd32(in), in2 = rd32(in + len - 4);
        uint64_t flip = (rd64(sec + 8) ^ rd64(sec + 16)) - seed;
        uint64_t in64 = in2 + ((uint64_t)in1 << 32);
        return rrmxmx(in64 ^ flip, len);
    }
    if (len > 0) {
        uint8_t c1 = in[0], c2 = in[len >> 1], c3 = in[len - 1];
        uint32_t comb = ((uint32_t)c1 << 16) | ((uint32_t)c2 << 24) | (uint32_t)c3 |
                        ((uint32_t)len << 8);
        uint64_t flip = (uint64_t)(rd32(sec) ^ rd32(sec + 4)) + seed;
        return xxh64_avalanche((uint64_t)comb ^ flip);
    }
    return xxh64_avalanche(seed ^ (rd64(sec + 56) ^ rd64(sec + 64)));
}

static uint64_t len_17to128(const uint8_t *in, size_t len, const uint8_t *sec, uint64_t seed) {
    uint64_t acc = len * P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += mix16(in + 48, sec + 96, seed);
                acc += mix16(in + len - 64, sec + 112, seed);
            }
            acc += mix16(in + 32, sec + 64, seed);
            acc += mix16(in + len - 48, sec + 80, seed);
        }
        acc += mix16(in + 16, sec + 32, seed);
        acc += mix16(in + len - 32, sec + 48, seed);
    }
    acc += mix16(in, sec, seed);
    acc += mix16(in + len - 16, sec + 16, seed);
    return xxh3_avalanche(acc);
}

static uint64_t len_129to240(const uint8_t *in, size_t len, const uint8_t *sec, uint64_t seed) {
    uint64_t acc = len * P64_1, acc_end;
    unsigned rounds = (unsigned)len / 16, i;
    for (i = 0; i < 8; i++) acc += mix16(in + 16 * i, sec + 16 * i, seed);
    acc_end = mix16(in + len - 16, sec + SECRET_SIZE_MIN - MIDSIZE_LASTOFFSET, seed);
    acc = xxh3_avalanche(acc);
    for (i = 8; i < rounds; i++)
        acc_end += mix16(in + 16 * i, sec + 16 * (i - 8) + MIDSIZE_STARTOFFSET, seed);
    return xxh3_avalanche(acc + acc_end);
}

static inline void accumulate_512(uint64_t *acc, const uint8_t *in, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = rd64(in + 8 * i);
        uint64_t k = v ^ rd64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (uint64_t)(uint32_t)k * (k >> 32);
    }
}

static inline void scramble(uint64_t *acc, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(sec + 8 * i);
        a *= P32_1;
        acc[i] = a;
    }
}

static uint64_t hash_long(const uint8_t *in, size_t len, const uint8_t *sec) {
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    const size_t stripes_per_block = (SECRET_SIZE - STRIPE_LEN) / SECRET_CONSUME_RATE;
    const size_t block_len = STRIPE_LEN * stripes_per_block;
    const size_t nb_blocks = (len - 1) / block_len;
    for (size_t n = 0; n < nb_blocks; n++) {
        const uint8_t *b = in + n * block_len;
        for (size_t s = 0; s < stripes_per_block; s++)
            accumulate_512(acc, b + s * STRIPE_LEN, sec + s * SECRET_CONSUME_RATE);
        scramble(acc, sec + SECRET_SIZE - STRIPE_LEN);
    }
    size_t stripes = ((len - 1) - block_len * nb_blocks) / STRIPE_LEN;
    const uint8_t *b = in + nb_blocks * block_len;
    for (size_t s = 0; s < stripes; s++)
        accumulate_512(acc, b + s * STRIPE_LEN, sec + s * SECRET_CONSUME_RATE);
    accumulate_512(acc, in + len - STRIPE_LEN, sec + SECRET_SIZE - STRIPE_LEN - SECRET_LASTACC_START);
    uint64_t r = (uint64_t)len * P64_1;
    const uint8_t *ms = sec + SECRET_MERGEACCS_START;
    for (int i = 0; i < 4; i++)
        r += mul128_fold64(acc[2 * i] ^ rd64(ms + 16 * i), acc[2 * i + 1] ^ rd64(ms + 16 * i + 8));
    return xxh3_avalanche(r);
}

static uint64_t xxh3_64(const void *data, size_t len, uint64_t seed) {
    const uint8_t *in = (const uint8_t *)data;
    if (len <= 16) return len_0to16(in, len, k_secret, seed);
    if (len <= 128) return len_17to128(in, len, k_secret, seed);
    if (len <= 240) return len_129to240(in, len, k_secret, seed);
    if (seed == 0) return hash_long(in, len, k_secret);
    uint8_t custom[SECRET_SIZE];
    for (int i = 0; i < SECRET_SIZE / 16; i++) {
        wr64(custom + 16 * i, rd64(k_secret + 16 * i) + seed);
        wr64(custom + 16 * i + 8, rd64(k_secret + 16 * i + 8) - seed);
    }
    return hash_long(in, len, custom);
}

/* ------------------------------------------------------------------------------------------
 * Token input: a list/tuple of ints, or packed little-endian uint32 (bytes, memoryview,
 * array('I')). TokenSource hands out one block at a time as bytes.
 * ---------------------------------------------------------------------------------------- */

typedef struct {
    PyObject *fast;     /* PySequence_Fast result, or NULL for a buffer */
    PyObject **items;
    Py_buffer view;
    int has_view;
    Py_ssize_t n_tokens;
    uint8_t *scratch;   /* block_size * 4 bytes for the sequence path */
} TokenSource;

static int is_packed(PyObject *o) {
    if (PyBytes_Check(o) || PyByteArray_Check(o) || PyMemoryView_Check(o)) return 1;
    if (PyObject_CheckBuffer(o) && !PyList_Check(o) && !PyTuple_Check(o)) {
        /* array('I') : typecode via its buffer format */
        Py_buffer v;
        if (PyObject_GetBuffer(o, &v, PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            return 0;
        }
        int ok = v.format && v.itemsize == 4 && (strcmp(v.format, "I") == 0 || strcmp(v.format, "=I") == 0 ||
                                                  strcmp(v.format, "<I") == 0);
        PyBuffer_Release(&v);
        return ok;
    }
    return 0;
}

static int tokens_open(TokenSource *ts, PyObject *tokens, Py_ssize_t block_size) {
    memset(ts, 0, sizeof(*ts));
    if (is_packed(tokens)) {
        if (PyObject_GetBuffer(tokens, &ts->view, PyBUF_SIMPLE) < 0) return -1;
        ts->has_view = 1;
        ts->n_tokens = ts->view.len / 4;
        return 0;
    }
    ts->fast = PySequence_Fast(tokens, "token ids must be a sequence of ints");
    if (!ts->fast) return -1;
    ts->items = PySequence_Fast_ITEMS(ts->fast);
    ts->n_tokens = PySequence_Fast_GET_SIZE(ts->fast);
    ts->scratch = (uint8_t *)PyMem_Malloc((size_t)(block_size > 0 ? block_size : 1) * 4);
    if (!ts->scratch) {
        Py_CLEAR(ts->fast);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void tokens_close(TokenSource *ts) {
    if (ts->has_view) PyBuffer_Release(&ts->view);
    Py_CLEAR(ts->fast);
    if (ts->scratch) PyMem_Free(ts->scratch);
    ts->scratch = NULL;
}

/* Block ``b`` as 4*block_size bytes, or NULL with an exception set (bad token id). */
static const uint8_t *tokens_block(TokenSource *ts, Py_ssize_t b, Py_ssize_t block_size) {
    if (ts->has_view) return (const uint8_t *)ts->view.buf + (size_t)b * block_size * 4;
    PyObject **it = ts->items + b * block_size;
    uint8_t *out = ts->scratch;
    for (Py_ssize_t i = 0; i < block_size; i++) {
        PyObject *o = it[i];
        unsigned long v;
        if (PyLong_Check(o)) {
            v = PyLong_AsUnsignedLong(o);
        } else { /* numpy integers and other __index__ types, as struct.pack takes them */
            PyObject *ix = PyNumber_Index(o);
            if (!ix) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "token ids must be integers, got %.80s",
                             Py_TYPE(o)->tp_name);
                return NULL;
            }
            v = PyLong_AsUnsignedLong(ix);
            Py_DECREF(ix);
        }
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
            PyErr_Clear();
            PyErr_SetString(PyExc_OverflowError, "token id outside uint32");
            return NULL;
        }
        uint32_t le = LE32((uint32_t)v);
        memcpy(out + 4 * i, &le, 4);
    }
    return out;
}

/* ------------------------------------------------------------------------------------------
 * KeyTable
 *
 * One entry = two words: the key and its holder word H. H = 0: empty entry.
 * - narrow mode (W == 1: every slot < 64): H is the bitmask of the slots holding the key;
 * - wide mode (W > 1): H is tagged. Bit 0 set: an inline list of 1..3 slot ids (count in
 *   bits 1-2, ids of 20 bits at bits 4, 24, 44). Bit 0 clear: (p + 1) << 1 for pool entry p,
 *   a W-word bitmask, used iff the key has more than INL_MAX holders (canonical form).
 * So a key held by few workers costs 16 bytes whatever the namespace's size, and only keys
 * held by many pay W words (shared among those many pairs).
 * ---------------------------------------------------------------------------------------- */

#define INL_MAX 3
#define INL_BITS 20
#define MAX_SLOTS (1 << INL_BITS)

typedef struct {
    PyObject_HEAD
    uint64_t *ent;      /* cap entries of 2 words: key, holder word (0 = empty) */
    uint64_t *stamps;   /* cap, only with tracking: log position of the key's last touch */
    Py_ssize_t cap;     /* power of two */
    int shift;          /* 64 - log2(cap) */
    Py_ssize_t used;    /* keys */
    Py_ssize_t W;       /* words of a slot bitmask (live, counts, pool entries) */
    uint64_t *live;     /* W words */
    uint64_t *scratch;  /* 2 * W words for queries */
    int64_t *counts;    /* 64 * W */
    int64_t pairs;
    int track;
    uint64_t *log;      /* keys by touch order */
    Py_ssize_t log_len, log_cap, log_head;
    uint64_t log_base;  /* stamp of log[0] */
    uint64_t *pool;     /* wide mode: pool_cap entries of W words */
    Py_ssize_t pool_len, pool_cap, pool_used, pool_free; /* pool_free: free-list head or -1 */
} KeyTable;

#define KEY(t, i) ((t)->ent[2 * (size_t)(i)])
#define H(t, i) ((t)->ent[2 * (size_t)(i) + 1])
#define HINL(h) ((h) & 1)
#define INL_N(h) ((int)(((h) >> 1) & 3))
#define INL_ID(h, j) ((Py_ssize_t)(((h) >> (4 + INL_BITS * (j))) & (MAX_SLOTS - 1)))
#define HREF(p) (((uint64_t)(p) + 1) << 1)
#define HPOOL(h) ((Py_ssize_t)((h) >> 1) - 1)
#define POOLM(t, h) ((t)->pool + (size_t)HPOOL(h) * (size_t)(t)->W)

static inline uint64_t inl_make(const Py_ssize_t *ids, int n) {
    uint64_t h = 1 | ((uint64_t)n << 1);
    for (int j = 0; j < n; j++) h |= (uint64_t)ids[j] << (4 + INL_BITS * j);
    return h;
}

static inline Py_ssize_t home(const KeyTable *t, uint64_t k) {
    return (Py_ssize_t)((k * 0x9E3779B97F4A7C15ULL) >> t->shift);
}

static inline Py_ssize_t find(const KeyTable *t, uint64_t k) {
    Py_ssize_t mask = t->cap - 1, i = home(t, k);
    for (;;) {
        if (!t->ent[2 * i + 1]) return -1;
        if (t->ent[2 * i] == k) return i;
        i = (i + 1) & mask;
    }
}

/* ---- the pool of wide bitmasks */

static Py_ssize_t pool_alloc(KeyTable *t) {
    Py_ssize_t p, W = t->W;
    if (t->pool_free >= 0) {
        p = t->pool_free;
        t->pool_free = (Py_ssize_t)(int64_t)t->pool[(size_t)p * W];
    } else {
        if (t->pool_len == t->pool_cap) {
            Py_ssize_t nc = t->pool_cap ? t->pool_cap * 2 : 64;
            uint64_t *np_ = (uint64_t *)PyMem_Realloc(t->pool, (size_t)nc * (size_t)W * 8);
            if (!np_) {
                PyErr_NoMemory();
                return -1;
            }
            t->pool = np_;
            t->pool_cap = nc;
        }
        p = t->pool_len++;
    }
    memset(t->pool + (size_t)p * W, 0, (size_t)W * 8);
    t->pool_used++;
    return p;
}

static void pool_release(KeyTable *t, Py_ssize_t p) {
    t->pool[(size_t)p * t->W] = (uint64_t)(int64_t)t->pool_free;
    t->pool_free = p;
    t->pool_used--;
}

/* ---- holder sets, both modes */

static inline int h_has(const KeyTable *t, uint64_t h, Py_ssize_t s) {
    if (t->W == 1) return s < 64 && ((h >> s) & 1);
    if (!h) return 0;
    if (HINL(h)) {
        int n = INL_N(h);
        for (int j = 0; j < n; j++)
            if (INL_ID(h, j) == s) return 1;
        return 0;
    }
    if (s >= 64 * t->W) return 0;
    return (POOLM(t, h)[s >> 6] >> (s & 63)) & 1;
}

/* Add slot s (< 64 * W) to entry i's holders: 1 added, 0 already held, -1 error. */
static int h_add(KeyTable *t, Py_ssize_t i, Py_ssize_t s) {
    uint64_t h = H(t, i);
    if (t->W == 1) {
        uint64_t b = 1ULL << s;
        if (h & b) return 0;
        H(t, i) = h | b;
        return 1;
    }
    if (!h) {
        H(t, i) = inl_make(&s, 1);
        return 1;
    }
    if (HINL(h)) {
        int n = INL_N(h);
        Py_ssize_t ids[INL_MAX + 1];
        for (int j = 0; j < n; j++) {
            ids[j] = INL_ID(h, j);
            if (ids[j] == s) return 0;
        }
        if (n < INL_MAX) {
            ids[n] = s;
            H(t, i) = inl_make(ids, n + 1);
            return 1;
        }
        Py_ssize_t p = pool_alloc(t);
        if (p < 0) return -1;
        uint64_t *pm = t->pool + (size_t)p * t->W;
        ids[n] = s;
        for (int j = 0; j <= n; j++) pm[ids[j] >> 6] |= 1ULL << (ids[j] & 63);
        H(t, i) = HREF(p);
        return 1;
    }
    uint64_t *pm = POOLM(t, h);
    uint64_t b = 1ULL << (s & 63);
    if (pm[s >> 6] & b) return 0;
    pm[s >> 6] |= b;
    return 1;
}

/* Remove slot s from entry i's holders: 1 removed, 0 not held. Leaves H = 0 when no holder
 * is left (the caller deletes the entry). */
static int h_del(KeyTable *t, Py_ssize_t i, Py_ssize_t s) {
    uint64_t h = H(t, i);
    if (t->W == 1) {
        if (s >= 64) return 0;
        uint64_t b = 1ULL << s;
        if (!(h & b)) return 0;
        H(t, i) = h & ~b;
        return 1;
    }
    if (!h) return 0;
    if (HINL(h)) {
        int n = INL_N(h), k = 0, hit = 0;
        Py_ssize_t ids[INL_MAX];
        for (int j = 0; j < n; j++) {
            Py_ssize_t x = INL_ID(h, j);
            if (x == s)
                hit = 1;
            else
                ids[k++] = x;
        }
        if (!hit) return 0;
        H(t, i) = k ? inl_make(ids, k) : 0;
        return 1;
    }
    if (s >= 64 * t->W) return 0;
    uint64_t *pm = POOLM(t, h);
    uint64_t b = 1ULL << (s & 63);
    if (!(pm[s >> 6] & b)) return 0;
    pm[s >> 6] &= ~b;
    Py_ssize_t W = t->W, cnt = 0;
    for (Py_ssize_t w = 0; w < W && cnt <= INL_MAX; w++) cnt += __builtin_popcountll(pm[w]);
    if (cnt <= INL_MAX) { /* back to the inline form */
        Py_ssize_t ids[INL_MAX];
        int k = 0;
        for (Py_ssize_t w = 0; w < W; w++) {
            uint64_t x = pm[w];
            while (x) {
                ids[k++] = w * 64 + __builtin_ctzll(x);
                x &= x - 1;
            }
        }
        pool_release(t, HPOOL(h));
        H(t, i) = inl_make(ids, k);
    }
    return 1;
}

/* Release what entry i's holder word owns (before the entry is deleted). */
static inline void h_free(KeyTable *t, Py_ssize_t i) {
    uint64_t h = H(t, i);
    if (t->W > 1 && h && !HINL(h)) pool_release(t, HPOOL(h));
}

/* The holder set of h as W words in out. */
static void h_to_mask(const KeyTable *t, uint64_t h, uint64_t *out) {
    Py_ssize_t W = t->W;
    if (W == 1) {
        out[0] = h;
        return;
    }
    if (h && !HINL(h)) {
        memcpy(out, POOLM(t, h), (size_t)W * 8);
        return;
    }
    memset(out, 0, (size_t)W * 8);
    if (!h) return;
    int n = INL_N(h);
    for (int j = 0; j < n; j++) {
        Py_ssize_t s = INL_ID(h, j);
        out[s >> 6] |= 1ULL << (s & 63);
    }
}

/* The holder word for the W-word set m (not all zero): inline or a new pool entry. */
static int h_from_mask(KeyTable *t, const uint64_t *m, uint64_t *out) {
    Py_ssize_t W = t->W;
    if (W == 1) {
        *out = m[0];
        return 0;
    }
    Py_ssize_t cnt = 0;
    for (Py_ssize_t w = 0; w < W && cnt <= INL_MAX; w++) cnt += __builtin_popcountll(m[w]);
    if (cnt <= INL_MAX) {
        Py_ssize_t ids[INL_MAX];
        int k = 0;
        for (Py_ssize_t w = 0; w < W; w++) {
            uint64_t x = m[w];
            while (x) {
                ids[k++] = w * 64 + __builtin_ctzll(x);
                x &= x - 1;
            }
        }
        *out = inl_make(ids, k);
        return 0;
    }
    Py_ssize_t p = pool_alloc(t);
    if (p < 0) return -1;
    memcpy(t->pool + (size_t)p * W, m, (size_t)W * 8);
    *out = HREF(p);
    return 0;
}

/* ---- table storage */

static int alloc_arrays(KeyTable *t, Py_ssize_t cap) {
    uint64_t *ent = (uint64_t *)PyMem_Calloc((size_t)cap * 2, 8);
    uint64_t *stamps = t->track ? (uint64_t *)PyMem_Calloc((size_t)cap, 8) : NULL;
    if (!ent || (t->track && !stamps)) {
        PyMem_Free(ent);
        PyMem_Free(stamps);
        PyErr_NoMemory();
        return -1;
    }
    t->ent = ent;
    t->stamps = stamps;
    t->cap = cap;
    int lg = 0;
    while (((Py_ssize_t)1 << lg) < cap) lg++;
    t->shift = 64 - lg;
    return 0;
}

/* Rehash into ``cap`` entries. */
static int rebuild(KeyTable *t, Py_ssize_t cap) {
    uint64_t *oent = t->ent, *ostamps = t->stamps;
    Py_ssize_t ocap = t->cap;
    if (alloc_arrays(t, cap) < 0) {
        t->ent = oent;
        t->stamps = ostamps;
        return -1;
    }
    Py_ssize_t m = cap - 1;
    for (Py_ssize_t j = 0; j < ocap; j++) {
        uint64_t h = oent[2 * j + 1];
        if (!h) continue;
        uint64_t k = oent[2 * j];
        Py_ssize_t i = home(t, k);
        while (H(t, i)) i = (i + 1) & m;
        KEY(t, i) = k;
        H(t, i) = h;
        if (t->track) t->stamps[i] = ostamps[j];
    }
    PyMem_Free(oent);
    PyMem_Free(ostamps);
    return 0;
}

static int ensure_room(KeyTable *t, Py_ssize_t extra) {
    Py_ssize_t need = t->used + extra, cap = t->cap;
    while (need * 4 > cap * 3) cap *= 2;
    return cap == t->cap ? 0 : rebuild(t, cap);
}

/* Make slot ``slot`` representable: grow W (and the per-slot arrays); the first slot >= 64
 * turns the table wide (every bitmask holder word is re-encoded). */
static int ensure_width(KeyTable *t, Py_ssize_t slot) {
    if (slot < 64 * t->W) return 0;
    Py_ssize_t W = slot / 64 + 1, oW = t->W;
    uint64_t *live = (uint64_t *)PyMem_Calloc((size_t)W, 8);
    uint64_t *scratch = (uint64_t *)PyMem_Calloc((size_t)(2 * W), 8);
    int64_t *counts = (int64_t *)PyMem_Calloc((size_t)(64 * W), 8);
    uint64_t *pool = NULL;
    Py_ssize_t pool_cap = 0;
    if (oW == 1) { /* narrow -> wide: a pool entry for every key held by more than INL_MAX */
        for (Py_ssize_t i = 0; i < t->cap; i++)
            if (__builtin_popcountll(H(t, i)) > INL_MAX) pool_cap++;
    } else {
        pool_cap = t->pool_cap;
    }
    if (pool_cap < 64) pool_cap = 64;
    pool = (uint64_t *)PyMem_Calloc((size_t)pool_cap * (size_t)W, 8);
    if (!live || !scratch || !counts || !pool) {
        PyMem_Free(live);
        PyMem_Free(scratch);
        PyMem_Free(counts);
        PyMem_Free(pool);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(live, t->live, (size_t)oW * 8);
    memcpy(counts, t->counts, (size_t)(64 * oW) * 8);
    if (oW == 1) {
        Py_ssize_t p = 0;
        for (Py_ssize_t i = 0; i < t->cap; i++) {
            uint64_t h = H(t, i);
            if (!h) continue;
            if (__builtin_popcountll(h) > INL_MAX) {
                pool[(size_t)p * W] = h;
                H(t, i) = HREF(p);
                p++;
            } else {
                Py_ssize_t ids[INL_MAX];
                int k = 0;
                while (h) {
                    ids[k++] = __builtin_ctzll(h);
                    h &= h - 1;
                }
                H(t, i) = inl_make(ids, k);
            }
        }
        t->pool_len = t->pool_used = p;
        t->pool_free = -1;
    } else {
        for (Py_ssize_t p = 0; p < t->pool_len; p++)
            memcpy(pool + (size_t)p * W, t->pool + (size_t)p * oW, (size_t)oW * 8);
    }
    PyMem_Free(t->pool);
    t->pool = pool;
    t->pool_cap = pool_cap;
    PyMem_Free(t->live);
    PyMem_Free(t->scratch);
    PyMem_Free(t->counts);
    t->live = live;
    t->scratch = scratch;
    t->counts = counts;
    t->W = W;
    return 0;
}

static int log_touch(KeyTable *t, Py_ssize_t i);

/* Position of ``k``, inserting an empty entry if absent (the caller gives it a holder at
 * once: an entry with H = 0 reads as empty). Needs room (ensure_room). */
static inline Py_ssize_t find_or_slot(KeyTable *t, uint64_t k, int *is_new) {
    Py_ssize_t m = t->cap - 1, i = home(t, k);
    for (;;) {
        if (!H(t, i)) {
            KEY(t, i) = k;
            *is_new = 1;
            return i;
        }
        if (KEY(t, i) == k) {
            *is_new = 0;
            return i;
        }
        i = (i + 1) & m;
    }
}

/* Remove entry ``i`` (backward-shift deletion). Its holder word must own nothing (h_free). */
static void delete_at(KeyTable *t, Py_ssize_t i) {
    Py_ssize_t m = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & m;
        if (!H(t, j)) break;
        Py_ssize_t h = home(t, KEY(t, j));
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (stays) continue;
        KEY(t, i) = KEY(t, j);
        H(t, i) = H(t, j);
        if (t->track) t->stamps[i] = t->stamps[j];
        i = j;
    }
    H(t, i) = 0;
    t->used--;
}

static int log_compact(KeyTable *t) {
    /* keep the current entries, in order; renumber stamps from 0 */
    Py_ssize_t out = 0;
    for (Py_ssize_t p = t->log_head; p < t->log_len; p++) {
        uint64_t k = t->log[p];
        Py_ssize_t i = find(t, k);
        if (i >= 0 && t->stamps[i] == t->log_base + (uint64_t)p) {
            t->log[out] = k;
            t->stamps[i] = (uint64_t)out;
            out++;
        }
    }
    t->log_len = out;
    t->log_head = 0;
    t->log_base = 0;
    Py_ssize_t want = out * 2 + 1024;
    if (want < t->log_cap / 2) {
        uint64_t *nl = (uint64_t *)PyMem_Realloc(t->log, (size_t)want * 8);
        if (nl) {
            t->log = nl;
            t->log_cap = want;
        }
    }
    return 0;
}

static int log_touch(KeyTable *t, Py_ssize_t i) {
    if (t->log_len == t->log_cap) {
        if (t->log_len - t->log_head > 2 * t->used + 1024 || t->log_head > t->log_len / 2)
            log_compact(t);
        if (t->log_len == t->log_cap) {
            Py_ssize_t nc = t->log_cap ? t->log_cap * 2 : 1024;
            uint64_t *nl = (uint64_t *)PyMem_Realloc(t->log, (size_t)nc * 8);
            if (!nl) {
                PyErr_NoMemory();
                return -1;
            }
            t->log = nl;
            t->log_cap = nc;
        }
    }
    t->stamps[i] = t->log_base + (uint64_t)t->log_len;
    t->log[t->log_len++] = KEY(t, i);
    return 0;
}

static int KeyTable_init(KeyTable *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"track_lru", NULL};
    int track = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p", kwlist, &track)) return -1;
    if (t->ent) return 0;
    t->track = track;
    t->W = 1;
    t->pool_free = -1;
    t->live = (uint64_t *)PyMem_Calloc(1, 8);
    t->scratch = (uint64_t *)PyMem_Calloc(2, 8);
    t->counts = (int64_t *)PyMem_Calloc(64, 8);
    if (!t->live || !t->scratch || !t->counts) {
        PyErr_NoMemory();
        return -1;
    }
    return alloc_arrays(t, 8);
}

static void KeyTable_dealloc(KeyTable *t) {
    PyMem_Free(t->ent);
    PyMem_Free(t->stamps);
    PyMem_Free(t->live);
    PyMem_Free(t->scratch);
    PyMem_Free(t->counts);
    PyMem_Free(t->log);
    PyMem_Free(t->pool);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int as_key(PyObject *o, uint64_t *k) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "keys must be integers, got %.80s", Py_TYPE(o)->tp_name);
        return -1;
    }
    *k = PyLong_AsUnsignedLongLong(o);
    if (*k == (uint64_t)-1 && PyErr_Occurred()) return -1;
    return 0;
}

/* For lookups: a key that is not a uint64 simply is not stored (returns 0 = absent). */
static int lookup_key(PyObject *o, uint64_t *k) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "keys must be integers, got %.80s", Py_TYPE(o)->tp_name);
        return -1;
    }
    *k = PyLong_AsUnsignedLongLong(o);
    if (*k == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static Py_ssize_t parse_slot(KeyTable *t, PyObject *o) {
    Py_ssize_t s = PyLong_AsSsize_t(o);
    if (s == -1 && PyErr_Occurred()) return -1;
    if (s < 0 || s >= MAX_SLOTS) {
        PyErr_SetString(PyExc_ValueError, "slot out of range");
        return -1;
    }
    if (ensure_width(t, s) < 0) return -1;
    return s;
}

static inline int slot_live(const KeyTable *t, Py_ssize_t s) {
    return (t->live[s >> 6] >> (s & 63)) & 1;
}

/* store(keys, slot) -> pairs added. Adds the slot to every key, touching each (LRU). */
static PyObject *KeyTable_store(KeyTable *t, PyObject *args) {
    PyObject *keys, *slot_o;
    if (!PyArg_ParseTuple(args, "OO", &keys, &slot_o)) return NULL;
    Py_ssize_t s = parse_slot(t, slot_o);
    if (s < 0) return NULL;
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    if (ensure_room(t, n) < 0) {
        Py_DECREF(fast);
        return NULL;
    }
    int64_t added = 0;
    int narrow = t->W == 1;
    uint64_t bit = 1ULL << (s & 63);
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t k;
        if (as_key(items[j], &k) < 0) goto fail;
        int is_new;
        Py_ssize_t i = find_or_slot(t, k, &is_new);
        if (is_new) t->used++;
        if (narrow) {
            uint64_t *hw = &H(t, i);
            if (!(*hw & bit)) {
                *hw |= bit;
                added++;
            }
        } else if (is_new) {
            H(t, i) = inl_make(&s, 1);
            added++;
        } else {
            int r = h_add(t, i, s);
            if (r < 0) goto fail;
            added += r;
        }
        if (t->track && log_touch(t, i) < 0) goto fail;
    }
    Py_DECREF(fast);
    t->counts[s] += added;
    if (slot_live(t, s)) t->pairs += added;
    return PyLong_FromLongLong(added);
fail:
    Py_DECREF(fast);
    t->counts[s] += added;
    if (slot_live(t, s)) t->pairs += added;
    return NULL;
}

/* remove(keys, slot) -> pairs removed (keys left with no holder are deleted; no LRU touch). */
static PyObject *KeyTable_remove(KeyTable *t, PyObject *args) {
    PyObject *keys, *slot_o;
    if (!PyArg_ParseTuple(args, "OO", &keys, &slot_o)) return NULL;
    Py_ssize_t s = parse_slot(t, slot_o);
    if (s < 0) return NULL;
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int64_t removed = 0;
    int err = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t k;
        int r = lookup_key(items[j], &k);
        if (r < 0) {
            err = 1;
            break;
        }
        if (!r) continue;
        Py_ssize_t i = find(t, k);
        if (i < 0 || !h_del(t, i, s)) continue;
        removed++;
        if (!H(t, i)) delete_at(t, i);
    }
    Py_DECREF(fast);
    t->counts[s] -= removed;
    if (slot_live(t, s)) t->pairs -= removed;
    if (err) return NULL;
    return PyLong_FromLongLong(removed);
}

/* Subtract a (to be deleted) entry's pairs from the counts; returns its live pairs. */
static int64_t uncount(KeyTable *t, Py_ssize_t i) {
    int64_t n = 0;
    uint64_t h = H(t, i);
    if (t->W > 1 && HINL(h)) {
        int c = INL_N(h);
        for (int j = 0; j < c; j++) {
            Py_ssize_t s = INL_ID(h, j);
            t->counts[s]--;
            n += slot_live(t, s);
        }
    } else {
        const uint64_t *m = t->W == 1 ? &H(t, i) : POOLM(t, h);
        for (Py_ssize_t w = 0; w < t->W; w++) {
            uint64_t x = m[w];
            while (x) {
                int b = __builtin_ctzll(x);
                x &= x - 1;
                t->counts[w * 64 + b]--;
            }
            n += __builtin_popcountll(m[w] & t->live[w]);
        }
    }
    t->pairs -= n;
    return n;
}

/* drop(keys) -> live pairs removed: the keys leave the table with every holder. */
static PyObject *KeyTable_drop(KeyTable *t, PyObject *keys) {
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int64_t removed = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t k;
        int r = lookup_key(items[j], &k);
        if (r < 0) {
            Py_DECREF(fast);
            return NULL;
        }
        if (!r) continue;
        Py_ssize_t i = find(t, k);
        if (i < 0) continue;
        removed += uncount(t, i);
        h_free(t, i);
        delete_at(t, i);
    }
    Py_DECREF(fast);
    return PyLong_FromLongLong(removed);
}

static PyObject *mask_to_int(const uint64_t *m, Py_ssize_t W) {
    Py_ssize_t top = W;
    while (top > 0 && !m[top - 1]) top--;
    if (top <= 1) return PyLong_FromUnsignedLongLong(top ? m[0] : 0);
    return _PyLong_FromByteArray((const unsigned char *)m, (size_t)top * 8, 1, 0);
}

/* get(key) -> mask as an int (0: not stored). */
static PyObject *KeyTable_get(KeyTable *t, PyObject *key) {
    uint64_t k;
    int r = lookup_key(key, &k);
    if (r < 0) return NULL;
    Py_ssize_t i = r ? find(t, k) : -1;
    if (i < 0) return PyLong_FromLong(0);
    h_to_mask(t, H(t, i), t->scratch);
    return mask_to_int(t->scratch, t->W);
}

/* put(key, mask, touch) : set a key's mask as is (0 deletes it). Counts are the caller's
 * business (adjust()); a new key is always touched. */
static PyObject *KeyTable_put(KeyTable *t, PyObject *args) {
    PyObject *key, *mask_o;
    int touch;
    if (!PyArg_ParseTuple(args, "OO!p", &key, &PyLong_Type, &mask_o, &touch)) return NULL;
    uint64_t k;
    if (as_key(key, &k) < 0) return NULL;
    if (_PyLong_Sign(mask_o) < 0) {
        PyErr_SetString(PyExc_ValueError, "mask must be >= 0");
        return NULL;
    }
    size_t bits = _PyLong_NumBits(mask_o);
    if (bits > (size_t)MAX_SLOTS) {
        PyErr_SetString(PyExc_ValueError, "slot out of range");
        return NULL;
    }
    if (bits > 0 && ensure_width(t, (Py_ssize_t)bits - 1) < 0) return NULL;
    Py_ssize_t W = t->W;
    uint64_t *tmp = t->scratch;
    memset(tmp, 0, (size_t)W * 8);
#if PY_VERSION_HEX >= 0x030D0000
    if (_PyLong_AsByteArray((PyLongObject *)mask_o, (unsigned char *)tmp, (size_t)W * 8, 1, 0, 1) < 0)
        return NULL;
#else
    if (_PyLong_AsByteArray((PyLongObject *)mask_o, (unsigned char *)tmp, (size_t)W * 8, 1, 0) < 0)
        return NULL;
#endif
    int zero = 1;
    for (Py_ssize_t w = 0; w < W; w++) zero &= tmp[w] == 0;
    Py_ssize_t i = find(t, k);
    if (zero) {
        if (i >= 0) {
            h_free(t, i);
            delete_at(t, i);
        }
        Py_RETURN_NONE;
    }
    uint64_t h;
    if (h_from_mask(t, tmp, &h) < 0) return NULL;
    if (i < 0) {
        if (ensure_room(t, 1) < 0) {
            if (W > 1 && !HINL(h)) pool_release(t, HPOOL(h)); /* give the pool entry back */
            return NULL;
        }
        int is_new;
        i = find_or_slot(t, k, &is_new);
        t->used++;
        touch = 1;
    } else {
        h_free(t, i);
    }
    H(t, i) = h;
    if (touch && t->track && log_touch(t, i) < 0) return NULL;
    Py_RETURN_NONE;
}

/* adjust(slot, delta): change a slot's pair count (for edits made with put). */
static PyObject *KeyTable_adjust(KeyTable *t, PyObject *args) {
    PyObject *slot_o;
    long long delta;
    if (!PyArg_ParseTuple(args, "OL", &slot_o, &delta)) return NULL;
    Py_ssize_t s = parse_slot(t, slot_o);
    if (s < 0) return NULL;
    t->counts[s] += delta;
    if (slot_live(t, s)) t->pairs += delta;
    Py_RETURN_NONE;
}

/* set_live(slot, on): a slot joins or leaves the live set (its count joins/leaves pairs). */
static PyObject *KeyTable_set_live(KeyTable *t, PyObject *args) {
    PyObject *slot_o;
    int on;
    if (!PyArg_ParseTuple(args, "Op", &slot_o, &on)) return NULL;
    Py_ssize_t s = parse_slot(t, slot_o);
    if (s < 0) return NULL;
    uint64_t bit = 1ULL << (s & 63);
    int was = (t->live[s >> 6] & bit) != 0;
    if (on && !was) {
        t->live[s >> 6] |= bit;
        t->pairs += t->counts[s];
    } else if (!on && was) {
        t->live[s >> 6] &= ~bit;
        t->pairs -= t->counts[s];
    }
    Py_RETURN_NONE;
}

/* clear_slot(slot) -> pairs it had: the slot leaves the live set and is scrubbed from every
 * key now (one pass over the table), so the slot can be reused at once. */
static PyObject *KeyTable_clear_slot(KeyTable *t, PyObject *slot_o) {
    Py_ssize_t s = parse_slot(t, slot_o);
    if (s < 0) return NULL;
    int64_t n = t->counts[s];
    if (slot_live(t, s)) t->pairs -= n;
    t->live[s >> 6] &= ~(1ULL << (s & 63));
    t->counts[s] = 0;
    Py_ssize_t i = 0;
    while (i < t->cap) {
        if (H(t, i) && h_del(t, i, s) && !H(t, i)) {
            delete_at(t, i);
            continue; /* an entry may have shifted into i: look again */
        }
        i++;
    }
    return PyLong_FromLongLong(n);
}

typedef struct {
    PyObject *names;
    PyObject *result;
} Assign;

/* result[names[s]] = depth for every slot s set in (a ^ b) (or in a when b is NULL). */
static int assign(Assign *as, const uint64_t *a, const uint64_t *b, Py_ssize_t W, Py_ssize_t depth) {
    PyObject *d = NULL;
    for (Py_ssize_t w = 0; w < W; w++) {
        uint64_t x = b ? (a[w] ^ b[w]) : a[w];
        while (x) {
            int bi = __builtin_ctzll(x);
            x &= x - 1;
            Py_ssize_t s = w * 64 + bi;
            if (s >= PyList_GET_SIZE(as->names)) continue;
            PyObject *name = PyList_GET_ITEM(as->names, s);
            if (name == Py_None) continue;
            if (!d && !(d = PyLong_FromSsize_t(depth))) return -1;
            if (PyDict_SetItem(as->result, name, d) < 0) {
                Py_DECREF(d);
                return -1;
            }
        }
    }
    Py_XDECREF(d);
    return 0;
}

/* The fold of find/match: active &= holders(key); record workers whose run ended. Returns 1
 * to continue, 0 when no worker matches any more, -1 on error. ``acount`` = |active| (wide). */
static inline int step(KeyTable *t, Assign *as, uint64_t *active, uint64_t *m, Py_ssize_t i,
                       Py_ssize_t depth, Py_ssize_t *acount) {
    Py_ssize_t W = t->W;
    uint64_t h = i >= 0 ? t->ent[2 * i + 1] : 0;
    if (W == 1) {
        uint64_t x = h & active[0];
        if (x == active[0]) return 1;
        m[0] = x;
        if (depth && assign(as, active, m, 1, depth) < 0) return -1;
        active[0] = x;
        return x != 0;
    }
    Py_ssize_t cnt = 0;
    if (h && HINL(h)) {
        int n = INL_N(h);
        if (n >= *acount) { /* every active worker may be among the ids */
            for (int j = 0; j < n; j++) {
                Py_ssize_t s = INL_ID(h, j);
                cnt += (active[s >> 6] >> (s & 63)) & 1;
            }
            if (cnt == *acount) return 1;
        }
        memset(m, 0, (size_t)W * 8);
        cnt = 0;
        for (int j = 0; j < n; j++) {
            Py_ssize_t s = INL_ID(h, j);
            uint64_t b = 1ULL << (s & 63);
            if (active[s >> 6] & b) {
                m[s >> 6] |= b;
                cnt++;
            }
        }
    } else if (h) {
        const uint64_t *pm = POOLM(t, h);
        int same = 1;
        for (Py_ssize_t w = 0; w < W; w++) {
            m[w] = pm[w] & active[w];
            same &= m[w] == active[w];
            cnt += __builtin_popcountll(m[w]);
        }
        if (same) return 1;
    } else {
        memset(m, 0, (size_t)W * 8);
    }
    if (depth && assign(as, active, m, W, depth) < 0) return -1;
    memcpy(active, m, (size_t)W * 8);
    *acount = cnt;
    return cnt != 0;
}

static Py_ssize_t live_count(KeyTable *t) {
    Py_ssize_t n = 0;
    for (Py_ssize_t w = 0; w < t->W; w++) n += __builtin_popcountll(t->live[w]);
    return n;
}

/* find(keys, names) -> {names[slot]: leading keys held} (live slots, 0 omitted). */
static PyObject *KeyTable_find(KeyTable *t, PyObject *args) {
    PyObject *keys, *names;
    if (!PyArg_ParseTuple(args, "OO!", &keys, &PyList_Type, &names)) return NULL;
    PyObject *result = PyDict_New();
    Py_ssize_t acount = live_count(t);
    if (!result || !acount) return result;
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (!fast) goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), W = t->W, depth = 0;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t *active = t->scratch, *m = t->scratch + W;
    memcpy(active, t->live, (size_t)W * 8);
    Assign as = {names, result};
    /* as match does: convert a group of keys, prefetch their table entries, then look them
     * up, so the cache misses of a group overlap (a cold 10 M-key table: 4x faster) */
    enum { GROUP = 8 };
    uint64_t ks[GROUP];
    int rs[GROUP];
    for (Py_ssize_t j0 = 0; j0 < n; j0 += GROUP) {
        Py_ssize_t g = n - j0 < GROUP ? n - j0 : GROUP;
        for (Py_ssize_t j = 0; j < g; j++) {
            rs[j] = lookup_key(items[j0 + j], &ks[j]);
            if (rs[j] < 0) { /* a bad key is an error only if the match gets that far */
                PyErr_Clear();
                break;
            }
            if (rs[j]) __builtin_prefetch(&KEY(t, home(t, ks[j])));
        }
        for (Py_ssize_t j = 0; j < g; j++) {
            if (rs[j] < 0 && lookup_key(items[j0 + j], &ks[j]) < 0) goto fail2;
            int c = step(t, &as, active, m, rs[j] ? find(t, ks[j]) : -1, depth, &acount);
            if (c < 0) goto fail2;
            if (!c) {
                Py_DECREF(fast);
                return result;
            }
            depth++;
        }
    }
    Py_DECREF(fast);
    if (depth && assign(&as, active, NULL, W, depth) < 0) goto fail;
    return result;
fail2:
    Py_DECREF(fast);
fail:
    Py_XDECREF(result);
    return NULL;
}

/* match(tokens, block_size, seed, names) -> find(chain_keys(tokens, block_size, seed), names),
 * hashing block by block and stopping at the first block no worker holds. */
static PyObject *KeyTable_match(KeyTable *t, PyObject *args) {
    PyObject *tokens, *names;
    Py_ssize_t bs;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OnKO!", &tokens, &bs, &seed, &PyList_Type, &names)) return NULL;
    PyObject *result = PyDict_New();
    Py_ssize_t acount = live_count(t);
    if (!result || !acount || bs <= 0) return result;
    TokenSource ts;
    if (tokens_open(&ts, tokens, bs) < 0) goto fail;
    Py_ssize_t n = ts.n_tokens / bs, W = t->W, depth = 0;
    uint64_t *active = t->scratch, *m = t->scratch + W, h = seed;
    memcpy(active, t->live, (size_t)W * 8);
    Assign as = {names, result};
    /* hash a group of blocks, prefetch their table entries, then look them up: the cache
     * misses of the group overlap instead of following one another */
    enum { GROUP = 8 };
    uint64_t hs[GROUP];
    for (Py_ssize_t b0 = 0; b0 < n; b0 += GROUP) {
        Py_ssize_t g = n - b0 < GROUP ? n - b0 : GROUP;
        for (Py_ssize_t j = 0; j < g; j++) {
            const uint8_t *blk = tokens_block(&ts, b0 + j, bs);
            if (!blk) goto fail2;
            h = xxh3_64(blk, (size_t)bs * 4, h);
            hs[j] = h;
            __builtin_prefetch(&KEY(t, home(t, h)));
        }
        for (Py_ssize_t j = 0; j < g; j++) {
            int c = step(t, &as, active, m, find(t, hs[j]), depth, &acount);
            if (c < 0) goto fail2;
            if (!c) {
                tokens_close(&ts);
                return result;
            }
            depth++;
        }
    }
    tokens_close(&ts);
    if (depth && assign(&as, active, NULL, W, depth) < 0) goto fail;
    return result;
fail2:
    tokens_close(&ts);
fail:
    Py_XDECREF(result);
    return NULL;
}

/* prune(target) -> keys dropped, oldest first, until pairs <= target (needs tracking). */
static PyObject *KeyTable_prune(KeyTable *t, PyObject *arg) {
    long long target = PyLong_AsLongLong(arg);
    if (target == -1 && PyErr_Occurred()) return NULL;
    if (!t->track) {
        PyErr_SetString(PyExc_RuntimeError, "prune needs a table made with track_lru=True");
        return NULL;
    }
    PyObject *victims = PyList_New(0);
    if (!victims) return NULL;
    while (t->pairs > target && t->log_head < t->log_len) {
        Py_ssize_t p = t->log_head++;
        uint64_t k = t->log[p];
        Py_ssize_t i = find(t, k);
        if (i < 0 || t->stamps[i] != t->log_base + (uint64_t)p) continue;
        uncount(t, i);
        h_free(t, i);
        delete_at(t, i);
        PyObject *ko = PyLong_FromUnsignedLongLong(k);
        if (!ko || PyList_Append(victims, ko) < 0) {
            Py_XDECREF(ko);
            Py_DECREF(victims);
            return NULL;
        }
        Py_DECREF(ko);
    }
    return victims;
}

/* The entries (key, holder word) in LRU order (tracking) or table order, as a new array of
 * 2 * used words (PyMem_Free it); NULL on NoMemory. Sets *n to the number of entries.
 * LRU order without a probe per log entry: every key's stamp is its current log position
 * (>= log_head), so one sequential pass over the table scatters each entry to its position
 * and a sequential pass gathers them in order (no dependent cache misses). */
static uint64_t *ordered_entries(KeyTable *t, Py_ssize_t *n) {
    Py_ssize_t c = 0;
    uint64_t *out = (uint64_t *)PyMem_Malloc((size_t)(t->used + 1) * 16);
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    if (t->track) {
        Py_ssize_t span = t->log_len - t->log_head;
        uint64_t first = t->log_base + (uint64_t)t->log_head;
        uint64_t *at = (uint64_t *)PyMem_Calloc((size_t)(span + 1), 16);
        if (!at) {
            PyMem_Free(out);
            PyErr_NoMemory();
            return NULL;
        }
        for (Py_ssize_t i = 0; i < t->cap; i++) {
            uint64_t h = H(t, i);
            if (!h) continue;
            uint64_t *e = at + 2 * (t->stamps[i] - first);
            e[0] = KEY(t, i);
            e[1] = h;
        }
        for (Py_ssize_t p = 0; p < span; p++)
            if (at[2 * p + 1]) {
                out[2 * c] = at[2 * p];
                out[2 * c + 1] = at[2 * p + 1];
                c++;
            }
        PyMem_Free(at);
    } else {
        for (Py_ssize_t i = 0; i < t->cap; i++)
            if (H(t, i)) {
                out[2 * c] = KEY(t, i);
                out[2 * c + 1] = H(t, i);
                c++;
            }
    }
    *n = c;
    return out;
}

/* export() -> (keys as uint64 bytes, [mask word w as uint64 bytes for w < W]). */
static PyObject *KeyTable_export(KeyTable *t, PyObject *unused) {
    Py_ssize_t n, W = t->W;
    uint64_t *ents = ordered_entries(t, &n);
    if (!ents) return NULL;
    PyObject *kb = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *words = PyList_New(W);
    uint64_t **wp = (uint64_t **)PyMem_Calloc((size_t)W, sizeof(uint64_t *));
    if (!kb || !words || !wp) goto fail;
    uint64_t *kp = (uint64_t *)PyBytes_AS_STRING(kb);
    for (Py_ssize_t w = 0; w < W; w++) {
        PyObject *wb = PyBytes_FromStringAndSize(NULL, n * 8);
        if (!wb) goto fail;
        wp[w] = (uint64_t *)PyBytes_AS_STRING(wb);
        PyList_SET_ITEM(words, w, wb);
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        kp[j] = ents[2 * j];
        h_to_mask(t, ents[2 * j + 1], t->scratch);
        for (Py_ssize_t w = 0; w < W; w++) wp[w][j] = t->scratch[w];
    }
    PyMem_Free(wp);
    PyMem_Free(ents);
    return Py_BuildValue("(NN)", kb, words);
fail:
    PyMem_Free(wp);
    PyMem_Free(ents);
    Py_XDECREF(kb);
    Py_XDECREF(words);
    if (!PyErr_Occurred()) PyErr_NoMemory();
    return NULL;
}

/* export_pairs() -> (keys, slots): one row per (key, holder) pair, as uint64 and uint32 bytes;
 * a key's rows are consecutive, keys in LRU order (tracking) or table order. */
static PyObject *KeyTable_export_pairs(KeyTable *t, PyObject *unused) {
    Py_ssize_t n, W = t->W, rows = 0;
    uint64_t *ents = ordered_entries(t, &n);
    if (!ents) return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t h = ents[2 * j + 1];
        if (W > 1 && HINL(h)) {
            rows += INL_N(h);
        } else {
            const uint64_t *m = W == 1 ? &ents[2 * j + 1] : POOLM(t, h);
            for (Py_ssize_t w = 0; w < W; w++) rows += __builtin_popcountll(m[w]);
        }
    }
    PyObject *kb = PyBytes_FromStringAndSize(NULL, rows * 8);
    PyObject *sb = PyBytes_FromStringAndSize(NULL, rows * 4);
    if (!kb || !sb) {
        PyMem_Free(ents);
        Py_XDECREF(kb);
        Py_XDECREF(sb);
        return NULL;
    }
    uint64_t *kp = (uint64_t *)PyBytes_AS_STRING(kb);
    uint32_t *sp = (uint32_t *)PyBytes_AS_STRING(sb);
    Py_ssize_t r = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t k = ents[2 * j], h = ents[2 * j + 1];
        if (W > 1 && HINL(h)) {
            int c = INL_N(h);
            for (int q = 0; q < c; q++) {
                kp[r] = k;
                sp[r++] = (uint32_t)INL_ID(h, q);
            }
        } else {
            const uint64_t *m = W == 1 ? &ents[2 * j + 1] : POOLM(t, h);
            for (Py_ssize_t w = 0; w < W; w++) {
                uint64_t x = m[w];
                while (x) {
                    kp[r] = k;
                    sp[r++] = (uint32_t)(w * 64 + __builtin_ctzll(x));
                    x &= x - 1;
                }
            }
        }
    }
    PyMem_Free(ents);
    return Py_BuildValue("(NN)", kb, sb);
}

/* held(slot) -> uint64 bytes of the keys the slot holds (table order: one pass, no copy of
 * the table; resync diffs and checks sort or hash them anyway). */
static PyObject *KeyTable_held(KeyTable *t, PyObject *slot_o) {
    Py_ssize_t s = parse_slot(t, slot_o);
    if (s < 0) return NULL;
    PyObject *kb = PyBytes_FromStringAndSize(NULL, t->counts[s] * 8);
    if (!kb) return NULL;
    uint64_t *kp = (uint64_t *)PyBytes_AS_STRING(kb);
    Py_ssize_t c = 0, n = t->counts[s];
    for (Py_ssize_t i = 0; i < t->cap && c < n; i++)
        if (h_has(t, H(t, i), s)) kp[c++] = KEY(t, i);
    if (c != n) { /* counts and table disagree: a bug, never a silent short answer */
        Py_DECREF(kb);
        PyErr_SetString(PyExc_RuntimeError, "slot count differs from the table");
        return NULL;
    }
    return kb;
}

/* keys() -> list of keys (LRU order with tracking). */
static PyObject *KeyTable_keys(KeyTable *t, PyObject *unused) {
    Py_ssize_t n;
    uint64_t *ents = ordered_entries(t, &n);
    if (!ents) return NULL;
    PyObject *out = PyList_New(n);
    if (!out) {
        PyMem_Free(ents);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *k = PyLong_FromUnsignedLongLong(ents[2 * j]);
        if (!k) {
            PyMem_Free(ents);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, k);
    }
    PyMem_Free(ents);
    return out;
}

/* Empty the table for ``keys`` keys with slots below 64 * W: fresh arrays, nothing live. */
static int reset_for(KeyTable *t, Py_ssize_t keys, Py_ssize_t W) {
    Py_ssize_t cap = 8;
    while (keys * 4 > cap * 3) cap *= 2;
    uint64_t *live = (uint64_t *)PyMem_Calloc((size_t)W, 8);
    uint64_t *scratch = (uint64_t *)PyMem_Calloc((size_t)(2 * W), 8);
    int64_t *counts = (int64_t *)PyMem_Calloc((size_t)(64 * W), 8);
    if (!live || !scratch || !counts) {
        PyMem_Free(live);
        PyMem_Free(scratch);
        PyMem_Free(counts);
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *oent = t->ent, *ostamps = t->stamps;
    if (alloc_arrays(t, cap) < 0) {
        t->ent = oent;
        t->stamps = ostamps;
        PyMem_Free(live);
        PyMem_Free(scratch);
        PyMem_Free(counts);
        return -1;
    }
    PyMem_Free(oent);
    PyMem_Free(ostamps);
    PyMem_Free(t->live);
    PyMem_Free(t->scratch);
    PyMem_Free(t->counts);
    PyMem_Free(t->pool);
    t->pool = NULL;
    t->pool_len = t->pool_cap = t->pool_used = 0;
    t->pool_free = -1;
    t->live = live;
    t->scratch = scratch;
    t->counts = counts;
    t->W = W;
    t->used = 0;
    t->pairs = 0;
    t->log_len = t->log_head = 0;
    t->log_base = 0;
    return 0;
}

/* load(keys, words): replace the content with uint64 buffers as export() gives them (keys
 * stored in the given order, which becomes the LRU order). Every slot ends not live, counts
 * recomputed from the masks: the caller marks live slots with set_live. */
static PyObject *KeyTable_load(KeyTable *t, PyObject *args) {
    PyObject *keys_o, *words_o;
    if (!PyArg_ParseTuple(args, "OO", &keys_o, &words_o)) return NULL;
    PyObject *wfast = PySequence_Fast(words_o, "words must be a sequence");
    if (!wfast) return NULL;
    Py_ssize_t nw = PySequence_Fast_GET_SIZE(wfast);
    Py_buffer kv;
    if (PyObject_GetBuffer(keys_o, &kv, PyBUF_SIMPLE) < 0) {
        Py_DECREF(wfast);
        return NULL;
    }
    Py_ssize_t n = kv.len / 8;
    Py_buffer *wv = (Py_buffer *)PyMem_Calloc((size_t)(nw + 1), sizeof(Py_buffer));
    Py_ssize_t got = 0;
    PyObject *ret = NULL;
    if (!wv) {
        PyErr_NoMemory();
        goto done;
    }
    if (nw > MAX_SLOTS / 64) {
        PyErr_SetString(PyExc_ValueError, "too many mask words");
        goto done;
    }
    for (; got < nw; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(wfast, got), &wv[got], PyBUF_SIMPLE) < 0)
            goto done;
        if (wv[got].len != kv.len) {
            got++;
            PyErr_SetString(PyExc_ValueError, "mask words must have one entry per key");
            goto done;
        }
    }
    {
        Py_ssize_t W = nw > 0 ? nw : 1;
        if (reset_for(t, n, W) < 0) goto done;
        const uint64_t *kp = (const uint64_t *)kv.buf;
        uint64_t *m = t->scratch;
        for (Py_ssize_t j = 0; j < n; j++) {
            int nz = 0;
            for (Py_ssize_t w = 0; w < nw; w++) {
                m[w] = ((const uint64_t *)wv[w].buf)[j];
                nz |= m[w] != 0;
            }
            if (!nz) continue;
            int is_new;
            Py_ssize_t i = find_or_slot(t, kp[j], &is_new);
            if (!is_new) { /* a repeated key: its last row wins */
                for (Py_ssize_t w = 0; w < W; w++) m[W + w] = 0;
                h_to_mask(t, H(t, i), m + W);
                for (Py_ssize_t w = 0; w < W; w++) {
                    uint64_t x = m[W + w];
                    while (x) {
                        t->counts[w * 64 + __builtin_ctzll(x)]--;
                        x &= x - 1;
                    }
                }
                h_free(t, i);
            } else {
                t->used++;
            }
            uint64_t h;
            if (h_from_mask(t, m, &h) < 0) {
                H(t, i) = 0; /* the table is left consistent, partly loaded */
                if (is_new) t->used--;
                goto done;
            }
            H(t, i) = h;
            for (Py_ssize_t w = 0; w < nw; w++) {
                uint64_t x = m[w];
                while (x) {
                    t->counts[w * 64 + __builtin_ctzll(x)]++;
                    x &= x - 1;
                }
            }
            if (t->track && log_touch(t, i) < 0) goto done;
        }
        ret = Py_None;
        Py_INCREF(ret);
    }
done:
    for (Py_ssize_t w = 0; w < got; w++) PyBuffer_Release(&wv[w]);
    PyMem_Free(wv);
    PyBuffer_Release(&kv);
    Py_DECREF(wfast);
    return ret;
}

/* load_pairs(keys, slots, append=False, total_keys=0, top_slot=0): replace the content with
 * export_pairs() output (uint64 keys and uint32 slots, one row per pair; a key's rows
 * consecutive; the keys' order becomes the LRU order). Every slot ends not live, counts
 * recomputed: the caller marks live slots. With ``append`` the rows are added to what earlier
 * calls loaded (a snapshot loaded in slices: the first call sized for ``total_keys`` keys and
 * slots up to ``top_slot``, so later slices neither rehash nor widen the table). */
static PyObject *KeyTable_load_pairs(KeyTable *t, PyObject *args) {
    PyObject *keys_o, *slots_o;
    int append = 0;
    Py_ssize_t total_keys = 0, top_slot = 0;
    if (!PyArg_ParseTuple(args, "OO|pnn", &keys_o, &slots_o, &append, &total_keys, &top_slot))
        return NULL;
    Py_buffer kv, sv;
    if (PyObject_GetBuffer(keys_o, &kv, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(slots_o, &sv, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&kv);
        return NULL;
    }
    PyObject *ret = NULL;
    Py_ssize_t n = kv.len / 8;
    const uint64_t *kp = (const uint64_t *)kv.buf;
    const uint32_t *sp = (const uint32_t *)sv.buf;
    if (kv.len % 8 || sv.len != n * 4) {
        PyErr_SetString(PyExc_ValueError, "keys (uint64) and slots (uint32) differ in rows");
        goto done;
    }
    {
        Py_ssize_t keys = 0, top = 0;
        for (Py_ssize_t j = 0; j < n; j++) {
            keys += j == 0 || kp[j] != kp[j - 1];
            if ((Py_ssize_t)sp[j] > top) top = sp[j];
        }
        if (top_slot > top) top = top_slot;
        if (top >= MAX_SLOTS) {
            PyErr_SetString(PyExc_ValueError, "slot out of range");
            goto done;
        }
        if (append) {
            if (ensure_width(t, top) < 0 || ensure_room(t, keys) < 0) goto done;
        } else if (reset_for(t, keys > total_keys ? keys : total_keys, top / 64 + 1) < 0) {
            goto done;
        }
        Py_ssize_t i = -1;
        enum { AHEAD = 16 };
        for (Py_ssize_t j = 0; j < n; j++) {
            if (j + AHEAD < n) __builtin_prefetch(&KEY(t, home(t, kp[j + AHEAD])));
            Py_ssize_t s = sp[j];
            if (j == 0 || kp[j] != kp[j - 1]) {
                int is_new;
                i = find_or_slot(t, kp[j], &is_new);
                if (is_new) {
                    t->used++;
                    if (t->W == 1)
                        H(t, i) = 1ULL << s;
                    else
                        H(t, i) = inl_make(&s, 1);
                    t->counts[s]++;
                    if (t->track && log_touch(t, i) < 0) goto done;
                    continue;
                }
            }
            int r = h_add(t, i, s);
            if (r < 0) goto done;
            t->counts[s] += r;
        }
        ret = Py_None;
        Py_INCREF(ret);
    }
done:
    PyBuffer_Release(&kv);
    PyBuffer_Release(&sv);
    return ret;
}

/* prefault(part, parts): touch part ``part`` of ``parts`` of the table's memory, one write per
 * page (the table of a snapshot load is sized at once; its pages would otherwise all fault in
 * during the first slice of rows: 200 ms at 10 M keys). Entries stay as they are. */
static PyObject *KeyTable_prefault(KeyTable *t, PyObject *args) {
    Py_ssize_t part, parts;
    if (!PyArg_ParseTuple(args, "nn", &part, &parts)) return NULL;
    if (parts <= 0 || part < 0 || part >= parts) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= part < parts");
        return NULL;
    }
    volatile uint64_t *words = t->ent;
    Py_ssize_t n = 2 * t->cap, a = n / parts * part, b = part == parts - 1 ? n : n / parts * (part + 1);
    for (Py_ssize_t i = a; i < b; i += 512) words[i] = words[i];
    Py_RETURN_NONE;
}

static PyObject *KeyTable_count(KeyTable *t, PyObject *slot_o) {
    Py_ssize_t s = parse_slot(t, slot_o);
    if (s < 0) return NULL;
    return PyLong_FromLongLong(t->counts[s]);
}

static PyObject *KeyTable_get_pairs(KeyTable *t, void *c) { return PyLong_FromLongLong(t->pairs); }
static PyObject *KeyTable_get_width(KeyTable *t, void *c) { return PyLong_FromSsize_t(t->W); }
static PyObject *KeyTable_get_pooled(KeyTable *t, void *c) {
    return PyLong_FromSsize_t(t->pool_used);
}
static PyObject *KeyTable_get_nbytes(KeyTable *t, void *c) {
    size_t per = 16 + (t->track ? 8 : 0);
    return PyLong_FromSize_t((size_t)t->cap * per + (size_t)t->log_cap * 8 +
                             (size_t)t->pool_cap * (size_t)t->W * 8);
}
static Py_ssize_t KeyTable_len(KeyTable *t) { return t->used; }

static PyMethodDef KeyTable_methods[] = {
    {"store", (PyCFunction)KeyTable_store, METH_VARARGS, "store(keys, slot) -> pairs added"},
    {"remove", (PyCFunction)KeyTable_remove, METH_VARARGS, "remove(keys, slot) -> pairs removed"},
    {"drop", (PyCFunction)KeyTable_drop, METH_O, "drop(keys) -> live pairs removed"},
    {"get", (PyCFunction)KeyTable_get, METH_O, "get(key) -> mask (0: absent)"},
    {"put", (PyCFunction)KeyTable_put, METH_VARARGS, "put(key, mask, touch)"},
    {"adjust", (PyCFunction)KeyTable_adjust, METH_VARARGS, "adjust(slot, delta)"},
    {"set_live", (PyCFunction)KeyTable_set_live, METH_VARARGS, "set_live(slot, on)"},
    {"clear_slot", (PyCFunction)KeyTable_clear_slot, METH_O, "clear_slot(slot) -> pairs"},
    {"find", (PyCFunction)KeyTable_find, METH_VARARGS, "find(keys, names) -> {name: depth}"},
    {"match", (PyCFunction)KeyTable_match, METH_VARARGS,
     "match(tokens, block_size, seed, names) -> {name: depth}"},
    {"prune", (PyCFunction)KeyTable_prune, METH_O, "prune(target) -> dropped keys, oldest first"},
    {"export", (PyCFunction)KeyTable_export, METH_NOARGS, "export() -> (keys, [words])"},
    {"export_pairs", (PyCFunction)KeyTable_export_pairs, METH_NOARGS,
     "export_pairs() -> (keys uint64 bytes, slots uint32 bytes), one row per pair"},
    {"held", (PyCFunction)KeyTable_held, METH_O, "held(slot) -> uint64 bytes of its keys"},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "keys() -> list"},
    {"load", (PyCFunction)KeyTable_load, METH_VARARGS, "load(keys, words)"},
    {"prefault", (PyCFunction)KeyTable_prefault, METH_VARARGS, "prefault(part, parts)"},
    {"load_pairs", (PyCFunction)KeyTable_load_pairs, METH_VARARGS,
     "load_pairs(keys, slots, append=False, total_keys=0, top_slot=0)"},
    {"count", (PyCFunction)KeyTable_count, METH_O, "count(slot) -> pairs of the slot"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeyTable_getset[] = {
    {"pairs", (getter)KeyTable_get_pairs, NULL, "live (worker, key) pairs", NULL},
    {"nbytes", (getter)KeyTable_get_nbytes, NULL, "bytes held by the arrays", NULL},
    {"width", (getter)KeyTable_get_width, NULL, "64-bit words per slot bitmask", NULL},
    {"pooled", (getter)KeyTable_get_pooled, NULL, "keys whose holders are a pooled bitmask",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_length = (lenfunc)KeyTable_len,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "services.core._cindex.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "uint64 key -> worker-slot set table with per-slot counts and optional LRU",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KeyTable_init,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_methods = KeyTable_methods,
    .tp_getset = KeyTable_getset,
    .tp_as_sequence = &KeyTable_as_sequence,
};

/* ------------------------------------------------------------------------------------------
 * module functions
 * ---------------------------------------------------------------------------------------- */

static PyObject *py_xxh3_64(PyObject *self, PyObject *args) {
    Py_buffer b;
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "y*|K", &b, &seed)) return NULL;
    uint64_t h = xxh3_64(b.buf, (size_t)b.len, seed);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_chain_keys(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t bs, max_blocks = -1;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OnK|n", &tokens, &bs, &seed, &max_blocks)) return NULL;
    if (bs <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be > 0, got %zd", bs);
        return NULL;
    }
    TokenSource ts;
    if (tokens_open(&ts, tokens, bs) < 0) return NULL;
    Py_ssize_t n = ts.n_tokens / bs;
    if (max_blocks >= 0 && max_blocks < n) n = max_blocks;
    PyObject *out = PyList_New(n);
    if (!out) goto fail;
    uint64_t h = seed;
    for (Py_ssize_t b = 0; b < n; b++) {
        const uint8_t *blk = tokens_block(&ts, b, bs);
        if (!blk) goto fail;
        h = xxh3_64(blk, (size_t)bs * 4, h);
        PyObject *k = PyLong_FromUnsignedLongLong(h);
        if (!k) goto fail;
        PyList_SET_ITEM(out, b, k);
    }
    tokens_close(&ts);
    return out;
fail:
    tokens_close(&ts);
    Py_XDECREF(out);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"xxh3_64", py_xxh3_64, METH_VARARGS, "xxh3_64(data, seed=0) -> int"},
    {"chain_keys", py_chain_keys, METH_VARARGS,
     "chain_keys(tokens, block_size, seed, max_blocks=-1) -> canonical chained block keys"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "services.core._cindex",
    "Compiled hot paths of the prefix index (see services/core/cindex.py).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__cindex(void) {
    if (PyType_Ready(&KeyTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(&KeyTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
