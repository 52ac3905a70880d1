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
 *
 * kernel rope_store(X, x_off, ldx, pos, T, theta, freq_scale,
 *     int v_off,                               v head g of token t at
 *                                              X[x_off + t*ldx + v_off + g*HEAD_DIM]
 *     __global KV_T *Kc, __global KV_T *Vc, int layer_off,
 *     const __global int *row_of, const __global int *page_table)
 * rope, then the rotated keys (the last N_KV_HEADS of the N_HEADS heads) and the
 * values into the paged cache exactly as kv_store.cl stores them (its layout,
 * KV_F16 and skips: a position outside the page table or an unmapped page
 * stores nothing): one launch where a decoder ran two. Macros as rope's plus
 * N_KV_HEADS, PAGE_SIZE, MAX_PAGES (KV_F16); ROPE_DIMS == HEAD_DIM, so every
 * dimension of a head is some work-item's pair.
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

/* pair i's cosine and sine at position p (c through *c): common.cl's */
#define rope_angle(i, p, theta, freq_scale, c) loom_rope_angle(i, ROPE_DIMS, p, theta, freq_scale, c)
#define ROPE_IA(i) LOOM_ROPE_IA(i, ROPE_DIMS)
#define ROPE_IB(i) LOOM_ROPE_IB(i, ROPE_DIMS)

__kernel void rope(__global float *X, int x_off, int ldx, const __global int *pos,
                   int T, float theta, float freq_scale)
{
    const int i = get_global_id(0), t = get_global_id(1);
    if (i >= ROPE_DIMS / 2 || t >= T)
        return;
    float c;
    const float s = rope_angle(i, pos[t], theta, freq_scale, &c);
    const int ia = ROPE_IA(i), ib = ROPE_IB(i);
    __global float *x = X + x_off + (size_t)t * ldx;
    for (int h = 0; h < N_HEADS; h++) {
        float a = x[h * HEAD_DIM + ia], b = x[h * HEAD_DIM + ib];
        x[h * HEAD_DIM + ia] = a * c - b * s;
        x[h * HEAD_DIM + ib] = a * s + b * c;
    }
}

#if defined(N_KV_HEADS) && defined(PAGE_SIZE) && defined(MAX_PAGES)
#if ROPE_DIMS != HEAD_DIM || N_KV_HEADS > N_HEADS
#error "rope.cl: rope_store needs ROPE_DIMS == HEAD_DIM and N_KV_HEADS <= N_HEADS"
#endif
#ifdef KV_F16
#define KV_T half
#define KV_PUT(v, p) vstore_half_rte((v), 0, (p))
#else
#define KV_T float
#define KV_PUT(v, p) (*(p) = (v))
#endif
#define KV_ROW (N_KV_HEADS * HEAD_DIM)

__kernel void rope_store(__global float *X, int x_off, int ldx, const __global int *pos,
                         int T, float theta, float freq_scale, int v_off,
                         __global KV_T *Kc, __global KV_T *Vc, int layer_off,
                         const __global int *row_of, const __global int *page_table)
{
    const int i = get_global_id(0), t = get_global_id(1);
    if (i >= ROPE_DIMS / 2 || t >= T)
        return;
    const int p = pos[t];
    float c;
    const float s = rope_angle(i, p, theta, freq_scale, &c);
    const int ia = ROPE_IA(i), ib = ROPE_IB(i);
    const int page = p < 0 || p >= MAX_PAGES * PAGE_SIZE ? -1
                     : page_table[(size_t)row_of[t] * MAX_PAGES + p / PAGE_SIZE];
    const size_t dst = page < 0 ? 0 : (size_t)layer_off + ((size_t)page * PAGE_SIZE + p % PAGE_SIZE) * KV_ROW;
    __global float *x = X + x_off + (size_t)t * ldx;
    for (int h = 0; h < N_HEADS; h++) {
        float a = x[h * HEAD_DIM + ia], b = x[h * HEAD_DIM + ib];
        const float ra = a * c - b * s, rb = a * s + b * c;
        x[h * HEAD_DIM + ia] = ra;
        x[h * HEAD_DIM + ib] = rb;
        const int g = h - (N_HEADS - N_KV_HEADS);
        if (g >= 0 && page >= 0) {
            KV_PUT(ra, Kc + dst + g * HEAD_DIM + ia);
            KV_PUT(rb, Kc + dst + g * HEAD_DIM + ib);
            KV_PUT(x[v_off + g * HEAD_DIM + ia], Vc + dst + g * HEAD_DIM + ia);
            KV_PUT(x[v_off + g * HEAD_DIM + ib], Vc + dst + g * HEAD_DIM + ib);
        }
    }
}
#endif
