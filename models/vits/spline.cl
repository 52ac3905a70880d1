/* spline.cl - the inverse rational-quadratic spline of VITS's ConvFlow
 *
 * transforms.piecewise_rational_quadratic_transform(inverse=True, tails="linear")
 * on one column of z [n, 2]: outside [-TAIL, TAIL] the identity; inside, BINS
 * bins whose widths and heights are softmaxes of the row's parameters (divided by
 * SCALE, with minimum sizes 1e-3) and whose knot derivatives are 1e-3 +
 * softplus (the boundary ones fixed so the tails join with slope 1). Computed
 * in double where the device has it (the reference is float64; the spline
 * amplifies rounding where it is flat). Rows past their sentence's length
 * become 0 in both columns (VITS's x_mask).
 *
 * kernel spline(__global float *z, int col, __global const float *h, __global const int *lengths, int T, int S)
 *   h: [n, SPLINE] = widths[BINS], heights[BINS], derivatives[BINS - 1].
 * Macros: BINS, SPLINE (3 * BINS - 1), TAIL, SCALE. Launch: global = (T, S).
 */

#ifdef cl_khr_fp64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
typedef double real;
#else
typedef float real;
#endif

#define MIN_SIZE 1e-3
#define MIN_DERIVATIVE 1e-3

/* Bin edges from unnormalized sizes u[BINS]: edges[BINS + 1] from -TAIL to TAIL. */
static void spline_edges(const __global float *u, real *edges) {
    real top = -1e30, total = 0;
    for (int i = 0; i < BINS; ++i) top = fmax(top, (real)u[i] / (real)SCALE);
    for (int i = 0; i < BINS; ++i) total += exp((real)u[i] / (real)SCALE - top);
    real acc = 0;
    edges[0] = -TAIL;
    for (int i = 0; i < BINS; ++i) {
        acc += MIN_SIZE + (1 - MIN_SIZE * BINS) * (exp((real)u[i] / (real)SCALE - top) / total);
        edges[i + 1] = 2 * TAIL * acc - TAIL;
    }
    edges[BINS] = TAIL;
}

static real spline_softplus(real x) {
    return x > 20 ? x : log1p(exp(x));
}

__kernel void spline(__global float *z, int col, __global const float *h, __global const int *lengths, int T,
                     int S) {
    const int t = get_global_id(0), s = get_global_id(1);
    if (t >= T || s >= S) return;
    const long r = (long)s * T + t;
    if (t >= lengths[s]) {
        z[2 * r] = z[2 * r + 1] = 0.0f;
        return;
    }
    const real x = z[2 * r + col];
    if (x < -TAIL || x > TAIL) return;          /* linear tails: the identity */
    const __global float *p = h + r * SPLINE;
    real cw[BINS + 1], ch[BINS + 1];
    spline_edges(p, cw);
    spline_edges(p + BINS, ch);
    int k = 0;
    for (int i = 0; i < BINS; ++i)
        if (x >= ch[i]) k = i;      /* the last bin also takes x == TAIL */
    const real boundary = log(exp(1 - MIN_DERIVATIVE) - 1);
    const real d0 = MIN_DERIVATIVE + spline_softplus(k == 0 ? boundary : (real)p[2 * BINS + k - 1]);
    const real d1 = MIN_DERIVATIVE + spline_softplus(k == BINS - 1 ? boundary : (real)p[2 * BINS + k]);
    const real bw = cw[k + 1] - cw[k], bh = ch[k + 1] - ch[k], delta = bh / bw;
    const real dy = x - ch[k];
    const real a = dy * (d0 + d1 - 2 * delta) + bh * (delta - d0);
    const real b = bh * d0 - dy * (d0 + d1 - 2 * delta);
    const real c = -delta * dy;
    const real disc = fmax(b * b - 4 * a * c, (real)0);
    const real theta = (2 * c) / (-b - sqrt(disc));
    z[2 * r + col] = (float)(theta * bw + cw[k]);
}
