/* common.cl - shared helpers, prepended by the compiler to every opencl/NAME.cl.
 *
 * Only helpers live here: no kernels, no required macros, and every name is
 * prefixed loom_ / LOOM_ so kernel files stay free to use short names.
 *
 * f16 is a storage format only (PoCL on the CPU has no cl_khr_fp16): half data
 * is read through these helpers and computed in f32.
 *
 * Quantized blocks are the raw ggml layouts, addressed as bytes:
 *   Q8_0: 34 bytes = f16 scale d, 32 x int8 q;           value = d * q
 *   Q4_1: 20 bytes = f16 scale d, f16 minimum m, then Q4_0's nibbles; value q * d + m
 *   Q4_0: 18 bytes = f16 scale d, 16 bytes of nibbles;   byte j holds element j
 *         in its low nibble and element j + 16 in its high nibble; value = d * (q - 8)
 *   Q5_0 / Q5_1: Q4_0 / Q4_1 plus a fifth bit per element (32-bit qh)
 *   K-quants (Q2_K ... Q6_K): 256-element superblocks, see "K-quants" below
 * Blocks start at even byte offsets.
 *
 * Why not the builtins on CPUs: PoCL 3.0 here inlines no builtin function
 * (vloadN, vload_half, min/max, exp, sqrt...): each is a call that spills every
 * vector register, and vload_half is a scalar software conversion. On CPU
 * targets (where unaligned vector loads are cheap) the helpers below load
 * through packed structs, convert f16 with integer ops and compute exp with an
 * inline polynomial, which compile to plain vector code. Other targets (GPUs)
 * use the builtins; define LOOM_USE_BUILTINS to force them anywhere. Kernels
 * keep builtin calls (and min/max, fmax...) out of their hot loops.
 */

#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpsabi" /* float16 on AVX2-tuned targets: an ABI note, harmless */
#endif

#if !defined(LOOM_USE_BUILTINS) && !(defined(__x86_64__) || defined(__i386__) || defined(__aarch64__))
#define LOOM_USE_BUILTINS 1
#endif

#define LOOM_CAT_(a, b) a##b
#define LOOM_CAT(a, b) LOOM_CAT_(a, b)

#define LOOM_QK 32          /* elements per quantized block */
#define LOOM_Q8_0_BYTES 34
#define LOOM_Q4_0_BYTES 18
#define LOOM_Q4_1_BYTES 20  /* f16 scale d, f16 minimum m, 16 bytes of nibbles: q * d + m */
#define LOOM_Q5_0_BYTES 22  /* f16 d, 32 high bits qh, nibbles: ((nibble | bit << 4) - 16) * d */
#define LOOM_Q5_1_BYTES 24  /* f16 d, f16 m, 32 high bits qh, nibbles: (nibble | bit << 4) * d + m */
#define LOOM_QK_K 256       /* elements per K-quant superblock */
#define LOOM_Q2_K_BYTES 84
#define LOOM_Q3_K_BYTES 110
#define LOOM_Q4_K_BYTES 144
#define LOOM_Q5_K_BYTES 176
#define LOOM_Q6_K_BYTES 210

/* ---- horizontal sums: accumulators stay vectors in hot loops, reduced once ---- */
inline float loom_hsum4(float4 v) { return (v.s0 + v.s1) + (v.s2 + v.s3); }
inline float loom_hsum8(float8 v) { return loom_hsum4(v.lo + v.hi); }
inline float loom_hsum16(float16 v) { return loom_hsum8(v.lo + v.hi); }

/* ---- exp without a library call (Cephes expf: ~1 ulp on [-87, 88]) ----
 * Inputs below -87.3 (and -inf) give exactly 0 (no subnormal results); above
 * 88 give ~1.7e38, not inf: callers use it for softmax weights and sigmoids,
 * where that is harmless. NaN gives NaN. */
#ifndef LOOM_USE_BUILTINS
#define LOOM_DEF_EXP(T, IT, AS_T, AS_IT)                                         \
    inline T loom_exp_##T(T x0)                                                  \
    {                                                                            \
        T x = x0 < -87.3f ? (T)(-87.3f) : x0;                                    \
        x = x > 88.0f ? (T)(88.0f) : x;                                          \
        /* n = round(x / ln2) via the 1.5 * 2^23 trick; r = x - n ln2 */          \
        T t = x * 1.44269504089f + 12582912.0f;                                  \
        IT n = AS_IT(t) - 0x4B400000;                                            \
        T nf = t - 12582912.0f;                                                  \
        T r = x - nf * 0.693359375f + nf * 2.12194440e-4f;                       \
        T p = 1.9875691500e-4f;                                                  \
        p = p * r + 1.3981999507e-3f;                                            \
        p = p * r + 8.3334519073e-3f;                                            \
        p = p * r + 4.1665795894e-2f;                                            \
        p = p * r + 1.6666665459e-1f;                                            \
        p = p * r + 5.0000001201e-1f;                                            \
        p = p * r * r + r + 1.0f;                                                \
        p = p * AS_T((n + 127) << 23);                                           \
        return x0 < -87.3f ? (T)(0.0f) : (x0 != x0 ? x0 : p);                     \
    }
LOOM_DEF_EXP(float, int, as_float, as_int)
LOOM_DEF_EXP(float8, int8, as_float8, as_int8)
#define loom_exp(x) loom_exp_float(x)
#define loom_exp8(x) loom_exp_float8(x)

/* erf, Abramowitz & Stegun 7.1.26: absolute error < 1.5e-7. */
inline float loom_erf(float x)
{
    float a = x < 0.0f ? -x : x;
    float t = 1.0f / (1.0f + 0.3275911f * a);
    float p = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t;
    float y = 1.0f - p * loom_exp(-a * a);
    return x < 0.0f ? -y : y;
}
inline float8 loom_erf8(float8 x)
{
    float8 a = fabs(x);
    float8 t = 1.0f / (1.0f + 0.3275911f * a);
    float8 p = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t;
    return copysign(1.0f - p * loom_exp8(-a * a), x);
}

/* tanh, Cephes tanhf (~2 ulp): an odd polynomial for |x| <= 0.625 (no
 * cancellation near 0), 1 - 2 / (exp(2|x|) + 1) above (exactly +-1 from
 * |x| ~ 9 on); NaN gives NaN. */
inline float loom_tanh(float x)
{
    float a = x < 0.0f ? -x : x, r;
    if (a > 0.625f) {
        r = 1.0f - 2.0f / (loom_exp(2.0f * a) + 1.0f);
    } else {
        float z = a * a;
        r = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z
             - 3.33332819422e-1f) * z * a + a;
    }
    return x < 0.0f ? -r : r;
}
#else
#define loom_exp(x) exp(x)
#define loom_exp8(x) exp(x)
#define loom_erf(x) erf(x)
#define loom_erf8(x) erf(x)
#define loom_tanh(x) tanh(x)
#endif

/* ---- work-group reductions for row kernels with WG lanes (WG > 1 only) ----
 * Every lane gets the same result, summed in lane order (deterministic).
 * scratch: __local float[WG] declared by the kernel. */
inline float loom_wg_sum(float v, __local float *scratch, int lane, int wg)
{
    scratch[lane] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    float s = 0.0f;
    for (int i = 0; i < wg; i++)
        s += scratch[i];
    barrier(CLK_LOCAL_MEM_FENCE);
    return s;
}
inline float loom_wg_max(float v, __local float *scratch, int lane, int wg)
{
    scratch[lane] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    float m = scratch[0];
    for (int i = 1; i < wg; i++)
        m = scratch[i] > m ? scratch[i] : m;
    barrier(CLK_LOCAL_MEM_FENCE);
    return m;
}

/* ---- f16 bits -> f32 (exact, including subnormals, inf and nan) ---- */
inline float loom_h2f(ushort h)
{
    uint x = h, em = x & 0x7fffu;
    /* exponent rebias by multiplying: also normalizes subnormals */
    float f = as_float(em << 13) * 0x1p112f;
    if (em >= 0x7c00u)
        f = as_float(0x7f800000u | (em << 13));
    return as_float(as_uint(f) | ((x & 0x8000u) << 16));
}

/* Vector f16 -> f32 for finite data (weights, KV cache): exact for normals,
 * subnormals and zeros in 4 vector ops (sign-extend, shift, mask, multiply);
 * inf and nan come out finite (+-65536 and up), unlike loom_h2f. */
#define LOOM_DEF_H2F(n)                                                          \
    inline LOOM_CAT(float, n) LOOM_CAT(loom_h2f, n)(LOOM_CAT(short, n) h)        \
    {                                                                            \
        /* sign-extended, shifted: bit 31 = sign, bits 27..13 = exponent and     \
         * mantissa; the multiply rebiases the exponent (and normalizes        \
         * subnormals) */                                                        \
        LOOM_CAT(uint, n) x = LOOM_CAT(as_uint, n)(LOOM_CAT(convert_int, n)(h)) << 13; \
        return LOOM_CAT(as_float, n)(x & 0x8FFFE000u) * 0x1p112f;               \
    }
LOOM_DEF_H2F(4)
LOOM_DEF_H2F(8)
LOOM_DEF_H2F(16)

/* ---- element-aligned vector loads/stores ---- */
#ifndef LOOM_USE_BUILTINS
#define LOOM_DEF_LD(T, n)                                                        \
    typedef struct __attribute__((packed)) { LOOM_CAT(T, n) v; } LOOM_CAT(loom_u_##T, n); \
    inline LOOM_CAT(T, n) LOOM_CAT(loom_ld_##T, n)(const __global T *p)          \
    {                                                                            \
        return ((const __global LOOM_CAT(loom_u_##T, n) *)p)->v;                 \
    }                                                                            \
    inline void LOOM_CAT(loom_st_##T, n)(LOOM_CAT(T, n) v, __global T *p)        \
    {                                                                            \
        ((__global LOOM_CAT(loom_u_##T, n) *)p)->v = v;                          \
    }
#else
#define LOOM_DEF_LD(T, n)                                                        \
    inline LOOM_CAT(T, n) LOOM_CAT(loom_ld_##T, n)(const __global T *p)          \
    {                                                                            \
        return LOOM_CAT(vload, n)(0, p);                                         \
    }                                                                            \
    inline void LOOM_CAT(loom_st_##T, n)(LOOM_CAT(T, n) v, __global T *p)        \
    {                                                                            \
        LOOM_CAT(vstore, n)(v, 0, p);                                            \
    }
#endif
LOOM_DEF_LD(float, 4)
LOOM_DEF_LD(float, 8)
LOOM_DEF_LD(float, 16)
LOOM_DEF_LD(short, 4)
LOOM_DEF_LD(short, 8)
LOOM_DEF_LD(short, 16)
LOOM_DEF_LD(char, 4)
LOOM_DEF_LD(char, 8)
LOOM_DEF_LD(char, 16)
LOOM_DEF_LD(uchar, 4)
LOOM_DEF_LD(uchar, 8)
LOOM_DEF_LD(uchar, 16)

/* f16 storage -> f32: loom_ldh(p) scalar (exact, inf/nan too), loom_ldhN(p)
 * N consecutive (finite data only, see loom_h2fN). */
#ifndef LOOM_USE_BUILTINS
inline float loom_ldh(const __global half *p) { return loom_h2f(*(const __global ushort *)p); }
inline float4 loom_ldh4(const __global half *p) { return loom_h2f4(loom_ld_short4((const __global short *)p)); }
inline float8 loom_ldh8(const __global half *p) { return loom_h2f8(loom_ld_short8((const __global short *)p)); }
inline float16 loom_ldh16(const __global half *p) { return loom_h2f16(loom_ld_short16((const __global short *)p)); }
#else
inline float loom_ldh(const __global half *p) { return vload_half(0, p); }
inline float4 loom_ldh4(const __global half *p) { return vload_half4(0, p); }
inline float8 loom_ldh8(const __global half *p) { return vload_half8(0, p); }
inline float16 loom_ldh16(const __global half *p) { return vload_half16(0, p); }
#endif

/* f32 -> f16 storage (round to nearest even). Only used off the hot paths. */
inline void loom_sth(float v, __global half *p) { vstore_half_rte(v, 0, p); }

/* ---- quantized blocks ---- */

/* The f16 scale at the start of a block. */
inline float loom_block_scale(const __global uchar *blk)
{
    return loom_ldh((const __global half *)blk);
}

/* The block scale when it is known finite (weights): exact for normals,
 * subnormals and zero, cheaper than loom_h2f in hot loops (inf/nan scales
 * come out as large finite numbers). */
inline float loom_block_scale_finite(const __global uchar *blk)
{
    uint u = (uint)(*(const __global ushort *)blk) << 16;
    return as_float((u & 0x80000000u) | ((u & 0x7fff0000u) >> 3)) * 0x1p112f;
}

/* Q8_0: elements [off, off + n) of one block as float, not yet scaled. */
#define LOOM_DEF_Q8(n)                                                           \
    inline LOOM_CAT(float, n) LOOM_CAT(loom_q8_0_q, n)(const __global uchar *blk, int off) \
    {                                                                            \
        return LOOM_CAT(convert_float, n)(LOOM_CAT(loom_ld_char, n)((const __global char *)(blk + 2 + off))); \
    }
LOOM_DEF_Q8(4)
LOOM_DEF_Q8(8)
LOOM_DEF_Q8(16)

/* Q4_0: elements [off, off + n) of one block (off a multiple of n): the raw
 * nibbles q as float (loom_q4_0_uN; callers fold the -8 into an fma) or q - 8
 * (loom_q4_0_qN), not yet scaled. Elements 0..15 are the low nibbles of bytes
 * 0..15, elements 16..31 the high nibbles of the same bytes. off is a constant
 * in hot loops, so the select folds away. */
#define LOOM_DEF_Q4(n)                                                           \
    inline LOOM_CAT(float, n) LOOM_CAT(loom_q4_0_u, n)(const __global uchar *blk, int off) \
    {                                                                            \
        LOOM_CAT(uchar, n) b = LOOM_CAT(loom_ld_uchar, n)(blk + 2 + (off & 15)); \
        return LOOM_CAT(convert_float, n)(off < 16 ? (b & (uchar)15) : (b >> (uchar)4)); \
    }                                                                            \
    inline LOOM_CAT(float, n) LOOM_CAT(loom_q4_0_q, n)(const __global uchar *blk, int off) \
    {                                                                            \
        return LOOM_CAT(loom_q4_0_u, n)(blk, off) - 8.0f;                        \
    }
LOOM_DEF_Q4(4)
LOOM_DEF_Q4(8)
LOOM_DEF_Q4(16)

/* Q4_1: the same nibble order as Q4_0, after the 4 bytes of d and m. */
#define LOOM_DEF_Q4_1(n)                                                         \
    inline LOOM_CAT(float, n) LOOM_CAT(loom_q4_1_u, n)(const __global uchar *blk, int off) \
    {                                                                            \
        LOOM_CAT(uchar, n) b = LOOM_CAT(loom_ld_uchar, n)(blk + 4 + (off & 15)); \
        return LOOM_CAT(convert_float, n)(off < 16 ? (b & (uchar)15) : (b >> (uchar)4)); \
    }
LOOM_DEF_Q4_1(4)
LOOM_DEF_Q4_1(8)
LOOM_DEF_Q4_1(16)

/* Q5_0 / Q5_1: Q4's nibbles (at qs) plus a fifth bit per element: element e of the
 * block takes bit e of the little-endian 32-bit qh (at qh, read bytewise: blocks are
 * only 2-byte aligned). Returns the unsigned 5-bit q in [0, 31] as float. */
inline uint loom_q5_high(const __global uchar *blk, int qh)
{
    return (uint)blk[qh] | (uint)blk[qh + 1] << 8 | (uint)blk[qh + 2] << 16 | (uint)blk[qh + 3] << 24;
}
#define LOOM_IOTA4 (uint4)(0, 1, 2, 3)
#define LOOM_IOTA8 (uint8)(0, 1, 2, 3, 4, 5, 6, 7)
#define LOOM_IOTA16 (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define LOOM_DEF_Q5(n)                                                           \
    inline LOOM_CAT(float, n) LOOM_CAT(loom_q5_u, n)(const __global uchar *blk, int qs, int qh, int off) \
    {                                                                            \
        LOOM_CAT(uchar, n) b = LOOM_CAT(loom_ld_uchar, n)(blk + qs + (off & 15)); \
        LOOM_CAT(uint, n) lo = LOOM_CAT(convert_uint, n)(off < 16 ? (b & (uchar)15) : (b >> (uchar)4)); \
        LOOM_CAT(uint, n) hi = ((LOOM_CAT(uint, n))(loom_q5_high(blk, qh) >> off) >> LOOM_CAT(LOOM_IOTA, n)) & 1u; \
        return LOOM_CAT(convert_float, n)(lo | hi << 4);                         \
    }
LOOM_DEF_Q5(4)
LOOM_DEF_Q5(8)
LOOM_DEF_Q5(16)

/* ---- K-quants (ggml's layouts, QK_K = 256) ----
 * A superblock of 256 elements is eight 32-element chunks; chunk j holds elements
 * 32j .. 32j + 31. Each element is u * ds + ms for an unsigned quant u and its
 * sub-block's float scale ds and offset ms (sub-blocks of 16 elements, or 32 for
 * Q4_K/Q5_K):
 *   Q2_K (84 bytes):  scales[16] (4-bit scale | 4-bit min << 4 per 16 elements),
 *                     qs[64] (2 bits), f16 d, f16 dmin;  d*sc * u - dmin*m
 *   Q3_K (110):       hmask[32] (third bit), qs[64] (low 2 bits), scales[12]
 *                     (sixteen 6-bit, stored + 32), f16 d;  d*sc * (u - 4)
 *   Q4_K (144):       f16 d, f16 dmin, scales[12] (eight 6-bit scales and mins),
 *                     qs[128] (nibbles);  d*sc * u - dmin*m
 *   Q5_K (176):       as Q4_K with qh[32] (fifth bit) before qs
 *   Q6_K (210):       ql[128] (low nibbles), qh[64] (top 2 bits), scales[16]
 *                     (int8), f16 d;  d*sc * (u - 32)
 * Quant bits lie in planes whose bytes carry several chunks: the helpers below
 * take chunk j (0..7) and element offset off within it (a multiple of n). off
 * is a constant in hot loops; j is too where callers unroll a superblock. The
 * n = (empty) variants are scalar. Scales are read with loom_block_scale_finite:
 * readers reject non-finite ones. */
inline uchar loom_ld_uchar(const __global uchar *p) { return *p; }
#define LOOM_DEF_KQ(n)                                                           \
    /* 2 bits: chunk j is bits 2(j%4).. of bytes 32(j/4) + off (Q2_K, Q3_K low bits, Q6_K high bits) */ \
    inline LOOM_CAT(uchar, n) LOOM_CAT(loom_kq_bits2, n)(const __global uchar *p, int j, int off) \
    {                                                                            \
        return (LOOM_CAT(loom_ld_uchar, n)(p + 32 * (j >> 2) + off) >> (uchar)(2 * (j & 3))) & (uchar)3; \
    }                                                                            \
    /* 1 bit: chunk j is bit j of bytes off.. (Q3_K's hmask, Q5_K's qh) */      \
    inline LOOM_CAT(uchar, n) LOOM_CAT(loom_kq_bit, n)(const __global uchar *p, int j, int off) \
    {                                                                            \
        return (LOOM_CAT(loom_ld_uchar, n)(p + off) >> (uchar)j) & (uchar)1;      \
    }                                                                            \
    /* nibbles: chunk j is the low (j even) or high nibbles of bytes 32(j/2) + off (Q4_K, Q5_K) */ \
    inline LOOM_CAT(uchar, n) LOOM_CAT(loom_kq_bits4, n)(const __global uchar *p, int j, int off) \
    {                                                                            \
        return (LOOM_CAT(loom_ld_uchar, n)(p + 32 * (j >> 1) + off) >> (uchar)(4 * (j & 1))) & (uchar)15; \
    }                                                                            \
    /* Q6_K's low nibbles: each 128-element half takes 64 bytes, low nibbles first */ \
    inline LOOM_CAT(uchar, n) LOOM_CAT(loom_kq_bits4_q6, n)(const __global uchar *p, int j, int off) \
    {                                                                            \
        return (LOOM_CAT(loom_ld_uchar, n)(p + 64 * (j >> 2) + 32 * (j & 1) + off) >> (uchar)(2 * (j & 2))) & (uchar)15; \
    }                                                                            \
    /* each type's unsigned quants u */                                         \
    inline LOOM_CAT(uchar, n) LOOM_CAT(loom_q2_k_u, n)(const __global uchar *blk, int j, int off) \
    {                                                                            \
        return LOOM_CAT(loom_kq_bits2, n)(blk + 16, j, off);                     \
    }                                                                            \
    inline LOOM_CAT(uchar, n) LOOM_CAT(loom_q3_k_u, n)(const __global uchar *blk, int j, int off) \
    {                                                                            \
        return LOOM_CAT(loom_kq_bits2, n)(blk + 32, j, off) | LOOM_CAT(loom_kq_bit, n)(blk, j, off) << (uchar)2; \
    }                                                                            \
    inline LOOM_CAT(uchar, n) LOOM_CAT(loom_q4_k_u, n)(const __global uchar *blk, int j, int off) \
    {                                                                            \
        return LOOM_CAT(loom_kq_bits4, n)(blk + 16, j, off);                     \
    }                                                                            \
    inline LOOM_CAT(uchar, n) LOOM_CAT(loom_q5_k_u, n)(const __global uchar *blk, int j, int off) \
    {                                                                            \
        return LOOM_CAT(loom_kq_bits4, n)(blk + 48, j, off) | LOOM_CAT(loom_kq_bit, n)(blk + 16, j, off) << (uchar)4; \
    }                                                                            \
    inline LOOM_CAT(uchar, n) LOOM_CAT(loom_q6_k_u, n)(const __global uchar *blk, int j, int off) \
    {                                                                            \
        return LOOM_CAT(loom_kq_bits4_q6, n)(blk, j, off) | LOOM_CAT(loom_kq_bits2, n)(blk + 128, j, off) << (uchar)4; \
    }
LOOM_DEF_KQ()
LOOM_DEF_KQ(4)
LOOM_DEF_KQ(8)
LOOM_DEF_KQ(16)

/* Chunk j's scales: ds[h], ms[h] for its elements 16h .. 16h + 15 (both halves
 * equal for Q4_K/Q5_K, whose sub-blocks are whole chunks). */
inline void loom_q2_k_scales(const __global uchar *blk, int j, float *ds, float *ms)
{
    float d = loom_block_scale_finite(blk + 80), dmin = loom_block_scale_finite(blk + 82);
    for (int h = 0; h < 2; h++) {
        uchar s = blk[2 * j + h];
        ds[h] = d * (float)(s & 15);
        ms[h] = -(dmin * (float)(s >> 4));
    }
}
inline void loom_q3_k_scales(const __global uchar *blk, int j, float *ds, float *ms)
{
    const __global uchar *s = blk + 96;
    float d = loom_block_scale_finite(blk + 108);
    for (int h = 0; h < 2; h++) {
        int i = 2 * j + h;     /* low nibble in byte i % 8, top 2 bits at bit 2(i/4) of byte 8 + i % 4 */
        int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
        int high = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        ds[h] = d * (float)((low | high << 4) - 32);
        ms[h] = -4.0f * ds[h];
    }
}
/* Q4_K/Q5_K's 6-bit scale and min of chunk j from their 12 bytes: j < 4 in the low
 * 6 bits of bytes j and j + 4; j >= 4 in the nibbles of byte j + 4, topped by the
 * high 2 bits of bytes j - 4 and j. */
inline void loom_q4_k_scales(const __global uchar *blk, int j, float *ds, float *ms)
{
    const __global uchar *s = blk + 4;
    int sc, m;
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
    ds[0] = ds[1] = loom_block_scale_finite(blk) * (float)sc;
    ms[0] = ms[1] = -(loom_block_scale_finite(blk + 2) * (float)m);
}
#define loom_q5_k_scales loom_q4_k_scales   /* the same d, dmin and scales at the same offsets */
inline void loom_q6_k_scales(const __global uchar *blk, int j, float *ds, float *ms)
{
    float d = loom_block_scale_finite(blk + 208);
    for (int h = 0; h < 2; h++) {
        ds[h] = d * (float)((const __global char *)blk)[192 + 2 * j + h];
        ms[h] = -32.0f * ds[h];
    }
}

/* A whole superblock's scales at once, ds[2j + h] and ms[2j + h] for chunk j's
 * elements 16h .. 16h + 15: the values of the per-chunk helpers above, bit for
 * bit (the same products of the same operands), decoded as vectors: matmul.cl's
 * tiles of several rows take them once a superblock instead of eight scalar chunk
 * decodes a row (Q3_K's scattered bits keep the per-chunk path). */
#define LOOM_PAIRS16(v) (float16)((v).s0, (v).s0, (v).s1, (v).s1, (v).s2, (v).s2, (v).s3, (v).s3, \
                                  (v).s4, (v).s4, (v).s5, (v).s5, (v).s6, (v).s6, (v).s7, (v).s7)
inline void loom_q2_k_scales16(const __global uchar *blk, float16 *ds, float16 *ms)
{
    const uchar16 s = loom_ld_uchar16(blk);
    const float d = loom_block_scale_finite(blk + 80), dmin = loom_block_scale_finite(blk + 82);
    *ds = d * convert_float16(s & (uchar)15);
    *ms = -(dmin * convert_float16(s >> (uchar)4));
}
inline void loom_q4_k_scales16(const __global uchar *blk, float16 *ds, float16 *ms)
{
    const uchar4 lo = loom_ld_uchar4(blk + 4), mid = loom_ld_uchar4(blk + 8), hi = loom_ld_uchar4(blk + 12);
    const uchar8 sc = (uchar8)(lo & (uchar)63, (hi & (uchar)15) | (lo >> (uchar)6) << (uchar)4);
    const uchar8 m = (uchar8)(mid & (uchar)63, (hi >> (uchar)4) | (mid >> (uchar)6) << (uchar)4);
    const float8 d = loom_block_scale_finite(blk) * convert_float8(sc);
    const float8 mn = -(loom_block_scale_finite(blk + 2) * convert_float8(m));
    *ds = LOOM_PAIRS16(d);
    *ms = LOOM_PAIRS16(mn);
}
#define loom_q5_k_scales16 loom_q4_k_scales16
inline void loom_q6_k_scales16(const __global uchar *blk, float16 *ds, float16 *ms)
{
    *ds = loom_block_scale_finite(blk + 208) * convert_float16(loom_ld_char16((const __global char *)blk + 192));
    *ms = -32.0f * *ds;
}

/* Scalar element i of a K-quant row. */
#define LOOM_DEF_KQ_AT(t, BYTES)                                                 \
    inline float loom_##t##_at(const __global uchar *row, int i)                 \
    {                                                                            \
        const __global uchar *blk = row + (size_t)(i / LOOM_QK_K) * BYTES;       \
        int j = i % LOOM_QK_K / 32, l = i % 32;                                  \
        float ds[2], ms[2];                                                      \
        loom_##t##_scales(blk, j, ds, ms);                                       \
        return (float)loom_##t##_u(blk, j, l) * ds[l / 16] + ms[l / 16];         \
    }
LOOM_DEF_KQ_AT(q2_k, LOOM_Q2_K_BYTES)
LOOM_DEF_KQ_AT(q3_k, LOOM_Q3_K_BYTES)
LOOM_DEF_KQ_AT(q4_k, LOOM_Q4_K_BYTES)
LOOM_DEF_KQ_AT(q5_k, LOOM_Q5_K_BYTES)
LOOM_DEF_KQ_AT(q6_k, LOOM_Q6_K_BYTES)

/* Scalar element i of a quantized row (slow path: tails, odd sizes). */
inline float loom_q8_0_at(const __global uchar *row, int i)
{
    const __global uchar *blk = row + (size_t)(i / LOOM_QK) * LOOM_Q8_0_BYTES;
    return loom_block_scale(blk) * (float)((const __global char *)blk)[2 + i % LOOM_QK];
}
inline float loom_q5_at(const __global uchar *row, int i, int bytes, int qs, int qh, int has_min)
{
    const __global uchar *blk = row + (size_t)(i / LOOM_QK) * bytes;
    int j = i % LOOM_QK;
    uchar b = blk[qs + (j & 15)];
    uint q = (uint)(j < 16 ? (b & 15) : (b >> 4)) | ((loom_q5_high(blk, qh) >> j) & 1u) << 4;
    float d = loom_block_scale(blk);
    return has_min ? (float)q * d + loom_block_scale(blk + 2) : ((float)q - 16.0f) * d;
}
inline float loom_q4_1_at(const __global uchar *row, int i)
{
    const __global uchar *blk = row + (size_t)(i / LOOM_QK) * LOOM_Q4_1_BYTES;
    int j = i % LOOM_QK;
    uchar b = blk[4 + (j & 15)];
    float q = (float)(j < 16 ? (b & 15) : (b >> 4));
    return q * loom_block_scale(blk) + loom_block_scale(blk + 2);
}
inline float loom_q4_0_at(const __global uchar *row, int i)
{
    const __global uchar *blk = row + (size_t)(i / LOOM_QK) * LOOM_Q4_0_BYTES;
    int j = i % LOOM_QK;
    uchar b = blk[2 + (j & 15)];
    int q = j < 16 ? (b & 15) : (b >> 4);
    return loom_block_scale(blk) * (float)(q - 8);
}

/* One tile of an online softmax over key/value rows (attention.cl and
 * attention_seq.cl): n rows (n <= the length of the float array s), keys at
 * kp and values at vp, kstride and vstride elements apart, each row `hd8` float8s loaded
 * with LOAD8(pointer). Scores s[j] = qv . k_j; the running max m, sum l and
 * output av (hd8 float8s) are rescaled once per tile, then the weighted
 * values added. Start with m = -FLT_MAX (not -inf, so the first rescale is
 * exp(-huge) = 0, never inf - inf), l = 0, av = 0; finish with av / l. */
#define LOOM_SOFTMAX_TILE(qv, av, m, l, s, kp, kstride, vp, vstride, n, hd8, LOAD8) \
    do {                                                                   \
        float bm_ = -FLT_MAX;                                              \
        int j_ = 0;                                                        \
        /* four positions at a time: four independent FMA chains */       \
        for (; j_ + 4 <= (n); j_ += 4) {                                   \
            float8 d0_ = (float8)(0.0f), d1_ = d0_, d2_ = d0_, d3_ = d0_;  \
            _Pragma("unroll")                                              \
            for (int c_ = 0; c_ < (hd8); c_++) {                           \
                d0_ += (qv)[c_] * LOAD8((kp) + (size_t)j_ * (kstride) + 8 * c_); \
                d1_ += (qv)[c_] * LOAD8((kp) + (size_t)(j_ + 1) * (kstride) + 8 * c_); \
                d2_ += (qv)[c_] * LOAD8((kp) + (size_t)(j_ + 2) * (kstride) + 8 * c_); \
                d3_ += (qv)[c_] * LOAD8((kp) + (size_t)(j_ + 3) * (kstride) + 8 * c_); \
            }                                                              \
            (s)[j_] = loom_hsum8(d0_);                                     \
            (s)[j_ + 1] = loom_hsum8(d1_);                                 \
            (s)[j_ + 2] = loom_hsum8(d2_);                                 \
            (s)[j_ + 3] = loom_hsum8(d3_);                                 \
        }                                                                  \
        for (; j_ < (n); j_++) {                                           \
            float8 d_ = (float8)(0.0f);                                    \
            _Pragma("unroll")                                              \
            for (int c_ = 0; c_ < (hd8); c_++)                             \
                d_ += (qv)[c_] * LOAD8((kp) + (size_t)j_ * (kstride) + 8 * c_); \
            (s)[j_] = loom_hsum8(d_);                                      \
        }                                                                  \
        for (j_ = 0; j_ < (n); j_++)                                       \
            bm_ = (s)[j_] > bm_ ? (s)[j_] : bm_;                           \
        const float mn_ = bm_ > (m) ? bm_ : (m);                           \
        const float corr_ = loom_exp((m) - mn_);                           \
        (l) *= corr_;                                                      \
        _Pragma("unroll")                                                  \
        for (int c_ = 0; c_ < (hd8); c_++)                                 \
            (av)[c_] *= corr_;                                             \
        j_ = 0;                                                            \
        for (; j_ + 8 <= (n); j_ += 8)    /* eight exponentials a vector */ \
            vstore8(loom_exp8(vload8(0, (s) + j_) - mn_), 0, (s) + j_);    \
        for (; j_ < (n); j_++)                                             \
            (s)[j_] = loom_exp((s)[j_] - mn_);                             \
        for (j_ = 0; j_ < (n); j_++) {                                     \
            const float pj_ = (s)[j_];                                     \
            (l) += pj_;                                                    \
            _Pragma("unroll")                                              \
            for (int c_ = 0; c_ < (hd8); c_++)                             \
                (av)[c_] += pj_ * LOAD8((vp) + (size_t)j_ * (vstride) + 8 * c_); \
        }                                                                  \
        (m) = mn_;                                                         \
    } while (0)

/* ---- int8 inputs (matmul.cl INT8_DOT, quantize_x; attention.cl QUANT_OUT) ----
 * A block a | b (32 values) as two int8 digits: q[0 .. 7] h (int i: elements 4i ..
 * 4i + 3), q[8 .. 15] l, q[16] the scale s (its bits), q[17] sum(h), q[18] sum(l),
 * q[19] the sums over a (Q6_K's 16-value scales): sum(h) in its low 16 bits (two's
 * complement), sum(l) in its high ones. With x16 (Q8_0 tiles' inputs) q[0 .. 15]
 * hold each value's two digits as one int16 256 h + l (|.| <= 32639) instead, in
 * pairs a vpmaddwd takes whole: int 2i elements 4i and 4i + 2, int 2i + 1 elements
 * 4i + 1 and 4i + 3 (low half first); the rest as above. */
__attribute__((always_inline)) inline void loom_quantize32(const float16 a, const float16 b, __global int *q,
                                                           const int x16)
{
    const float16 m16 = fmax(fabs(a), fabs(b));
    const float8 m8 = fmax(m16.lo, m16.hi);
    const float4 m4 = fmax(m8.lo, m8.hi);
    const float amax = fmax(fmax(m4.x, m4.y), fmax(m4.z, m4.w));
    const float dx = amax / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
    const float16 ha = rint(a * id), hb = rint(b * id);
    /* |x - h s| <= s / 2: l within [-128, 128], and 128 is clamped */
    const float16 la = clamp(rint((a - ha * dx) * (256.0f * id)), -127.0f, 127.0f);
    const float16 lb = clamp(rint((b - hb * dx) * (256.0f * id)), -127.0f, 127.0f);
    if (x16) {
        const short16 va = convert_short16(convert_int16(ha) * 256 + convert_int16(la));
        const short16 vb = convert_short16(convert_int16(hb) * 256 + convert_int16(lb));
        vstore16(va.s021346578A9BCEDF, 0, (__global short *)q);
        vstore16(vb.s021346578A9BCEDF, 1, (__global short *)q);
    } else {
        __global char *c = (__global char *)q;
        vstore16(convert_char16(convert_int16(ha)), 0, c);
        vstore16(convert_char16(convert_int16(hb)), 1, c);
        vstore16(convert_char16(convert_int16(la)), 2, c);
        vstore16(convert_char16(convert_int16(lb)), 3, c);
    }
    q[16] = as_int(dx);
    q[17] = (int)loom_hsum16(ha + hb);          /* |sum| <= 32 x 127: exact in float */
    q[18] = (int)loom_hsum16(la + lb);
    q[19] = as_int(((uint)(int)loom_hsum16(ha) & 0xFFFFu) | ((uint)(int)loom_hsum16(la) << 16));
}

/* ---- rotary embedding (rope.cl; attention.cl ROPE_IN) ----
 * Pair i of a head's `dims` rotated dimensions turns by p freq_scale
 * theta^(-2i / dims); c through *c, the sine returned. The pair is (2i, 2i + 1)
 * (ggml mode 0), or (i, i + dims / 2) with ROPE_NEOX. */
inline float loom_rope_angle(int i, int dims, int p, float theta, float freq_scale, float *c)
{
    const float inv_freq = pow(theta, -2.0f * (float)i / (float)dims);
    return sincos((float)p * freq_scale * inv_freq, c);
}
#ifdef ROPE_NEOX
#define LOOM_ROPE_IA(i, dims) (i)
#define LOOM_ROPE_IB(i, dims) ((i) + (dims) / 2)
#else
#define LOOM_ROPE_IA(i, dims) (2 * (i))
#define LOOM_ROPE_IB(i, dims) (2 * (i) + 1)
#endif
