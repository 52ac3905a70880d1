/* rope.cl - rotary position embedding, in place on X[T, N_HEADS, HEAD_DIM]
 *
 * kernel rope(
 *     __global float *X, int x_off, int ldx,   head h of token t starts at
 *                                              X[x_off + t*ldx + h*HEAD_DIM]
 *     const __global int *pos,                 pos[T]: position of each token (>= 0)
 *     int T,                                   tokens
 *     float theta,                             frequency base (10000, 1e6 ...)
 *     float freq_scale)                        linear position scaling: angles use
 *                                              pos * freq_scale (1.0f for none)
 *
 * For pair i (0 <= i < ROPE_DIMS/2) the angle is
 *   pos * freq_scale * theta^(-2i / ROPE_DIMS)
 * and the pair (a, b) becomes (a cos - b sin, a sin + b cos). The pair is
 *   NORMAL (GPT-J, ggml mode 0, default):  (2i, 2i + 1)
 *   ROPE_NEOX (GPT-NeoX / HF Llama layout): (i, i + ROPE_DIMS/2)
 * Dims >= ROPE_DIMS pass through unchanged.
 *
 * Macros: N_HEADS, HEAD_DIM (required); ROPE_DIMS (HEAD_DIM, even, <= HEAD_DIM);
 *   ROPE_NEOX, or ROPE_NORMAL (the default, accepted for explicitness). Run once for Q (N_HEADS = query heads) and once for K (N_HEADS =
 *   kv heads): two builds with different N_HEADS.
 * Launch: global = (ROPE_DIMS / 2, T), local = any (NULL). Each work-item
 *   computes one angle and rotates that pair in every head.
 */

#ifndef N_HEADS
#error "rope.cl: define N_HEADS (heads in this tensor)"
#endif
#ifndef HEAD_DIM
#error "rope.cl: define HEAD_DIM"
#endif
#ifndef ROPE_DIMS
#define ROPE_DIMS HEAD_DIM
#endif
#if defined(ROPE_NEOX) && defined(ROPE_NORMAL)
#error "rope.cl: define ROPE_NEOX or ROPE_NORMAL, not both"
#endif
#if ROPE_DIMS % 2 != 0 || ROPE_DIMS > HEAD_DIM
#error "rope.cl: ROPE_DIMS must be even and <= HEAD_DIM"
#endif

__kernel void rope(__global float *X, int x_off, int ldx, const __global int *pos,
                   int T, float theta, float freq_scale)
{
    const int i = get_global_id(0), t = get_global_id(1);
    if (i >= ROPE_DIMS / 2 || t >= T)
        return;
    const float inv_freq = pow(theta, -2.0f * (float)i / (float)ROPE_DIMS);
    const float angle = (float)pos[t] * freq_scale * inv_freq;
    float c;
    const float s = sincos(angle, &c);
#ifdef ROPE_NEOX
    const int ia = i, ib = i + ROPE_DIMS / 2;
#else
    const int ia = 2 * i, ib = 2 * i + 1;
#endif
    __global float *x = X + x_off + (size_t)t * ldx;
    for (int h = 0; h < N_HEADS; h++) {
        float a = x[h * HEAD_DIM + ia], b = x[h * HEAD_DIM + ib];
        x[h * HEAD_DIM + ia] = a * c - b * s;
        x[h * HEAD_DIM + ib] = a * s + b * c;
    }
}
