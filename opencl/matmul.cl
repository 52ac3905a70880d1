/* matmul.cl - Y[T, N] (+)= X[T, K] . W[N, K]^T (+ b[N])
 *
 * kernel matmul(
 *     const __global float *X, int x_off, int ldx,   X[t, k] = X[x_off + t*ldx + k]
 *     const __global WTYPE *W,                        W[N, K] row-major, see WEIGHT_*
 *     const __global float *bias,                     b[N]; read only with HAS_BIAS (else may be NULL)
 *     __global float *Y, int y_off, int ldy,          Y[t, n] = Y[y_off + t*ldy + n]
 *     int T)                                          tokens (rows of X and Y), T >= 1
 *
 * Macros:
 *   K, N                 required: inputs per row, output rows
 *   WEIGHT_F32 | WEIGHT_F16 | WEIGHT_Q8_0 | WEIGHT_Q4_0 | WEIGHT_Q4_1 | WEIGHT_Q5_0 | WEIGHT_Q5_1
 *   | WEIGHT_Q2_K | WEIGHT_Q3_K | WEIGHT_Q4_K | WEIGHT_Q5_K | WEIGHT_Q6_K
 *                        required, exactly one (all but Q8_0, Q4_0: the float path only).
 *                        W is float* / half* (storage) / uchar* (raw ggml blocks,
 *                        K/32 blocks per row, or K/256 superblocks for the K-quants,
 *                        rows back to back). Quantized: K % 32 == 0 (K-quants: K % 256 == 0).
 *                        Block scales must be finite (a reader should reject others).
 *   ROWS_PER_ITEM  (1)   output rows per work-item
 *   TOKENS_PER_ITEM (1)  tokens per register tile (at most 16): each loaded
 *                        weight vector is used for this many tokens
 *   WG             (8)   local size along dim 0 (reqd_work_group_size)
 *   VW            (16)   vector width along K: 4, 8 or 16
 *   ACCS          (0 or unset: 2 for a 1x1 tile, else 1)  independent accumulators per output
 *   LUT            (0)   Q4_0 / Q5_0 weights with VW 16: each block's possible values
 *                        as a 16-float table, weight vectors looked up lane-wise (a
 *                        variable permute on AVX-512) instead of converted and scaled;
 *                        the same values, so the same bits. Elsewhere ignored. Slower
 *                        on GPUs (vector subscripts); measured only on CPUs.
 *   HAS_BIAS             add b[n]
 *   ACCUMULATE           Y += result (residual add) instead of Y = result
 *   ACT_F32 (default) | ACT_Q8   activations as float, or (Q8_0 / Q4_0 weights
 *                        only) quantized to int8 per 32-block by each work-group
 *                        into local memory, as llama.cpp does: d_x = max|x| / 127,
 *                        q_x = round-half-even(x * (1 / d_x)); each block's dot is an
 *                        int32 sum of q_w * q_x scaled once by d_w * d_x. Results
 *                        differ from the float path by the activation rounding
 *                        (<= d_x / 2 per element; ~0.5% of the output scale). VW and
 *                        ACCS are unused; use WG >= 32 (every group quantizes its
 *                        tokens' rows of X: more rows per group amortize that).
 *                        x86 with AVX2 uses pmaddubsw/pmaddwd, other targets (and
 *                        MM_PORTABLE) a widening int multiply.
 *   ROW_TILE       (0)   16: W is Q4_0, Q5_0 or Q4_1 (with INT8_DOT also Q4_K, Q6_K or Q8_0) in
 *                        tiles of 16 rows (a param declared tiled(0, 16):
 *                        runtime.tile_blocks), or F16 as runtime.tile holds it
 *                        ([N/16][K][16] halves, float inputs only); a work-item
 *                        computes one tile (ROWS_PER_ITEM, VW, ACCS and LUT are
 *                        unused). 0: W is row-major (blocks).
 *   INT8_DOT       (0)   1 (with ROW_TILE; Intel's runtime on AVX512-VNNI or AVX2 CPUs only:
 *                        device.int8_dot): X is quantize_x's output (every value as
 *                        two int8 digits, per block of 32 a scale and the digits'
 *                        sums; ldx is unused) and the tiles take vpdpbusd. Results
 *                        differ from the float path by the input rounding (<= s / 512
 *                        per value, s = max|x| / 127 of its block: ~2e-5 of the
 *                        output scale).
 *   DOT16          (0)   1 (INT8_DOT, Q4_0): the tiles take vpmaddwd on int16s, X
 *                        in quantize_x's x16 layout (a Q8_0 program's always is):
 *                        the byte tiles' integers, so the same results to the bit.
 *   NORM_IN              (ROW_TILE, TOKENS_PER_ITEM 1, float inputs) each token's
 *                        input row is RMS-normed inside the kernel, as rms_norm.cl
 *                        with its weight would: x / sqrt(mean(x^2) + eps) * g, for
 *                        g = norm_w[K] and eps, two more arguments after T. The
 *                        work-group (WG <= 8) norms the row together into local
 *                        memory (K + 8 floats: 8 partial sums of squares whatever
 *                        WG, so the same bits) and each tile scales its 16 sums by 1 / rms
 *                        once, so results differ from rms_norm then matmul by
 *                        rounding (~1e-6 of the output scale). Decode's launch of
 *                        rms_norm (one work-item a token, the other core idle) is gone.
 *   QX_TAIL              (INT8_DOT) the launch's last work-group also writes the next
 *                        projection's input as quantize_x would (below): 1 Y's rows
 *                        RMS-normed (XQ, norm_w, eps, done after T), 2 silu(gate) up
 *                        of gate | up rows (XQ, done); QX_K, QX_X16 the consumer's K
 *                        and layout; done an int that is 0 between launches.
 *   RT_AHEAD  (4)        (INT8_DOT) prefetch the block this many blocks ahead of the
 *                        one summed, on a tile's first pass (AVX2: T = 1; else T > 1).
 *   Any T >= 1 works with any geometry; X and Y may not overlap.
 *
 * kernel dequantize(const __global WTYPE *W, __global float *Y)   Y[N, K] float32
 *   The weights as the float path reads them (the same WLOAD per element: every
 *   quantized value is exact in float32, so these are the very values the
 *   quantized matmul multiplies), for a prefill chunk to run the float tile on.
 *   Same macros (K, N, WEIGHT_*); global = (ceil(K / 32), N), any local size.
 *
 * kernel matmul_glu(X, x_off, ldx, W0, W1, Y, y_off, ldy, T [, norm_w, eps])   (GLU)
 *   Y[t, n] = silu(x . W0[n]) * (x . W1[n]), n < N: gate and up of a feed-forward
 *   layer (W0, W1 [N, K] in tiles of 16 rows: ROW_TILE, TOKENS_PER_ITEM 1) as one
 *   launch, a work-item taking the same tile of both; NORM_IN as above. silu is
 *   elementwise.cl's (g / (1 + exp(-g))). Launch: matmul's with ROWS_PER_ITEM 16.
 *
 * kernel quantize_x(const __global float *X, int ldx, __global int *XQ, int T)
 *   (INT8_DOT programs) X [T, K] (row stride ldx) -> XQ [T, K / 32, 20 ints];
 *   global = (K / 32, T), any local size. A Q8_0 or DOT16 program's digits are
 *   int16s (common.cl loom_quantize32's x16): only those programs' tiles read them.
 *
 * Launch: global = (round_up(ceil(N / ROWS_PER_ITEM), WG), G1), local = (WG, 1).
 *   G1 >= 1 is free: work-item (i, g) handles token tiles g, g + G1, ... With
 *   G1 = 1 each weight row is read from DRAM once per call and reused from
 *   L1/L2 for all T tokens (best on CPUs); larger G1 adds parallelism for small N.
 *
 * Geometry measured on PoCL (2-core Zen; opencl/README.md has the table):
 *   decode T = 1: ROWS_PER_ITEM=1 TOKENS_PER_ITEM=1 WG=8 VW=16; cohorts of
 *   2-15: 1,4,8,16, or 2,4,8,8 when K >= 4096 (T rows of X outgrow L1, and two
 *   rows per item halve the X loads); prefill chunks: 4,2,8,8 (F32) or 2,4,8,8
 *   (others). One row
 *   per work-item makes each work-group stream one contiguous stretch of W; on
 *   PoCL several interleaved rows per work-item streamed 2x slower from DRAM.
 *   ACT_Q8 (Q8_0/Q4_0, T <= 2): 1,T,64 (WG 64); faster than float there only:
 *   from T = 4 on the per-block int->float scaling costs what the float FMAs do.
 *   Tail rows (N not a multiple of ROWS_PER_ITEM) read row N-1 again and skip
 *   the store, keeping the hot loop branch-free; tail tokens (T not a multiple
 *   of TOKENS_PER_ITEM) run as one narrower tile (T = 3 with 4 tokens per item
 *   loads each weight vector once, not three times).
 */

#ifndef K
#error "matmul.cl: define K (inputs per row)"
#endif
#ifndef N
#error "matmul.cl: define N (output rows)"
#endif
#ifndef ROWS_PER_ITEM
#define ROWS_PER_ITEM 1
#endif
#ifndef TOKENS_PER_ITEM
#define TOKENS_PER_ITEM 1
#endif
#ifndef WG
#define WG 8
#endif
#ifndef VW
#define VW 16
#endif

#if defined(ROW_TILE) && ROW_TILE == 0                /* tiles(w) of an untiled param */
#undef ROW_TILE
#endif
#if defined(INT8_DOT) && INT8_DOT && !defined(ROW_TILE)
#error "matmul.cl: INT8_DOT needs ROW_TILE"
#endif
#if (defined(NORM_IN) || defined(GLU)) && (!defined(ROW_TILE) || TOKENS_PER_ITEM != 1 || (defined(INT8_DOT) && INT8_DOT))
#error "matmul.cl: NORM_IN and GLU need ROW_TILE, TOKENS_PER_ITEM 1 and float inputs"
#endif
#if defined(QX_TAIL) && !(defined(INT8_DOT) && INT8_DOT)
#error "matmul.cl: QX_TAIL needs INT8_DOT"
#endif
#if defined(QX_TAIL) && (QX_K % 32 != 0 || (QX_TAIL == 1 ? N : 2 * QX_K) != N)
#error "matmul.cl: QX_TAIL quantizes Y's N columns (1) or gate | up's N / 2 (2), in blocks of 32"
#endif
#ifdef NORM_IN
#define NORM_PARAMS , const __global float *norm_w, float eps
#define NORM_PASS , norm_w, eps
#else
#define NORM_PARAMS
#define NORM_PASS
#endif

#define RPI ROWS_PER_ITEM
#define TPI TOKENS_PER_ITEM
#define VF LOOM_CAT(float, VW)
#define VLOAD(p) LOOM_CAT(loom_ld_float, VW)(p)
#define HSUM LOOM_CAT(loom_hsum, VW)

#if VW != 4 && VW != 8 && VW != 16
#error "matmul.cl: VW must be 4, 8 or 16"
#endif

#if defined(WEIGHT_F32) + defined(WEIGHT_F16) + defined(WEIGHT_Q8_0) + defined(WEIGHT_Q4_0) + defined(WEIGHT_Q4_1) \
    + defined(WEIGHT_Q5_0) + defined(WEIGHT_Q5_1) + defined(WEIGHT_Q2_K) + defined(WEIGHT_Q3_K) + defined(WEIGHT_Q4_K) \
    + defined(WEIGHT_Q5_K) + defined(WEIGHT_Q6_K) != 1
#error "matmul.cl: define exactly one of WEIGHT_F32, WEIGHT_F16, WEIGHT_Q8_0, WEIGHT_Q4_0, WEIGHT_Q4_1, WEIGHT_Q5_0, WEIGHT_Q5_1, WEIGHT_Q2_K, WEIGHT_Q3_K, WEIGHT_Q4_K, WEIGHT_Q5_K, WEIGHT_Q6_K"
#endif

/* LUT (VW 16, Q4_0 and Q5_0 weights): a block's sixteen possible values are one
 * float16 table, built once per block (exactly the products the unpacking path
 * forms), and each weight vector is a lane-wise lookup by its nibbles, which
 * compilers for AVX-512 emit as one vpermps: no int->float conversion or
 * dequantizing fma per vector (opencl/README.md has the measured speed-up). */
/* MM_SCALE: a Q4_0 / Q4_1 / Q5_0 block's f16 scale. Where builtins are inlined
 * (Intel's runtime) vload_half is one conversion instruction, against the integer
 * reconstruction of loom_block_scale_finite (the same value for finite scales):
 * 4864x896 at T = 1, Q4_0 91 -> 81 us, Q4_1 108 -> 97, Q5_0 130 -> 125 (Q8_0 and
 * Q5_1 went slower: they keep the integer one). Measured at VW 16 only. */
#if defined(LOOM_USE_BUILTINS) && VW == 16
#define MM_SCALE(blk) vload_half(0, (const __global half *)(blk))
#else
#define MM_SCALE(blk) loom_block_scale_finite(blk)
#endif

#if defined(LUT) && LUT && VW == 16
#define MM_LUT 1
#define MM_IOTA16F (float16)(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f, 8.0f, 9.0f, 10.0f, 11.0f, 12.0f, 13.0f, 14.0f, 15.0f)
/* t[i & 15] per lane: element subscripts the back end turns into a variable permute
 * (OpenCL's shuffle() with a run-time mask was 2-7x slower on both CPU drivers) */
inline float16 mm_lut16(float16 t, uint16 i)
{
    i &= (uint16)15;
    return (float16)(t[i.s0], t[i.s1], t[i.s2], t[i.s3], t[i.s4], t[i.s5], t[i.s6], t[i.s7],
                     t[i.s8], t[i.s9], t[i.sa], t[i.sb], t[i.sc], t[i.sd], t[i.se], t[i.sf]);
}
/* 5-bit quants: lo holds the values whose fifth bit is clear; lane j adds 16 d
 * where bit j of its half's bits (lane bit j, or j + 16 for elements 16..31) of h
 * is set: (u - 16) d + 16 d = u d exactly (both products fit float's mantissa),
 * the value a second table would give, for one masked add instead of a second
 * lookup and a blend. */
#define MM_Q5_BITS(c) ((uint16)1u << (LOOM_IOTA16 + ((c) < 16 ? 0u : 16u)))
inline float16 mm_lut16_q5(float16 lo, float d16, uint16 i, uint h, uint16 bits)
{
    const float16 t = mm_lut16(lo, i);
    return select(t, t + d16, ((uint16)h & bits) != (uint16)0);
}
/* a block's 16 quant bytes widened to uint lanes: the low nibbles feed elements
 * 0..15, the same lanes >> 4 elements 16..31 */
#define MM_QB(blk) convert_uint16(loom_ld_uchar16(blk))
#define MM_NIB(qb, c) ((c) < 16 ? (qb) : (qb) >> 4)
#endif

/* KSTEP: elements per step (one quantized block, or one 32-element chunk of a
 * K-quant superblock); WLOAD(r, kb, c): VW dequantized weights of row r at
 * k = kb + c; WSCALE_DECL: per-step block scales. KBLOCK: elements per unrolled
 * group of steps (KSTEP, or a whole superblock, so each step's chunk index is a
 * constant and the K-quant bit-plane shifts fold). */
#define KSTEP 32
#define KBLOCK KSTEP
#if defined(WEIGHT_F32)
#define WTYPE float
#define ROW_STRIDE ((size_t)K)                         /* in WTYPE units */
#define WSCALE_DECL
#define WLOAD(r, kb, c) VLOAD(wrow[r] + (kb) + (c))
#elif defined(WEIGHT_F16)
#define WTYPE half
#define ROW_STRIDE ((size_t)K)
#define WSCALE_DECL
#define WLOAD(r, kb, c) LOOM_CAT(loom_ldh, VW)(wrow[r] + (kb) + (c))
#elif defined(WEIGHT_Q8_0)
#define WTYPE uchar
#define ROW_STRIDE ((size_t)(K / LOOM_QK) * LOOM_Q8_0_BYTES)
#define WBLK(r, kb) (wrow[r] + ((kb) / LOOM_QK) * LOOM_Q8_0_BYTES)
#define WSCALE_DECL float d[RPI]; _Pragma("unroll") for (int r = 0; r < RPI; r++) d[r] = loom_block_scale_finite(WBLK(r, kb));
#define WLOAD(r, kb, c) (d[r] * LOOM_CAT(loom_q8_0_q, VW)(WBLK(r, kb), (c)))
#elif defined(WEIGHT_Q5_0)
#define WTYPE uchar
#define ROW_STRIDE ((size_t)(K / LOOM_QK) * LOOM_Q5_0_BYTES)
#define WBLK(r, kb) (wrow[r] + ((kb) / LOOM_QK) * LOOM_Q5_0_BYTES)
#ifdef MM_LUT
#define WSCALE_DECL float16 tlo[RPI]; float d16[RPI]; uint16 qb[RPI]; uint qh[RPI]; _Pragma("unroll") for (int r = 0; r < RPI; r++) { \
    const float d_ = MM_SCALE(WBLK(r, kb)); \
    tlo[r] = (MM_IOTA16F - 16.0f) * d_; d16[r] = 16.0f * d_; \
    qh[r] = loom_q5_high(WBLK(r, kb), 2); qb[r] = MM_QB(WBLK(r, kb) + 6); }
#define WLOAD(r, kb, c) mm_lut16_q5(tlo[r], d16[r], MM_NIB(qb[r], c), qh[r], MM_Q5_BITS(c))
#else
#define WSCALE_DECL float d[RPI], m[RPI]; _Pragma("unroll") for (int r = 0; r < RPI; r++) { d[r] = MM_SCALE(WBLK(r, kb)); m[r] = -16.0f * d[r]; }
#define WLOAD(r, kb, c) (LOOM_CAT(loom_q5_u, VW)(WBLK(r, kb), 6, 2, (c)) * d[r] + m[r])
#endif
#elif defined(WEIGHT_Q5_1)
#define WTYPE uchar
#define ROW_STRIDE ((size_t)(K / LOOM_QK) * LOOM_Q5_1_BYTES)
#define WBLK(r, kb) (wrow[r] + ((kb) / LOOM_QK) * LOOM_Q5_1_BYTES)
#define WSCALE_DECL float d[RPI], m[RPI]; _Pragma("unroll") for (int r = 0; r < RPI; r++) { d[r] = loom_block_scale_finite(WBLK(r, kb)); m[r] = loom_block_scale_finite(WBLK(r, kb) + 2); }
#define WLOAD(r, kb, c) (LOOM_CAT(loom_q5_u, VW)(WBLK(r, kb), 8, 4, (c)) * d[r] + m[r])
#elif defined(WEIGHT_Q2_K)
#define KQ_BYTES LOOM_Q2_K_BYTES
#define KQ_SCALES loom_q2_k_scales
#define KQ_SCALES16 loom_q2_k_scales16
#define KQ_U LOOM_CAT(loom_q2_k_u, VW)
#elif defined(WEIGHT_Q3_K)
#define KQ_BYTES LOOM_Q3_K_BYTES
#define KQ_SCALES loom_q3_k_scales
#define KQ_U LOOM_CAT(loom_q3_k_u, VW)
#elif defined(WEIGHT_Q4_K)
#define KQ_BYTES LOOM_Q4_K_BYTES
#define KQ_SCALES loom_q4_k_scales
#define KQ_SCALES16 loom_q4_k_scales16
#define KQ_U LOOM_CAT(loom_q4_k_u, VW)
#elif defined(WEIGHT_Q5_K)
#define KQ_BYTES LOOM_Q5_K_BYTES
#define KQ_SCALES loom_q5_k_scales
#define KQ_SCALES16 loom_q5_k_scales16
#define KQ_U LOOM_CAT(loom_q5_k_u, VW)
#elif defined(WEIGHT_Q6_K)
#define KQ_BYTES LOOM_Q6_K_BYTES
#define KQ_SCALES loom_q6_k_scales
#define KQ_SCALES16 loom_q6_k_scales16
#define KQ_U LOOM_CAT(loom_q6_k_u, VW)
#elif defined(WEIGHT_Q4_1)
#define WTYPE uchar
#define ROW_STRIDE ((size_t)(K / LOOM_QK) * LOOM_Q4_1_BYTES)
#define WBLK(r, kb) (wrow[r] + ((kb) / LOOM_QK) * LOOM_Q4_1_BYTES)
/* q * d + m as one fma, d and m read once per block */
#define WSCALE_DECL float d[RPI], m[RPI]; _Pragma("unroll") for (int r = 0; r < RPI; r++) { d[r] = MM_SCALE(WBLK(r, kb)); m[r] = MM_SCALE(WBLK(r, kb) + 2); }
#define WLOAD(r, kb, c) (LOOM_CAT(loom_q4_1_u, VW)(WBLK(r, kb), (c)) * d[r] + m[r])
#else
#define WTYPE uchar
#define ROW_STRIDE ((size_t)(K / LOOM_QK) * LOOM_Q4_0_BYTES)
#define WBLK(r, kb) (wrow[r] + ((kb) / LOOM_QK) * LOOM_Q4_0_BYTES)
/* d * (q - 8) as one fma: q * d + (-8 d) */
#ifdef MM_LUT
#define WSCALE_DECL float16 tab[RPI]; uint16 qb[RPI]; _Pragma("unroll") for (int r = 0; r < RPI; r++) { \
    tab[r] = (MM_IOTA16F - 8.0f) * MM_SCALE(WBLK(r, kb)); qb[r] = MM_QB(WBLK(r, kb) + 2); }
#define WLOAD(r, kb, c) mm_lut16(tab[r], MM_NIB(qb[r], c))
#else
#define WSCALE_DECL float d[RPI], m[RPI]; _Pragma("unroll") for (int r = 0; r < RPI; r++) { d[r] = MM_SCALE(WBLK(r, kb)); m[r] = -8.0f * d[r]; }
#define WLOAD(r, kb, c) (LOOM_CAT(loom_q4_0_u, VW)(WBLK(r, kb), (c)) * d[r] + m[r])
#endif
#endif

#ifdef KQ_BYTES
/* K-quants, one path for all five: chunk kj = (kb - kb0) / 32 of the superblock at
 * kb0; each step takes that chunk's scales per row, then u * ds + ms as one fma
 * per lane (ds, ms per 16-element half: VW <= 16 lanes never straddle two). Tiles
 * of two or more rows decode a superblock's scales once, as vectors (MM_SB_DECL,
 * KQ_SCALES16: the same values): Q4_K 4x4 tiles 1.17-1.35x; one-row tiles ran
 * the same at T = 1 and 10-13% slower at T = 4 (opencl/README.md). dequantize
 * and Q3_K decode them chunk by chunk. */
#define WTYPE uchar
#undef KBLOCK
#define KBLOCK LOOM_QK_K
#define ROW_STRIDE ((size_t)(K / LOOM_QK_K) * KQ_BYTES)
#define WBLK(r, kb) (wrow[r] + ((kb) / LOOM_QK_K) * KQ_BYTES)
#define WSCALE_DECL const int kj = ((kb) - kb0) / KSTEP; float ds[RPI][2], ms[RPI][2]; \
    _Pragma("unroll") for (int r = 0; r < RPI; r++) KQ_SCALES(WBLK(r, kb), kj, ds[r], ms[r]);
#define WLOAD(r, kb, c) (LOOM_CAT(convert_float, VW)(KQ_U(WBLK(r, kb), kj, (c))) * ds[r][(c) / 16] + ms[r][(c) / 16])
#if defined(KQ_SCALES16) && RPI >= 2
#define MM_SB_DECL float16 sbd[RPI], sbm[RPI]; _Pragma("unroll") for (int r = 0; r < RPI; r++) KQ_SCALES16(WBLK(r, kb0), &sbd[r], &sbm[r]);
#define MM_WSCALE_DECL const int kj = ((kb) - kb0) / KSTEP; float ds[RPI][2], ms[RPI][2]; \
    _Pragma("unroll") for (int r = 0; r < RPI; r++) { ds[r][0] = sbd[r][2 * kj]; ds[r][1] = sbd[r][2 * kj + 1]; \
                                                      ms[r][0] = sbm[r][2 * kj]; ms[r][1] = sbm[r][2 * kj + 1]; }
#endif
#if K % LOOM_QK_K != 0
#error "matmul.cl: K-quant weights need K % 256 == 0"
#endif
#endif

#ifndef MM_SB_DECL
#define MM_SB_DECL
#define MM_WSCALE_DECL WSCALE_DECL
#endif

#if !defined(WEIGHT_F32) && !defined(WEIGHT_F16) && K % LOOM_QK != 0
#error "matmul.cl: quantized weights need K % 32 == 0"
#endif

#define K_MAIN (K / KSTEP * KSTEP) /* vector part; F32/F16 finish [K_MAIN, K) scalar */
/* Independent accumulators per output (ACCS, default 2 for a 1x1 tile, else 1):
 * a single output's FMA chain is latency-bound; bigger tiles already have
 * RPI*TPI independent chains and more accumulators would spill. */
#if !defined(ACCS) || ACCS == 0
#undef ACCS
#if RPI * TPI == 1
#define ACCS 2
#else
#define ACCS 1
#endif
#endif
/* A step of the loop over K covers MM_KBLOCK elements: KBLOCK, or more blocks
 * when ACCS asks for more accumulators than one block has vectors (decode: each
 * accumulator's FMA chain is latency-bound, and one block's two vectors leave
 * the core idle between FMAs). */
#if !defined(KQ_BYTES) && ACCS * VW > KBLOCK && K_MAIN % (ACCS * VW) == 0
#define MM_KBLOCK (ACCS * VW)
#else
#define MM_KBLOCK KBLOCK
#endif
#define NACC (ACCS < MM_KBLOCK / VW ? ACCS : MM_KBLOCK / VW)

/* One output: bias and residual add, then the store (every path ends here). */
inline void mm_store(const __global float *bias, __global float *y, int n, float s)
{
#ifdef HAS_BIAS
    s += bias[n];
#endif
#ifdef ACCUMULATE
    s += *y;
#endif
    *y = s;
}

#ifdef ROW_TILE
/* ---- Q4_0 / Q5_0 / Q4_1 rows in tiles of 16 (ROW_TILE 16: the param declared tiled(0, 16)) ----
 * runtime.tile_blocks lays each tile of 16 rows out block by block: the 16 rows'
 * f16 scales (32 bytes; Q4_1 then its 16 minimums), then the block's other bytes
 * as words, word j of the 16 rows side by side (one uint16: bytes 4j .. 4j + 3 of
 * each row; Q5_0's first word is its 32 fifth bits). A work-item takes one tile
 * with the rows as the 16 lanes of its vectors, so an input element is one
 * broadcast and no sum crosses lanes. An element is unpacked without a widen or a
 * conversion: one shift puts its 4 bits at the top of a float's mantissa and one
 * mask-and-or (vpternlogd) gives f = 1 + u/16 (Q5_0, its fifth bit joined once a
 * word: 1 + u/32), three instructions an element with its FMA, where the byte
 * planes this replaces took three and a half (a widen per byte, a mask or shift
 * and a conversion per nibble). f - 1.5 is (u - z)/16 exactly (z = 8; Q5_0
 * (u - 16)/32): tiles of 4 or 8 tokens take that; one token sums f x and takes
 * off 1.5 sum(x) once a block. Word by word, not unrolled: four words loaded at
 * once stream 10% slower (T = 1) and spill beside 2 TPI accumulators (T = 8).
 * Against the byte planes, Zen 5, Intel's runtime, medians of 9 alternating,
 * streamed / cached: Q4_0 9728x896 T = 1 124 / 83 -> 123 / 73 us, T = 8 412 /
 * 326 -> 402 / 298, T = 64 2661 / 2645 -> 2469 / 2376; Q5_0 T = 1 148 / 114 ->
 * 140 / 92 (opencl/README.md). The values are those of dequantize; the sums
 * run in another order. */
#if (defined(WEIGHT_Q4_K) || defined(WEIGHT_Q6_K)) && defined(INT8_DOT) && INT8_DOT
#define RT_KQ 1                                   /* K-quant tiles: int8 dot products only (below) */
#endif
#if defined(WEIGHT_Q8_0) && defined(INT8_DOT) && INT8_DOT
#define RT_Q8 1                                   /* Q8_0 tiles: int16 products of int8 dot programs only */
#endif
#if defined(RT_KQ) || defined(RT_Q8)
#define RT_INT_ONLY 1                             /* no float tile, no tiled dequantize */
#endif
#ifdef WEIGHT_F16
#define RT_F16 1                                  /* F16 tiles: float products only (below) */
#endif
#if ROW_TILE != 16 || !(defined(WEIGHT_Q4_0) || defined(WEIGHT_Q5_0) || defined(WEIGHT_Q4_1) || defined(RT_F16) \
    || defined(RT_INT_ONLY)) || defined(ACT_Q8) || defined(RT_F16) && defined(INT8_DOT) && INT8_DOT
#error "matmul.cl: ROW_TILE needs 16, WEIGHT_Q4_0, WEIGHT_Q5_0, WEIGHT_Q4_1 or WEIGHT_F16 (Q4_K, Q6_K, Q8_0 with INT8_DOT), and float activations"
#endif
#undef RPI
#define RPI ROW_TILE                              /* a work-item's rows: one tile */
#ifdef RT_F16
#define RT_TILE_SIZE (16 * (size_t)K)             /* halves: runtime.tile's [K][16] */
#elif defined(RT_Q8)
#define RT_BYTES (16 * LOOM_Q8_0_BYTES)           /* a tile's block: 16 scales d, then 8 words */
#define RT_QS 32
#elif defined(RT_KQ)
#define RT_BYTES (16 * KQ_BYTES)                  /* a tile's superblock: 16 scales d (Q4_K: 16 dmin), then words */
#ifdef WEIGHT_Q4_K
#define RT_QS 64
#else
#define RT_QS 32
#endif
#else
#define RT_ACCS 4                                 /* T = 1: independent FMA chains per block */
#define RT_SHIFT(v, s) ((s) >= 0 ? (v) << (s) : (v) >> -(s))
#ifdef WEIGHT_Q4_0
#define RT_BYTES (16 * LOOM_Q4_0_BYTES)           /* a tile's block */
#define RT_QS 32                                  /* where its quant words start */
#define RT_BIAS 1.5f                              /* (f - RT_BIAS) RT_SCALE = u - 8 */
#elif defined(WEIGHT_Q4_1)
#define RT_BYTES (16 * LOOM_Q4_1_BYTES)           /* 16 scales d, 16 minimums m, the quant words */
#define RT_QS 64
#define RT_BIAS 1.0f                              /* u: w = u d + m */
#define RT_MIN 1
#else
#define RT_BYTES (16 * LOOM_Q5_0_BYTES)
#define RT_QS 96                                  /* after the fifth bits' word */
#define RT_BIAS 1.5f                              /* (f - 1.5) 32 = u - 16 */
#endif
/* Word j holds elements 4j + b (b = 0..3) in its low nibbles (bits 8b) and 4j + b +
 * 16 in its high ones. RT_WORD gives wl and wh, where RT_F finds element 4j + b
 * and 4j + b + 16 at bit RT_AT(b, 0) and RT_AT(b, 1): for Q5_0, the nibbles with
 * their fifth bits at bit 8b + 4, which tile_blocks placed in h so that one shift
 * and one bitselect a word join them (h's bit 8b + 4 + j is element 4j + b's, bit
 * 8b + j element 4j + b + 16's). */
#ifdef WEIGHT_Q5_0
#define RT_SCALE 32.0f
#define RT_TOP 18                                 /* the value's lowest bit in f: 1 + u/32 */
#define RT_MASK 0x007C0000u
#define RT_AT(b, hi) (8 * (b))
#define RT_HIGH_DECL(p) const uint16 h = vload16(0, (const __global uint *)((p) + 32));
#define RT_WORD(w, j) const uint16 wl = bitselect(h >> (j), (w), (uint16)(0x0F0F0F0Fu)), \
    wh = bitselect(h << (4 - (j)), (w) >> 4, (uint16)(0x0F0F0F0Fu));
#else
#define RT_SCALE 16.0f
#define RT_TOP 19                                 /* 1 + u/16 */
#define RT_MASK 0x00780000u
#define RT_AT(b, hi) (8 * (b) + 4 * (hi))
#define RT_HIGH_DECL(p)
#define RT_WORD(w, j) const uint16 wl = (w), wh = (w);
#endif
#define RT_F(v, b, hi) as_float16((RT_SHIFT(v, RT_TOP - RT_AT(b, hi)) & RT_MASK) | 0x3F800000u)

/* A block's sum s = sum(f x) for one token, x's own sum sx: w = (u - z) d gives
 * RT_SCALE d (s - RT_BIAS sx), w = u d + m (Q4_1) 16 d (s - sx) + m sx. Wider
 * tiles sum RT_W(f) x: f - RT_BIAS for Q4_0 and Q5_0; Q4_1 sums f itself, since it
 * needs each token's sx anyway (16 d s + (m - 16 d) sx). */
#ifdef RT_MIN
#define RT_MIN_DECL(p) const float16 m = vload_half16(1, (const __global half *)(p));
#define RT_BLOCK(acc, s, sx) fma(RT_SCALE * d, (s) - RT_BIAS * (sx), fma(m, (sx), (acc)))
#define RT_W(f) (f)
#else
#define RT_MIN_DECL(p)
#define RT_BLOCK(acc, s, sx) fma(RT_SCALE * d, (s) - RT_BIAS * (sx), (acc))
#define RT_W(f) ((f) - RT_BIAS)
#endif
#endif /* RT_Q8, RT_KQ */
#ifndef RT_TILE_SIZE
#define RT_TILE_SIZE ((size_t)(K / LOOM_QK) * RT_BYTES)   /* bytes a tile */
#endif
/* The first pass over an int8 tile streams it from memory, the work-item's own
 * 8-28 KB: a prefetch of the block RT_AHEAD blocks on (prefetcht0 on Intel's
 * runtime) keeps the loads ahead of the sums. Where it pays differs by CPU
 * (opencl/README.md): AVX2 (Zen 3) only at one token (Q4_0 decode +10 %, Q8_0
 * and Q4_1 +6 %; a tile re-read for more tokens lost 4 %); AVX512-VNNI (Zen 5)
 * only in cohorts, whose sums keep the core busy (8 rows of decode: Q8_0 24.3 ->
 * 19.5 ms a step, Q4_0 and Q4_1 -6 %), while one token's loads keep up alone
 * (Q4_0 decode 7 % faster without). Never on F16's float tiles, which lost
 * 6-30 % at any distance. Inside the tile only: a prefetch past a buffer is
 * undefined. RT_AHEAD 0: no prefetch. */
#ifndef RT_AHEAD
#define RT_AHEAD 4
#endif
#ifdef LOOM_DOT8_AVX2
#define RT_STREAMED(T, t0) (TPI == 1 && (T) == 1)          /* folds away in cohort programs */
#else
#define RT_STREAMED(T, t0) ((T) > 1 && (t0) == 0)
#endif
#if RT_AHEAD > 0
#define RT_PREFETCH(stream, p, bytes, left) \
    do { if ((stream) && (left) > RT_AHEAD) prefetch((p) + RT_AHEAD * (bytes), (bytes)); } while (0)
#else
#define RT_PREFETCH(stream, p, bytes, left) do { } while (0)
#endif

/* Token j's 16 sums of a tile to Y (rows >= nr are padding, not stored). */
__attribute__((always_inline)) inline void rt_store(
    const float16 *acc, const __global float *bias, __global float *Y, int ldy,
    int n0, const int nr, int t0, const int nt)
{
    #pragma unroll
    for (int j = 0; j < TPI; j++) {
        if (j < nt) {
            __global float *y = Y + (size_t)(t0 + j) * ldy + n0;
            if (n0 + 16 <= nr) {
                float16 v = acc[j];
#ifdef HAS_BIAS
                v += vload16(0, bias + n0);
#endif
#ifdef ACCUMULATE
                v += vload16(0, y);
#endif
                vstore16(v, 0, y);
            } else {
                #pragma unroll
                for (int r = 0; r < 16; r++)
                    if (n0 + r < nr)
                        mm_store(bias, y + r, n0 + r, acc[j][r]);
            }
        }
    }
}

/* silu(g) u, 16 lanes (elementwise.cl's silu_mul): matmul_glu's outputs, QX_GLU's inputs. */
inline float16 rt_glu16(float16 g, float16 u)
{
    return g / (1.0f + (float16)(loom_exp8(-g.lo), loom_exp8(-g.hi))) * u;
}

#ifndef RT_INT_ONLY
#ifdef RT_F16
/* ---- F16 rows in tiles of 16 (the param declared tiled(0, 16): runtime.tile) ----
 * A tile is [K][16] halves: element k of its 16 rows is one vector, so a
 * work-item's sums are outer products, a weight vector times one broadcast input
 * per token, with no horizontal sums; 6 tokens a tile hold 12 ymm accumulators
 * and load each weight vector once for all 6. Against 4 rows x 2 tokens of
 * row-major halves (8-wide dot products, a horizontal sum per output): 9728x896,
 * T = 128, Zen 3, Intel's runtime, 15.8 -> 12.5 ms (70 -> 89 G multiply-adds/s);
 * decode reads the tile in one stream (737 -> 640 us). A row's sum runs along K
 * in one chain (two at T = 1, k even and odd): relative error ~1e-6 of the
 * output scale at K = 896 against the row-major tile's 2.5e-7. */
#define RT_DEF_SUM1(NAME, AS)                                                      \
__attribute__((always_inline)) inline float16 NAME(const AS float *x, const __global half *p) \
{                                                                                  \
    float16 a0 = (float16)(0.0f), a1 = (float16)(0.0f);                            \
    for (int k = 0; k + 1 < K; k += 2) {                                           \
        a0 = fma(loom_ldh16(p + 16 * k), (float16)(x[k]), a0);                     \
        a1 = fma(loom_ldh16(p + 16 * (k + 1)), (float16)(x[k + 1]), a1);           \
    }                                                                              \
    if (K % 2)                                                                     \
        a0 = fma(loom_ldh16(p + 16 * (K - 1)), (float16)(x[K - 1]), a0);           \
    return a0 + a1;                                                                \
}
#else
/* One token's 16 sums of the tile at p: per block, sum f x and apply the block's
 * scale (and zero point or minimum) once (RT_BLOCK). xr: the token's K inputs, in
 * global memory (rt_sum1) or, normed, in the work-group's local copy (rt_sum1_local). */
#define RT_DEF_SUM1(NAME, AS)                                                      \
__attribute__((always_inline)) inline float16 NAME(const AS float *xr, const __global uchar *p) \
{                                                                                  \
    float16 acc = (float16)(0.0f);                                                 \
    for (int kb = 0; kb < K; kb += LOOM_QK, p += RT_BYTES) {                       \
        const float16 d = vload_half16(0, (const __global half *)p);              \
        RT_MIN_DECL(p)                                                             \
        RT_HIGH_DECL(p)                                                            \
        const AS float *x = xr + kb;                                               \
        const float16 xs = vload16(0, x) + vload16(1, x);                          \
        float16 s[RT_ACCS];                                                        \
        _Pragma("unroll")                                                          \
        for (int a = 0; a < RT_ACCS; a++)                                          \
            s[a] = (float16)(0.0f);                                                \
        _Pragma("unroll 1")                       /* a word at a time (above) */   \
        for (int j = 0; j < 4; j++) {                                              \
            const uint16 w = vload16(j, (const __global uint *)(p + RT_QS));       \
            RT_WORD(w, j)                                                          \
            _Pragma("unroll")                                                      \
            for (int b = 0; b < 4; b++) {                                          \
                const int c = 4 * j + b;                                           \
                s[2 * c % RT_ACCS] = fma(RT_F(wl, b, 0), x[c], s[2 * c % RT_ACCS]); \
                s[(2 * c + 1) % RT_ACCS] = fma(RT_F(wh, b, 1), x[c + 16], s[(2 * c + 1) % RT_ACCS]); \
            }                                                                      \
        }                                                                          \
        acc = RT_BLOCK(acc, (s[0] + s[1]) + (s[2] + s[3]), loom_hsum16(xs));       \
    }                                                                              \
    return acc;                                                                    \
}
#endif /* RT_F16 */
RT_DEF_SUM1(rt_sum1, __global)

#ifdef NORM_IN
RT_DEF_SUM1(rt_sum1_local, __local)
/* One token's inputs normed by the work-group together (every work-item calls it):
 * xl[0 .. K) = x g (rms_norm.cl's weight, element by element), and the returned
 * 1 / rms(x) scales the tile's sums once. The sum of squares is RT_NORM_PARTS
 * partial sums (part i: the 16-value chunks i, i + 8, ...), taken by the group's
 * items in turn, meeting in xl[K ..] and added in one order: every work-item
 * has the same scale, and a group of 4 the bits of a group of 8. A group costs
 * ~K/16 vector steps for all its tiles. */
#define RT_NORM_PARTS 8
#if WG > RT_NORM_PARTS
#error "matmul.cl: NORM_IN needs WG <= 8"
#endif
__attribute__((always_inline)) inline float rt_norm(const __global float *x, const __global float *g, float eps,
                                                    __local float *xl)
{
    barrier(CLK_LOCAL_MEM_FENCE);                 /* the previous token's reads are done */
    for (int i = get_local_id(0); i < RT_NORM_PARTS; i += WG) {
        float16 ss = (float16)(0.0f);
        for (int k = i * 16; k < K; k += 16 * RT_NORM_PARTS) {
            const float16 v = vload16(0, x + k);
            ss = fma(v, v, ss);
            vstore16(v * vload16(0, g + k), 0, xl + k);
        }
        xl[K + i] = loom_hsum16(ss);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    float total = 0.0f;
    for (int i = 0; i < RT_NORM_PARTS; i++)
        total += xl[K + i];
    return rsqrt(total / (float)K + eps);
}
#endif

/* Rows n0 .. n0 + 15 (one tile; rows >= nr are padding: computed, not stored) x nt
 * tokens from t0. One token: rt_sum1; wider F16 tiles are outer products per k,
 * wider block tiles take RT_W(f) once for their nt tokens (Q4_1 adds m sum(x) per
 * token and block). */
__attribute__((always_inline)) inline void mm_tile(
    const __global float *X, int ldx, const __global WTYPE *W,
    const __global float *bias, __global float *Y, int ldy,
    int n0, const int nr, int t0, const int nt)
{
    const __global WTYPE *p = W + (size_t)(n0 / 16) * RT_TILE_SIZE;
    const __global float *xrow[TPI];
    float16 acc[TPI];
    #pragma unroll
    for (int j = 0; j < TPI; j++) {
        xrow[j] = X + (size_t)(t0 + (j < nt ? j : nt - 1)) * ldx;
        acc[j] = (float16)(0.0f);
    }
    if (nt == 1) {
        acc[0] = rt_sum1(xrow[0], p);
    } else {
#ifdef RT_F16
        #pragma unroll 4
        for (int k = 0; k < K; k++) {
            const float16 w = loom_ldh16(p + 16 * k);
            #pragma unroll
            for (int t = 0; t < TPI; t++)
                if (t < nt)
                    acc[t] = fma(w, (float16)(xrow[t][k]), acc[t]);
        }
#else
        for (int kb = 0; kb < K; kb += LOOM_QK, p += RT_BYTES) {
            const float16 d = vload_half16(0, (const __global half *)p);
            RT_MIN_DECL(p)
            RT_HIGH_DECL(p)
            float16 s[TPI];
            #pragma unroll
            for (int j = 0; j < TPI; j++)
                s[j] = (float16)(0.0f);
            #pragma unroll 1
            for (int j = 0; j < 4; j++) {
                const uint16 w = vload16(j, (const __global uint *)(p + RT_QS));
                RT_WORD(w, j)
                #pragma unroll
                for (int b = 0; b < 4; b++) {
                    const float16 lo = RT_W(RT_F(wl, b, 0)), hi = RT_W(RT_F(wh, b, 1));
                    const int c = kb + 4 * j + b;
                    #pragma unroll
                    for (int t = 0; t < TPI; t++)
                        if (t < nt)
                            s[t] = fma(hi, xrow[t][c + 16], fma(lo, xrow[t][c], s[t]));
                }
            }
            #pragma unroll
            for (int j = 0; j < TPI; j++) {
#ifdef RT_MIN
                const float16 xs = vload16(0, xrow[j] + kb) + vload16(1, xrow[j] + kb);
                acc[j] = fma(RT_SCALE * d, s[j], fma(m - RT_SCALE * d, loom_hsum16(xs), acc[j]));
#else
                acc[j] = fma(RT_SCALE * d, s[j], acc[j]);
#endif
            }
        }
#endif /* RT_F16 */
    }
    rt_store(acc, bias, Y, ldy, n0, nr, t0, nt);
}

#ifdef NORM_IN
/* The tile at n0 for one token whose normed inputs the group holds in xl. */
__attribute__((always_inline)) inline void mm_tile_normed(
    const __local float *xl, float inv, const __global WTYPE *W, const __global float *bias,
    __global float *Y, int ldy, int n0, const int nr, int t0)
{
    float16 acc[1];
    acc[0] = inv * rt_sum1_local(xl, W + (size_t)(n0 / 16) * RT_TILE_SIZE);
    rt_store(acc, bias, Y, ldy, n0, nr, t0, 1);
}
#endif
#endif /* !RT_INT_ONLY */

#if defined(INT8_DOT) && INT8_DOT
/* ---- Tiles by int8 dot products (INT8_DOT: X is quantize_x's output) ----
 * On Intel's runtime where the CPU has AVX512-VNNI (the `int8_dot` device fact)
 * llama.loom quantizes the inputs of cohorts of two or more tokens once per
 * launch (quantize_x) and the tiles take vpdpbusd, reached by naming its LLVM
 * intrinsic (that compiler has no x86 builtins): for each of the 16 rows, four
 * unsigned weight bytes times four int8 inputs, 64 products where an FMA makes
 * 16. Each input is held as two int8 digits, x ~ s (h + l / 256) with s =
 * max|x| / 127 per block of 32, so the products carry about 16 bits of every
 * input: 2e-5 of the largest output where float sums give 3e-7, 256 times finer
 * than llama.cpp's single digit. Per word and token, four vpdpbusd (low and high
 * nibbles times h and l); per block and token the zero point starts the integer
 * sums (-z sum(h), -z sum(l)) and one conversion and two FMAs apply s and d.
 * Against the float tile, 9728x896 Q4_0 T = 64 on Zen 5: 2350 -> 1332 us
 * (opencl/README.md). */
#define RT_DOT 1
#define RT_NB (K / LOOM_QK)
#define RT_XQ 20                                   /* ints a block of quantize_x's output */
#if defined(DOT16) && DOT16 && !defined(WEIGHT_Q4_0)
#error "matmul.cl: DOT16 needs WEIGHT_Q4_0"
#endif
#if defined(RT_Q8) || defined(DOT16) && DOT16
#define RT_X16 1                                   /* the digits as int16s 256 h + l: vpmaddwd tiles */
#else
#define RT_X16 0
#endif
int8 rt_maddwd(short16 a, short16 b) __asm__("llvm.x86.avx2.pmadd.wd");
#ifdef LOOM_DOT8_AVX2
/* Without VNNI (the compiler defines LOOM_DOT8_AVX2 where device.int8_isa is "avx2"):
 * vpmaddubsw multiplies 32 weight bytes by 32 input digits and adds them in pairs
 * (int16 lanes, two a row), vpmaddwd adds the pairs. The pair sums of RT_SPAN words
 * add up in int16 first (at most 8 * 2 * 15 * 127 = 30480; 5-bit weights 4 * 2 * 31
 * * 127), then one vpmaddwd by 256 (h) and one by 1 (l) fold both digits into one
 * integer, 256 ih + il: f = that / 256 is the VNNI path's ih + il / 256, the same
 * float (a power of two scales the one rounding). */
typedef uchar rt_u8x32 __attribute__((ext_vector_type(32)));
typedef char rt_i8x32 __attribute__((ext_vector_type(32)));
short16 rt_maddubs(rt_u8x32 u, rt_i8x32 x) __asm__("llvm.x86.avx2.pmadd.ub.sw");
#define RT_MUB(u, x) rt_maddubs(__builtin_astype((u), rt_u8x32), __builtin_astype((int8)(x), rt_i8x32))
#define RT_PAIRS(s, k) ((int16)(rt_maddwd((s)[0], (short16)(k)), rt_maddwd((s)[1], (short16)(k))))
#else
typedef uchar rt_u8x64 __attribute__((ext_vector_type(64)));
typedef char rt_i8x64 __attribute__((ext_vector_type(64)));
int16 rt_dpbusd(int16 acc, rt_u8x64 u, rt_i8x64 x) __asm__("llvm.x86.avx512.vpdpbusd.512");
#define RT_DP(acc, u, x) rt_dpbusd((acc), __builtin_astype((u), rt_u8x64), __builtin_astype((int16)(x), rt_i8x64))
#endif
#if defined(WEIGHT_Q5_0)
#define RT_UL(wl) ((wl) & 0x1F1F1F1Fu)             /* element 4j + b's 5 bits in byte b */
#define RT_UH(wh) ((wh) & 0x1F1F1F1Fu)
#define RT_Z 16
#define RT_SPAN 2
#else
#define RT_SPAN 4
#define RT_UL(wl) ((wl) & 0x0F0F0F0Fu)
#define RT_UH(wh) (((wh) >> 4) & 0x0F0F0F0Fu)
#ifdef RT_MIN
#define RT_Z 0
#else
#define RT_Z 8
#endif
#endif

#if RT_X16
/* ---- Tiles on vpmaddwd: Q8_0, and Q4_0 cohorts (DOT16) ----
 * A Q8_0 weight is signed, so vpmaddubsw (unsigned times signed bytes, pairs
 * saturating at 32767) cannot take it; vpmaddwd can, on int16s: an input's two
 * digits as one int16 256 h + l (quantize_x's x16 layout), the weights widened
 * in the register, 16 products an instruction into int32 row sums with no fold:
 * 256 (ih + il / 256), the other tiles' integers exactly. Word j of 8 rows as
 * int16 lanes [b0 b1][b2 b3] a row gives pairs of elements whose inputs sit in
 * one int of the x16 layout (values 4i, 4i + 2 | 4i + 1, 4i + 3), one 32-bit
 * broadcast each. Q8_0 (W16_PAIRS 2): a left and a right arithmetic shift by 8
 * give e0, e2 sign-extended, one right shift e1, e3; |sum| <= 32 * 128 * 32639
 * < 2^31 a block. Q4_0: four masks give the nibbles of 4j, 4j + 2 | 4j + 1,
 * 4j + 3 | 4j + 16, 4j + 18 | 4j + 17, 4j + 19, and the zero point starts the
 * sums (-8 sum(x16)): where vpmaddubsw took both digits apart and folded its
 * int16 pairs, a product of a nibble and a whole input is one lane. Two int8
 * accumulators a token (rows 0-7, 8-15). */
#ifdef RT_Q8
#ifndef LOOM_DOT8_AVX2
/* With AVX512-VNNI a word of all 16 rows is one zmm of int16 pairs and vpdpwssd
 * multiplies, pairs and accumulates them in one instruction, 32 products, where
 * AVX2's vpmaddwd then vpaddd took 16 in two: the same integers, so the same
 * bits. */
#define RT_Q8_DP 1
typedef short rt_i16x32 __attribute__((ext_vector_type(32)));
int16 rt_dpwssd(int16 acc, rt_i16x32 a, rt_i16x32 b) __asm__("llvm.x86.avx512.vpdpwssd.512");
#endif
#define W16_WORDS 8
#define W16_PAIRS 2
#define W16_UNPACK(w, u) (u[0] = (as_short16(w) << (short)8) >> (short)8, u[1] = as_short16(w) >> (short)8)
#define W16_X(j, i) (2 * (j) + (i))                /* the input int paired with u[i] of word j */
#define W16_Z 0
#else
#define W16_WORDS 4
#define W16_PAIRS 4
#define W16_M 0x000F000Fu
#define W16_UNPACK(w, u) (u[0] = as_short16((w) & W16_M), u[1] = as_short16(((w) >> 8) & W16_M), \
    u[2] = as_short16(((w) >> 4) & W16_M), u[3] = as_short16(((w) >> 12) & W16_M))
#define W16_X(j, i) (2 * (j) + 8 * ((i) / 2) + (i) % 2)
#define W16_Z 8
#if TPI == 1
/* One token (decode) is bound by the unpacking: an int16 lane [b0 b1] holds the
 * nibbles of elements 4j | 4j + 16 | 4j + 1 | 4j + 17 at bits 0, 4, 8, 12, so one
 * op each leaves them in place: three masks give e, 16 e and 256 e, a logical
 * shift by 12 the top one (4 ops a word-half where 7 were). The x16 and x256
 * products sum apart (|sum| <= 8 * 3840 * 32640 < 2^31 a block) and fold once a
 * block by exact shifts: the same integers, so the same bits. Wider tiles keep
 * the masks: three sums a token would spill. */
#define W16_INPLACE 1
#endif
#endif
__attribute__((always_inline)) inline void mm_tile_dot(
    const __global int *XQ, const __global WTYPE *W, const __global float *bias, __global float *Y, int ldy,
    int n0, const int nr, int t0, const int nt, const int stream)
{
    const __global uchar *p = W + (size_t)(n0 / 16) * RT_NB * RT_BYTES;
    const __global int *xq[TPI];
    float16 acc[TPI];
    #pragma unroll
    for (int t = 0; t < TPI; t++) {
        xq[t] = XQ + (size_t)(t0 + (t < nt ? t : nt - 1)) * RT_NB * RT_XQ;
        acc[t] = (float16)(0.0f);
    }
    for (int kb = 0; kb < RT_NB; kb++, p += RT_BYTES) {
        RT_PREFETCH(stream, p, RT_BYTES, RT_NB - kb);
        const float16 d = vload_half16(0, (const __global half *)p);
        int8 s[TPI][2];                            /* rows 0-7, 8-15 */
        #pragma unroll
        for (int t = 0; t < TPI; t++)
            s[t][0] = s[t][1] = (int8)(-W16_Z * (256 * xq[t][kb * RT_XQ + 17] + xq[t][kb * RT_XQ + 18]));
#ifdef RT_Q8_DP
        int16 s16[TPI], s16b[TPI];                 /* the 16 rows' sums, two chains a token up to 4 */
        #pragma unroll
        for (int t = 0; t < TPI; t++)
            s16[t] = s16b[t] = (int16)(0);
#endif
#ifdef W16_INPLACE
        const __global int *x = xq[0] + kb * RT_XQ;
        int8 s16[2] = {(int8)(0), (int8)(0)}, s256[2] = {(int8)(0), (int8)(0)};
        #pragma unroll 2
        for (int j = 0; j < W16_WORDS; j++) {
            const uint16 w = vload16(j, (const __global uint *)(p + RT_QS));
            #pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint8 v = h ? w.hi : w.lo;
                s[0][h] += rt_maddwd(as_short16(v & 0x000F000Fu), as_short16((int8)(x[2 * j])))
                         + rt_maddwd(as_short16(as_ushort16(v) >> (ushort)12), as_short16((int8)(x[2 * j + 9])));
                s16[h] += rt_maddwd(as_short16(v & 0x00F000F0u), as_short16((int8)(x[2 * j + 8])));
                s256[h] += rt_maddwd(as_short16(v & 0x0F000F00u), as_short16((int8)(x[2 * j + 1])));
            }
        }
        #pragma unroll
        for (int h = 0; h < 2; h++)
            s[0][h] += (s16[h] >> 4) + (s256[h] >> 8);
#elif defined(RT_Q8_DP)
        #pragma unroll 2
        for (int j = 0; j < W16_WORDS; j++) {
            const rt_i16x32 w = __builtin_astype(vload16(j, (const __global uint *)(p + RT_QS)), rt_i16x32);
            const rt_i16x32 u0 = (w << (short)8) >> (short)8, u1 = w >> (short)8;
            #pragma unroll
            for (int t = 0; t < TPI; t++) {
                if (t < nt) {
                    const __global int *x = xq[t] + kb * RT_XQ;
                    s16[t] = rt_dpwssd(s16[t], u0, __builtin_astype((int16)(x[W16_X(j, 0)]), rt_i16x32));
                    if (TPI > 4)                   /* one chain a token: two would spill */
                        s16[t] = rt_dpwssd(s16[t], u1, __builtin_astype((int16)(x[W16_X(j, 1)]), rt_i16x32));
                    else
                        s16b[t] = rt_dpwssd(s16b[t], u1, __builtin_astype((int16)(x[W16_X(j, 1)]), rt_i16x32));
                }
            }
        }
#else
        #pragma unroll 2
        for (int j = 0; j < W16_WORDS; j++) {
            const uint16 w = vload16(j, (const __global uint *)(p + RT_QS));
            #pragma unroll
            for (int h = 0; h < 2; h++) {
                short16 u[W16_PAIRS];
                W16_UNPACK(h ? w.hi : w.lo, u);
                #pragma unroll
                for (int t = 0; t < TPI; t++) {
                    if (t < nt) {
                        const __global int *x = xq[t] + kb * RT_XQ;
                        #pragma unroll
                        for (int i = 0; i < W16_PAIRS; i += 2)
                            s[t][h] += rt_maddwd(u[i], as_short16((int8)(x[W16_X(j, i)])))
                                     + rt_maddwd(u[i + 1], as_short16((int8)(x[W16_X(j, i + 1)])));
                    }
                }
            }
        }
#endif
        #pragma unroll
        for (int t = 0; t < TPI; t++) {
            if (t < nt) {
                const float sx = as_float(xq[t][kb * RT_XQ + 16]);
#ifdef RT_Q8_DP
                const int16 si = s16[t] + s16b[t];
#else
                const int16 si = (int16)(s[t][0], s[t][1]);
#endif
                acc[t] = fma(d, convert_float16(si) * (sx / 256.0f), acc[t]);
            }
        }
    }
    rt_store(acc, bias, Y, ldy, n0, nr, t0, nt);
}
#elif defined(RT_KQ)
/* ---- Q4_K and Q6_K tiles (int8 dot products only) ----
 * tile_blocks lays a superblock of 16 rows out as for the 32-value blocks: the
 * rows' d (Q4_K: then dmin) as halves, then word w (bytes 4w .. 4w + 3 of the
 * rest) of the 16 rows side by side. Q4_K: words 0-2 the packed 6-bit scales
 * and minimums, 3-34 the nibbles (32-value sub-block 2c in the low nibbles of
 * words 3 + 8c .. 10 + 8c, 2c + 1 in their high ones). Q6_K: words 0-31 the low
 * nibbles, 32-47 the high bit pairs, 48-51 the sixteen int8 scales (one per 16
 * values). Per sub-block the digits' products add up as integers (KQ_ADD, KQ_FOLD:
 * 256 ih + il, as the tiles above), then the row's scale applies once:
 * Q4_K d sc (that sum) - dmin m sum(x); Q6_K d sc (that sum - 32 sum(x)) per 16
 * values, sum(x) of the first 16 from quantize_x's q[19]. Unsigned digits (Q6_K
 * u = q + 32 < 64) keep vpmaddubsw's pairs in range: 2 * 63 * 127 < 32768. */
#ifdef LOOM_DOT8_AVX2
#define KQ_SUMS short16 sh[TPI][2], sl[TPI][2]
#define KQ_ZERO(t) (sh[t][0] = sh[t][1] = sl[t][0] = sl[t][1] = (short16)(0))
#define KQ_ADD(t, u, xh, xl) do { sh[t][0] += RT_MUB((u).lo, xh); sh[t][1] += RT_MUB((u).hi, xh); \
    sl[t][0] += RT_MUB((u).lo, xl); sl[t][1] += RT_MUB((u).hi, xl); } while (0)
#define KQ_FOLD(t) (RT_PAIRS(sh[t], 256) + RT_PAIRS(sl[t], 1))
#else
#define KQ_SUMS int16 ih[TPI], il[TPI]
#define KQ_ZERO(t) (ih[t] = il[t] = (int16)(0))
#define KQ_ADD(t, u, xh, xl) do { ih[t] = RT_DP(ih[t], u, xh); il[t] = RT_DP(il[t], u, xl); } while (0)
#define KQ_FOLD(t) (256 * ih[t] + il[t])
#endif
#define KQ_BYTE(v, b) convert_float16(((v) >> (8 * (b))) & 0xFFu)
/* One token a tile (decode) is bound by the stream and by Q6_K's unpacking: the
 * next superblock is prefetched while this one is summed (prefetch(): prefetcht0
 * a line on Intel's runtime), and Q6_K's sub-blocks unroll so that their shifts
 * and word offsets are constants. Zen 3, Intel 2026.2: Q6_K 4864x4864 at T = 1,
 * weights streamed, 2.28 -> 1.61 ms (Q4_K 0.84-0.92 ms with or without); the
 * Q4_K_M bench file's decode 53.9 -> 59.3 tok/s (medians of 7 alternating, one
 * process). Wider tiles reuse each superblock for their tokens: unrolled, Q4_K_M
 * prefill lost 165 -> 147 tok/s, so they keep the loops; on AVX512-VNNI their
 * first pass prefetches too (RT_STREAMED; Zen 5: Q4_K_M 4 rows of decode 14.7 ->
 * 11.4 ms a step, 8 rows 20.2 -> 17.4). */
#if TPI == 1
#define KQ6_UNROLL _Pragma("unroll")
#else
#define KQ6_UNROLL _Pragma("unroll 1")
#endif

__attribute__((always_inline)) inline void mm_tile_dot(
    const __global int *XQ, const __global WTYPE *W, const __global float *bias, __global float *Y, int ldy,
    int n0, const int nr, int t0, const int nt, const int stream)
{
    const __global uchar *p = W + (size_t)(n0 / 16) * (K / LOOM_QK_K) * RT_BYTES;
    const __global int *xq[TPI];
    float16 acc[TPI];
    #pragma unroll
    for (int t = 0; t < TPI; t++) {
        xq[t] = XQ + (size_t)(t0 + (t < nt ? t : nt - 1)) * RT_NB * RT_XQ;
        acc[t] = (float16)(0.0f);
    }
    for (int kb = 0; kb < RT_NB; kb += 8, p += RT_BYTES) {
        if ((TPI == 1 || stream) && kb + 8 < RT_NB)  /* within the tile: a prefetch past a buffer is undefined */
            prefetch(p + RT_BYTES, RT_BYTES);        /* the next superblock (above; cohorts: RT_STREAMED) */
        const float16 d = vload_half16(0, (const __global half *)p);
        const __global uint *wp = (const __global uint *)(p + RT_QS);
#ifdef WEIGHT_Q4_K
        const float16 dmin = vload_half16(1, (const __global half *)p);
        const uint16 s0 = vload16(0, wp), s1 = vload16(1, wp), s2 = vload16(2, wp);
        const uint16 sc_lo = s0 & 0x3F3F3F3Fu, m_lo = s1 & 0x3F3F3F3Fu;      /* sub-blocks 0-3 */
        const uint16 sc_hi = (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u);   /* 4-7 */
        const uint16 m_hi = ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
        #pragma unroll 1
        for (int i = 0; i < 8; i++) {
            KQ_SUMS;
            #pragma unroll
            for (int t = 0; t < TPI; t++)
                KQ_ZERO(t);
            #pragma unroll 1
            for (int j = 0; j < 8; j++) {            /* 8 * 2 * 15 * 127 < 32768 */
                const uint16 u = (vload16(3 + 8 * (i / 2) + j, wp) >> (4 * (i % 2))) & 0x0F0F0F0Fu;
                #pragma unroll
                for (int t = 0; t < TPI; t++)
                    if (t < nt)
                        KQ_ADD(t, u, xq[t][(kb + i) * RT_XQ + j], xq[t][(kb + i) * RT_XQ + 8 + j]);
            }
            const float16 ds = d * KQ_BYTE(i < 4 ? sc_lo : sc_hi, i % 4);
            const float16 dm = dmin * KQ_BYTE(i < 4 ? m_lo : m_hi, i % 4);
            #pragma unroll
            for (int t = 0; t < TPI; t++) {
                if (t < nt) {
                    const __global int *x = xq[t] + (kb + i) * RT_XQ;
                    const float sx = as_float(x[16]);
                    const float xsum = sx * ((float)x[17] + (float)x[18] / 256.0f);
                    const float16 f = convert_float16(KQ_FOLD(t)) * (1.0f / 256.0f);
                    acc[t] = fma(ds, f * sx, fma(-dm, xsum, acc[t]));
                }
            }
        }
#else   /* Q6_K */
        KQ6_UNROLL
        for (int i = 0; i < 8; i++) {                /* sub-block i: hf n = i / 4, k = i % 4 of it */
            const int n = i / 4, k = i % 4;
            int16 hl[TPI][2];
            KQ6_UNROLL
            for (int hf = 0; hf < 2; hf++) {
                KQ_SUMS;
                #pragma unroll
                for (int t = 0; t < TPI; t++) {
                    KQ_ZERO(t);
                    hl[t][hf] = (int16)(0);
                }
                #pragma unroll
                for (int j = 4 * hf; j < 4 * hf + 4; j++) {
                    const uint16 ql = vload16(16 * n + 8 * (k % 2) + j, wp), qh = vload16(32 + 8 * n + j, wp);
                    const uint16 u = ((ql >> (4 * (k / 2))) & 0x0F0F0F0Fu) | (((qh >> (2 * k)) << 4) & 0x30303030u);
                    #pragma unroll
                    for (int t = 0; t < TPI; t++) {
                        if (t < nt) {
                            KQ_ADD(t, u, xq[t][(kb + i) * RT_XQ + j], xq[t][(kb + i) * RT_XQ + 8 + j]);
                            if (j % 2 == 1) {        /* 2 * 2 * 63 * 127 < 32768: fold every two words */
                                hl[t][hf] += KQ_FOLD(t);
                                KQ_ZERO(t);
                            }
                        }
                    }
                }
            }
            const uint16 sw = vload16(48 + i / 2, wp);   /* scales 2i, 2i + 1: bytes 2 (i % 2), + 1 */
            const float16 sc0 = convert_float16(as_int16(sw << (24 - 16 * (i % 2))) >> 24);
            const float16 sc1 = convert_float16(as_int16(sw << (16 - 16 * (i % 2))) >> 24);
            #pragma unroll
            for (int t = 0; t < TPI; t++) {
                if (t < nt) {
                    const __global int *x = xq[t] + (kb + i) * RT_XQ;
                    const int h0 = (short)(x[19] & 0xFFFF), l0 = x[19] >> 16;   /* the first 16 values' digit sums */
                    const int z0 = 32 * (256 * h0 + l0), z1 = 32 * (256 * (x[17] - h0) + x[18] - l0);
                    const float16 g = fma(convert_float16(hl[t][0] - z0), sc0, convert_float16(hl[t][1] - z1) * sc1);
                    acc[t] = fma(d, g * (as_float(x[16]) / 256.0f), acc[t]);
                }
            }
        }
#endif
    }
    rt_store(acc, bias, Y, ldy, n0, nr, t0, nt);
}
#else
/* The tile of mm_tile for nt tokens from t0, X as quantize_x wrote it. */
__attribute__((always_inline)) inline void mm_tile_dot(
    const __global int *XQ, const __global WTYPE *W, const __global float *bias, __global float *Y, int ldy,
    int n0, const int nr, int t0, const int nt, const int stream)
{
    const __global uchar *p = W + (size_t)(n0 / 16) * RT_NB * RT_BYTES;
    const __global int *xq[TPI];
    float16 acc[TPI];
    #pragma unroll
    for (int t = 0; t < TPI; t++) {
        xq[t] = XQ + (size_t)(t0 + (t < nt ? t : nt - 1)) * RT_NB * RT_XQ;
        acc[t] = (float16)(0.0f);
    }
    for (int kb = 0; kb < RT_NB; kb++, p += RT_BYTES) {
        RT_PREFETCH(stream, p, RT_BYTES, RT_NB - kb);
        const float16 d = vload_half16(0, (const __global half *)p);
        RT_MIN_DECL(p)
        RT_HIGH_DECL(p)
#ifdef LOOM_DOT8_AVX2
        int16 hl[TPI];                             /* 256 ih + il */
        short16 sh[TPI][2], sl[TPI][2];            /* pair sums of h and l, each row's 16 rows in two halves */
        #pragma unroll
        for (int t = 0; t < TPI; t++) {
            hl[t] = (int16)(-RT_Z * (256 * xq[t][kb * RT_XQ + 17] + xq[t][kb * RT_XQ + 18]));
            sh[t][0] = sh[t][1] = sl[t][0] = sl[t][1] = (short16)(0);
        }
        #pragma unroll 1
        for (int j = 0; j < 4; j++) {
            const uint16 w = vload16(j, (const __global uint *)(p + RT_QS));
            RT_WORD(w, j)
            const uint16 ul = RT_UL(wl), uh = RT_UH(wh);
            #pragma unroll
            for (int t = 0; t < TPI; t++) {
                if (t < nt) {
                    const __global int *x = xq[t] + kb * RT_XQ;
                    sh[t][0] += RT_MUB(ul.lo, x[j]) + RT_MUB(uh.lo, x[4 + j]);
                    sh[t][1] += RT_MUB(ul.hi, x[j]) + RT_MUB(uh.hi, x[4 + j]);
                    sl[t][0] += RT_MUB(ul.lo, x[8 + j]) + RT_MUB(uh.lo, x[12 + j]);
                    sl[t][1] += RT_MUB(ul.hi, x[8 + j]) + RT_MUB(uh.hi, x[12 + j]);
                    if ((j + 1) % RT_SPAN == 0) {
                        hl[t] += RT_PAIRS(sh[t], 256) + RT_PAIRS(sl[t], 1);
                        sh[t][0] = sh[t][1] = sl[t][0] = sl[t][1] = (short16)(0);
                    }
                }
            }
        }
#else
        int16 ih[TPI], il[TPI];
        #pragma unroll
        for (int t = 0; t < TPI; t++) {
            ih[t] = (int16)(-RT_Z * xq[t][kb * RT_XQ + 17]);
            il[t] = (int16)(-RT_Z * xq[t][kb * RT_XQ + 18]);
        }
        #pragma unroll 1
        for (int j = 0; j < 4; j++) {
            const uint16 w = vload16(j, (const __global uint *)(p + RT_QS));
            RT_WORD(w, j)
            const uint16 ul = RT_UL(wl), uh = RT_UH(wh);
            #pragma unroll
            for (int t = 0; t < TPI; t++) {
                if (t < nt) {
                    const __global int *x = xq[t] + kb * RT_XQ;
                    ih[t] = RT_DP(RT_DP(ih[t], ul, x[j]), uh, x[4 + j]);
                    il[t] = RT_DP(RT_DP(il[t], ul, x[8 + j]), uh, x[12 + j]);
                }
            }
        }
#endif
        #pragma unroll
        for (int t = 0; t < TPI; t++) {
            if (t < nt) {
                const __global int *x = xq[t] + kb * RT_XQ;
                const float sx = as_float(x[16]);
#ifdef LOOM_DOT8_AVX2
                const float16 f = convert_float16(hl[t]) * (1.0f / 256.0f);
#else
                const float16 f = fma(convert_float16(il[t]), 1.0f / 256.0f, convert_float16(ih[t]));
#endif
#ifdef RT_MIN
                const float xsum = sx * ((float)x[17] + (float)x[18] / 256.0f);
                acc[t] = fma(d, f * sx, fma(m, xsum, acc[t]));
#else
                acc[t] = fma(d, f * sx, acc[t]);
#endif
            }
        }
    }
    rt_store(acc, bias, Y, ldy, n0, nr, t0, nt);
}
#endif /* RT_Q8, RT_KQ */

/* X [T, ldx] -> XQ [T, K / 32 blocks of RT_XQ ints]: one work-item a block and
 * token, once per launch for every matmul that reads it. The launch before it
 * can fold in: QX_NORM, X's rows RMS-normed first (rms_norm.cl with its weight:
 * (x / rms(x)) g; two more arguments, norm_w and eps; a work-group per token,
 * local size (K / 32, 1), whose items add their blocks' squares in local memory
 * in one order); QX_GLU, X is gate | up rows ([T, 2K], ldx = 2K) and the values
 * are silu(gate) up (elementwise.cl's silu_mul). */
/* A block's sum of squares, and 1 / rms of a row from its nb blocks' sums added
 * in block order: QX_NORM and QX_TAIL share them, so the same bits. */
inline float rt_squares32(const float16 lo, const float16 hi)
{
    return loom_hsum16(fma(hi, hi, lo * lo));
}

inline float rt_inv_rms(const __local float *part, int nb, int k, float eps)
{
    float total = 0.0f;
    for (int i = 0; i < nb; i++)
        total += part[i];
    return rsqrt(total / (float)k + eps);
}

#ifdef QX_NORM
__kernel __attribute__((reqd_work_group_size(RT_NB, 1, 1)))
void quantize_x(const __global float *X, int ldx, __global int *XQ, int T, const __global float *norm_w, float eps)
{
    __local float part[RT_NB];
    const int b = get_global_id(0), t = get_global_id(1);
    const __global float *x = X + (size_t)t * ldx + b * LOOM_QK;
    float16 lo = vload16(0, x), hi = vload16(1, x);
    part[b] = rt_squares32(lo, hi);
    barrier(CLK_LOCAL_MEM_FENCE);
    const float inv = rt_inv_rms(part, RT_NB, K, eps);
    lo = lo * inv * vload16(0, norm_w + b * LOOM_QK);
    hi = hi * inv * vload16(1, norm_w + b * LOOM_QK);
    if (t < T)
        loom_quantize32(lo, hi, XQ + ((size_t)t * RT_NB + b) * RT_XQ, RT_X16);
}
#else
__kernel void quantize_x(const __global float *X, int ldx, __global int *XQ, int T)
{
    const int b = get_global_id(0), t = get_global_id(1);
    if (b >= RT_NB || t >= T)
        return;
    const __global float *x = X + (size_t)t * ldx + b * LOOM_QK;
    float16 lo = vload16(0, x), hi = vload16(1, x);
#ifdef QX_GLU
    lo = rt_glu16(lo, vload16(0, x + K));
    hi = rt_glu16(hi, vload16(1, x + K));
#endif
    loom_quantize32(lo, hi, XQ + ((size_t)t * RT_NB + b) * RT_XQ, RT_X16);
}
#endif

/* QX_TAIL (a matmul or matmul_cat on these tiles): the next projection's
 * quantize_x folded into this launch, done by its last work-group. Each group
 * adds one to *done once its tiles are stored; the one that finds every other
 * group counted quantizes Y's T rows as the consumer's quantize_x would and
 * sets *done back to 0 for the next launch (a state that starts at zero). The
 * add is a locked instruction, a full fence on x86, where Intel's runtime (the
 * only one INT8_DOT runs on) puts every group: the others' stores are visible
 * to the last one. QX_TAIL 1: the rows RMS-normed first (QX_NORM's sums in its
 * order, so the same bits), norm_w and eps; 2: silu(gate) up of gate | up rows
 * (QX_GLU's). QX_K: the consumer's K (Y's row is QX_K wide, 2 QX_K for 2);
 * QX_X16: its digits' layout. Decode saves the quantize_x launch, ~15 us on a
 * 2-core host, three a layer; the tail's few microseconds on one core are less. */
#ifdef QX_TAIL
#define QX_NB (QX_K / LOOM_QK)
__attribute__((always_inline)) inline void qx_tail(const __global float *Y, int ldy, int T, __global int *XQ,
                                                  const __global float *norm_w, float eps,
                                                  volatile __global int *done, __local float *part, __local int *last)
{
    const int lid = get_local_id(0);
    barrier(CLK_GLOBAL_MEM_FENCE);                /* this group's stores are done */
    if (lid == 0)
        *last = atomic_inc(done) == (int)(get_num_groups(0) * get_num_groups(1)) - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!*last)
        return;
    for (int t = 0; t < T; t++) {
        const __global float *y = Y + (size_t)t * ldy;
#if QX_TAIL == 1
        for (int b = lid; b < QX_NB; b += WG)
            part[b] = rt_squares32(vload16(0, y + b * LOOM_QK), vload16(1, y + b * LOOM_QK));
        barrier(CLK_LOCAL_MEM_FENCE);
        const float inv = rt_inv_rms(part, QX_NB, QX_K, eps);
#endif
        for (int b = lid; b < QX_NB; b += WG) {
            float16 lo = vload16(0, y + b * LOOM_QK), hi = vload16(1, y + b * LOOM_QK);
#if QX_TAIL == 1
            lo = lo * inv * vload16(0, norm_w + b * LOOM_QK);
            hi = hi * inv * vload16(1, norm_w + b * LOOM_QK);
#else
            lo = rt_glu16(lo, vload16(0, y + QX_K + b * LOOM_QK));
            hi = rt_glu16(hi, vload16(1, y + QX_K + b * LOOM_QK));
#endif
            loom_quantize32(lo, hi, XQ + ((size_t)t * QX_NB + b) * RT_XQ, QX_X16);
        }
        barrier(CLK_LOCAL_MEM_FENCE);             /* part is read before the next row writes it */
    }
    if (lid == 0)
        atomic_xchg(done, 0);
}
#endif
#endif /* INT8_DOT */

#else
/* One register tile: RPI rows from n0 x nt tokens from t0. nt is a literal at
 * each call site, so after inlining the token loops have constant trip counts. */
__attribute__((always_inline)) inline void mm_tile(
    const __global float *X, int ldx, const __global WTYPE *W,
    const __global float *bias, __global float *Y, int ldy,
    int n0, const int nr, int t0, const int nt)
{
    const __global WTYPE *wrow[RPI];
    #pragma unroll
    for (int r = 0; r < RPI; r++)
        wrow[r] = W + (size_t)(n0 + r < nr ? n0 + r : nr - 1) * ROW_STRIDE;
    const __global float *xrow[TPI];
    #pragma unroll
    for (int j = 0; j < TPI; j++)
        xrow[j] = X + (size_t)(t0 + (j < nt ? j : nt - 1)) * ldx;

    VF acc[RPI][TPI][NACC];
    #pragma unroll
    for (int r = 0; r < RPI; r++)
        #pragma unroll
        for (int j = 0; j < TPI; j++)
            #pragma unroll
            for (int a = 0; a < NACC; a++)
                acc[r][j][a] = (VF)(0.0f);

    for (int kb0 = 0; kb0 < K_MAIN; kb0 += MM_KBLOCK) {
        MM_SB_DECL
        #pragma unroll
        for (int kb = kb0; kb < kb0 + MM_KBLOCK; kb += KSTEP) {
            MM_WSCALE_DECL
            #pragma unroll
            for (int c = 0; c < KSTEP; c += VW) {
                VF w[RPI];
                #pragma unroll
                for (int r = 0; r < RPI; r++)
                    w[r] = WLOAD(r, kb, c);
                #pragma unroll
                for (int j = 0; j < TPI; j++) {
                    if (j < nt) {
                        VF x = VLOAD(xrow[j] + kb + c);
                        #pragma unroll
                        for (int r = 0; r < RPI; r++)
                            acc[r][j][((kb - kb0 + c) / VW) % NACC] += w[r] * x;
                    }
                }
            }
        }
    }

    #pragma unroll
    for (int r = 0; r < RPI; r++) {
        int n = n0 + r;
        #pragma unroll
        for (int j = 0; j < TPI; j++) {
            if (j < nt && n < nr) {
                VF sum = acc[r][j][0];
                #pragma unroll
                for (int a = 1; a < NACC; a++)
                    sum += acc[r][j][a];
                float s = HSUM(sum);
#if K_MAIN < K
                for (int k = K_MAIN; k < K; k++) {
#if defined(WEIGHT_F16)
                    s += loom_ldh(wrow[r] + k) * xrow[j][k];
#else
                    s += wrow[r][k] * xrow[j][k];
#endif
                }
#endif
                mm_store(bias, Y + (size_t)(t0 + j) * ldy + n, n, s);
            }
        }
    }
}

#endif /* ROW_TILE */

/* Vector conversions for ACT_Q8: clang's builtin where the compiler is clang (PoCL's
 * convert_* of int vectors miscompiled), the OpenCL C built-in elsewhere. */
#if defined(__clang__)
#define MM_CVT(v, type) __builtin_convertvector((v), type)
#else
#define MM_CVT(v, type) convert_##type(v)
#endif

#ifdef ACT_Q8
/* ---- int8 activations (ACT_Q8): the llama.cpp scheme ----
 * Each work-group quantizes the TPI tokens of its current tile into local
 * memory, per 32-element block b of token t: dx = max|x| / 127 (float),
 * qx = round-to-nearest-even(x * (1 / dx)) in [-127, 127] (0 when dx = 0), and
 * for Q4_0 sx = sum(qx). A block's dot with a weight block is an int32 sum of
 * int8 x int8 products, scaled once: dw * dx * sum(qw * qx); Q4_0 uses the
 * unsigned nibbles u (qw = u - 8): dw * dx * (sum(u * qx) - 8 * sx). */
#if !defined(WEIGHT_Q8_0) && !defined(WEIGHT_Q4_0)
#error "matmul.cl: ACT_Q8 needs WEIGHT_Q8_0 or WEIGHT_Q4_0"
#endif
#define NB (K / LOOM_QK)

/* One block of activations: 32 floats -> 32 int8 at q, scale *d, sum *s. */
__attribute__((always_inline)) inline void mm_quantize_block(
    const __global float *x, __local char *q, __local float *d, __local int *s)
{
#pragma OPENCL FP_CONTRACT OFF
    float16 a = loom_ld_float16(x), b = loom_ld_float16(x + 16);
    float16 aa = as_float16(as_uint16(a) & 0x7fffffffu), ab = as_float16(as_uint16(b) & 0x7fffffffu);
    float16 m16 = aa > ab ? aa : ab;
    float8 m8 = m16.lo > m16.hi ? m16.lo : m16.hi;
    float4 m4 = m8.lo > m8.hi ? m8.lo : m8.hi;
    float2 m2 = m4.lo > m4.hi ? m4.lo : m4.hi;
    float amax = m2.x > m2.y ? m2.x : m2.y;
    float dx = amax / 127.0f;
    float id = dx != 0.0f ? 1.0f / dx : 0.0f;
    /* round to nearest even: |x * id| <= 127.x, far below 2^22 */
    float16 va = a * id, vb = b * id;
    int16 qa = as_int16(va + 12582912.0f) - 0x4B400000;
    int16 qb = as_int16(vb + 12582912.0f) - 0x4B400000;
    /* MM_CVT: PoCL 3.0's convert_char16(int16) returned zeros here */
    *(__local char16 *)q = MM_CVT(qa, char16);
    *(__local char16 *)(q + 16) = MM_CVT(qb, char16);
    *d = dx;
#ifdef WEIGHT_Q4_0
    int16 t16 = qa + qb;
    int8 t8 = t16.lo + t16.hi;
    int4 t4 = t8.lo + t8.hi;
    *s = (t4.x + t4.y) + (t4.z + t4.w);
#endif
}

/* Integer block dots: MM_WPREP(r) loads row r's weight block b into wq[r]
 * (and wv[r]); MM_DOT(r, xv) is an int8 whose lanes sum to the block's
 * integer dot (Q4_0: sum(u * qx), the -8 * sx term is added by the caller). */
#if defined(__AVX2__) && !defined(LOOM_USE_BUILTINS) && !defined(MM_PORTABLE)
typedef char mm_v32qi __attribute__((vector_size(32)));
typedef uchar mm_v16qu __attribute__((vector_size(16)));
typedef short mm_v16hi __attribute__((vector_size(32)));
typedef int mm_v8si __attribute__((vector_size(32)));
typedef struct __attribute__((packed)) { mm_v32qi v; } mm_u32qi;
typedef struct __attribute__((packed)) { mm_v16qu v; } mm_u16qu;
#define MM_XV(p) (*(const __local mm_v32qi *)(p))
#define MM_ONES ((mm_v16hi){1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1})
/* pmaddubsw (u8 x s8 pairs -> s16) then pmaddwd by ones (-> s32): no
 * saturation, as |qx| <= 127 and the unsigned operand is <= 128 */
#define MM_MADD(u, sx) __builtin_astype(__builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256((u), (sx)), MM_ONES), int8)
#if defined(WEIGHT_Q8_0)
#define MM_WDECL mm_v32qi wv[RPI], wq[RPI];
#define MM_WPREP(r) { wv[r] = ((const __global mm_u32qi *)(WBLK(r, kb) + 2))->v; wq[r] = __builtin_ia32_psignb256(wv[r], wv[r]); }
/* |qw| * (qx with qw's sign) = qw * qx */
#define MM_DOT(r, xv) MM_MADD(wq[r], __builtin_ia32_psignb256((xv), wv[r]))
#else
#define MM_WDECL mm_v32qi wq[RPI];
#define MM_WPREP(r) { mm_v16qu b16 = ((const __global mm_u16qu *)(WBLK(r, kb) + 2))->v; \
    mm_v16qu lo = b16 & (uchar)15, hi = (b16 >> (uchar)4) & (uchar)15; \
    wq[r] = (mm_v32qi)__builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, \
        16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31); }
#define MM_DOT(r, xv) MM_MADD(wq[r], (xv))
#endif
#else /* portable: widen to int and multiply */
#define MM_I16(v) MM_CVT((v), int16)   /* not convert_int16 on PoCL: see mm_quantize_block */
typedef struct { char16 a, b; } mm_v32qi;
#define MM_XV(p) ((mm_v32qi){*(const __local char16 *)(p), *(const __local char16 *)((p) + 16)})
#if defined(WEIGHT_Q8_0)
#define MM_WDECL int16 wa[RPI], wb[RPI];
#define MM_WPREP(r) { wa[r] = MM_I16(loom_ld_char16((const __global char *)(WBLK(r, kb) + 2))); \
    wb[r] = MM_I16(loom_ld_char16((const __global char *)(WBLK(r, kb) + 18))); }
#else
#define MM_WDECL int16 wa[RPI], wb[RPI];
#define MM_WPREP(r) { uchar16 b16 = loom_ld_uchar16(WBLK(r, kb) + 2); \
    wa[r] = MM_I16(b16 & (uchar)15); wb[r] = MM_I16(b16 >> (uchar)4); }
#endif
inline int8 mm_dot(int16 wa, int16 wb, mm_v32qi xv)
{
    int16 p = wa * MM_I16(xv.a) + wb * MM_I16(xv.b);
    return p.lo + p.hi;
}
#define MM_DOT(r, xv) mm_dot(wa[r], wb[r], (xv))
#endif

/* One register tile over quantized activations (local memory, token-major:
 * lq[j*K + k], ld[j*NB + b], ls[j*NB + b] for tile token j). */
__attribute__((always_inline)) inline void mm_tile_q(
    const __local char *lq, const __local float *ld, const __local int *ls,
    const __global WTYPE *W, const __global float *bias, __global float *Y, int ldy,
    int n0, const int nr, int t0, const int nt)
{
    const __global WTYPE *wrow[RPI];
    #pragma unroll
    for (int r = 0; r < RPI; r++)
        wrow[r] = W + (size_t)(n0 + r < nr ? n0 + r : nr - 1) * ROW_STRIDE;
    float8 acc[RPI][TPI];
    #pragma unroll
    for (int r = 0; r < RPI; r++)
        #pragma unroll
        for (int j = 0; j < TPI; j++)
            acc[r][j] = (float8)(0.0f);

    for (int kb = 0; kb < K; kb += LOOM_QK) {
        const int b = kb / LOOM_QK;
        float dw[RPI];
        MM_WDECL
        #pragma unroll
        for (int r = 0; r < RPI; r++) {
            dw[r] = loom_block_scale_finite(WBLK(r, kb));
            MM_WPREP(r)
        }
        #pragma unroll
        for (int j = 0; j < TPI; j++) {
            if (j < nt) {
                mm_v32qi xv = MM_XV(lq + j * K + kb);
                float dx = ld[j * NB + b];
#ifdef WEIGHT_Q4_0
                int8 corr = (int8)(-8 * ls[j * NB + b], 0, 0, 0, 0, 0, 0, 0);
#endif
                #pragma unroll
                for (int r = 0; r < RPI; r++) {
                    int8 s = MM_DOT(r, xv);
#ifdef WEIGHT_Q4_0
                    s += corr;
#endif
                    acc[r][j] += convert_float8(s) * (dw[r] * dx);
                }
            }
        }
    }

    #pragma unroll
    for (int r = 0; r < RPI; r++) {
        int n = n0 + r;
        #pragma unroll
        for (int j = 0; j < TPI; j++) {
            if (j < nt && n < nr) {
                float s = loom_hsum8(acc[r][j]);
                mm_store(bias, Y + (size_t)(t0 + j) * ldy + n, n, s);
            }
        }
    }
}
#endif /* ACT_Q8 */

/* One 32-element step of one row per work-item: W[n, kb .. kb + 32) -> Y. */
#if !defined(RT_INT_ONLY) && !defined(RT_F16) /* (K-quant and Q8_0 tiles exist where int8 dot products run; F16 tiles are float already) */
__kernel void dequantize(const __global WTYPE *W, __global float *Y)
{
    const int kb = get_global_id(0) * KSTEP, n = get_global_id(1);
    if (kb >= K || n >= N)
        return;
    Y += (size_t)n * K;
#ifdef ROW_TILE
    const int lane = n % 16;
    const __global uchar *p = W + ((size_t)(n / 16) * (K / LOOM_QK) + kb / LOOM_QK) * RT_BYTES;
    const float d = vload_half(lane, (const __global half *)p);
#ifdef WEIGHT_Q5_0
    const uint h = ((const __global uint *)(p + 32))[lane];
#else
    const uint h = 0;
#endif
#ifdef RT_MIN
    const float m = vload_half(16 + lane, (const __global half *)p);
#define RT_VALUE(u) ((float)(u) * d + m)
#else
#define RT_VALUE(u) (((float)(u) - (RT_BIAS - 1.0f) * RT_SCALE) * d)     /* z = 8 (Q5_0 16) */
#endif
    for (int c = 0; c < 16; c++) {          /* byte b of word j; h's bits as RT_WORD reads them */
        const int j = c / 4, b = c % 4;
        const uint q = p[RT_QS + (j * 16 + lane) * 4 + b];
        Y[kb + c] = RT_VALUE((q & 15u) | ((h >> (8 * b + 4 + j)) & 1u) << 4);
        Y[kb + c + 16] = RT_VALUE((q >> 4) | ((h >> (8 * b + j)) & 1u) << 4);
    }
#else
    const __global WTYPE *wrow[RPI];
    #pragma unroll
    for (int r = 0; r < RPI; r++)
        wrow[r] = W + (size_t)n * ROW_STRIDE;
    if (kb + KSTEP > K) {         /* F32/F16 rows whose K is not a multiple of 32 */
        for (int k = kb; k < K; k++)
#if defined(WEIGHT_F16)
            Y[k] = loom_ldh(wrow[0] + k);
#else
            Y[k] = wrow[0][k];
#endif
        return;
    }
    const int kb0 = kb / KBLOCK * KBLOCK;
    (void)kb0;
    WSCALE_DECL
    #pragma unroll
    for (int c = 0; c < KSTEP; c += VW)
        LOOM_CAT(loom_st_float, VW)(WLOAD(0, kb, c), Y + kb + c);
#endif
}
#endif

#if TPI > 16
#error "matmul.cl: TOKENS_PER_ITEM must be at most 16"
#endif
/* A tail of nt < TPI tokens (cases nt >= TPI are dead and fold away). */
#define MM_TAIL(nt) case nt: if (nt < TPI) mm_tile(X, ldx, W, bias, Y, ldy, n0, nr, t0, nt); break;

#define MM_TAIL_D(nt) case nt: if (nt < TPI) mm_tile_dot(xq, W, bias, Y, ldy, n0, nr, t0, nt, RT_STREAMED(T, t0)); break;

#define MM_TAIL_Q(nt) case nt: if (nt < TPI) mm_tile_q(lq, ld, ls, W, bias, Y, ldy, n0, nr, t0, nt); break;

/* Rows n0 .. n0 + RPI - 1 of a matrix of nr rows at W (rows >= nr only read row
 * nr - 1 again and store nothing), for every token tile of this work-item. */
__attribute__((always_inline)) inline void mm_rows(
    const __global float *X, int ldx, const __global WTYPE *W, const __global float *bias,
    __global float *Y, int ldy, int n0, const int nr, int T NORM_PARAMS
#ifdef ACT_Q8
    , __local char *lq, __local float *ld, __local int *ls
#endif
#ifdef NORM_IN
    , __local float *xl
#endif
    )
{
#ifdef ACT_Q8
    const int lid = get_local_id(0);
#endif
    const int tstride = get_global_size(1) * TPI;
    for (int t0 = get_global_id(1) * TPI; t0 < T; t0 += tstride) {
#ifdef ACT_Q8
        const int ntile = T - t0 < TPI ? T - t0 : TPI;
        barrier(CLK_LOCAL_MEM_FENCE);                  /* the previous tile's reads are done */
        for (int i = lid; i < ntile * NB; i += WG) {
            int j = i / NB, b = i - j * NB;
            mm_quantize_block(X + (size_t)(t0 + j) * ldx + b * LOOM_QK, lq + j * K + b * LOOM_QK,
                              ld + j * NB + b, ls + j * NB + b);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (ntile == TPI) {
            mm_tile_q(lq, ld, ls, W, bias, Y, ldy, n0, nr, t0, TPI);
        } else {
            switch (ntile) {
            MM_TAIL_Q(1) MM_TAIL_Q(2) MM_TAIL_Q(3) MM_TAIL_Q(4) MM_TAIL_Q(5) MM_TAIL_Q(6) MM_TAIL_Q(7)
            MM_TAIL_Q(8) MM_TAIL_Q(9) MM_TAIL_Q(10) MM_TAIL_Q(11) MM_TAIL_Q(12) MM_TAIL_Q(13) MM_TAIL_Q(14) MM_TAIL_Q(15)
            }
        }
#elif defined(NORM_IN)
        const float inv = rt_norm(X + (size_t)t0 * ldx, norm_w, eps, xl);
        if (n0 < nr)                                  /* (items past the rows only help norm) */
            mm_tile_normed(xl, inv, W, bias, Y, ldy, n0, nr, t0);
#elif defined(RT_DOT)
        const __global int *xq = (const __global int *)X;   /* quantize_x's output */
        if (t0 + TPI <= T) {
            mm_tile_dot(xq, W, bias, Y, ldy, n0, nr, t0, TPI, RT_STREAMED(T, t0));
        } else {
            switch (T - t0) {
            MM_TAIL_D(1) MM_TAIL_D(2) MM_TAIL_D(3) MM_TAIL_D(4) MM_TAIL_D(5) MM_TAIL_D(6) MM_TAIL_D(7)
            MM_TAIL_D(8) MM_TAIL_D(9) MM_TAIL_D(10) MM_TAIL_D(11) MM_TAIL_D(12) MM_TAIL_D(13) MM_TAIL_D(14) MM_TAIL_D(15)
            }
        }
#else
        if (t0 + TPI <= T) {
            mm_tile(X, ldx, W, bias, Y, ldy, n0, nr, t0, TPI);
        } else {
            /* the tail: one narrower tile, its width a literal at each case */
            switch (T - t0) {
            MM_TAIL(1) MM_TAIL(2) MM_TAIL(3) MM_TAIL(4) MM_TAIL(5) MM_TAIL(6) MM_TAIL(7)
            MM_TAIL(8) MM_TAIL(9) MM_TAIL(10) MM_TAIL(11) MM_TAIL(12) MM_TAIL(13) MM_TAIL(14) MM_TAIL(15)
            }
        }
#endif
    }
}

#ifdef ACT_Q8
/* no early exit: every work-item reaches the barriers (rows >= N skip stores) */
#define MM_LOCALS __local char lq[TPI * K] __attribute__((aligned(32))); __local float ld[TPI * NB]; \
    __local int ls[TPI * NB];
#define MM_LOCAL_ARGS , lq, ld, ls
#define MM_EXIT_PAST_N
#elif defined(NORM_IN)
/* every work-item norms its share of the token (items past N store nothing) */
#define MM_LOCALS __local float xl[K + RT_NORM_PARTS] __attribute__((aligned(64)));
#define MM_LOCAL_ARGS , xl
#define MM_EXIT_PAST_N
#elif defined(QX_TAIL)
/* every work-item reaches the tail's barriers (items past N store nothing) */
#define MM_LOCALS __local float qx_part[QX_NB]; __local int qx_last;
#define MM_LOCAL_ARGS
#define MM_EXIT_PAST_N
#else
#define MM_LOCALS
#define MM_LOCAL_ARGS
#define MM_EXIT_PAST_N if (n0 >= N) return;
#endif
#ifdef QX_TAIL
#if QX_TAIL == 1
#define TAIL_PARAMS , __global int *XQ, const __global float *norm_w, float eps, volatile __global int *done
#define QX_TAIL_RUN(Yt) qx_tail(Yt, ldy, T, XQ, norm_w, eps, done, qx_part, &qx_last);
#else
#define TAIL_PARAMS , __global int *XQ, volatile __global int *done
#define QX_TAIL_RUN(Yt) qx_tail(Yt, ldy, T, XQ, 0, 0.0f, done, qx_part, &qx_last);
#endif
#define MM_IF_ROWS if (n0 < N)
#else
#define TAIL_PARAMS
#define QX_TAIL_RUN(Yt)
#define MM_IF_ROWS
#endif

#ifndef N0
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void matmul(const __global float *X, int x_off, int ldx,
            const __global WTYPE *W,
            const __global float *bias,
            __global float *Y, int y_off, int ldy,
            int T NORM_PARAMS TAIL_PARAMS)
{
    const int n0 = get_global_id(0) * RPI;
    MM_LOCALS
    MM_EXIT_PAST_N
    MM_IF_ROWS
        mm_rows(X + x_off, ldx, W, bias, Y + y_off, ldy, n0, N, T NORM_PASS MM_LOCAL_ARGS);
    QX_TAIL_RUN(Y + y_off)
}
#else
/* matmul_cat: W is [W0; W1; W2] (N0, N1 and N - N0 - N1 rows), each read where
 * it lies; with N1 undefined, [W0; W1] (N1 = N - N0; W2 unused). A work-item's
 * rows lie in one matrix (N0 and N1 multiples of ROWS_PER_ITEM), and its sums
 * are the ones matmul forms for that matrix alone: the same bits. */
#ifndef N1
#define N1 (N - N0)
#endif
#if N0 % RPI != 0 || N1 % RPI != 0 || N0 <= 0 || N1 <= 0 || N0 + N1 > N
#error "matmul.cl: N0, N1 must be positive multiples of ROWS_PER_ITEM with N0 + N1 <= N"
#endif
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void matmul_cat(const __global float *X, int x_off, int ldx,
                const __global WTYPE *W0, const __global WTYPE *W1, const __global WTYPE *W2,
                const __global float *bias0, const __global float *bias1, const __global float *bias2,
                __global float *Y, int y_off, int ldy,
                int T NORM_PARAMS TAIL_PARAMS)
{
    int n0 = get_global_id(0) * RPI;
    MM_LOCALS
    MM_EXIT_PAST_N
    const __global WTYPE *W = W0;
    const __global float *bias = bias0;
    int first = 0, nr = N0;
    if (n0 >= N0 + N1) {
        W = W2; bias = bias2; first = N0 + N1; nr = N - N0 - N1;
    } else if (n0 >= N0) {
        W = W1; bias = bias1; first = N0; nr = N1;
    }
    MM_IF_ROWS
        mm_rows(X + x_off, ldx, W, bias, Y + y_off + first, ldy, n0 - first, nr, T NORM_PASS MM_LOCAL_ARGS);
    QX_TAIL_RUN(Y + y_off)
}
#endif

#ifdef GLU
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void matmul_glu(const __global float *X, int x_off, int ldx,
                const __global WTYPE *W0, const __global WTYPE *W1,
                __global float *Y, int y_off, int ldy,
                int T NORM_PARAMS)
{
    const int n0 = get_global_id(0) * 16;
    const size_t at = (size_t)(n0 / 16) * RT_TILE_SIZE;
    MM_LOCALS
    MM_EXIT_PAST_N
    for (int t = get_global_id(1); t < T; t += get_global_size(1)) {
        const __global float *x = X + x_off + (size_t)t * ldx;
#ifdef NORM_IN
        const float inv = rt_norm(x, norm_w, eps, xl);
        if (n0 >= N)
            continue;
        const float16 a = inv * rt_sum1_local(xl, W0 + at), b = inv * rt_sum1_local(xl, W1 + at);
#else
        const float16 a = rt_sum1(x, W0 + at), b = rt_sum1(x, W1 + at);
#endif
        float16 v[1];
        v[0] = rt_glu16(a, b);
        rt_store(v, 0, Y + y_off, ldy, n0, N, t, 1);
    }
}
#endif
