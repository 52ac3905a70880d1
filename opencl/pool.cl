/* pool.cl - sequence pooling and row normalization for encoders
 *
 * Tokens X[T, D] hold S sequences back to back: sequence s is rows
 * offsets[s] .. offsets[s+1]-1 (offsets[S+1] ascending; padding excluded).
 *
 *   kernel mean_pool(const __global float *X, const __global int *offsets,
 *                    __global float *out, int S)
 *       out[s, :] = mean of the rows of sequence s (zeros if it is empty)
 *       Launch: global = (D, S), local = any.
 *   kernel cls_pool(const __global float *X, const __global int *offsets,
 *                   __global float *out, int S)
 *       out[s, :] = X[offsets[s], :] (its first token; zeros if empty)
 *       Launch: global = (D, S), local = any.
 *   kernel l2_normalize(const __global float *X, __global float *Y, int T, float eps)
 *       Y[t, :] = X[t, :] / max(||X[t, :]||_2, eps)  (torch F.normalize; Y may be X)
 *       Launch: global = (WG, T), local = (WG, 1).
 *
 * Macros: D (required) row length; WG (1) lanes per row for l2_normalize.
 */

#ifndef D
#error "pool.cl: define D (row length)"
#endif
#ifndef WG
#define WG 1
#endif

#define D8 (D / 8 * 8)

__kernel void mean_pool(const __global float *X, const __global int *offsets,
                        __global float *out, int S)
{
    const int i = get_global_id(0), s = get_global_id(1);
    if (i >= D || s >= S)
        return;
    const int a = offsets[s], b = offsets[s + 1];
    float sum = 0.0f;
    for (int t = a; t < b; t++)
        sum += X[(size_t)t * D + i];
    out[(size_t)s * D + i] = b > a ? sum / (float)(b - a) : 0.0f;
}

__kernel void cls_pool(const __global float *X, const __global int *offsets,
                       __global float *out, int S)
{
    const int i = get_global_id(0), s = get_global_id(1);
    if (i >= D || s >= S)
        return;
    const int a = offsets[s], b = offsets[s + 1];
    out[(size_t)s * D + i] = b > a ? X[(size_t)a * D + i] : 0.0f;
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void l2_normalize(const __global float *X, __global float *Y, int T, float eps)
{
    const int t = get_global_id(1), lane = get_local_id(0);
    if (t >= T)
        return;
    const __global float *x = X + (size_t)t * D;
    __global float *y = Y + (size_t)t * D;

    float8 acc = (float8)(0.0f);
    for (int i = lane * 8; i < D8; i += WG * 8) {
        float8 v = loom_ld_float8(x + i);
        acc += v * v;
    }
    float ss = loom_hsum8(acc);
    for (int i = D8 + lane; i < D; i += WG)
        ss += x[i] * x[i];
#if WG > 1
    __local float scratch[WG];
    ss = loom_wg_sum(ss, scratch, lane, WG);
#endif
    const float norm = sqrt(ss);
    const float inv = 1.0f / (norm > eps ? norm : eps);

    for (int i = lane * 8; i < D8; i += WG * 8)
        loom_st_float8(loom_ld_float8(x + i) * inv, y + i);
    for (int i = D8 + lane; i < D; i += WG)
        y[i] = x[i] * inv;
}
