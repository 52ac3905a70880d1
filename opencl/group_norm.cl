/* group_norm.cl - torch.nn.GroupNorm over channels-last images (Stable Diffusion's UNet and VAE)
 *
 * kernel group_norm(
 *     const __global float *X,      X[n, p, c] = X[(n*HW + p)*C + c]: N images of HW pixels
 *     const __global float *gamma,  gamma[C]
 *     const __global float *beta,   beta[C] (always read: diffusers' GroupNorm is affine)
 *     __global float *Y,            Y[n, p, c]; Y == X (in place) is allowed
 *     int N, int HW,                images, pixels per image (per call)
 *     float eps)                    SD: 1e-5 in the UNet's resnets, 1e-6 in the VAE and the
 *                                   UNet's Transformer2DModel norms
 *   Group k of image n is channels k*CG .. (k+1)*CG - 1 (CG = C / G) over all HW pixels:
 *     mean = sum(x) / (HW*CG), var = sum((x - mean)^2) / (HW*CG)   (biased, as PyTorch),
 *     y = (x - mean) / sqrt(var + eps) * gamma[c] + beta[c], then y * sigmoid(y) with OUT_SILU.
 *
 * Macros: C, G (required; G must divide C); OUT_SILU; WG (1) lanes per work-group;
 *   GROUPS_PER_ITEM (1, must divide G) groups per work-group.
 * Launch: global = (WG, G / GROUPS_PER_ITEM, N), local = (WG, 1, 1) (required; any WG >= 1).
 *   One work-group per (image, GROUPS_PER_ITEM adjacent groups); its lanes take blocks of 64
 *   consecutive pixels in turn and read the slab of GROUPS_PER_ITEM * C/G channels of each
 *   as vectors. WG = 1 on CPUs: a work-group runs on one core, so cores are filled by the
 *   N * G / GROUPS_PER_ITEM work-groups. With few channels a group (the illustrator: 2-8,
 *   SD-1.5 at 320 channels: 10) a work-group per group reads a few bytes of each line that the
 *   other groups' work-groups fetch again; a slab of >= 16 channels (the smallest divisor of
 *   G that gives one) was 1.5-4.5x faster on both CPU drivers (opencl/README.md).
 *
 * Statistics: float, two passes over the group (the mean, then squared deviations from it:
 * E[x^2] - mean^2 cancels badly when |mean| >> std), then a third pass writes y. Each lane
 * sums 64-pixel blocks into a partial before adding it to its running total (error grows
 * with 64 + HW/64, not with HW), and lanes combine in lane order: deterministic for a WG.
 * In place is safe: every pixel is read for both statistics before any lane writes, and
 * the writing pass reads and writes each element in the same lane.
 */

#ifndef C
#error "group_norm.cl: define C (channels)"
#endif
#ifndef G
#error "group_norm.cl: define G (groups)"
#endif
#if C % G != 0
#error "group_norm.cl: G must divide C"
#endif
#ifndef WG
#define WG 1
#endif

#ifndef GROUPS_PER_ITEM
#define GROUPS_PER_ITEM 1
#endif
#if G % GROUPS_PER_ITEM != 0
#error "group_norm.cl: GROUPS_PER_ITEM must divide G"
#endif
#define CG (C / G)
#define GPI GROUPS_PER_ITEM
#define SC (GPI * CG)               /* the slab of channels one work-group reads per pixel */
#if SC % 8 == 0
#define GV 8
#elif SC % 4 == 0
#define GV 4
#else
#define GV 1
#endif
#define NSV (SC / GV)
#define GN_BLOCK 64

#if GV == 1
#define VF float
#define VLOAD(p) (*(p))
#define VSTORE(v, p) (*(p) = (v))
#else
#define VF LOOM_CAT(float, GV)
#define VLOAD(p) LOOM_CAT(loom_ld_float, GV)(p)
#define VSTORE(v, p) LOOM_CAT(loom_st_float, GV)(v, p)
#endif

#ifdef OUT_SILU
inline float8 gn_silu8(float8 v) { return v / (1.0f + loom_exp8(-v)); }
#if GV == 8
#define SILU(v) gn_silu8(v)
#elif GV == 4
#define SILU(v) (gn_silu8((float8)((v), (v))).lo)
#else
#define SILU(v) ((v) / (1.0f + loom_exp(-(v))))
#endif
#else
#define SILU(v) (v)
#endif

/* One pass over this lane's pixel blocks: per-channel sums of x (mv NULL) or of (x - mean)^2,
 * each 64-pixel block summed apart before joining the running total; -> per-group sums. */
inline void gn_pass(const __global float *x, int HW, int lane, const VF *mv, float *gsum)
{
    VF acc[NSV];
    for (int i = 0; i < NSV; i++)
        acc[i] = (VF)(0.0f);
    for (int p0 = lane * GN_BLOCK; p0 < HW; p0 += WG * GN_BLOCK) {
        const int p1 = p0 + GN_BLOCK < HW ? p0 + GN_BLOCK : HW;
        VF part[NSV];
        _Pragma("unroll")
        for (int i = 0; i < NSV; i++)
            part[i] = (VF)(0.0f);
        for (int p = p0; p < p1; p++)
            _Pragma("unroll")
            for (int i = 0; i < NSV; i++) {
                const VF v = VLOAD(x + (size_t)p * C + i * GV);
                if (mv) {
                    const VF d = v - mv[i];
                    part[i] += d * d;
                } else {
                    part[i] += v;
                }
            }
        _Pragma("unroll")
        for (int i = 0; i < NSV; i++)
            acc[i] += part[i];
    }
    const float *a = (const float *)acc;
    for (int k = 0; k < GPI; k++) {
        float s = 0.0f;
        for (int c = 0; c < CG; c++)
            s += a[k * CG + c];
        gsum[k] = s;
    }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void group_norm(const __global float *X, const __global float *gamma, const __global float *beta,
                __global float *Y, int N, int HW, float eps)
{
    const int lane = get_local_id(0), k0 = get_global_id(1) * GPI, n = get_global_id(2);
    if (k0 >= G || n >= N || HW <= 0)
        return;                                       /* uniform over the work-group */
    const size_t base = (size_t)n * HW * C + (size_t)k0 * CG;
    const __global float *x = X + base;
    __global float *y = Y + base;
#if WG > 1
    __local float scratch[WG];
#endif
    const float count = (float)HW * (float)CG;
    float gs[GPI], mean[GPI];
    VF mv[NSV];

    gn_pass(x, HW, lane, 0, gs);
    for (int k = 0; k < GPI; k++) {
#if WG > 1
        gs[k] = loom_wg_sum(gs[k], scratch, lane, WG);
#endif
        mean[k] = gs[k] / count;
        for (int c = 0; c < CG; c++)
            ((float *)mv)[k * CG + c] = mean[k];
    }

    gn_pass(x, HW, lane, mv, gs);
    VF a[NSV], b[NSV];
    for (int k = 0; k < GPI; k++) {
#if WG > 1
        gs[k] = loom_wg_sum(gs[k], scratch, lane, WG);
#endif
        const float inv = rsqrt(gs[k] / count + eps);
        for (int c = 0; c < CG; c++) {
            ((float *)a)[k * CG + c] = gamma[(k0 + k) * CG + c] * inv;
            ((float *)b)[k * CG + c] = beta[(k0 + k) * CG + c];
        }
    }

    for (int p0 = lane * GN_BLOCK; p0 < HW; p0 += WG * GN_BLOCK) {
        const int p1 = p0 + GN_BLOCK < HW ? p0 + GN_BLOCK : HW;
        for (int p = p0; p < p1; p++)
            _Pragma("unroll")
            for (int i = 0; i < NSV; i++) {
                const VF v = (VLOAD(x + (size_t)p * C + i * GV) - mv[i]) * a[i] + b[i];
                VSTORE(SILU(v), y + (size_t)p * C + i * GV);
            }
    }
}
