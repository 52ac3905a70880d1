/* conv1d.cl - 1-D convolutions over channels-last frames (X[T, C], row-major)
 *
 * Four kernels. Weights are in PyTorch's layouts as a checkpoint stores them
 * (F32, or F16 storage with WEIGHT_F16). Sequences are packed back to back
 * along T; the direct kernels take their frame offsets and treat every frame
 * outside a frame's own sequence as zero (packed sequences never see each
 * other: each behaves as if convolved alone with zero padding).
 *
 * ---- im2col1d: conv1d as im2col + matmul ----
 * A conv1d with weights W[O, C, KW] is a matmul of the unfolded input against
 * W viewed as [O, C*KW]: this kernel unfolds, and matmul.cl (N = O,
 * K = C*KW, with bias) does the arithmetic. Sequences here are S equal-length
 * blocks of T_in frames.
 *
 * kernel im2col1d(
 *     const __global float *X,     S sequences of T_in frames, channels last: X[s, t, c]
 *     __global float *Y,           Y[s, t, c*KW + k] = X[s, t*STRIDE + k*DILATION - PAD, c] (0 outside)
 *     int T_in, int T_out, int S)
 * Macros: C, KW (required); STRIDE (1), PAD (0), DILATION (1).
 * Launch: global = (C * KW, T_out, S), local = any (NULL).
 *
 * ---- conv1d_direct: conv1d without scratch, register-tiled (needs O) ----
 * kernel conv1d_direct(
 *     const __global float *X, int x_off, int ldx,   X[u, c] = X[x_off + u*ldx + c], u < x_offsets[S]
 *     const __global WTYPE *W,                        W[O, C, KW] (PyTorch Conv1d), W[o, c, k] = W[(o*C + c)*KW + k]
 *     const __global float *bias,                     b[O]; read only with HAS_BIAS (else may be NULL)
 *     __global float *Y, int y_off, int ldy,          Y[t, o] = Y[y_off + t*ldy + o], t < T
 *     const __global int *x_offsets,                  [S+1]: sequence s is input frames x_offsets[s] .. x_offsets[s+1]-1
 *     const __global int *y_offsets,                  [S+1]: and output frames y_offsets[s] .. y_offsets[s+1]-1
 *     int S, int T)                                   S >= 1 sequences; T = y_offsets[S] output frames
 *                                                     (frames past y_offsets[S] are never touched)
 *   For output frame t of sequence s (j = t - y_offsets[s], lo/hi = x_offsets[s], x_offsets[s+1]):
 *     v = sum_{c < C, k < KW} act(X[u, c]) * W[o, c, k],  u = lo + j*STRIDE + k*DILATION - PAD,
 *         terms with u outside [lo, hi) are zero;
 *     v += b[o] (HAS_BIAS); v += X[t, o] (RESIDUAL: the raw input row of frame t,
 *         needs C == O and x_offsets == y_offsets); v = tanh(v) (OUT_TANH);
 *     Y[t, o] = v, or Y[t, o] += v (ACCUMULATE).
 *   act(x) = x, or with LEAKY = slope: x < 0 ? slope*x : x (HiFi-GAN's conv(leaky_relu(x))).
 *   Output frames per sequence are the caller's choice (the kernel computes
 *   any j); PyTorch's are (T_in + 2*PAD - DILATION*(KW-1) - 1) / STRIDE + 1,
 *   which for STRIDE 1 and "same" padding (PAD = DILATION*(KW-1)/2, KW odd)
 *   is T_in: then pass the same buffer as x_offsets and y_offsets.
 *   X and Y may not overlap (frames read neighbours that others write).
 *
 * ---- conv1d_depthwise: groups = channels, stride 1 ----
 * kernel conv1d_depthwise(
 *     const __global float *X, int x_off, int ldx,   as above
 *     const __global WTYPE *W,                        W[C, 1, KW], W[c, 0, k] = W[c*KW + k]
 *     const __global float *bias,                     b[C]; HAS_BIAS
 *     __global float *Y, int y_off, int ldy,          Y[t, c]
 *     const __global int *offsets, int S, int T)      [S+1] frames of each sequence (in = out); T = offsets[S]
 *   Y[t, c] (+)= b[c] + sum_{k < KW} X[t + k*DILATION - PAD, c] * W[c, 0, k], zero outside
 *   t's sequence; PAD = DILATION*(KW-1)/2 is PyTorch's "same". X and Y may not overlap.
 *
 * ---- conv_transpose1d: ConvTranspose1d (needs O, STRIDE) ----
 * kernel conv_transpose1d(
 *     const __global float *X, int x_off, int ldx,   X[m, c], m < offsets[S]
 *     const __global WTYPE *W,                        W[C, O, KW] (PyTorch ConvTranspose1d), W[c, o, k] = W[(c*O + o)*KW + k]
 *     const __global float *bias,                     b[O]; HAS_BIAS
 *     __global float *Y, int y_off, int ldy,          Y[t, o], t < STRIDE * offsets[S]
 *     const __global int *offsets, int S, int T)      [S+1] input frames of each sequence; T = offsets[S]
 *   Sequence s of n = offsets[s+1] - offsets[s] input frames gives exactly STRIDE*n
 *   output frames, STRIDE*offsets[s] .. STRIDE*offsets[s+1] - 1; its local frame l is
 *     Y[l, o] (+)= b[o] + sum_{m < n, k < KW: l = m*STRIDE - PAD + k} act(X[m, c]) * W[c, o, k]
 *   (act: LEAKY as above). That is PyTorch's output, (n-1)*STRIDE - 2*PAD + KW frames,
 *   when KW - 2*PAD == STRIDE (HiFi-GAN: KW = 2*STRIDE, PAD = STRIDE/2); otherwise
 *   its first STRIDE*n frames (KW - 2*PAD > STRIDE), or its frames followed by
 *   bias-only ones (KW - 2*PAD < STRIDE). Built only when DILATION is 1 and PAD >= 0.
 *
 * Macros:
 *   C, KW                 required (all kernels)
 *   O                     output channels; conv1d_direct and conv_transpose1d exist only when defined
 *   OUT_VW (4, 8, 16)     builds conv1d_outer and conv_transpose1d_outer instead of those two (with O)
 *   STRIDE (1), PAD (0), DILATION (1)   conv_transpose1d exists only with DILATION 1 and PAD >= 0
 *   WEIGHT_F32 (default) | WEIGHT_F16   W as float or half (storage; widened once per work-item)
 *   HAS_BIAS, ACCUMULATE  (all three direct kernels)
 *   X_SCALE=factor        (conv1d_direct, conv_transpose1d) X times factor as it is read (before LEAKY;
 *                         not the RESIDUAL term): a mean of summed branches without a pass of its own
 *   LEAKY=slope           (conv1d_direct, conv_transpose1d) leaky ReLU on X as it is read
 *   RESIDUAL, OUT_TANH    (conv1d_direct)
 *   VW (8, or 4 / 1 when C is not a multiple of 8)   vector width along C; must divide C
 *   OUTS_PER_ITEM (8)     output channels per work-item (conv1d_direct, conv_transpose1d)
 *   FRAMES_PER_ITEM (1)   frames per register tile (all three): OUTS_PER_ITEM x
 *                         FRAMES_PER_ITEM accumulators of VW floats; keep it <= ~12
 *                         vectors (16 ymm on the CPUs here). conv1d_direct is the
 *                         kernel for one or a few outputs (HiFi-GAN's conv_post: 1 x 8);
 *                         conv1d_outer is faster from 16 outputs up (opencl/README.md).
 *
 * Launch (G1 >= 1 free: work-item (i, g) runs frame tiles g, g + G1, ... so each
 * work-item widens its weights once and reuses them for ~T / (FRAMES_PER_ITEM*G1)
 * tiles. Widening the weights costs each item about as much as a few dozen tiles,
 * so keep G1 small: 1 when ceil(O / OUTS_PER_ITEM) items already fill the device,
 * 4-8 for narrow layers over long sequences (opencl/README.md); any G1 gives the same answer):
 *   conv1d_direct:     global = (ceil(O / OUTS_PER_ITEM), G1), local = (1, 1)
 *   conv1d_depthwise:  global = (C / VW, G1), local = (1, 1)
 *   conv_transpose1d:  global = (ceil(O / OUTS_PER_ITEM), STRIDE, G1), local = (1, 1, 1)
 * Give the local size (1s; small groups such as (1, 8) work too): with NULL, PoCL 3.1
 * picks groups of thousands of items, allocates every item's private weight copy at
 * once and overflows its stack (a segfault at the first enqueue, seen at C = 192).
 * Each work-item keeps its widened weights in private memory:
 * OUTS_PER_ITEM * KW * C floats (conv_transpose1d: OUTS_PER_ITEM * ceil(KW/STRIDE) * C),
 * and conv1d_direct a tile's input rows, activated once for all its taps:
 * ((FRAMES_PER_ITEM - 1) * STRIDE + (KW - 1) * DILATION + 1) * C floats (its tiles
 * never straddle two sequences, so those rows are one contiguous run);
 * e.g. 4 * 7 * 192 = 21 KB for HiFi-GAN's conv_pre. For much larger C * KW
 * (a 768-channel k3 FFN conv: 36 KB) lower OUTS_PER_ITEM or use im2col1d + matmul.
 * Tail outputs (O not a multiple of OUTS_PER_ITEM) recompute channel O-1 and skip the
 * store; tail frames likewise (the hot loop has no per-output branches).
 */

#ifndef C
#error "conv1d.cl: define C (input channels)"
#endif
#ifndef KW
#error "conv1d.cl: define KW (kernel width)"
#endif
#ifndef STRIDE
#define STRIDE 1
#endif
#ifndef PAD
#define PAD 0
#endif
#ifndef DILATION
#define DILATION 1
#endif

__kernel void im2col1d(const __global float *X, __global float *Y, int T_in, int T_out, int S) {
    const int j = get_global_id(0), t = get_global_id(1), s = get_global_id(2);
    if (j >= C * KW || t >= T_out || s >= S) return;
    const int c = j / KW, k = j % KW;
    const int u = t * STRIDE + k * DILATION - PAD;
    Y[((long)s * T_out + t) * (C * KW) + j] = (u >= 0 && u < T_in) ? X[((long)s * T_in + u) * C + c] : 0.0f;
}

/* ---- shared by the direct kernels ---- */

#ifndef VW
#if C % 8 == 0
#define VW 8
#elif C % 4 == 0
#define VW 4
#else
#define VW 1
#endif
#endif
#if VW != 1 && VW != 4 && VW != 8 && VW != 16
#error "conv1d.cl: VW must be 1, 4, 8 or 16"
#endif
#if C % VW != 0
#error "conv1d.cl: VW must divide C"
#endif
#define NCV (C / VW)

#if VW == 1
#define VF float
#define VLOAD(p) (*(p))
#define VHSUM(v) (v)
#else
#define VF LOOM_CAT(float, VW)
#define VLOAD(p) LOOM_CAT(loom_ld_float, VW)(p)
#define VHSUM(v) LOOM_CAT(loom_hsum, VW)(v)
#endif

#if defined(WEIGHT_F32) + defined(WEIGHT_F16) > 1
#error "conv1d.cl: define at most one of WEIGHT_F32, WEIGHT_F16"
#endif
#ifdef WEIGHT_F16
#define WTYPE half
#define WGET(p) loom_ldh(p)
#else
#define WTYPE float
#define WGET(p) (*(p))
#endif

#ifndef WEIGHT_TILES
#define WEIGHT_TILES 0
#endif
#if WEIGHT_TILES && !defined(OUT_VW)
#error "conv1d.cl: tiled weights (WEIGHT_TILES) are read by conv1d_outer and conv_transpose1d_outer only (define OUT_VW)"
#endif

#ifndef FRAMES_PER_ITEM
#define FRAMES_PER_ITEM 1
#endif
#ifndef OUTS_PER_ITEM
#define OUTS_PER_ITEM 8
#endif
#define TT FRAMES_PER_ITEM
#define OT OUTS_PER_ITEM

#ifdef X_SCALE
#define XS(v) ((v) * (float)(X_SCALE))
#else
#define XS(v) (v)
#endif
#ifdef LEAKY
#define ACT(v) (XS(v) < 0.0f ? XS(v) * (float)(LEAKY) : XS(v))
#else
#define ACT(v) XS(v)
#endif

#ifdef ACCUMULATE
#define STORE(p, v) (*(p) += (v))
#else
#define STORE(p, v) (*(p) = (v))
#endif

/* Advance the sequence cursor *s (frames only increase per work-item) to the
 * sequence holding frame t of the partition offs[S+1]; empty sequences are skipped. */
inline int conv_seq(const __global int *offs, int S, int s, int t)
{
    while (s < S - 1 && t >= offs[s + 1])
        s++;
    return s;
}

/* ---- conv1d_direct (built without OUT_VW) ---- */
#if defined(O) && !defined(OUT_VW)
#define ROWS ((TT - 1) * STRIDE + (KW - 1) * DILATION + 1)     /* input rows a tile of TT frames reads */
__kernel void conv1d_direct(const __global float *X, int x_off, int ldx,
                            const __global WTYPE *W, const __global float *bias,
                            __global float *Y, int y_off, int ldy,
                            const __global int *x_offsets, const __global int *y_offsets, int S, int T)
{
    const int o0 = get_global_id(0) * OT;
    T = T < y_offsets[S] ? T : y_offsets[S];      /* a T past the partition reads nothing out of bounds */
    if (o0 >= O || T <= 0)
        return;
    const int g = get_global_id(1), G1 = get_global_size(1);

    /* this item's weights, widened and re-laid [r][k][c] so a VW-run of c is one vector */
    VF wp[OT][KW][NCV];
    for (int r = 0; r < OT; r++) {
        const int o = o0 + r < O ? o0 + r : O - 1;
        const __global WTYPE *wo = W + (size_t)o * C * KW;
        for (int k = 0; k < KW; k++)
            for (int c = 0; c < C; c++)
                ((float *)&wp[r][k][0])[c] = WGET(wo + c * KW + k);
    }

    /* Tiles never straddle sequences: the partition's tiles are each sequence's
     * ceil(frames / TT) in order, and item g takes tiles g, g + G1, ... of them. */
    int q0 = 0;                                   /* tiles of the sequences before s */
    for (int s = 0; s < S; s++) {
        const int ylo = y_offsets[s], n = (y_offsets[s + 1] < T ? y_offsets[s + 1] : T) - ylo;
        if (n <= 0)
            continue;
        const int lo = x_offsets[s], hi = x_offsets[s + 1], nt = (n + TT - 1) / TT;
        for (int q = q0 + (g - q0 % G1 + G1) % G1; q < q0 + nt; q += G1) {
            const int j0 = (q - q0) * TT, u0 = lo + j0 * STRIDE - PAD;
            /* the tile's input rows, activated once, zero outside the sequence */
            VF win[ROWS][NCV];
            for (int r = 0; r < ROWS; r++) {
                const int u = u0 + r;
                const int ok = u >= lo && u < hi;
                const __global float *xp = X + x_off + (size_t)(ok ? u : 0) * ldx;   /* row 0: a safe address */
                for (int cv = 0; cv < NCV; cv++) {
                    const VF v = VLOAD(xp + cv * VW);
                    win[r][cv] = ok ? ACT(v) : (VF)(0.0f);
                }
            }
            VF acc[OT][TT];
            _Pragma("unroll")
            for (int r = 0; r < OT; r++)
                _Pragma("unroll")
                for (int j = 0; j < TT; j++)
                    acc[r][j] = (VF)(0.0f);
            _Pragma("unroll")
            for (int k = 0; k < KW; k++)
                for (int cv = 0; cv < NCV; cv++)
                    _Pragma("unroll")
                    for (int r = 0; r < OT; r++) {
                        const VF w = wp[r][k][cv];
                        _Pragma("unroll")
                        for (int j = 0; j < TT; j++)
                            acc[r][j] = w * win[j * STRIDE + k * DILATION][cv] + acc[r][j];
                    }
            _Pragma("unroll")
            for (int j = 0; j < TT; j++) {
                if (j0 + j >= n)
                    break;
                const int t = ylo + j0 + j;
                __global float *yrow = Y + y_off + (size_t)t * ldy;
                _Pragma("unroll")
                for (int r = 0; r < OT; r++) {
                    const int o = o0 + r;
                    if (o >= O)
                        break;
                    float v = VHSUM(acc[r][j]);
#ifdef HAS_BIAS
                    v += bias[o];
#endif
#ifdef RESIDUAL
                    v += X[x_off + (size_t)t * ldx + o];
#endif
#ifdef OUT_TANH
                    v = loom_tanh(v);
#endif
                    STORE(yrow + o, v);
                }
            }
        }
        q0 += nt;
    }
}
#endif /* O */

/* ---- conv1d_outer: conv1d_direct's contract as outer products over outputs ----
 * The same arguments, result and launch shape as conv1d_direct (but not OUT_TANH;
 * global = (ceil(O / (OUT_VW * OUT_VECS)), G1)). conv1d_direct sums each output's VW
 * lanes at the end of a tile, one horizontal sum per (output, frame), which costs as
 * much as the FMAs when C * KW is small (HiFi-GAN's 32- and 64-channel stages). Here
 * an item holds OUT_VECS vectors of OUT_VW (4, 8, 16) consecutive outputs for
 * FRAMES_PER_ITEM frames: per (tap, input channel) one activated input, broadcast,
 * feeds OUT_VECS FMAs a frame, and nothing is summed across lanes. A tile first
 * stages its inputs, activated and zeroed outside their sequence, [frame][tap][channel]
 * in private memory (VW-wide). Private memory per item: KW * C * OUT_VECS * OUT_VW
 * floats of weights (32 KB at C = 192, KW = 7, 2 x 16) and TT * KW * C of inputs.
 * Conv1d_direct stays the kernel for one or a few outputs (conv_post).
 * GATE=H (conv1d_outer only; O = 2H, OUT_VECS 2, H a multiple of OUT_VW): WaveNet's
 * gate fused into the store, Y[t, o] = tanh(v[o]) * sigmoid(v[H + o]) for o < H
 * (VITS's flows: the conv's [T, 2H] result is never stored); item i holds outputs
 * i*OUT_VW.. and H + i*OUT_VW..; global = (H / OUT_VW, G1); no RESIDUAL or ACCUMULATE. */
#if defined(O) && defined(OUT_VW)
#ifdef OUT_TANH
#error "conv1d.cl: conv1d_outer has no OUT_TANH"
#endif
#ifndef OUT_VECS
#define OUT_VECS 2
#endif
#if OUT_VW != 4 && OUT_VW != 8 && OUT_VW != 16
#error "conv1d.cl: OUT_VW must be 4, 8 or 16"
#endif
#define OVF LOOM_CAT(float, OUT_VW)
#define OV_LD(p) LOOM_CAT(loom_ld_float, OUT_VW)(p)
#define OV_ST(v, p) LOOM_CAT(loom_st_float, OUT_VW)(v, p)
#if WEIGHT_TILES && WEIGHT_TILES != OUT_VW
#error "conv1d.cl: WEIGHT_TILES must equal OUT_VW (a tile is one output vector)"
#endif
#ifdef WEIGHT_F16
#define WT_LD(p) LOOM_CAT(vload_half, OUT_VW)(0, (p))
#else
#define WT_LD(p) OV_LD(p)
#endif
#ifdef GATE
#if OUT_VECS != 2 || O != 2 * (GATE) || (GATE) % OUT_VW != 0 || defined(RESIDUAL) || defined(ACCUMULATE)
#error "conv1d.cl: GATE=H needs O = 2H, OUT_VECS 2, OUT_VW dividing H, no RESIDUAL or ACCUMULATE"
#endif
#define OSTEP (GATE)                    /* between an item's output vectors */
#define OITEM OUT_VW                    /* outputs per item along dimension 0 */
#define OLIMIT (GATE)
#else
#define OSTEP OUT_VW
#define OITEM (OUT_VW * OUT_VECS)
#define OLIMIT O
#endif

/* acc[v][j] = sum over taps i < NTAPS and channels c of WP(i, c, v) * xs[j][i][c], the
 * input broadcast: OUT_VECS FMAs per input, each channel's weights loaded once a tile. */
#define OUTER_PRODUCTS(acc, xs, NTAPS)                                             \
    _Pragma("unroll")                                                              \
    for (int v = 0; v < OUT_VECS; v++)                                             \
        _Pragma("unroll")                                                          \
        for (int j = 0; j < TT; j++)                                               \
            acc[v][j] = (OVF)(0.0f);                                               \
    for (int i = 0; i < (NTAPS); i++)                                              \
        for (int c = 0; c < C; c++) {                                              \
            OVF w[OUT_VECS];                                                       \
            _Pragma("unroll")                                                      \
            for (int v = 0; v < OUT_VECS; v++)                                     \
                w[v] = WP(i, c, v);                                                \
            _Pragma("unroll")                                                      \
            for (int j = 0; j < TT; j++) {                                         \
                const OVF x = (OVF)(((const float *)&xs[j][i][0])[c]);             \
                _Pragma("unroll")                                                  \
                for (int v = 0; v < OUT_VECS; v++)                                 \
                    acc[v][j] = w[v] * x + acc[v][j];                              \
            }                                                                      \
        }

/* y[0, n) (+)= r (+ res[0, n) with RESIDUAL): one vector when n >= OUT_VW (the
 * last outputs: part of a vector, lane by lane). */
inline void outer_store(OVF r, __global float *y, const __global float *res, int n)
{
    if (n >= OUT_VW) {
#ifdef RESIDUAL
        if (res)        /* conv_transpose1d_outer has no residual */
            r += OV_LD(res);
#endif
#ifdef ACCUMULATE
        r += OV_LD(y);
#endif
        OV_ST(r, y);
        return;
    }
    for (int lane = 0; lane < n; lane++) {
        float e = ((float *)&r)[lane];
#ifdef RESIDUAL
        if (res)
            e += res[lane];
#endif
        STORE(y + lane, e);
    }
}
__kernel void conv1d_outer(const __global float *X, int x_off, int ldx,
                           const __global WTYPE *W, const __global float *bias,
                           __global float *Y, int y_off, int ldy,
                           const __global int *x_offsets, const __global int *y_offsets, int S, int T)
{
    const int o0 = get_global_id(0) * OITEM;
    T = T < y_offsets[S] ? T : y_offsets[S];
    if (o0 >= OLIMIT || T <= 0)
        return;
    const int g = get_global_id(1), G1 = get_global_size(1);
    const int ntiles = (T + TT - 1) / TT;
    if (g >= ntiles)
        return;

#if WEIGHT_TILES
    /* the param is laid out [O / OUT_VW][KW][C][OUT_VW] at load: an item reads its vectors in place */
    const __global WTYPE *wt[OUT_VECS];
    for (int v = 0; v < OUT_VECS; v++)
        wt[v] = W + (size_t)((o0 + v * OSTEP) / OUT_VW) * KW * C * OUT_VW;
#define WP(i, c, v) WT_LD(wt[v] + ((size_t)(i) * C + (c)) * OUT_VW)
#else
    /* weights re-laid [k][c][v] so OUT_VW consecutive outputs are one vector */
    OVF wp[KW][C][OUT_VECS];
    for (int v = 0; v < OUT_VECS; v++)
        for (int lane = 0; lane < OUT_VW; lane++) {
            const int o = o0 + v * OSTEP + lane < O ? o0 + v * OSTEP + lane : O - 1;
            const __global WTYPE *wo = W + (size_t)o * C * KW;
            for (int c = 0; c < C; c++)
                for (int k = 0; k < KW; k++)
                    ((float *)&wp[k][c][v])[lane] = WGET(wo + c * KW + k);
        }
#define WP(i, c, v) wp[i][c][v]
#endif
    OVF b[OUT_VECS];
    for (int v = 0; v < OUT_VECS; v++)
        for (int lane = 0; lane < OUT_VW; lane++) {
#ifdef HAS_BIAS
            const int o = o0 + v * OSTEP + lane;
            ((float *)&b[v])[lane] = o < O ? bias[o] : 0.0f;
#else
            ((float *)&b[v])[lane] = 0.0f;
#endif
        }

    int s = 0;
    VF xs[TT][KW][NCV];
    for (int tile = g; tile < ntiles; tile += G1) {
        const int t0 = tile * TT;
        for (int j = 0; j < TT; j++) {
            const int t = t0 + j < T ? t0 + j : T - 1;
            s = conv_seq(y_offsets, S, s, t);
            const int lo = x_offsets[s], hi = x_offsets[s + 1];
            const int u = lo + (t - y_offsets[s]) * STRIDE - PAD;
            for (int k = 0; k < KW; k++) {
                const int uu = u + k * DILATION;
                const int ok = uu >= lo && uu < hi;
                const __global float *xp = X + x_off + (size_t)(ok ? uu : 0) * ldx;
                for (int cv = 0; cv < NCV; cv++) {
                    const VF a = ACT(VLOAD(xp + cv * VW));
                    xs[j][k][cv] = ok ? a : (VF)(0.0f);
                }
            }
        }
        OVF acc[OUT_VECS][TT];
        OUTER_PRODUCTS(acc, xs, KW);
        _Pragma("unroll")
        for (int j = 0; j < TT; j++) {
            const int t = t0 + j;
            if (t >= T)
                break;
#ifdef GATE
            const OVF u = acc[0][j] + b[0], z = acc[1][j] + b[1];
            OV_ST(tanh(u) * ((OVF)(1.0f) / ((OVF)(1.0f) + exp(-z))), Y + y_off + (size_t)t * ldy + o0);
            continue;
#endif
            _Pragma("unroll")
            for (int v = 0; v < OUT_VECS; v++) {
                const int o = o0 + v * OUT_VW;
                if (o >= O)
                    break;
#ifdef RESIDUAL
                const __global float *res = X + x_off + (size_t)t * ldx + o;
#else
                const __global float *res = 0;
#endif
                outer_store(acc[v][j] + b[v], Y + y_off + (size_t)t * ldy + o, res, O - o);
            }
        }
    }
}
#endif /* O, OUT_VW */

/* ---- conv1d_depthwise ---- */
__kernel void conv1d_depthwise(const __global float *X, int x_off, int ldx,
                               const __global WTYPE *W, const __global float *bias,
                               __global float *Y, int y_off, int ldy,
                               const __global int *offsets, int S, int T)
{
    const int c0 = get_global_id(0) * VW;
    T = T < offsets[S] ? T : offsets[S];
    if (c0 >= C || T <= 0)
        return;
    const int g = get_global_id(1), G1 = get_global_size(1);
    const int ntiles = (T + TT - 1) / TT;
    VF wk[KW];
    for (int k = 0; k < KW; k++)
        for (int i = 0; i < VW; i++)
            ((float *)&wk[k])[i] = WGET(W + (size_t)(c0 + i) * KW + k);
    VF b = (VF)(0.0f);
#ifdef HAS_BIAS
    for (int i = 0; i < VW; i++)
        ((float *)&b)[i] = bias[c0 + i];
#endif
    int s = 0;
    for (int tile = g; tile < ntiles; tile += G1) {
        const int t0 = tile * TT;
        int u[TT], lo[TT], hi[TT];
        VF acc[TT];
        _Pragma("unroll")
        for (int j = 0; j < TT; j++) {
            const int t = t0 + j < T ? t0 + j : T - 1;
            s = conv_seq(offsets, S, s, t);
            lo[j] = offsets[s];
            hi[j] = offsets[s + 1];
            u[j] = t - PAD;
            acc[j] = b;
        }
        _Pragma("unroll")
        for (int k = 0; k < KW; k++) {
            _Pragma("unroll")
            for (int j = 0; j < TT; j++) {
                const int uu = u[j] + k * DILATION;
                const int ok = uu >= lo[j] && uu < hi[j];
                const VF v = VLOAD(X + x_off + (size_t)(ok ? uu : 0) * ldx + c0);
                acc[j] = wk[k] * (ok ? v : (VF)(0.0f)) + acc[j];
            }
        }
        _Pragma("unroll")
        for (int j = 0; j < TT; j++) {
            const int t = t0 + j;
            if (t >= T)
                break;
            __global float *yp = Y + y_off + (size_t)t * ldy + c0;
#if VW == 1
            STORE(yp, acc[j]);
#elif defined(ACCUMULATE)
            LOOM_CAT(loom_st_float, VW)(VLOAD(yp) + acc[j], yp);
#else
            LOOM_CAT(loom_st_float, VW)(acc[j], yp);
#endif
        }
    }
}

/* ---- conv_transpose1d ---- */
#if defined(O) && DILATION == 1 && PAD >= 0
#define NTMAX ((KW + STRIDE - 1) / STRIDE)
#ifndef OUT_VW
__kernel void conv_transpose1d(const __global float *X, int x_off, int ldx,
                               const __global WTYPE *W, const __global float *bias,
                               __global float *Y, int y_off, int ldy,
                               const __global int *offsets, int S, int T)
{
    const int o0 = get_global_id(0) * OT;
    const int rho = get_global_id(1);              /* output phase: local frame l = m*STRIDE + rho */
    T = T < offsets[S] ? T : offsets[S];
    if (o0 >= O || rho >= STRIDE || T <= 0)
        return;
    const int g = get_global_id(2), G1 = get_global_size(2);
    const int ntiles = (T + TT - 1) / TT;
    if (g >= ntiles)
        return;
    /* taps of this phase: k = k0 + STRIDE*i, reading input frame m + q0 - i */
    const int k0 = (rho + PAD) % STRIDE;
    const int q0 = (rho + PAD) / STRIDE;
    const int nt = k0 < KW ? (KW - k0 + STRIDE - 1) / STRIDE : 0;

    VF wp[OT][NTMAX][NCV];
    for (int r = 0; r < OT; r++) {
        const int o = o0 + r < O ? o0 + r : O - 1;
        for (int i = 0; i < NTMAX; i++)
            for (int c = 0; c < C; c++)
                ((float *)&wp[r][i][0])[c] = i < nt ? WGET(W + ((size_t)c * O + o) * KW + k0 + STRIDE * i) : 0.0f;
    }

    int s = 0;
    for (int tile = g; tile < ntiles; tile += G1) {
        const int m0 = tile * TT;
        int u[TT], lo[TT], hi[TT];
        _Pragma("unroll")
        for (int j = 0; j < TT; j++) {
            const int m = m0 + j < T ? m0 + j : T - 1;
            s = conv_seq(offsets, S, s, m);
            lo[j] = offsets[s];
            hi[j] = offsets[s + 1];
            u[j] = m + q0;
        }
        VF acc[OT][TT];
        _Pragma("unroll")
        for (int r = 0; r < OT; r++)
            _Pragma("unroll")
            for (int j = 0; j < TT; j++)
                acc[r][j] = (VF)(0.0f);
        for (int i = 0; i < nt; i++) {
            const __global float *xp[TT];
            int ok[TT];
            _Pragma("unroll")
            for (int j = 0; j < TT; j++) {
                const int uu = u[j] - i;
                ok[j] = uu >= lo[j] && uu < hi[j];
                xp[j] = X + x_off + (size_t)(ok[j] ? uu : 0) * ldx;
            }
            for (int cv = 0; cv < NCV; cv++) {
                VF xv[TT];
                _Pragma("unroll")
                for (int j = 0; j < TT; j++) {
                    const VF v = VLOAD(xp[j] + cv * VW);
                    const VF a = ACT(v);
                    xv[j] = ok[j] ? a : (VF)(0.0f);
                }
                _Pragma("unroll")
                for (int r = 0; r < OT; r++) {
                    const VF w = wp[r][i][cv];
                    _Pragma("unroll")
                    for (int j = 0; j < TT; j++)
                        acc[r][j] = w * xv[j] + acc[r][j];
                }
            }
        }
        _Pragma("unroll")
        for (int j = 0; j < TT; j++) {
            const int m = m0 + j;
            if (m >= T)
                break;
            __global float *yrow = Y + y_off + ((size_t)m * STRIDE + rho) * ldy;
            _Pragma("unroll")
            for (int r = 0; r < OT; r++) {
                const int o = o0 + r;
                if (o >= O)
                    break;
                float v = VHSUM(acc[r][j]);
#ifdef HAS_BIAS
                v += bias[o];
#endif
                STORE(yrow + o, v);
            }
        }
    }
}
#endif

/* conv_transpose1d's contract as outer products (conv1d_outer's scheme): global =
 * (ceil(O / (OUT_VW * OUT_VECS)), STRIDE, G1), local = (1, 1, 1). */
#ifdef OUT_VW
__kernel void conv_transpose1d_outer(const __global float *X, int x_off, int ldx,
                                     const __global WTYPE *W, const __global float *bias,
                                     __global float *Y, int y_off, int ldy,
                                     const __global int *offsets, int S, int T)
{
    const int o0 = get_global_id(0) * (OUT_VW * OUT_VECS);
    const int rho = get_global_id(1);
    T = T < offsets[S] ? T : offsets[S];
    if (o0 >= O || rho >= STRIDE || T <= 0)
        return;
    const int g = get_global_id(2), G1 = get_global_size(2);
    const int ntiles = (T + TT - 1) / TT;
    if (g >= ntiles)
        return;
    const int k0 = (rho + PAD) % STRIDE;
    const int q0 = (rho + PAD) / STRIDE;
    const int nt = k0 < KW ? (KW - k0 + STRIDE - 1) / STRIDE : 0;

#if WEIGHT_TILES
    /* W [C, O, KW] laid out [O / OUT_VW][KW][C][OUT_VW] at load; this item's taps are k0 + STRIDE * i */
    const __global WTYPE *wt[OUT_VECS];
    for (int v = 0; v < OUT_VECS; v++)
        wt[v] = W + ((size_t)((o0 + v * OUT_VW) / OUT_VW) * KW + k0) * C * OUT_VW;
#else
    OVF wp[NTMAX][C][OUT_VECS];
    for (int c = 0; c < C; c++)         /* W's rows in order: [c][o][k] */
        for (int v = 0; v < OUT_VECS; v++)
            for (int lane = 0; lane < OUT_VW; lane++) {
                const int o = o0 + v * OUT_VW + lane < O ? o0 + v * OUT_VW + lane : O - 1;
                for (int i = 0; i < NTMAX; i++)
                    ((float *)&wp[i][c][v])[lane] = i < nt ? WGET(W + ((size_t)c * O + o) * KW + k0 + STRIDE * i) : 0.0f;
            }
#endif
#undef WP
#if WEIGHT_TILES
#define WP(i, c, v) WT_LD(wt[v] + ((size_t)(i) * STRIDE * C + (c)) * OUT_VW)
#else
#define WP(i, c, v) wp[i][c][v]
#endif
    OVF b[OUT_VECS];
    for (int v = 0; v < OUT_VECS; v++)
        for (int lane = 0; lane < OUT_VW; lane++) {
            const int o = o0 + v * OUT_VW + lane < O ? o0 + v * OUT_VW + lane : O - 1;
#ifdef HAS_BIAS
            ((float *)&b[v])[lane] = bias[o];
#else
            ((float *)&b[v])[lane] = 0.0f;
#endif
        }

    int s = 0;
    VF xs[TT][NTMAX][NCV];
    for (int tile = g; tile < ntiles; tile += G1) {
        const int m0 = tile * TT;
        for (int j = 0; j < TT; j++) {
            const int m = m0 + j < T ? m0 + j : T - 1;
            s = conv_seq(offsets, S, s, m);
            const int lo = offsets[s], hi = offsets[s + 1];
            for (int i = 0; i < nt; i++) {
                const int uu = m + q0 - i;
                const int ok = uu >= lo && uu < hi;
                const __global float *xp = X + x_off + (size_t)(ok ? uu : 0) * ldx;
                for (int cv = 0; cv < NCV; cv++) {
                    const VF a = ACT(VLOAD(xp + cv * VW));
                    xs[j][i][cv] = ok ? a : (VF)(0.0f);
                }
            }
        }
        OVF acc[OUT_VECS][TT];
        OUTER_PRODUCTS(acc, xs, nt);
        _Pragma("unroll")
        for (int j = 0; j < TT; j++) {
            const int m = m0 + j;
            if (m >= T)
                break;
            _Pragma("unroll")
            for (int v = 0; v < OUT_VECS; v++) {
                const int o = o0 + v * OUT_VW;
                if (o >= O)
                    break;
                outer_store(acc[v][j] + b[v], Y + y_off + ((size_t)m * STRIDE + rho) * ldy + o, 0, O - o);
            }
        }
    }
}
#endif
#endif /* O, DILATION 1 */
