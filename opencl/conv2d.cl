/* conv2d.cl - 2-D convolution over channels-last images (Stable Diffusion's UNet and VAE)
 *
 * kernel conv2d(
 *     const __global float *X, int x_off, int ldx,   N images of IH x IW pixels, channels last:
 *                                                     pixel p = (n*IH + y)*IW + x, X[p, c] = X[x_off + p*ldx + c]
 *     const __global WTYPE *W,                        W[O, C, KH, KW] (PyTorch Conv2d),
 *                                                     W[o, c, i, j] = W[((o*C + c)*KH + i)*KW + j]
 *     const __global float *bias,                     b[O], or b[N, O] with BIAS_PER_IMAGE; read only with
 *                                                     HAS_BIAS or BIAS_PER_IMAGE (else may be NULL)
 *     const __global float *R, int r_off, int ldr,    R[q, o] = R[r_off + q*ldr + o] over output pixels q;
 *                                                     read only with RESIDUAL (else may be NULL)
 *     __global float *Y, int y_off, int ldy,          output pixel q = (n*OH + y)*OW + x, Y[q, o] = Y[y_off + q*ldy + o]
 *     int N, int IH, int IW)                          images and their input size (per call, not macros)
 *
 *   The input as the convolution sees it is X itself (SH = IH, SW = IW), or with UPSAMPLE2
 *   the nearest-neighbour 2x image (SH = 2*IH, SW = 2*IW, pixel (y, x) reads X at (y/2, x/2):
 *   diffusers' Upsample2D, interpolate(nearest) then a 3x3 conv, without the 4x scratch).
 *   OH = (SH + 2*PAD - KH) / STRIDE + 1, OW likewise (PyTorch's sizes); for output pixel (y, x):
 *     v = sum_{c, i, j} act(S[y*STRIDE + i - PAD, x*STRIDE + j - PAD, c]) * W[o, c, i, j]
 *         (terms outside the SH x SW image are zero: zero padding of act(x), as PyTorch pads);
 *     v += b[o] (HAS_BIAS) or b[n, o] (BIAS_PER_IMAGE: a ResnetBlock's conv1 bias plus its
 *         time_emb_proj of image n's timestep, one [N, O] buffer);
 *     v += R[q, o] (RESIDUAL: a ResnetBlock's skip, y = conv(x) + b + R);
 *     Y[q, o] = v, or Y[q, o] += v (ACCUMULATE).
 *   act(x) = x, or x * sigmoid(x) with IN_SILU (loom_exp, recomputed for every tap and output
 *   tile that reads an element: 3-12x the plain call; group_norm's OUT_SILU does it once per
 *   element, so IN_SILU is for inputs that are also needed raw).
 *   Images never see each other. X and Y may not overlap; Y may be R when ldy == ldr and
 *   y_off == r_off (each element is read, then written, by the same work-item).
 *
 * Macros:
 *   C, O, KH, KW          required: input / output channels, kernel height / width
 *   STRIDE (1), PAD (0)   the same on both axes; SD: 3x3 PAD 1; Downsample2D STRIDE 2 PAD 1; 1x1 PAD 0
 *   UPSAMPLE2             nearest 2x input as above
 *   WEIGHT_F32 (default) | WEIGHT_F16   W as float or half (storage; widened once per work-item)
 *   HAS_BIAS | BIAS_PER_IMAGE, ACCUMULATE, RESIDUAL, IN_SILU   as above
 *   VW (16, else 8 / 4 / 1 as C allows)  vector width along C; must divide C_BLOCK
 *   OUTS_PER_ITEM (8)     output channels per work-item (keep it <= O: tails recompute)
 *   POS_PER_ITEM (4)      output pixels of one row per register tile: OUTS_PER_ITEM x POS_PER_ITEM
 *                         accumulators of VW floats. 8 x 4 was the best or near it for SD-1.5's
 *                         320-channel shape on both CPU drivers and never far off elsewhere;
 *                         4 x 4 matches it on PoCL but fell 3x behind on Intel's runtime at
 *                         96 channels (opencl/README.md has the table)
 *   C_BLOCK (C)           input channels per weight block (must divide C): each work-item widens
 *                         the weights of one block, runs all its tiles, then the next block,
 *                         adding into Y (which holds partial sums meanwhile). Bounds private
 *                         memory on devices that have little; on the CPUs here it only cost
 *                         time (see below). Changes rounding, not the answer.
 *
 * Private memory: each work-item keeps OUTS_PER_ITEM * KH * KW * C_BLOCK floats of widened
 * weights, re-laid [r][i*KW + j][c] so a VW-run of c is one vector (the checkpoint has c
 * strided by KH*KW): 8 * 9 * 64 floats = 18 KB for the illustrator's 64-channel convs,
 * 8 * 9 * 320 = 90 KB for SD-1.5's first stage, 360 KB at 1280 channels. With local size
 * 1s both CPU drivers here ran up to 1.4 MB an item correctly (16 x 9 x 2560), and at
 * 8x8x1280 C_BLOCK 320 was slower than none (Intel 35 vs 24 ms): weights stream from L2
 * either way. Lower OUTS_PER_ITEM or set C_BLOCK where a device's private memory is small.
 *
 * Launch: global = (ceil(O / OUTS_PER_ITEM), G1), local = (1, 1).
 *   Work-item (i, g) computes outputs i*OUTS_PER_ITEM ... of the g-th of G1 contiguous
 *   stretches of the N*OH*ceil(OW/POS_PER_ITEM) row tiles (tiles never straddle rows), so an
 *   item walks along rows and its three input rows stay in cache. Any G1 >= 1 gives identical
 *   bits; G1 only spreads work: items widen their weights once, so keep
 *   ceil(O/OUTS_PER_ITEM) * G1 a small multiple of the cores. Give the local size (1s): with
 *   NULL, PoCL sizes groups by thousands and allocates every item's weight copy at once.
 *   Tail outputs (O not a multiple of OUTS_PER_ITEM) and tail pixels of a row recompute
 *   the last one and skip the store (no per-output branches in the hot loop).
 */

#ifndef C
#error "conv2d.cl: define C (input channels)"
#endif
#ifndef O
#error "conv2d.cl: define O (output channels)"
#endif
#ifndef KH
#error "conv2d.cl: define KH (kernel height)"
#endif
#ifndef KW
#error "conv2d.cl: define KW (kernel width)"
#endif
#ifndef STRIDE
#define STRIDE 1
#endif
#ifndef PAD
#define PAD 0
#endif
#if STRIDE < 1 || PAD < 0
#error "conv2d.cl: STRIDE >= 1 and PAD >= 0"
#endif
#if defined(HAS_BIAS) && defined(BIAS_PER_IMAGE)
#error "conv2d.cl: define at most one of HAS_BIAS, BIAS_PER_IMAGE"
#endif
#ifndef C_BLOCK
#define C_BLOCK C
#endif
#if C % C_BLOCK != 0
#error "conv2d.cl: C_BLOCK must divide C"
#endif

#ifndef VW
#if C_BLOCK % 16 == 0
#define VW 16
#elif C_BLOCK % 8 == 0
#define VW 8
#elif C_BLOCK % 4 == 0
#define VW 4
#else
#define VW 1
#endif
#endif
#if VW != 1 && VW != 4 && VW != 8 && VW != 16
#error "conv2d.cl: VW must be 1, 4, 8 or 16"
#endif
#if C_BLOCK % VW != 0
#error "conv2d.cl: VW must divide C_BLOCK"
#endif
#define NCV (C_BLOCK / VW)
#define KK (KH * KW)

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
#error "conv2d.cl: define at most one of WEIGHT_F32, WEIGHT_F16"
#endif
#ifdef WEIGHT_F16
#define WTYPE half
#define WGET(p) loom_ldh(p)
#else
#define WTYPE float
#define WGET(p) (*(p))
#endif

#ifndef OUTS_PER_ITEM
#define OUTS_PER_ITEM 8
#endif
#ifndef POS_PER_ITEM
#define POS_PER_ITEM 4
#endif
#define OT OUTS_PER_ITEM
#define PT POS_PER_ITEM

#ifdef UPSAMPLE2
#define SRC(v) ((v) >> 1)
#else
#define SRC(v) (v)
#endif

#ifdef IN_SILU
/* x * sigmoid(x) = x / (1 + e^-x): loom_exp is ~0 below -87 (x) and huge above 88 (-> -0) */
inline float8 c2_silu8(float8 v) { return v / (1.0f + loom_exp8(-v)); }
#if VW == 16
#define ACT(v) ((float16)(c2_silu8((v).lo), c2_silu8((v).hi)))
#elif VW == 8
#define ACT(v) c2_silu8(v)
#elif VW == 4
#define ACT(v) (c2_silu8((float8)((v), (v))).lo)
#else
#define ACT(v) ((v) / (1.0f + loom_exp(-(v))))
#endif
#else
#define ACT(v) (v)
#endif

#ifdef ACCUMULATE
#define STORE(p, v) (*(p) += (v))
#else
#define STORE(p, v) (*(p) = (v))
#endif

__kernel void conv2d(const __global float *X, int x_off, int ldx,
                     const __global WTYPE *W, const __global float *bias,
                     const __global float *R, int r_off, int ldr,
                     __global float *Y, int y_off, int ldy,
                     int N, int IH, int IW)
{
    const int o0 = get_global_id(0) * OT;
#ifdef UPSAMPLE2
    const int SH = 2 * IH, SW = 2 * IW;
#else
    const int SH = IH, SW = IW;
#endif
    const int OH = (SH + 2 * PAD - KH) / STRIDE + 1, OW = (SW + 2 * PAD - KW) / STRIDE + 1;
    if (o0 >= O || N <= 0 || SH + 2 * PAD < KH || SW + 2 * PAD < KW)
        return;
    const int g = get_global_id(1), G1 = get_global_size(1);
    const int tpr = (OW + PT - 1) / PT;                       /* tiles per output row */
    const long ntiles = (long)N * OH * tpr;
    const long t_lo = ntiles * g / G1, t_hi = ntiles * (g + 1) / G1;
    if (t_lo >= t_hi)
        return;

    VF wp[OT][KK][NCV];
    for (int cb = 0; cb < C; cb += C_BLOCK) {
        /* this item's weights for channels cb .. cb + C_BLOCK - 1, widened and re-laid */
        for (int r = 0; r < OT; r++) {
            const int o = o0 + r < O ? o0 + r : O - 1;
            const __global WTYPE *wo = W + ((size_t)o * C + cb) * KK;
            for (int k = 0; k < KK; k++)
                for (int c = 0; c < C_BLOCK; c++)
                    ((float *)&wp[r][k][0])[c] = WGET(wo + c * KK + k);
        }

        for (long tile = t_lo; tile < t_hi; tile++) {
            const int row = (int)(tile / tpr);                /* n*OH + oy */
            const int ox0 = (int)(tile % tpr) * PT;
            const int n = row / OH, oy = row % OH;
            const __global float *ximg = X + x_off + (size_t)n * IH * IW * ldx + cb;
            int ix[PT];
            _Pragma("unroll")
            for (int j = 0; j < PT; j++)
                ix[j] = (ox0 + j < OW ? ox0 + j : OW - 1) * STRIDE - PAD;

            VF acc[OT][PT];
            _Pragma("unroll")
            for (int r = 0; r < OT; r++)
                _Pragma("unroll")
                for (int j = 0; j < PT; j++)
                    acc[r][j] = (VF)(0.0f);

            _Pragma("unroll")
            for (int ki = 0; ki < KH; ki++) {
                const int sy = oy * STRIDE + ki - PAD;
                const int rok = sy >= 0 && sy < SH;
                const __global float *xrow = ximg + (size_t)(rok ? SRC(sy) : 0) * IW * ldx;
                _Pragma("unroll")
                for (int kj = 0; kj < KW; kj++) {
                    const __global float *xp[PT];
                    int ok[PT];
                    _Pragma("unroll")
                    for (int j = 0; j < PT; j++) {
                        const int sx = ix[j] + kj;
                        ok[j] = rok && sx >= 0 && sx < SW;
                        xp[j] = xrow + (size_t)(ok[j] ? SRC(sx) : 0) * ldx;   /* pixel 0: a safe address */
                    }
                    for (int cv = 0; cv < NCV; cv++) {
                        VF xv[PT];
                        _Pragma("unroll")
                        for (int j = 0; j < PT; j++) {
                            const VF v = VLOAD(xp[j] + cv * VW);
                            const VF a = ACT(v);
                            xv[j] = ok[j] ? a : (VF)(0.0f);
                        }
                        _Pragma("unroll")
                        for (int r = 0; r < OT; r++) {
                            const VF w = wp[r][ki * KW + kj][cv];
                            _Pragma("unroll")
                            for (int j = 0; j < PT; j++)
                                acc[r][j] = w * xv[j] + acc[r][j];
                        }
                    }
                }
            }

            _Pragma("unroll")
            for (int j = 0; j < PT; j++) {
                const size_t q = (size_t)row * OW + ox0 + j;
                __global float *yrow = Y + y_off + q * ldy;
                _Pragma("unroll")
                for (int r = 0; r < OT; r++) {
                    const int o = o0 + r;
                    if (ox0 + j >= OW || o >= O)     /* not break: keeps the loops unrollable */
                        continue;
                    float v = VHSUM(acc[r][j]);
#if C_BLOCK < C
                    if (cb > 0) {               /* later blocks add to the partial sum */
                        yrow[o] += v;
                        continue;
                    }
#endif
#ifdef HAS_BIAS
                    v += bias[o];
#elif defined(BIAS_PER_IMAGE)
                    v += bias[n * O + o];
#endif
#ifdef RESIDUAL
                    v += R[r_off + q * ldr + o];
#endif
                    STORE(yrow + o, v);
                }
            }
        }
    }
}
