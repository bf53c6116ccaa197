/*
 * accsum: the optional Redis module of redis-accumulator. It keeps a round's running sum
 * inside Redis: ACC.ADD adds one chunk of a gradient into the sum's chunk in place.
 *
 *   ACC.ADD <dst> <src> <dtype>   dst[i] += src[i] for every element; both keys strings of
 *                                 the same length, a whole number of elements. Replies the
 *                                 number of elements added. Replicated (and written to
 *                                 the AOF) as its effect, SETRANGE <dst> 0 <its new bytes>:
 *                                 replicas and an AOF replay need no module.
 *   ACC.PING                      replies "accsum <version> kernels=<base|avx2|avx512f>"
 *                                 (the scripts' probe; the float kernels in use).
 *
 * Load arguments: none, or "kernels best" (the default: the fastest float kernels the CPU
 * runs, AVX-512 or AVX2 on x86-64) or "kernels base" (the plain SSE2 ones).
 *
 * dtype: f32, f64 (IEEE, round to nearest, with TensorFlow's CPU flush-to-zero: a subnormal
 * operand counts as a signed zero and a subnormal result becomes one), i8, i16, i32, i64,
 * u8, u16, u32, u64 (two's complement, wrapping like C unsigned arithmetic).
 * Values are little-endian, as the library writes them.
 *
 * The library calls ACC.ADD only from its Lua scripts, after they checked everything, so that
 * an apply is all-or-nothing. The command itself trusts nothing either: every argument count,
 * key type, length and dtype is checked before a byte is written, and it never reads or
 * writes outside the two values.
 *
 * Built by accumulator/_module.py (cc -O3 -shared -fPIC: -O3 vectorizes the float kernels,
 * and AVX2/AVX-512 instances are built beside the SSE2 ones; no -march: the build may run on
 * another CPU, a Docker image's on many); no Redis header is needed: the few
 * declarations of the module API used here are written below.
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define ACCSUM_VERSION 1

/* ---- the part of the Redis module API this module uses (API version 1) ---------------- */

#define RM_OK 0
#define RM_ERR 1
#define RM_APIVER_1 1
#define RM_READ (1 << 0)
#define RM_WRITE (1 << 1)
#define RM_KEYTYPE_EMPTY 0
#define RM_KEYTYPE_STRING 1

typedef struct RedisModuleCtx RedisModuleCtx;
typedef struct RedisModuleKey RedisModuleKey;
typedef struct RedisModuleString RedisModuleString;
typedef int (*RedisModuleCmdFunc)(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
typedef int (*GetApiFunc)(const char *name, void *out);

static void (*RM_SetModuleAttribs)(RedisModuleCtx *ctx, const char *name, int ver, int apiver);
static int (*RM_IsModuleNameBusy)(const char *name);
static int (*RM_CreateCommand)(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc func,
                               const char *flags, int firstkey, int lastkey, int keystep);
static void *(*RM_OpenKey)(RedisModuleCtx *ctx, RedisModuleString *name, int mode);
static void (*RM_CloseKey)(RedisModuleKey *key);
static int (*RM_KeyType)(RedisModuleKey *key);
static char *(*RM_StringDMA)(RedisModuleKey *key, size_t *len, int mode);
static const char *(*RM_StringPtrLen)(const RedisModuleString *str, size_t *len);
static int (*RM_WrongArity)(RedisModuleCtx *ctx);
static int (*RM_ReplyWithError)(RedisModuleCtx *ctx, const char *err);
static int (*RM_ReplyWithLongLong)(RedisModuleCtx *ctx, long long value);
static int (*RM_ReplyWithSimpleString)(RedisModuleCtx *ctx, const char *msg);
static int (*RM_Replicate)(RedisModuleCtx *ctx, const char *cmdname, const char *fmt, ...);

/* Redis passes the API lookup function as the first field of the load context. */
static int resolve_api(RedisModuleCtx *ctx) {
    GetApiFunc get_api;
    void *first;
    memcpy(&first, (void *)ctx, sizeof first);
    get_api = (GetApiFunc)(uintptr_t)first;
    if (get_api == NULL) return RM_ERR;
#define NEED(field, name) \
    if (get_api("RedisModule_" name, (void *)&field) != RM_OK || field == NULL) return RM_ERR
    NEED(RM_SetModuleAttribs, "SetModuleAttribs");
    NEED(RM_CreateCommand, "CreateCommand");
    NEED(RM_OpenKey, "OpenKey");
    NEED(RM_CloseKey, "CloseKey");
    NEED(RM_KeyType, "KeyType");
    NEED(RM_StringDMA, "StringDMA");
    NEED(RM_StringPtrLen, "StringPtrLen");
    NEED(RM_WrongArity, "WrongArity");
    NEED(RM_ReplyWithError, "ReplyWithError");
    NEED(RM_ReplyWithLongLong, "ReplyWithLongLong");
    NEED(RM_ReplyWithSimpleString, "ReplyWithSimpleString");
    NEED(RM_Replicate, "Replicate");
#undef NEED
    if (get_api("RedisModule_IsModuleNameBusy", (void *)&RM_IsModuleNameBusy) != RM_OK)
        RM_IsModuleNameBusy = NULL; /* older servers */
    return RM_OK;
}

/* ---- element kernels ------------------------------------------------------------------ */

/* Every load and store goes through memcpy: Redis strings carry no alignment promise.
 *
 * NAN_RULE: of two NaNs, the sum's (dst: the earlier gradients') comes out, quieted, as from
 * TF's accum + grad on x86, whose add keeps its first operand's. C's + leaves the order to
 * the compiler (gcc -O3 swapped it for f64), so dst's NaN is chosen by its bits. */

/* The float kernels' bodies, instantiated below once for any x86-64 (SSE2) and, where the
 * compiler can, for AVX2 and AVX-512: the CPU's best is chosen at load (pick_kernels). The
 * same IEEE additions and bit operations in every instance, so every one gives the same bits
 * (a 1 MiB f32 add: 144 us with SSE2, 43 with AVX2, 26 with AVX-512, on the CI's machine). */
#define ADD_F32_BODY                                                                       \
    for (size_t i = 0; i < n; i++) {                                                       \
        uint32_t a, b, r;                                                                  \
        float fa, fb, fr;                                                                  \
        memcpy(&a, dst + 4 * i, 4);                                                        \
        memcpy(&b, src + 4 * i, 4);                                                        \
        if ((a & 0x7f800000u) == 0) a &= 0x80000000u; /* subnormal operand: signed zero */ \
        if ((b & 0x7f800000u) == 0) b &= 0x80000000u;                                      \
        memcpy(&fa, &a, 4);                                                                \
        memcpy(&fb, &b, 4);                                                                \
        fr = fa + fb;                                                                      \
        memcpy(&r, &fr, 4);                                                                \
        if ((r & 0x7f800000u) == 0) r &= 0x80000000u; /* subnormal result: signed zero */  \
        if ((a & 0x7fffffffu) > 0x7f800000u) r = a | 0x00400000u; /* see NAN_RULE */      \
        memcpy(dst + 4 * i, &r, 4);                                                        \
    }

#define ADD_F64_BODY                                                                       \
    const uint64_t exp = 0x7ff0000000000000ull, sign = 0x8000000000000000ull;              \
    for (size_t i = 0; i < n; i++) {                                                       \
        uint64_t a, b, r;                                                                  \
        double fa, fb, fr;                                                                 \
        memcpy(&a, dst + 8 * i, 8);                                                        \
        memcpy(&b, src + 8 * i, 8);                                                        \
        if ((a & exp) == 0) a &= sign;                                                     \
        if ((b & exp) == 0) b &= sign;                                                     \
        memcpy(&fa, &a, 8);                                                                \
        memcpy(&fb, &b, 8);                                                                \
        fr = fa + fb;                                                                      \
        memcpy(&r, &fr, 8);                                                                \
        if ((r & exp) == 0) r &= sign;                                                     \
        if ((a & ~sign) > exp) r = a | 0x0008000000000000ull; /* see NAN_RULE */           \
        memcpy(dst + 8 * i, &r, 8);                                                        \
    }

typedef void (*Kernel)(unsigned char *dst, const unsigned char *src, size_t n);

#define FLOAT_KERNELS(suffix, attr)                                                        \
    attr static void add_f32_##suffix(unsigned char *dst, const unsigned char *src,        \
                                      size_t n) {                                          \
        ADD_F32_BODY                                                                       \
    }                                                                                      \
    attr static void add_f64_##suffix(unsigned char *dst, const unsigned char *src,        \
                                      size_t n) {                                          \
        ADD_F64_BODY                                                                       \
    }

FLOAT_KERNELS(base, )
/* (target("avx512f") needs gcc 5 or clang 4: older compilers build the base kernels only) */
#if defined(__x86_64__) && !defined(ACCSUM_NO_DISPATCH) && \
    ((defined(__clang__) && __clang_major__ >= 4) || \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 5))
#define ACCSUM_DISPATCH 1
FLOAT_KERNELS(avx2, __attribute__((target("avx2"))))
FLOAT_KERNELS(avx512, __attribute__((target("avx512f"))))
#endif

/* The instances in use, chosen at load (pick_kernels). */
static Kernel best_f32 = add_f32_base, best_f64 = add_f64_base;

static void add_f32(unsigned char *dst, const unsigned char *src, size_t n) {
    best_f32(dst, src, n);
}

static void add_f64(unsigned char *dst, const unsigned char *src, size_t n) {
    best_f64(dst, src, n);
}

/* The fastest instances this CPU runs, unless the load arguments say "kernels base"
 * (redis-server --loadmodule accsum.so kernels base). The name of the ones chosen. */
static const char *pick_kernels(int base_only) {
    best_f32 = add_f32_base;
    best_f64 = add_f64_base;
#ifdef ACCSUM_DISPATCH
    if (base_only) return "base";
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        best_f32 = add_f32_avx512;
        best_f64 = add_f64_avx512;
        return "avx512f";
    }
    if (__builtin_cpu_supports("avx2")) {
        best_f32 = add_f32_avx2;
        best_f64 = add_f64_avx2;
        return "avx2";
    }
#else
    (void)base_only;
#endif
    return "base";
}

#define WRAPPING_ADD(name, type)                                                   \
    static void name(unsigned char *dst, const unsigned char *src, size_t n) {     \
        for (size_t i = 0; i < n; i++) {                                           \
            type a, b;                                                             \
            memcpy(&a, dst + sizeof(type) * i, sizeof(type));                      \
            memcpy(&b, src + sizeof(type) * i, sizeof(type));                      \
            a = (type)(a + b);                                                     \
            memcpy(dst + sizeof(type) * i, &a, sizeof(type));                      \
        }                                                                          \
    }
WRAPPING_ADD(add_u8, uint8_t)
WRAPPING_ADD(add_u16, uint16_t)
WRAPPING_ADD(add_u32, uint32_t)
WRAPPING_ADD(add_u64, uint64_t)

static const struct {
    const char *name;
    size_t size;
    Kernel add;
} DTYPES[] = {
    {"f32", 4, add_f32}, {"f64", 8, add_f64}, {"i8", 1, add_u8},   {"u8", 1, add_u8},
    {"i16", 2, add_u16}, {"u16", 2, add_u16}, {"i32", 4, add_u32}, {"u32", 4, add_u32},
    {"i64", 8, add_u64}, {"u64", 8, add_u64},
};

/* Little-endian hosts only: the integer and float kernels read the wire bytes natively. */
static int little_endian(void) {
    const uint16_t one = 1;
    unsigned char first;
    memcpy(&first, &one, 1);
    return first == 1;
}

/* ---- commands -------------------------------------------------------------------------- */

static int acc_add(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    size_t dlen = 0, slen = 0, tlen = 0, nlen1 = 0, nlen2 = 0;
    const char *tname, *n1, *n2;
    Kernel add = NULL;
    size_t size = 0;
    RedisModuleKey *dkey, *skey;
    unsigned char *dst;
    const unsigned char *src;

    if (argc != 4) return RM_WrongArity(ctx);
    tname = RM_StringPtrLen(argv[3], &tlen);
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++) {
        if (strlen(DTYPES[i].name) == tlen && memcmp(DTYPES[i].name, tname, tlen) == 0) {
            add = DTYPES[i].add;
            size = DTYPES[i].size;
            break;
        }
    }
    if (add == NULL)
        return RM_ReplyWithError(ctx, "ERR ACC.ADD: unknown dtype (f32 f64 i8 u8 i16 u16 i32 u32 "
                                      "i64 u64)");
    n1 = RM_StringPtrLen(argv[1], &nlen1);
    n2 = RM_StringPtrLen(argv[2], &nlen2);
    if (nlen1 == nlen2 && memcmp(n1, n2, nlen1) == 0)
        return RM_ReplyWithError(ctx, "ERR ACC.ADD: dst and src are the same key");

    skey = RM_OpenKey(ctx, argv[2], RM_READ);
    if (skey == NULL || RM_KeyType(skey) != RM_KEYTYPE_STRING) {
        int empty = skey == NULL || RM_KeyType(skey) == RM_KEYTYPE_EMPTY;
        if (skey) RM_CloseKey(skey);
        return RM_ReplyWithError(ctx, empty ? "ERR ACC.ADD: src does not exist"
                                            : "WRONGTYPE ACC.ADD: src is not a string");
    }
    dkey = RM_OpenKey(ctx, argv[1], RM_READ | RM_WRITE);
    if (dkey == NULL || RM_KeyType(dkey) != RM_KEYTYPE_STRING) {
        int empty = dkey == NULL || RM_KeyType(dkey) == RM_KEYTYPE_EMPTY;
        if (dkey) RM_CloseKey(dkey);
        RM_CloseKey(skey);
        return RM_ReplyWithError(ctx, empty ? "ERR ACC.ADD: dst does not exist"
                                            : "WRONGTYPE ACC.ADD: dst is not a string");
    }
    /* lengths first (read-only access: nothing is converted or written yet) */
    src = (const unsigned char *)RM_StringDMA(skey, &slen, RM_READ);
    RM_StringDMA(dkey, &dlen, RM_READ);
    if (src == NULL || dlen != slen || dlen % size != 0) {
        RM_CloseKey(dkey);
        RM_CloseKey(skey);
        return RM_ReplyWithError(ctx, "ERR ACC.ADD: lengths differ or are not whole elements");
    }
    dst = (unsigned char *)RM_StringDMA(dkey, &dlen, RM_WRITE);
    /* a write DMA may move dst (unsharing it); src is another key, so it stays put */
    if (dst == NULL || dlen != slen) {
        RM_CloseKey(dkey);
        RM_CloseKey(skey);
        return RM_ReplyWithError(ctx, "ERR ACC.ADD: dst is not writable");
    }
    add(dst, src, dlen / size);
    /* The effect, not the command: replicas and the AOF get the sum's bytes (SETRANGE keeps
     * the key's expiry), so neither needs this module. */
    RM_Replicate(ctx, "SETRANGE", "slb", argv[1], 0LL, (const char *)dst, dlen);
    RM_CloseKey(dkey);
    RM_CloseKey(skey);
    return RM_ReplyWithLongLong(ctx, (long long)(dlen / size));
}

/* ACC.PING's reply: "accsum <version> kernels=<the float kernels chosen at load>". */
#define PING_PREFIX "accsum 1 kernels="
static char ping_reply[64] = PING_PREFIX "base";

static int acc_ping(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1) return RM_WrongArity(ctx);
    return RM_ReplyWithSimpleString(ctx, ping_reply);
}

/* Whether a load argument is the given word. */
static int arg_is(RedisModuleString *arg, const char *word) {
    size_t len = 0;
    const char *text = RM_StringPtrLen(arg, &len);
    return text != NULL && len == strlen(word) && memcmp(text, word, len) == 0;
}

/* Load arguments: none, or "kernels base" (the SSE2 float kernels whatever the CPU: a check
 * of them, or a way around a CPU that misreports its features) or "kernels best" (the
 * default). Anything else fails the load, so that a typo is not silently ignored. */
int RedisModule_OnLoad(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    int base_only = 0;
    const char *chosen;
    if (!little_endian()) return RM_ERR;
    if (resolve_api(ctx) != RM_OK) return RM_ERR;
    if (argc == 2 && arg_is(argv[0], "kernels") &&
        (arg_is(argv[1], "base") || arg_is(argv[1], "best")))
        base_only = arg_is(argv[1], "base");
    else if (argc != 0)
        return RM_ERR;
    if (RM_IsModuleNameBusy && RM_IsModuleNameBusy("accsum")) return RM_ERR;
    chosen = pick_kernels(base_only);
    memcpy(ping_reply + strlen(PING_PREFIX), chosen, strlen(chosen) + 1);
    RM_SetModuleAttribs(ctx, "accsum", ACCSUM_VERSION, RM_APIVER_1);
    if (RM_CreateCommand(ctx, "acc.add", acc_add, "write deny-oom", 1, 2, 1) != RM_OK)
        return RM_ERR;
    if (RM_CreateCommand(ctx, "acc.ping", acc_ping, "readonly fast", 0, 0, 0) != RM_OK)
        return RM_ERR;
    return RM_OK;
}
