/* argmax.cl - greedy sampling: ids[t] = argmax_i X[t, i]
 *
 * kernel argmax(
 *     const __global float *X, int x_off, int ldx,   X[t, i] = X[x_off + t*ldx + i], i < D
 *     __global int *ids,                             ids[T]
 *     int T)
 *
 * Macros: D (required) row length (vocabulary); WG (1) lanes per row.
 * Launch: global = (WG, T), local = (WG, 1).
 * Ties go to the lowest index (as numpy.argmax). NaNs are skipped (numpy would
 * return the first NaN); a row with no number > -inf gives 0.
 */

#ifndef D
#error "argmax.cl: define D (row length)"
#endif
#ifndef WG
#define WG 1
#endif

#define D8 (D / 8 * 8)

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void argmax(const __global float *X, int x_off, int ldx, __global int *ids, int T)
{
    const int t = get_global_id(1), lane = get_local_id(0);
    if (t >= T)
        return;
    const __global float *x = X + x_off + (size_t)t * ldx;

    /* 8 running (value, index) slots; strict > keeps the first of equal values */
    float8 bv = (float8)(-INFINITY);
    int8 bi = (int8)(D);
    const int8 lanes = (int8)(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = lane * 8; i < D8; i += WG * 8) {
        float8 v = loom_ld_float8(x + i);
        int8 better = v > bv;
        bv = better ? v : bv;
        bi = better ? lanes + i : bi;
    }
    float best = -INFINITY;
    int besti = D;
#define TAKE(c) if (bv.c > best || (bv.c == best && bi.c < besti)) { best = bv.c; besti = bi.c; }
    TAKE(s0) TAKE(s1) TAKE(s2) TAKE(s3) TAKE(s4) TAKE(s5) TAKE(s6) TAKE(s7)
#undef TAKE
    for (int i = D8 + lane; i < D; i += WG) {
        if (x[i] > best) {   /* increasing i: strict > keeps the lowest index */
            best = x[i];
            besti = i;
        }
    }
#if WG > 1
    __local float sv[WG];
    __local int si[WG];
    sv[lane] = best;
    si[lane] = besti;
    barrier(CLK_LOCAL_MEM_FENCE);
    best = -INFINITY;
    besti = D;
    for (int k = 0; k < WG; k++) {
        if (sv[k] > best || (sv[k] == best && si[k] < besti)) {
            best = sv[k];
            besti = si[k];
        }
    }
#endif
    if (lane == 0)
        ids[t] = besti < D ? besti : 0;
}
