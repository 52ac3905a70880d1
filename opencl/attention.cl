/* attention.cl - causal attention of new tokens over the paged KV cache
 *
 * For token t and query head h (kv head g = h / (N_HEADS / N_KV_HEADS)):
 *   O[t, h, :] = sum_p softmax_p(scale * Q[t, h, :] . K[r, p, g, :]) V[r, p, g, :]
 * over positions p of row r = row_of[t] from 0 (or pos[t] - WINDOW + 1) to
 * pos[t] inclusive, reading K/V through the page table (layout: kv_store.cl).
 * Tokens of one call may belong to different rows and positions (a prefill
 * chunk of one row next to decode tokens of others); each token's own K/V (and
 * those of earlier tokens of its chunk) must already be stored by kv_store.
 *
 * kernel attention(
 *     const __global float *Q, int q_off, int ldq,   Q[t, h, d] = Q[q_off + t*ldq + h*HEAD_DIM + d]
 *     const __global KV_T *Kc, const __global KV_T *Vc, int layer_off,   as in kv_store.cl
 *     const __global int *pos,                       pos[T]
 *     const __global int *row_of,                    row_of[T]
 *     const __global int *page_table,                [R][MAX_PAGES]
 *     __global float *O, int o_off, int ldo,         O[t, h, d] = O[o_off + t*ldo + h*HEAD_DIM + d]
 *     int T,
 *     float scale)                                   score scale, usually 1/sqrt(HEAD_DIM)
 *
 * Macros: N_HEADS, N_KV_HEADS, HEAD_DIM (multiple of 8), PAGE_SIZE, MAX_PAGES
 *   (required); KV_F16 (cache holds half); WINDOW (sliding window length);
 *   QUANT_OUT (HEAD_DIM a multiple of 32): O is an int buffer that takes each
 *   token's output row as matmul.cl's quantize_x would write it ([T, N_HEADS *
 *   HEAD_DIM / 32 blocks of 20 ints]; o_off and ldo unused): the output
 *   projection's int8 inputs without a launch of their own; QUANT_X16 1 writes
 *   them as Q8_0 tiles read them (common.cl loom_quantize32's x16).
 *   ROPE_IN (ROPE_NEOX or not, as rope.cl; every token of the launch in a row of
 *   its own, as in decode): Q is the q | k | v rows as projected, k and v heads at
 *   columns k_off and v_off (four more arguments after scale: theta, freq_scale,
 *   k_off, v_off); each work-group first rotates its kv head's key and
 *   stores it and the value at pos[t] as rope.cl's rope_store would, and each
 *   query head is rotated as it is read: one launch where decode ran two. Needs
 *   local = (N_HEADS / N_KV_HEADS, 1) (a group, one kv head).
 * Launch: global = (N_HEADS, T), local = (L, 1) with L dividing N_HEADS, e.g.
 *   N_HEADS / N_KV_HEADS so one work-group shares its kv head's pages in cache.
 *
 * One pass with an online softmax, a page at a time: scores of the page's
 * positions, one rescale of the running sum and output per page, then the
 * weighted values. The running max starts at -FLT_MAX (not -inf) so the first
 * rescale is exp(-huge) = 0, never inf - inf. A token with an invalid position
 * (< 0 or beyond the page table) gets zeros; pages with a negative id are
 * skipped. Both are caller errors the kernel only keeps in bounds.
 */

#ifndef N_HEADS
#error "attention.cl: define N_HEADS"
#endif
#ifndef N_KV_HEADS
#error "attention.cl: define N_KV_HEADS"
#endif
#ifndef HEAD_DIM
#error "attention.cl: define HEAD_DIM"
#endif
#ifndef PAGE_SIZE
#error "attention.cl: define PAGE_SIZE"
#endif
#ifndef MAX_PAGES
#error "attention.cl: define MAX_PAGES (page-table row length)"
#endif
#if N_HEADS % N_KV_HEADS != 0 || HEAD_DIM % 8 != 0
#error "attention.cl: N_HEADS must be a multiple of N_KV_HEADS and HEAD_DIM of 8"
#endif

#ifdef KV_F16
#define KV_T half
#define LDKV(p) loom_ldh8(p)
#else
#define KV_T float
#define LDKV(p) loom_ld_float8(p)
#endif
#define KV_ROW (N_KV_HEADS * HEAD_DIM)
#define GROUP (N_HEADS / N_KV_HEADS)
#define HD8 (HEAD_DIM / 8)
#if defined(QUANT_OUT) && HEAD_DIM % 32 != 0
#error "attention.cl: QUANT_OUT needs HEAD_DIM a multiple of 32"
#endif
#ifndef QUANT_X16
#define QUANT_X16 0
#endif

#ifdef ROPE_IN
#define KV_IN __global KV_T
#define ROPE_PARAMS , float theta, float freq_scale, int k_off, int v_off
#ifdef KV_F16
#define KV_PUT(v, p) vstore_half_rte((v), 0, (p))
#else
#define KV_PUT(v, p) (*(p) = (v))
#endif
#else
#define KV_IN const __global KV_T
#define ROPE_PARAMS
#endif

__kernel void attention(const __global float *Q, int q_off, int ldq,
                        KV_IN *Kc, KV_IN *Vc, int layer_off,
                        const __global int *pos, const __global int *row_of,
                        const __global int *page_table,
                        __global float *O, int o_off, int ldo,
                        int T, float scale ROPE_PARAMS)
{
    const int h = get_global_id(0), t = get_global_id(1);
#ifdef ROPE_IN
    __local float rope_c[HEAD_DIM / 2], rope_s[HEAD_DIM / 2];
    if (t >= T)     /* whole groups only: all of one reach the barrier */
        return;
#else
    if (h >= N_HEADS || t >= T)
        return;
#endif
    const int g = h / GROUP;
    int last = pos[t];
    if (last >= MAX_PAGES * PAGE_SIZE)
        last = -1;
    int first = 0;
#ifdef WINDOW
    first = last - WINDOW + 1 > 0 ? last - WINDOW + 1 : 0;
#endif
    const __global int *pt = page_table + (size_t)row_of[t] * MAX_PAGES;

    float8 qv[HD8], av[HD8];
    const __global float *q = Q + q_off + (size_t)t * ldq + h * HEAD_DIM;
#ifdef ROPE_IN
    /* The angles of pos[t], once a group (its items share them out): every head
     * of every layer turns by the same ones, and a sincos each was ~5 % of a Q4_0
     * decode step. Then this group's kv head: the key rotated, it and the value
     * stored at pos[t] (rope_store's arithmetic and skips), the angles and the
     * stores visible to the group after the barrier. */
    for (int i = get_local_id(0); i < HEAD_DIM / 2; i += GROUP) {
        float c;
        rope_s[i] = loom_rope_angle(i, HEAD_DIM, pos[t], theta, freq_scale, &c);
        rope_c[i] = c;
    }
    if (last >= 0 && pt[last / PAGE_SIZE] >= 0) {
        const size_t dst = (size_t)layer_off + ((size_t)pt[last / PAGE_SIZE] * PAGE_SIZE + last % PAGE_SIZE) * KV_ROW
                           + g * HEAD_DIM;
        const __global float *k = Q + q_off + (size_t)t * ldq + k_off + g * HEAD_DIM;
        const __global float *v = Q + q_off + (size_t)t * ldq + v_off + g * HEAD_DIM;
        for (int i = get_local_id(0); i < HEAD_DIM / 2; i += GROUP) {     /* the angles this item wrote */
            const float c = rope_c[i], sn = rope_s[i];
            const int ia = LOOM_ROPE_IA(i, HEAD_DIM), ib = LOOM_ROPE_IB(i, HEAD_DIM);
            const float a = k[ia], b = k[ib];
            KV_PUT(a * c - b * sn, Kc + dst + ia);
            KV_PUT(a * sn + b * c, Kc + dst + ib);
            KV_PUT(v[ia], Vc + dst + ia);
            KV_PUT(v[ib], Vc + dst + ib);
        }
    }
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    float qr[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; d++)
        qr[d] = q[d];
    for (int i = 0; i < HEAD_DIM / 2; i++) {
        const float c = rope_c[i], sn = rope_s[i];
        const int ia = LOOM_ROPE_IA(i, HEAD_DIM), ib = LOOM_ROPE_IB(i, HEAD_DIM);
        const float a = qr[ia], b = qr[ib];
        qr[ia] = a * c - b * sn;
        qr[ib] = a * sn + b * c;
    }
    #pragma unroll
    for (int c = 0; c < HD8; c++) {
        qv[c] = vload8(c, qr) * scale;
        av[c] = (float8)(0.0f);
    }
#else
    #pragma unroll
    for (int c = 0; c < HD8; c++) {
        qv[c] = loom_ld_float8(q + 8 * c) * scale;
        av[c] = (float8)(0.0f);
    }
#endif
    float m = -FLT_MAX, l = 0.0f;

    for (int p0 = first; p0 <= last;) {
        const int pg = p0 / PAGE_SIZE;
        const int end = (pg + 1) * PAGE_SIZE < last + 1 ? (pg + 1) * PAGE_SIZE : last + 1;
        const int n = end - p0;
        const int page = pt[pg];
        p0 = end;
        if (page < 0)   /* unmapped page: skipped rather than read out of bounds */
            continue;
        const size_t base = (size_t)layer_off + ((size_t)page * PAGE_SIZE + (end - n) % PAGE_SIZE) * KV_ROW + g * HEAD_DIM;
        const __global KV_T *kp = Kc + base;
        const __global KV_T *vp = Vc + base;

        float s[PAGE_SIZE];
        LOOM_SOFTMAX_TILE(qv, av, m, l, s, kp, KV_ROW, vp, KV_ROW, n, HD8, LDKV);
    }

    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#ifdef QUANT_OUT
    __global int *xq = (__global int *)O + ((size_t)t * N_HEADS * HEAD_DIM + h * HEAD_DIM) / 32 * 20;
    #pragma unroll
    for (int c = 0; c < HD8; c += 4)
        loom_quantize32((float16)(av[c] * inv, av[c + 1] * inv), (float16)(av[c + 2] * inv, av[c + 3] * inv),
                        xq + c / 4 * 20, QUANT_X16);
#else
    __global float *o = O + o_off + (size_t)t * ldo + h * HEAD_DIM;
    #pragma unroll
    for (int c = 0; c < HD8; c++)
        loom_st_float8(av[c] * inv, o + 8 * c);
#endif
}
