/* attention_seq.cl - attention within packed sequences, no cache (encoders)
 *
 * Tokens X[T] are S sequences packed back to back: sequence s is tokens
 * offsets[s] .. offsets[s+1]-1. Token t of sequence s attends to every token
 * of s (bidirectional, BERT) or, with CAUSAL, to tokens offsets[s] .. t.
 *   O[t, h, :] = sum_u softmax_u(scale * Q[t, h, :] . K[u, g, :]) V[u, g, :]
 * with kv head g = h / (N_HEADS / N_KV_HEADS).
 *
 * kernel attention_seq(
 *     const __global float *Q, int q_off, int ldq,   Q[t, h, d] = Q[q_off + t*ldq + h*HEAD_DIM + d]
 *     const __global float *K, int k_off, int ldk,   K[u, g, d] = K[k_off + u*ldk + g*HEAD_DIM + d]
 *     const __global float *V, int v_off, int ldv,   likewise
 *     const __global int *offsets, int S,            offsets[S+1], offsets[0] = 0, offsets[S] = T
 *     __global float *O, int o_off, int ldo,         O[t, h, d] = O[o_off + t*ldo + h*HEAD_DIM + d]
 *     int T,
 *     float scale)
 *
 * Macros: N_HEADS, HEAD_DIM (multiple of 8) required; N_KV_HEADS (N_HEADS);
 *   CAUSAL; KV_OFFSETS: cross-attention, the kernel takes `const __global int
 *   *kv_offsets` right after S, and sequence s's queries attend to keys
 *   kv_offsets[s] .. kv_offsets[s+1]-1 of K and V (Stable Diffusion: an image's
 *   pixels to its prompt's tokens). With a fused QKV projection pass one buffer three times with
 *   column offsets q_off/k_off/v_off and the fused row length as ld.
 * Launch: global = (N_HEADS, T), local = any dividing N_HEADS (NULL is fine).
 * Online softmax over tiles of 16 keys, as in attention.cl.
 */

#ifndef N_HEADS
#error "attention_seq.cl: define N_HEADS"
#endif
#ifndef N_KV_HEADS
#define N_KV_HEADS N_HEADS
#endif
#ifndef HEAD_DIM
#error "attention_seq.cl: define HEAD_DIM"
#endif
#if N_HEADS % N_KV_HEADS != 0 || HEAD_DIM % 8 != 0
#error "attention_seq.cl: N_HEADS must be a multiple of N_KV_HEADS and HEAD_DIM of 8"
#endif

#define GROUP (N_HEADS / N_KV_HEADS)
#define HD8 (HEAD_DIM / 8)
#define TILE 16

__kernel void attention_seq(const __global float *Q, int q_off, int ldq,
                            const __global float *K, int k_off, int ldk,
                            const __global float *V, int v_off, int ldv,
                            const __global int *offsets, int S,
#ifdef KV_OFFSETS
                            const __global int *kv_offsets,
#endif
                            __global float *O, int o_off, int ldo,
                            int T, float scale)
{
    const int h = get_global_id(0), t = get_global_id(1);
    if (h >= N_HEADS || t >= T)
        return;
    const int g = h / GROUP;

    /* the sequence holding t: last s with offsets[s] <= t (binary search) */
    int lo = 0, hi = S - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
#if defined(KV_OFFSETS)
    const int first = kv_offsets[lo], end = kv_offsets[lo + 1];
#elif defined(CAUSAL)
    const int first = offsets[lo], end = t + 1;
#else
    const int first = offsets[lo], end = offsets[lo + 1];
#endif

    float8 qv[HD8], av[HD8];
    const __global float *q = Q + q_off + (size_t)t * ldq + h * HEAD_DIM;
    #pragma unroll
    for (int c = 0; c < HD8; c++) {
        qv[c] = loom_ld_float8(q + 8 * c) * scale;
        av[c] = (float8)(0.0f);
    }
    float m = -FLT_MAX, l = 0.0f;

    for (int u0 = first; u0 < end; u0 += TILE) {
        const int n = end - u0 < TILE ? end - u0 : TILE;
        const __global float *kp = K + k_off + (size_t)u0 * ldk + g * HEAD_DIM;
        const __global float *vp = V + v_off + (size_t)u0 * ldv + g * HEAD_DIM;
        float s[TILE];
        LOOM_SOFTMAX_TILE(qv, av, m, l, s, kp, ldk, vp, ldv, n, HD8, loom_ld_float8);
    }

    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    __global float *o = O + o_off + (size_t)t * ldo + h * HEAD_DIM;
    #pragma unroll
    for (int c = 0; c < HD8; c++)
        loom_st_float8(av[c] * inv, o + 8 * c);
}
