/* rms_norm.cl - Y[t, :] = X[t, :] / sqrt(mean(X[t, :]^2) + eps) (* w)
 *
 * kernel rms_norm(
 *     const __global float *X,    X[T, D] row-major
 *     const __global float *w,    w[D]; read only with HAS_WEIGHT (else may be NULL)
 *     __global float *Y,          Y[T, D]; Y == X (in place) is allowed
 *     int T,                      rows
 *     float eps)
 *
 * Macros: D (required) row length; HAS_WEIGHT multiply by w; WG (1) lanes per
 *   row (work-group size; lanes split the row and reduce in local memory);
 *   HEADS (1), LDX (HEADS * D), ROW_OFF (0): row r is head r % HEADS of token
 *   r / HEADS, at X[ROW_OFF + (r / HEADS) * LDX + (r % HEADS) * D] (Y alike).
 * Launch: global = (WG, T), local = (WG, 1).
 *
 * Per-head norms (Qwen3 q/k norm) are this kernel with D = head_dim and
 * T = tokens * heads: over a contiguous [T, heads, head_dim] tensor, or with
 * HEADS, LDX and ROW_OFF over the q or k columns of a fused q|k|v buffer.
 * On the CPU one lane per row is best: a row is a few KB, already in cache.
 */

#ifndef D
#error "rms_norm.cl: define D (row length)"
#endif
#ifndef WG
#define WG 1
#endif
#ifndef HEADS
#define HEADS 1
#endif
#ifndef LDX
#define LDX (HEADS * D)
#endif
#ifndef ROW_OFF
#define ROW_OFF 0
#endif

#define D8 (D / 8 * 8)

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void rms_norm(const __global float *X, const __global float *w, __global float *Y,
              int T, float eps)
{
    const int t = get_global_id(1), lane = get_local_id(0);
    if (t >= T)
        return;
    const size_t at = ROW_OFF + (size_t)(t / HEADS) * LDX + (size_t)(t % HEADS) * D;
    const __global float *x = X + at;
    __global float *y = Y + at;

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
    const float inv = rsqrt(ss / (float)D + eps);

    for (int i = lane * 8; i < D8; i += WG * 8) {
        float8 v = loom_ld_float8(x + i) * inv;
#ifdef HAS_WEIGHT
        v *= loom_ld_float8(w + i);
#endif
        loom_st_float8(v, y + i);
    }
    for (int i = D8 + lane; i < D; i += WG) {
        float v = x[i] * inv;
#ifdef HAS_WEIGHT
        v *= w[i];
#endif
        y[i] = v;
    }
}
