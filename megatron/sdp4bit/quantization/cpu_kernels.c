/* Fused CPU kernels of SDP4Bit's quantized collectives (C11, no dependencies).
 *
 * One function per operation of reference.py, with the same arguments and the same bytes:
 * every arithmetic step is the reference's, in the reference's order, in IEEE fp32, so the
 * results are bit-identical (cpu_kernels.py builds this file with -ffp-contract=off and
 * without -ffast-math: no fused multiply-add, no reassociation, IEEE division).
 *
 * Each operation makes one pass over memory: a quantization group (at most a few thousand
 * values) is assembled in a small fp32 scratch buffer that stays in the L1/L2 cache, is
 * transformed, quantized or summed there, and written out. Single-threaded: the ranks of a
 * node share its cores, one process each.
 *
 * Wire format of a message of `numel` values in groups of `G` at `bits` bits (format.py):
 *     [fp32 scales x numel/G][payload: numel*bits/8 bytes]
 * codes are offset binary (q + 2^(bits-1)); packed from the least significant bits up:
 * 4-bit codes two per byte, even element in the low nibble; 2-bit codes four per byte,
 * element 4i+k in bits 2k..2k+1 of byte i.
 *
 * Element types of float buffers: 0 = float32, 1 = bfloat16, 2 = float16. bfloat16 and float16
 * are converted by integer operations on their bits, not by a compiler's half-precision type:
 * C11 has none, and GCC before 12 offers none on x86.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ABI_VERSION 2

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

int sdp4bit_abi_version(void) { return ABI_VERSION; }

/* ------------------------------------------------------------------ element conversion */

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* The float of IEEE half h (exact: every half is an fp32). A NaN keeps its sign and payload
 * and comes out quiet, as the x86 F16C and ARM conversion instructions (torch's vectorized
 * path) make it. Every case is computed and one is selected, so the loops vectorize. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    /* normal: rebias the exponent from 15 to 127 (112 = 127 - 15), widen the mantissa */
    const uint32_t normal = sign | (((uint32_t)(h & 0x7FFFu) << 13) + (112u << 23));
    /* zero or subnormal: man * 2^-24, an fp32 normal (or zero) computed exactly */
    const uint32_t small = sign | f32_to_bits((float)man * 0x1p-24f);
    /* Inf, or NaN with the quiet bit set */
    const uint32_t special = sign | 0x7F800000u | (man << 13) | (man ? 0x00400000u : 0u);
    return bits_to_f32(exp == 0x1Fu ? special : (exp == 0 ? small : normal));
}

/* All ones when c holds, else zero. */
static inline uint32_t mask_if(int c) { return 0u - (uint32_t)c; }

/* fp32 x rounded to the nearest IEEE half, ties to even (IEEE's and torch's rule): values from
 * 65520 up become Inf, values up to 2^-25 become zero, both keeping the sign. A NaN keeps its
 * sign and the top bits of its payload and comes out quiet (as F16C and ARM make it). Every
 * case is computed and one kept by masks: GCC turns a chain of ?: here into branches, and
 * the loop would not vectorize. */
static inline uint16_t f32_to_f16(float x) {
    const uint32_t u = f32_to_bits(x);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    /* normal half (|x| >= 2^-14): round the 23-bit mantissa to 10 bits at bit 13 (a carry
     * into the exponent is the correct result), then rebias the exponent from 127 to 15 */
    const uint32_t normal = ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
    /* subnormal half: |x| / 2^-24 = m * 2^(e - 126) with m the 24-bit significand; shift
     * right by 126 - e (14 to 24 for 2^-25 <= |x| < 2^-14) and round the dropped bits to
     * nearest even (1024, from the largest subnormals, is the smallest normal: correct);
     * below 2^-25 (e < 102) the result is zero */
    const uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t sh = 126u - (e < 102u ? 102u : (e > 112u ? 112u : e)); /* in [14, 24] */
    const uint32_t q = m >> sh, rest = m & ((1u << sh) - 1u), half = 1u << (sh - 1u);
    const uint32_t up = (uint32_t)(rest > half) | ((uint32_t)(rest == half) & q);
    const uint32_t small = (q + up) & mask_if(e >= 102u);
    const uint32_t nan = 0x7E00u | ((a >> 13) & 0x1FFu);
    const uint32_t is_nan = mask_if(a > 0x7F800000u);
    const uint32_t is_inf = mask_if(a >= 0x477FF000u) & ~is_nan; /* 65520 and up, Inf too */
    const uint32_t is_normal = mask_if(a >= 0x38800000u) & ~(is_nan | is_inf);
    const uint32_t is_small = ~(is_nan | is_inf | is_normal);
    return (uint16_t)(sign | (nan & is_nan) | (0x7C00u & is_inf) | (normal & is_normal) |
                      (small & is_small));
}

/* dst[i] = float(src[off + i]) for i < n (exact for every source type). */
static void load_f32(float *restrict dst, const void *src, int dt, int64_t off, int64_t n) {
    if (dt == DT_F32) {
        memcpy(dst, (const float *)src + off, (size_t)n * 4);
    } else if (dt == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = bits_to_f32((uint32_t)s[i] << 16);
    } else {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(s[i]);
    }
}

/* dst[off + i] = src[i] rounded to nearest even, as torch's copy_ rounds (bf16: torch's rule,
 * NaN -> 0x7FC0; fp16: f32_to_f16). */
static void store_f32(void *dst, int dt, int64_t off, const float *restrict src, int64_t n) {
    if (dt == DT_F32) {
        memcpy((float *)dst + off, src, (size_t)n * 4);
    } else if (dt == DT_BF16) {
        uint16_t *d = (uint16_t *)dst + off;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = f32_to_bits(src[i]);
            uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
            d[i] = (uint16_t)(src[i] != src[i] ? 0x7FC0u : r);
        }
    } else {
        uint16_t *d = (uint16_t *)dst + off;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_f16(src[i]);
    }
}

/* ---------------------------------------------------------------------- random stream */

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

/* The hash word of element pair p (elements 2p and 2p+1) of stream (k0, k1) (rng.py). */
static inline uint32_t pair_word(uint32_t p, uint32_t k0, uint32_t k1) {
    return mix32(mix32(p ^ k0) ^ k1);
}

/* The uniform (2m + 1) * 2^-17 of a 16-bit half m of a pair word (exact in fp32). */
static inline float half_uniform(uint32_t m) { return (float)(2u * m + 1u) * 0x1p-17f; }

/* ----------------------------------------------------------------------- quantization */

/* The code of value v: clamp(floor(v * inv + u), -qm, qm) + qm + 1. */
static inline uint8_t code_of(float v, float inv, float u, int qm) {
    /* floor(...) is a small integer (|v * inv| <= qm + rounding): clamping it as an int32
     * is exact */
    int32_t q = (int32_t)floorf(v * inv + u);
    q = q < -qm ? -qm : (q > qm ? qm : q);
    return (uint8_t)(q + qm + 1);
}

/* The codes of x[2j] and x[2j+1], the pair whose stream index is idx0 + 2j (idx0 even):
 * stochastic, the low and high halves of the pair's word; else u = 0.5. */
#define PAIR_CODES(j, C0, C1)                                                              \
    uint8_t C0, C1;                                                                        \
    do {                                                                                   \
        float u0_ = 0.5f, u1_ = 0.5f;                                                      \
        if (stochastic) {                                                                  \
            const uint32_t w_ = pair_word((idx0 >> 1) + (uint32_t)(j), k0, k1);            \
            u0_ = half_uniform(w_ & 0xFFFFu);                                              \
            u1_ = half_uniform(w_ >> 16);                                                  \
        }                                                                                  \
        C0 = code_of(x[2 * (j)], inv, u0_, qm);                                            \
        C1 = code_of(x[2 * (j) + 1], inv, u1_, qm);                                        \
    } while (0)

/* Quantize the G values of x (G even) into the packed codes at dst and return the group's
 * scale, by the rules of reference.quantize_groups. `idx0` (even) is the random-stream index
 * of x[0]. */
static float quantize_group(const float *restrict x, int64_t G, uint8_t *restrict dst,
                            int bits, int stochastic, uint32_t k0, uint32_t k1,
                            uint32_t idx0) {
    const int qm = (1 << (bits - 1)) - 1;
    const float fqm = (float)qm;
    /* absmax on the bit patterns: with the sign cleared, IEEE order is integer order, and
     * NaN and Inf are the patterns >= 0x7F800000 (an integer max vectorizes; a float max
     * does not, for its NaN semantics). */
    uint32_t m = 0;
    for (int64_t i = 0; i < G; i++) {
        uint32_t b = f32_to_bits(x[i]) & 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    const float scale = m >= 0x7F800000u ? NAN : bits_to_f32(m) / fqm;
    if (!(scale > 0.0f)) { /* zeros, or NaN/Inf in the group: every code is q = 0 */
        uint8_t zero = (uint8_t)(qm + 1);
        for (int64_t k = bits; k < 8; k += bits) zero |= (uint8_t)((qm + 1) << k);
        memset(dst, zero, (size_t)(G * bits / 8));
        return scale;
    }
    const float inv = 1.0f / scale; /* once per group: x * inv, as every backend computes */
    /* one loop per rounding mode and width: each vectorizes without a branch inside */
#define PACK_LOOPS(STOCH)                                                                  \
    do {                                                                                   \
        const int stochastic = (STOCH);                                                    \
        if (bits == 2) {                                                                   \
            for (int64_t j = 0; j < G / 4; j++) {                                          \
                PAIR_CODES(2 * j, c0, c1);                                                 \
                PAIR_CODES(2 * j + 1, c2, c3);                                             \
                dst[j] = c0 | (uint8_t)(c1 << 2) | (uint8_t)(c2 << 4) | (uint8_t)(c3 << 6); \
            }                                                                              \
        } else if (bits == 8) {                                                            \
            for (int64_t j = 0; j < G / 2; j++) {                                          \
                PAIR_CODES(j, c0, c1);                                                     \
                dst[2 * j] = c0;                                                           \
                dst[2 * j + 1] = c1;                                                       \
            }                                                                              \
        } else {                                                                           \
            for (int64_t j = 0; j < G / 2; j++) {                                          \
                PAIR_CODES(j, c0, c1);                                                     \
                dst[j] = c0 | (uint8_t)(c1 << 4);                                          \
            }                                                                              \
        }                                                                                  \
    } while (0)
    if (stochastic)
        PACK_LOOPS(1);
    else
        PACK_LOOPS(0);
#undef PACK_LOOPS
    return scale;
}

/* How dequantize_into combines a value v with acc: acc = v, acc = 0 + v (a sum starting
 * from +0, as torch's sum does), acc = acc + v. */
enum { SET = 0, SET_FROM_ZERO = 1, ADD = 2 };

#define DEQUANTIZE_LOOP(EXPR)                                                              \
    do {                                                                                   \
        if (bits == 8) {                                                                   \
            const uint8_t *p = payload + e;                                                \
            for (int64_t j = 0; j < run; j++) {                                            \
                const float v = ((float)p[j] - off) * s;                                   \
                a[j] = EXPR;                                                               \
            }                                                                              \
        } else if (bits == 2) {                                                            \
            const uint8_t *p = payload + e / 4;                                            \
            for (int64_t jj = 0; jj < run / 4; jj++) {                                     \
                for (int64_t k = 0; k < 4; k++) {                                          \
                    const int64_t j = 4 * jj + k;                                          \
                    const float v = ((float)((p[jj] >> (2 * k)) & 0x03) - off) * s;        \
                    a[j] = EXPR;                                                           \
                }                                                                          \
            }                                                                              \
        } else {                                                                           \
            const uint8_t *p = payload + e / 2;                                            \
            for (int64_t jj = 0; jj < run / 2; jj++) {                                     \
                int64_t j = 2 * jj;                                                        \
                float v = ((float)(p[jj] & 0x0F) - off) * s;                               \
                a[j] = EXPR;                                                               \
                j += 1;                                                                    \
                v = ((float)(p[jj] >> 4) - off) * s;                                       \
                a[j] = EXPR;                                                               \
            }                                                                              \
        }                                                                                  \
    } while (0)

/* acc (mode)= fp32 values of elements [e0, e0 + n) of one message whose groups are `G`
 * long: (code - offset) * scale. `scales`/`payload` are the message's; e0 and n are whole
 * bytes of codes (even at 4 bits, multiples of 4 at 2 bits). */
static void dequantize_into(float *restrict acc, const float *scales, const uint8_t *payload,
                            int64_t e0, int64_t n, int64_t G, int bits, int mode) {
    const float off = (float)(1 << (bits - 1));
    int64_t i = 0;
    while (i < n) {
        const int64_t e = e0 + i;
        const int64_t g = e / G;
        int64_t run = (g + 1) * G - e; /* elements left in this group */
        if (run > n - i) run = n - i;
        const float s = scales[g];
        float *restrict a = acc + i;
        if (mode == SET)
            DEQUANTIZE_LOOP(v);
        else if (mode == SET_FROM_ZERO)
            DEQUANTIZE_LOOP(0.0f + v);
        else
            DEQUANTIZE_LOOP(a[j] + v);
        i += run;
    }
}

/* acc = sum over `count` messages, in message order from +0, of the fp32 values of
 * elements [e0, e0 + n). */
static void dequantize_sum(float *restrict acc, const uint8_t *wire, int64_t count,
                           int64_t msg_nbytes, int64_t numel, int64_t e0, int64_t n,
                           int64_t G, int bits) {
    const int64_t ngroups = numel / G;
    for (int64_t k = 0; k < count; k++) {
        const uint8_t *msg = wire + k * msg_nbytes;
        dequantize_into(acc, (const float *)msg, msg + 4 * ngroups, e0, n, G, bits,
                        k == 0 ? SET_FROM_ZERO : ADD);
    }
}

/* ----------------------------------------------------------------------------- Hadamard */

/* 8-lane vectors (GCC/Clang vector extensions: AVX, SSE or NEON code as the target has). */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#if defined(__clang__)
#define SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* The butterflies of half-width 1, 2 and 4 inside one vector of 8 values: lanes of the
 * lower half of each pair run get a + c, the upper half a - c (a lower, c upper). */
static inline v8f butterflies8(v8f v) {
    v8f p = SHUFFLE2(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    v = SHUFFLE2(v + p, p - v, 0, 9, 2, 11, 4, 13, 6, 15);
    p = SHUFFLE2(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v = SHUFFLE2(v + p, p - v, 0, 1, 10, 11, 4, 5, 14, 15);
    p = SHUFFLE2(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    return SHUFFLE2(v + p, p - v, 0, 1, 2, 3, 12, 13, 14, 15);
}

/* Orthonormal block Walsh-Hadamard transform (Sylvester order) of every block of HB values
 * of x[0..n): butterflies of half-width 1, 2, .., HB/2 ((a, c) -> (a + c, a - c)), then a
 * multiplication by `hscale` = fp32(1/sqrt(HB)): the order of hadamard.py. */
static void hadamard(float *restrict x, int64_t n, int64_t HB, float hscale) {
    if (HB < 8) { /* scalar: tiny blocks only */
        for (int64_t h = 1; h < HB; h <<= 1) {
            for (int64_t b = 0; b < n; b += 2 * h) {
                for (int64_t j = b; j < b + h; j++) {
                    float a = x[j], c = x[j + h];
                    x[j] = a + c;
                    x[j + h] = a - c;
                }
            }
        }
        for (int64_t i = 0; i < n; i++) x[i] = x[i] * hscale;
        return;
    }
    const v8f scale = {hscale, hscale, hscale, hscale, hscale, hscale, hscale, hscale};
    if (HB == 32) { /* the default block: every stage in registers, one pass */
        for (int64_t i = 0; i < n; i += 32) {
            v8f r0 = butterflies8(load8(x + i)), r1 = butterflies8(load8(x + i + 8));
            v8f r2 = butterflies8(load8(x + i + 16)), r3 = butterflies8(load8(x + i + 24));
            v8f t0 = r0 + r1, t1 = r0 - r1, t2 = r2 + r3, t3 = r2 - r3; /* half-width 8 */
            store8(x + i, (t0 + t2) * scale);                             /* half-width 16 */
            store8(x + i + 8, (t1 + t3) * scale);
            store8(x + i + 16, (t0 - t2) * scale);
            store8(x + i + 24, (t1 - t3) * scale);
        }
        return;
    }
    for (int64_t i = 0; i < n; i += 8) { /* half-widths 1, 2, 4 in registers */
        v8f v = butterflies8(load8(x + i));
        store8(x + i, HB == 8 ? v * scale : v);
    }
    for (int64_t h = 8; h < HB; h <<= 1) { /* then whole vectors; the last stage scales */
        const int last = 2 * h == HB;
        for (int64_t b = 0; b < n; b += 2 * h) {
            for (int64_t j = b; j < b + h; j += 8) {
                const v8f a = load8(x + j), c = load8(x + j + h);
                store8(x + j, last ? (a + c) * scale : a + c);
                store8(x + j + h, last ? (a - c) * scale : a - c);
            }
        }
    }
}

/* ---------------------------------------------------------------------------- scratch */

typedef struct {
    float *a, *b;
} scratch_t;

static int scratch_alloc(scratch_t *s, int64_t n) {
    s->a = (float *)malloc((size_t)n * 4);
    s->b = (float *)malloc((size_t)n * 4);
    return s->a && s->b ? 0 : -1;
}

static void scratch_free(scratch_t *s) {
    free(s->a);
    free(s->b);
}

/* Bytes of one message of `numel` values in groups of `G` at `bits` bits (format.py). */
static inline int64_t message_bytes(int64_t numel, int64_t G, int bits) {
    return 4 * (numel / G) + numel * bits / 8;
}

/* ------------------------------------------------------------------------- operations */

/* convert: dst = src converted element by element (load_f32, then store_f32), the element
 * conversions every operation uses, callable alone so the tests can check them over every
 * half-precision bit pattern. */
int sdp4bit_convert(const void *src, int src_dt, void *dst, int dst_dt, int64_t n) {
    float buf[1024];
    for (int64_t i = 0; i < n; i += 1024) {
        const int64_t run = n - i < 1024 ? n - i : 1024;
        load_f32(buf, src, src_dt, i, run);
        store_f32(dst, dst_dt, i, buf, run);
    }
    return 0;
}

/* qwd_sender: one message of Q(main - replica) (Q(main) when replica is NULL). */
int sdp4bit_qwd_sender(const void *main, int main_dt, const void *replica, int replica_dt,
                       uint8_t *out, int64_t numel, int64_t G, int bits, int stochastic,
                       uint32_t k0, uint32_t k1) {
    scratch_t s;
    if (scratch_alloc(&s, G)) return -1;
    const int64_t ngroups = numel / G;
    float *scales = (float *)out;
    uint8_t *payload = out + 4 * ngroups;
    for (int64_t g = 0; g < ngroups; g++) {
        load_f32(s.a, main, main_dt, g * G, G);
        if (replica) {
            load_f32(s.b, replica, replica_dt, g * G, G);
            for (int64_t i = 0; i < G; i++) s.a[i] = s.a[i] - s.b[i];
        }
        scales[g] = quantize_group(s.a, G, payload + g * G * bits / 8, bits, stochastic, k0, k1,
                                   (uint32_t)(g * G));
    }
    scratch_free(&s);
    return 0;
}

/* qwd_receiver: replica[s] (+)= D(message s) for the `world` shards of `shard` values. */
int sdp4bit_qwd_receiver(const uint8_t *wire, void *replica, int replica_dt, int64_t world,
                         int64_t shard, int64_t G, int bits, int accumulate) {
    scratch_t s;
    if (scratch_alloc(&s, G)) return -1;
    const int64_t groups = shard / G;
    const int64_t nbytes = message_bytes(shard, G, bits);
    for (int64_t r = 0; r < world; r++) {
        const uint8_t *msg = wire + r * nbytes;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t off = r * shard + g * G;
            dequantize_into(s.a, (const float *)msg, msg + 4 * groups, g * G, G, G, bits, SET);
            if (accumulate) {
                load_f32(s.b, replica, replica_dt, off, G);
                for (int64_t i = 0; i < G; i++) s.a[i] = s.b[i] + s.a[i];
            }
            store_f32(replica, replica_dt, off, s.a, G);
        }
    }
    scratch_free(&s);
    return 0;
}

/* tlq_sender: input viewed as [blocks_per_dest, num_dests, slices, chunk]; message
 * (p, d) = slice-major, then destination, holds inp[b, d, p, :] for every b; each element
 * Hadamard-transformed first when HB > 0 (chunk is a multiple of HB). */
int sdp4bit_tlq_sender(const void *inp, int dt, uint8_t *out, int64_t num_dests,
                       int64_t blocks_per_dest, int64_t slices, int64_t chunk, int64_t G,
                       int bits, int64_t HB, float hscale, int stochastic, uint32_t k0,
                       uint32_t k1) {
    scratch_t s;
    if (scratch_alloc(&s, G)) return -1;
    const int64_t msg_numel = blocks_per_dest * chunk;
    const int64_t groups = msg_numel / G;
    const int64_t nbytes = message_bytes(msg_numel, G, bits);
    const int64_t count = slices * num_dests;
    for (int64_t m = 0; m < count; m++) {
        const int64_t p = m / num_dests, d = m - p * num_dests;
        uint8_t *msg = out + m * nbytes;
        float *scales = (float *)msg;
        uint8_t *payload = msg + 4 * groups;
        for (int64_t g = 0; g < groups; g++) {
            /* gather the group's elements, chunk run by chunk run */
            int64_t r = g * G, filled = 0;
            while (filled < G) {
                const int64_t b = r / chunk, j = r - b * chunk;
                int64_t run = chunk - j;
                if (run > G - filled) run = G - filled;
                const int64_t src = ((b * num_dests + d) * slices + p) * chunk + j;
                load_f32(s.a + filled, inp, dt, src, run);
                filled += run;
                r += run;
            }
            if (HB > 0) hadamard(s.a, G, HB, hscale);
            scales[g] = quantize_group(s.a, G, payload + g * G * bits / 8, bits, stochastic, k0,
                                       k1, (uint32_t)(m * msg_numel + g * G));
        }
    }
    scratch_free(&s);
    return 0;
}

/* tlq_middle: sum the n_in messages of `numel` values, requantize as n_out messages. */
int sdp4bit_tlq_middle(const uint8_t *wire_in, uint8_t *out, int64_t n_in, int64_t numel,
                       int bits_in, int64_t G_in, int64_t n_out, int bits_out, int64_t G_out,
                       int stochastic, uint32_t k0, uint32_t k1) {
    scratch_t s;
    if (scratch_alloc(&s, G_out)) return -1;
    const int64_t in_nbytes = message_bytes(numel, G_in, bits_in);
    const int64_t out_numel = numel / n_out;
    const int64_t groups = out_numel / G_out;
    const int64_t out_nbytes = message_bytes(out_numel, G_out, bits_out);
    for (int64_t m = 0; m < n_out; m++) {
        uint8_t *msg = out + m * out_nbytes;
        float *scales = (float *)msg;
        uint8_t *payload = msg + 4 * groups;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t e0 = m * out_numel + g * G_out;
            dequantize_sum(s.a, wire_in, n_in, in_nbytes, numel, e0, G_out, G_in, bits_in);
            scales[g] = quantize_group(s.a, G_out, payload + g * G_out * bits_out / 8, bits_out,
                                       stochastic, k0, k1, (uint32_t)e0);
        }
    }
    scratch_free(&s);
    return 0;
}

/* tlq_receiver: out (+)= scale * H^-1(sum of the n_in messages of `numel` values). */
int sdp4bit_tlq_receiver(const uint8_t *wire_in, void *out, int out_dt, int64_t n_in,
                         int64_t numel, int64_t G, int bits, int64_t HB, float hscale,
                         float scale, int apply_scale, int accumulate) {
    scratch_t s;
    if (scratch_alloc(&s, G)) return -1;
    const int64_t nbytes = message_bytes(numel, G, bits);
    for (int64_t e0 = 0; e0 < numel; e0 += G) {
        dequantize_sum(s.a, wire_in, n_in, nbytes, numel, e0, G, G, bits);
        if (HB > 0) hadamard(s.a, G, HB, hscale);
        if (apply_scale)
            for (int64_t i = 0; i < G; i++) s.a[i] = s.a[i] * scale;
        if (accumulate) {
            load_f32(s.b, out, out_dt, e0, G);
            for (int64_t i = 0; i < G; i++) s.a[i] = s.b[i] + s.a[i];
        }
        store_f32(out, out_dt, e0, s.a, G);
    }
    scratch_free(&s);
    return 0;
}
