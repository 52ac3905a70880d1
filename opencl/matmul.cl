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
 *   WEIGHT_F32 | WEIGHT_F16 | WEIGHT_Q8_0 | WEIGHT_Q4_0   required, exactly one.
 *                        W is float* / half* (storage) / uchar* (raw ggml blocks,
 *                        K/32 blocks per row, rows back to back). Quantized: K % 32 == 0.
 *                        Block scales must be finite (a reader should reject others).
 *   ROWS_PER_ITEM  (1)   output rows per work-item
 *   TOKENS_PER_ITEM (1)  tokens per register tile (at most 16): each loaded
 *                        weight vector is used for this many tokens
 *   WG             (8)   local size along dim 0 (reqd_work_group_size)
 *   VW            (16)   vector width along K: 4, 8 or 16
 *   ACCS          (2 for a 1x1 tile, else 1)  independent accumulators per output
 *   HAS_BIAS             add b[n]
 *   ACCUMULATE           Y += result (residual add) instead of Y = result
 *   Any T >= 1 works with any geometry; X and Y may not overlap.
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

#define RPI ROWS_PER_ITEM
#define TPI TOKENS_PER_ITEM
#define VF LOOM_CAT(float, VW)
#define VLOAD(p) LOOM_CAT(loom_ld_float, VW)(p)
#define HSUM LOOM_CAT(loom_hsum, VW)

#if VW != 4 && VW != 8 && VW != 16
#error "matmul.cl: VW must be 4, 8 or 16"
#endif

#if defined(WEIGHT_F32) + defined(WEIGHT_F16) + defined(WEIGHT_Q8_0) + defined(WEIGHT_Q4_0) != 1
#error "matmul.cl: define exactly one of WEIGHT_F32, WEIGHT_F16, WEIGHT_Q8_0, WEIGHT_Q4_0"
#endif

/* KSTEP: elements per outer step (one quantized block); WLOAD(r, kb, c): VW
 * dequantized weights of row r at k = kb + c; WSCALE_DECL: per-step block scales. */
#define KSTEP 32
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
#else
#define WTYPE uchar
#define ROW_STRIDE ((size_t)(K / LOOM_QK) * LOOM_Q4_0_BYTES)
#define WBLK(r, kb) (wrow[r] + ((kb) / LOOM_QK) * LOOM_Q4_0_BYTES)
/* d * (q - 8) as one fma: q * d + (-8 d) */
#define WSCALE_DECL float d[RPI], m[RPI]; _Pragma("unroll") for (int r = 0; r < RPI; r++) { d[r] = loom_block_scale_finite(WBLK(r, kb)); m[r] = -8.0f * d[r]; }
#define WLOAD(r, kb, c) (LOOM_CAT(loom_q4_0_u, VW)(WBLK(r, kb), (c)) * d[r] + m[r])
#endif

#if (defined(WEIGHT_Q8_0) || defined(WEIGHT_Q4_0)) && K % LOOM_QK != 0
#error "matmul.cl: quantized weights need K % 32 == 0"
#endif

#define K_MAIN (K / KSTEP * KSTEP) /* vector part; F32/F16 finish [K_MAIN, K) scalar */
/* Independent accumulators per output (ACCS, default 2 for a 1x1 tile, else 1):
 * a single output's FMA chain is latency-bound; bigger tiles already have
 * RPI*TPI independent chains and more accumulators would spill. */
#ifndef ACCS
#if RPI * TPI == 1
#define ACCS 2
#else
#define ACCS 1
#endif
#endif
#define NACC (ACCS < KSTEP / VW ? ACCS : KSTEP / VW)

/* One register tile: RPI rows from n0 x nt tokens from t0. nt is a literal at
 * each call site, so after inlining the token loops have constant trip counts. */
__attribute__((always_inline)) inline void mm_tile(
    const __global float *X, int ldx, const __global WTYPE *W,
    const __global float *bias, __global float *Y, int ldy,
    int n0, int t0, const int nt)
{
    const __global WTYPE *wrow[RPI];
    #pragma unroll
    for (int r = 0; r < RPI; r++)
        wrow[r] = W + (size_t)(n0 + r < N ? n0 + r : N - 1) * ROW_STRIDE;
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

    for (int kb = 0; kb < K_MAIN; kb += KSTEP) {
        WSCALE_DECL
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
                        acc[r][j][(c / VW) % NACC] += w[r] * x;
                }
            }
        }
    }

    #pragma unroll
    for (int r = 0; r < RPI; r++) {
        int n = n0 + r;
        #pragma unroll
        for (int j = 0; j < TPI; j++) {
            if (j < nt && n < N) {
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
#ifdef HAS_BIAS
                s += bias[n];
#endif
                __global float *y = Y + (size_t)(t0 + j) * ldy + n;
#ifdef ACCUMULATE
                s += *y;
#endif
                *y = s;
            }
        }
    }
}

#if TPI > 16
#error "matmul.cl: TOKENS_PER_ITEM must be at most 16"
#endif
/* A tail of nt < TPI tokens (cases nt >= TPI are dead and fold away). */
#define MM_TAIL(nt) case nt: if (nt < TPI) mm_tile(X, ldx, W, bias, Y, ldy, n0, t0, nt); break;

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void matmul(const __global float *X, int x_off, int ldx,
            const __global WTYPE *W,
            const __global float *bias,
            __global float *Y, int y_off, int ldy,
            int T)
{
    const int n0 = get_global_id(0) * RPI;
    if (n0 >= N)
        return;
    X += x_off;
    Y += y_off;
    const int tstride = get_global_size(1) * TPI;
    for (int t0 = get_global_id(1) * TPI; t0 < T; t0 += tstride) {
        if (t0 + TPI <= T) {
            mm_tile(X, ldx, W, bias, Y, ldy, n0, t0, TPI);
        } else {
            /* the tail: one narrower tile, its width a literal at each case */
            switch (T - t0) {
            MM_TAIL(1) MM_TAIL(2) MM_TAIL(3) MM_TAIL(4) MM_TAIL(5) MM_TAIL(6) MM_TAIL(7)
            MM_TAIL(8) MM_TAIL(9) MM_TAIL(10) MM_TAIL(11) MM_TAIL(12) MM_TAIL(13) MM_TAIL(14) MM_TAIL(15)
            }
        }
    }
}
