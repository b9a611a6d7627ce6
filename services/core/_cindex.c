/* services.core._cindex: the compiled hot paths of the prefix index.
 *
 * Two things, both written from their specifications for kvgate:
 *
 * 1. XXH3-64 (xxHash's 64-bit XXH3, every input length, with a seed) and the canonical chained
 *    block keys of services/core/keys.py: key[i] = xxh3_64(block i as LE uint32, seed=key[i-1]).
 *    Tested bit for bit against the `xxhash` package on random inputs (tests/test_cindex.py).
 *
 * 2. KeyTable: an open-addressing hash table (linear probing, backward-shift deletion, no
 *    tombstones) from a uint64 block key to a bitmask of worker slots, W 64-bit words per key
 *    (W grows when a slot >= 64*W is used), with per-slot pair counts and a live-slot mask.
 *    With LRU tracking on, each touch of a key appends it to a log and stamps the entry with
 *    the log position; the least-recently-stored keys are the log entries whose stamp is still
 *    current, oldest first (stale log entries are skipped and compacted away).
 *
 * Invariants (checked by the property tests against the pure-Python PrefixIndex):
 * - a key is in the table iff its mask is non-zero;
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
 * ---------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    uint64_t *ent;      /* cap entries of W + 1 words: the key, then its mask words (one
                           cache line per probe for W = 1); an all-zero mask = empty entry */
    uint64_t *stamps;   /* cap, only with tracking: log position of the key's last touch */
    Py_ssize_t cap;     /* power of two */
    int shift;          /* 64 - log2(cap) */
    Py_ssize_t used;    /* keys */
    Py_ssize_t W;       /* mask words per key */
    uint64_t *live;     /* W words */
    uint64_t *scratch;  /* 2 * W words for queries */
    int64_t *counts;    /* 64 * W */
    int64_t pairs;
    int track;
    uint64_t *log;      /* keys by touch order */
    Py_ssize_t log_len, log_cap, log_head;
    uint64_t log_base;  /* stamp of log[0] */
} KeyTable;

#define KEY(t, i) ((t)->ent[(size_t)(i) * (size_t)((t)->W + 1)])
#define MASK(t, i) ((t)->ent + (size_t)(i) * (size_t)((t)->W + 1) + 1)

static inline Py_ssize_t home(const KeyTable *t, uint64_t k) {
    return (Py_ssize_t)((k * 0x9E3779B97F4A7C15ULL) >> t->shift);
}

static inline int empty_at(const KeyTable *t, Py_ssize_t i) {
    const uint64_t *m = MASK(t, i);
    for (Py_ssize_t w = 0; w < t->W; w++)
        if (m[w]) return 0;
    return 1;
}

static inline Py_ssize_t find(const KeyTable *t, uint64_t k) {
    Py_ssize_t mask = t->cap - 1, i = home(t, k);
    if (t->W == 1) {
        for (;;) {
            if (!t->ent[2 * i + 1]) return -1;
            if (t->ent[2 * i] == k) return i;
            i = (i + 1) & mask;
        }
    }
    for (;;) {
        if (empty_at(t, i)) return -1;
        if (KEY(t, i) == k) return i;
        i = (i + 1) & mask;
    }
}

static int alloc_arrays(KeyTable *t, Py_ssize_t cap, Py_ssize_t W) {
    uint64_t *ent = (uint64_t *)PyMem_Calloc((size_t)(cap * (W + 1)), 8);
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
    t->W = W;
    int lg = 0;
    while (((Py_ssize_t)1 << lg) < cap) lg++;
    t->shift = 64 - lg;
    return 0;
}

/* Rehash into ``cap`` entries of ``W`` words (W >= the current width). */
static int rebuild(KeyTable *t, Py_ssize_t cap, Py_ssize_t W) {
    uint64_t *oent = t->ent, *ostamps = t->stamps;
    Py_ssize_t ocap = t->cap, oW = t->W;
    if (alloc_arrays(t, cap, W) < 0) return -1;
    Py_ssize_t m = cap - 1;
    for (Py_ssize_t j = 0; j < ocap; j++) {
        const uint64_t *om = oent + (size_t)j * (oW + 1) + 1;
        int nz = 0;
        for (Py_ssize_t w = 0; w < oW; w++) nz |= om[w] != 0;
        if (!nz) continue;
        uint64_t k = oent[(size_t)j * (oW + 1)];
        Py_ssize_t i = home(t, k);
        while (!empty_at(t, i)) i = (i + 1) & m;
        KEY(t, i) = k;
        memcpy(MASK(t, i), om, (size_t)oW * 8);
        if (t->track) t->stamps[i] = ostamps[j];
    }
    PyMem_Free(oent);
    PyMem_Free(ostamps);
    return 0;
}

static int ensure_room(KeyTable *t, Py_ssize_t extra) {
    Py_ssize_t need = t->used + extra, cap = t->cap;
    while (need * 4 > cap * 3) cap *= 2;
    return cap == t->cap ? 0 : rebuild(t, cap, t->W);
}

static int ensure_width(KeyTable *t, Py_ssize_t slot) {
    if (slot < 64 * t->W) return 0;
    Py_ssize_t W = slot / 64 + 1;
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
    memcpy(live, t->live, (size_t)t->W * 8);
    memcpy(counts, t->counts, (size_t)(64 * t->W) * 8);
    if (rebuild(t, t->cap, W) < 0) {
        PyMem_Free(live);
        PyMem_Free(scratch);
        PyMem_Free(counts);
        return -1;
    }
    PyMem_Free(t->live);
    PyMem_Free(t->scratch);
    PyMem_Free(t->counts);
    t->live = live;
    t->scratch = scratch;
    t->counts = counts;
    return 0;
}

static int log_touch(KeyTable *t, Py_ssize_t i);

/* Position of ``k``, inserting an empty-mask entry if absent (the caller sets a bit at once:
 * an entry with a zero mask reads as empty). Needs room (ensure_room). */
static inline Py_ssize_t find_or_slot(KeyTable *t, uint64_t k, int *is_new) {
    Py_ssize_t m = t->cap - 1, i = home(t, k);
    for (;;) {
        if (empty_at(t, i)) {
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

/* Remove entry ``i`` (backward-shift deletion). */
static void delete_at(KeyTable *t, Py_ssize_t i) {
    Py_ssize_t m = t->cap - 1, j = i, W = t->W;
    for (;;) {
        j = (j + 1) & m;
        if (empty_at(t, j)) break;
        Py_ssize_t h = home(t, KEY(t, j));
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (stays) continue;
        KEY(t, i) = KEY(t, j);
        memcpy(MASK(t, i), MASK(t, j), (size_t)W * 8);
        if (t->track) t->stamps[i] = t->stamps[j];
        i = j;
    }
    memset(MASK(t, i), 0, (size_t)W * 8);
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
    t->live = (uint64_t *)PyMem_Calloc(1, 8);
    t->scratch = (uint64_t *)PyMem_Calloc(2, 8);
    t->counts = (int64_t *)PyMem_Calloc(64, 8);
    if (!t->live || !t->scratch || !t->counts) {
        PyErr_NoMemory();
        return -1;
    }
    return alloc_arrays(t, 8, 1);
}

static void KeyTable_dealloc(KeyTable *t) {
    PyMem_Free(t->ent);
    PyMem_Free(t->stamps);
    PyMem_Free(t->live);
    PyMem_Free(t->scratch);
    PyMem_Free(t->counts);
    PyMem_Free(t->log);
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
    if (s < 0 || s >= (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "slot out of range");
        return -1;
    }
    if (ensure_width(t, s) < 0) return -1;
    return s;
}

/* store(keys, slot) -> pairs added. Sets the slot's bit on every key, touching each (LRU). */
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
    Py_ssize_t word = s >> 6;
    uint64_t bit = 1ULL << (s & 63);
    int64_t added = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t k;
        if (as_key(items[j], &k) < 0) goto fail;
        int is_new;
        Py_ssize_t i = find_or_slot(t, k, &is_new);
        uint64_t *mw = MASK(t, i) + word;
        if (is_new) t->used++;
        if (!(*mw & bit)) {
            *mw |= bit;
            added++;
        }
        if (t->track && log_touch(t, i) < 0) goto fail;
    }
    Py_DECREF(fast);
    t->counts[s] += added;
    if (t->live[word] & bit) t->pairs += added;
    return PyLong_FromLongLong(added);
fail:
    Py_DECREF(fast);
    t->counts[s] += added;
    if (t->live[word] & bit) t->pairs += added;
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
    Py_ssize_t word = s >> 6;
    uint64_t bit = 1ULL << (s & 63);
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
        if (i < 0) continue;
        uint64_t *mw = MASK(t, i) + word;
        if (!(*mw & bit)) continue;
        *mw &= ~bit;
        removed++;
        if (empty_at(t, i)) delete_at(t, i);
    }
    Py_DECREF(fast);
    t->counts[s] -= removed;
    if (t->live[word] & bit) t->pairs -= removed;
    if (err) return NULL;
    return PyLong_FromLongLong(removed);
}

/* Subtract a deleted entry's live pairs from the counts. */
static int64_t uncount(KeyTable *t, Py_ssize_t i) {
    int64_t n = 0;
    const uint64_t *m = MASK(t, i);
    for (Py_ssize_t w = 0; w < t->W; w++) {
        uint64_t x = m[w];
        while (x) {
            int b = __builtin_ctzll(x);
            x &= x - 1;
            t->counts[w * 64 + b]--;
        }
        n += __builtin_popcountll(m[w] & t->live[w]);
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
    return mask_to_int(MASK(t, i), t->W);
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
        if (i >= 0) delete_at(t, i);
        Py_RETURN_NONE;
    }
    if (i < 0) {
        if (ensure_room(t, 1) < 0) return NULL;
        int is_new;
        i = find_or_slot(t, k, &is_new);
        t->used++;
        touch = 1;
    }
    memcpy(MASK(t, i), tmp, (size_t)W * 8);
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
    if (t->live[s >> 6] >> (s & 63) & 1) t->pairs += delta;
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

/* clear_slot(slot) -> pairs it had: the slot leaves the live set and its bit is scrubbed from
 * every key now (one pass over the table), so the slot can be reused at once. */
static PyObject *KeyTable_clear_slot(KeyTable *t, PyObject *slot_o) {
    Py_ssize_t s = parse_slot(t, slot_o);
    if (s < 0) return NULL;
    Py_ssize_t word = s >> 6;
    uint64_t bit = 1ULL << (s & 63);
    int64_t n = t->counts[s];
    if (t->live[word] & bit) t->pairs -= n;
    t->live[word] &= ~bit;
    t->counts[s] = 0;
    Py_ssize_t i = 0;
    while (i < t->cap) {
        uint64_t *mw = MASK(t, i) + word;
        if (*mw & bit) {
            *mw &= ~bit;
            if (empty_at(t, i)) {
                delete_at(t, i);
                continue; /* an entry may have shifted into i: look again */
            }
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

/* The fold of find/match: active &= mask(key); record workers whose run ended. Returns 1 to
 * continue, 0 when no worker matches any more, -1 on error. */
static inline int step(KeyTable *t, Assign *as, uint64_t *active, uint64_t *m, Py_ssize_t i,
                       Py_ssize_t depth) {
    Py_ssize_t W = t->W;
    if (W == 1) {
        uint64_t x = (i >= 0 ? t->ent[2 * i + 1] : 0) & active[0];
        if (x == active[0]) return 1;
        m[0] = x;
        if (depth && assign(as, active, m, 1, depth) < 0) return -1;
        active[0] = x;
        return x != 0;
    }
    int same = 1, any = 0;
    for (Py_ssize_t w = 0; w < W; w++) {
        m[w] = (i >= 0 ? MASK(t, i)[w] : 0) & active[w];
        same &= m[w] == active[w];
        any |= m[w] != 0;
    }
    if (same) return 1;
    if (depth && assign(as, active, m, W, depth) < 0) return -1;
    memcpy(active, m, (size_t)W * 8);
    return any;
}

static int live_any(KeyTable *t) {
    for (Py_ssize_t w = 0; w < t->W; w++)
        if (t->live[w]) return 1;
    return 0;
}

/* find(keys, names) -> {names[slot]: leading keys held} (live slots, 0 omitted). */
static PyObject *KeyTable_find(KeyTable *t, PyObject *args) {
    PyObject *keys, *names;
    if (!PyArg_ParseTuple(args, "OO!", &keys, &PyList_Type, &names)) return NULL;
    PyObject *result = PyDict_New();
    if (!result || !live_any(t)) return result;
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (!fast) goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), W = t->W, depth = 0;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t *active = t->scratch, *m = t->scratch + W;
    memcpy(active, t->live, (size_t)W * 8);
    Assign as = {names, result};
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t k;
        int r = lookup_key(items[j], &k);
        if (r < 0) goto fail2;
        int c = step(t, &as, active, m, r ? find(t, k) : -1, depth);
        if (c < 0) goto fail2;
        if (!c) {
            Py_DECREF(fast);
            return result;
        }
        depth++;
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
    if (!result || !live_any(t) || bs <= 0) return result;
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
            int c = step(t, &as, active, m, find(t, hs[j]), depth);
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

/* Keys in LRU order (tracking) or table order. */
static Py_ssize_t ordered_positions(KeyTable *t, Py_ssize_t *pos) {
    Py_ssize_t n = 0;
    if (t->track) {
        for (Py_ssize_t p = t->log_head; p < t->log_len; p++) {
            Py_ssize_t i = find(t, t->log[p]);
            if (i >= 0 && t->stamps[i] == t->log_base + (uint64_t)p) pos[n++] = i;
        }
    } else {
        for (Py_ssize_t i = 0; i < t->cap; i++)
            if (!empty_at(t, i)) pos[n++] = i;
    }
    return n;
}

/* export() -> (keys as uint64 bytes, [mask word w as uint64 bytes for w < W]). */
static PyObject *KeyTable_export(KeyTable *t, PyObject *unused) {
    Py_ssize_t *pos = (Py_ssize_t *)PyMem_Malloc((size_t)(t->used + 1) * sizeof(Py_ssize_t));
    if (!pos) return PyErr_NoMemory();
    Py_ssize_t n = ordered_positions(t, pos), W = t->W;
    PyObject *kb = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *words = PyList_New(W);
    if (!kb || !words) goto fail;
    uint64_t *kp = (uint64_t *)PyBytes_AS_STRING(kb);
    for (Py_ssize_t j = 0; j < n; j++) kp[j] = KEY(t, pos[j]);
    for (Py_ssize_t w = 0; w < W; w++) {
        PyObject *wb = PyBytes_FromStringAndSize(NULL, n * 8);
        if (!wb) goto fail;
        uint64_t *wp = (uint64_t *)PyBytes_AS_STRING(wb);
        for (Py_ssize_t j = 0; j < n; j++) wp[j] = MASK(t, pos[j])[w];
        PyList_SET_ITEM(words, w, wb);
    }
    PyMem_Free(pos);
    return Py_BuildValue("(NN)", kb, words);
fail:
    PyMem_Free(pos);
    Py_XDECREF(kb);
    Py_XDECREF(words);
    return NULL;
}

/* keys() -> list of keys (LRU order with tracking). */
static PyObject *KeyTable_keys(KeyTable *t, PyObject *unused) {
    Py_ssize_t *pos = (Py_ssize_t *)PyMem_Malloc((size_t)(t->used + 1) * sizeof(Py_ssize_t));
    if (!pos) return PyErr_NoMemory();
    Py_ssize_t n = ordered_positions(t, pos);
    PyObject *out = PyList_New(n);
    if (!out) {
        PyMem_Free(pos);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *k = PyLong_FromUnsignedLongLong(KEY(t, pos[j]));
        if (!k) {
            PyMem_Free(pos);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, k);
    }
    PyMem_Free(pos);
    return out;
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
        Py_ssize_t W = nw > 0 ? nw : 1, cap = 8;
        while (n * 4 > cap * 3) cap *= 2;
        uint64_t *live = (uint64_t *)PyMem_Calloc((size_t)W, 8);
        uint64_t *scratch = (uint64_t *)PyMem_Calloc((size_t)(2 * W), 8);
        int64_t *counts = (int64_t *)PyMem_Calloc((size_t)(64 * W), 8);
        if (!live || !scratch || !counts) {
            PyMem_Free(live);
            PyMem_Free(scratch);
            PyMem_Free(counts);
            PyErr_NoMemory();
            goto done;
        }
        PyMem_Free(t->ent);
        PyMem_Free(t->stamps);
        t->ent = t->stamps = NULL;
        if (alloc_arrays(t, cap, W) < 0) {
            PyMem_Free(live);
            PyMem_Free(scratch);
            PyMem_Free(counts);
            alloc_arrays(t, 8, 1);
            goto done;
        }
        PyMem_Free(t->live);
        PyMem_Free(t->scratch);
        PyMem_Free(t->counts);
        t->live = live;
        t->scratch = scratch;
        t->counts = counts;
        t->used = 0;
        t->pairs = 0;
        t->log_len = t->log_head = 0;
        t->log_base = 0;
        const uint64_t *kp = (const uint64_t *)kv.buf;
        for (Py_ssize_t j = 0; j < n; j++) {
            int nz = 0;
            for (Py_ssize_t w = 0; w < nw; w++) nz |= ((const uint64_t *)wv[w].buf)[j] != 0;
            if (!nz) continue;
            int is_new;
            Py_ssize_t i = find_or_slot(t, kp[j], &is_new);
            if (is_new) t->used++;
            for (Py_ssize_t w = 0; w < nw; w++) {
                uint64_t x = ((const uint64_t *)wv[w].buf)[j];
                MASK(t, i)[w] = x;
                while (x) {
                    int b = __builtin_ctzll(x);
                    x &= x - 1;
                    t->counts[w * 64 + b]++;
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

static PyObject *KeyTable_count(KeyTable *t, PyObject *slot_o) {
    Py_ssize_t s = parse_slot(t, slot_o);
    if (s < 0) return NULL;
    return PyLong_FromLongLong(t->counts[s]);
}

static PyObject *KeyTable_get_pairs(KeyTable *t, void *c) { return PyLong_FromLongLong(t->pairs); }
static PyObject *KeyTable_get_nbytes(KeyTable *t, void *c) {
    size_t per = 8 + (size_t)t->W * 8 + (t->track ? 8 : 0);
    return PyLong_FromSize_t((size_t)t->cap * per + (size_t)t->log_cap * 8);
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
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "keys() -> list"},
    {"load", (PyCFunction)KeyTable_load, METH_VARARGS, "load(keys, words)"},
    {"count", (PyCFunction)KeyTable_count, METH_O, "count(slot) -> pairs of the slot"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeyTable_getset[] = {
    {"pairs", (getter)KeyTable_get_pairs, NULL, "live (worker, key) pairs", NULL},
    {"nbytes", (getter)KeyTable_get_nbytes, NULL, "bytes held by the arrays", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_length = (lenfunc)KeyTable_len,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "services.core._cindex.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "uint64 key -> worker-slot bitmask table with per-slot counts and optional LRU",
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
