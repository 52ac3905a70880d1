/* softmax.cl - Y[t, :] = softmax(scale * X[t, :]), numerically stable
 *
 * kernel softmax(
 *     const __global float *X,    X[T, D] row-major
 *     __global float *Y,          Y[T, D]; Y == X (in place) is allowed
 *     int T,                      rows
 *     float scale)                multiplies the logits first (1.0f for none;
 *                                 1/temperature for sampling)
 *
 * Macros: D (required) row length; WG (1) lanes per row.
 * Launch: global = (WG, T), local = (WG, 1).
 * Three passes over the row: max of scale*x, then e = exp(scale*x - max) summed
 * (written to Y), then Y *= 1/sum. Subtracting the max keeps exp <= 1, so no
 * overflow; the max element contributes exp(0) = 1, so sum >= 1.
 * Rows of -inf become NaN; NaN inputs propagate.
 */

#ifndef D
#error "softmax.cl: define D (row length)"
#endif
#ifndef WG
#define WG 1
#endif

#define D8 (D / 8 * 8)

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void softmax(const __global float *X, __global float *Y, int T, float scale)
{
    const int t = get_global_id(1), lane = get_local_id(0);
    if (t >= T)
        return;
    const __global float *x = X + (size_t)t * D;
    __global float *y = Y + (size_t)t * D;
#if WG > 1
    __local float scratch[WG];
#endif

    float8 mv = (float8)(-INFINITY);
    for (int i = lane * 8; i < D8; i += WG * 8) {
        float8 v = loom_ld_float8(x + i) * scale;
        mv = v > mv ? v : mv;
    }
    float4 m4 = mv.lo > mv.hi ? mv.lo : mv.hi;
    float2 m2 = m4.lo > m4.hi ? m4.lo : m4.hi;
    float m = m2.s0 > m2.s1 ? m2.s0 : m2.s1;
    for (int i = D8 + lane; i < D; i += WG)
        m = x[i] * scale > m ? x[i] * scale : m;
#if WG > 1
    m = loom_wg_max(m, scratch, lane, WG);
#endif

    float8 acc = (float8)(0.0f);
    for (int i = lane * 8; i < D8; i += WG * 8) {
        float8 e = loom_exp8(loom_ld_float8(x + i) * scale - m);
        loom_st_float8(e, y + i);
        acc += e;
    }
    float s = loom_hsum8(acc);
    for (int i = D8 + lane; i < D; i += WG) {
        float e = loom_exp(x[i] * scale - m);
        y[i] = e;
        s += e;
    }
#if WG > 1
    s = loom_wg_sum(s, scratch, lane, WG);
#endif
    const float inv = 1.0f / s;

    for (int i = lane * 8; i < D8; i += WG * 8)
        loom_st_float8(loom_ld_float8(y + i) * inv, y + i);
    for (int i = D8 + lane; i < D; i += WG)
        y[i] *= inv;
}
