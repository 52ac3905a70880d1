/* layer_norm.cl - Y[t, :] = (X[t, :] - mean) / sqrt(var + eps) (* w) (+ b)
 *
 * kernel layer_norm(
 *     const __global float *X,    X[T, D] row-major
 *     const __global float *w,    w[D]; read only with HAS_WEIGHT (else may be NULL)
 *     const __global float *b,    b[D]; read only with HAS_BIAS (else may be NULL)
 *     __global float *Y,          Y[T, D]; Y == X (in place) is allowed, not with ACCUMULATE
 *     int T,                      rows
 *     float eps)
 *
 * Macros: D (required); HAS_WEIGHT; HAS_BIAS; WG (1) lanes per row;
 *   OUT_GELU: Y = gelu(...) (erf form, elementwise.cl's), ACCUMULATE: Y += ...
 *   (VITS's DDSConv: x += gelu(LN(conv(y))) in one pass, no gelu or add launch).
 * Launch: global = (WG, T), local = (WG, 1).
 * The variance is the biased one (divide by D), computed in a second pass
 * over (x - mean) rather than as E[x^2] - mean^2, which cancels badly.
 */

#ifndef D
#error "layer_norm.cl: define D (row length)"
#endif
#ifndef WG
#define WG 1
#endif

#define D8 (D / 8 * 8)

#ifdef OUT_GELU
inline float ln_out(float v) { return 0.5f * v * (1.0f + loom_erf(v * 0.70710678118f)); }
inline float8 ln_out8(float8 v) { return 0.5f * v * (1.0f + loom_erf8(v * 0.70710678118f)); }
#else
#define ln_out(v) (v)
#define ln_out8(v) (v)
#endif
#ifdef ACCUMULATE
#define LN_ST8(v, p) loom_st_float8(loom_ld_float8(p) + (v), p)
#define LN_ST(v, p) (*(p) += (v))
#else
#define LN_ST8(v, p) loom_st_float8(v, p)
#define LN_ST(v, p) (*(p) = (v))
#endif

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void layer_norm(const __global float *X, const __global float *w, const __global float *b,
                __global float *Y, int T, float eps)
{
    const int t = get_global_id(1), lane = get_local_id(0);
    if (t >= T)
        return;
    const __global float *x = X + (size_t)t * D;
    __global float *y = Y + (size_t)t * D;
#if WG > 1
    __local float scratch[WG];
#endif

    float8 acc = (float8)(0.0f);
    for (int i = lane * 8; i < D8; i += WG * 8)
        acc += loom_ld_float8(x + i);
    float s = loom_hsum8(acc);
    for (int i = D8 + lane; i < D; i += WG)
        s += x[i];
#if WG > 1
    s = loom_wg_sum(s, scratch, lane, WG);
#endif
    const float mean = s / (float)D;

    acc = (float8)(0.0f);
    for (int i = lane * 8; i < D8; i += WG * 8) {
        float8 v = loom_ld_float8(x + i) - mean;
        acc += v * v;
    }
    float ss = loom_hsum8(acc);
    for (int i = D8 + lane; i < D; i += WG)
        ss += (x[i] - mean) * (x[i] - mean);
#if WG > 1
    ss = loom_wg_sum(ss, scratch, lane, WG);
#endif
    const float inv = rsqrt(ss / (float)D + eps);

    for (int i = lane * 8; i < D8; i += WG * 8) {
        float8 v = (loom_ld_float8(x + i) - mean) * inv;
#ifdef HAS_WEIGHT
        v *= loom_ld_float8(w + i);
#endif
#ifdef HAS_BIAS
        v += loom_ld_float8(b + i);
#endif
        LN_ST8(ln_out8(v), y + i);
    }
    for (int i = D8 + lane; i < D; i += WG) {
        float v = (x[i] - mean) * inv;
#ifdef HAS_WEIGHT
        v *= w[i];
#endif
#ifdef HAS_BIAS
        v += b[i];
#endif
        LN_ST(ln_out(v), y + i);
    }
}
