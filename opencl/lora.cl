/* lora.cl - LoRA adapters as low-rank terms beside a projection, chosen per row
 *
 * A projection Y[T, N] (+)= X[T, K] . W^T keeps its shared weights W; the adapters
 * a request selects add, for each row t of image i = t / rows,
 *     sum_a scales[i, a] * (alpha_a / rank_a) * (X[t] . down_a^T) . up_a^T
 * in two launches after the matmul, so one batch can hold images with different
 * adapters and strengths. Every adapter touching W is packed in one float32 array
 * (loom/lora.py):
 *
 *     A[R, K + N + 1]   row r, one rank component: down[r, :K], then up[:, r] * alpha / rank
 *                       (N values), then the index of its adapter (a float, exact below 2^24);
 *                       R = the sum of the ranks of the adapters touching W
 *
 * kernel lora_down(
 *     const __global float *X, int x_off, int ldx,   X[t, k] = X[x_off + t*ldx + k]
 *     const __global float *A,                        A[R, K + N + 1] as above
 *     const __global float *scales,                   scales[i, a] = scales[i*LORAS + a]: adapter a's
 *                                                     strength for image i (0: not selected)
 *     int rows,                                       rows per image: row t belongs to image t / rows
 *     __global float *U,                              U[T, R]
 *     int R, int T)
 *   U[t, r] = scales[t / rows, owner(r)] * dot(X[t, :K], A[r, :K]), exactly 0 where that
 *   scale is 0 (the dot is skipped when no token of the item's tile needs it).
 *
 * kernel lora_up(
 *     const __global float *U,                        U[T, R] from lora_down
 *     const __global float *A,                        A[R, K + N + 1]
 *     __global float *Y, int y_off, int ldy,          Y[t, n] = Y[y_off + t*ldy + n]
 *     int R, int T)
 *   Y[t, n] += sum_r U[t, r] * A[r, K + n]; a sum of exactly 0 (a row whose image selected
 *   none of these adapters) leaves Y[t, n] as it was, so such rows keep the base model's
 *   bits (even a -0).
 *
 * Macros: K, N (required): W's inputs and outputs; LORAS (1): the adapters a scales row
 *   holds; VW (8): lora_down's vector width along K, NV (8): lora_up's outputs per item
 *   (each 4, 8 or 16; neither need divide K or N). Each item takes 4 tokens (rows).
 * Launch: lora_down global = (R, ceil(T / 4)), lora_up global = (ceil(N / NV), ceil(T / 4));
 *   local any.
 *   Each output is one work-item's sum in a fixed order, whatever T and the tile: a row's
 *   result never depends on the other rows of the batch.
 */

#ifndef K
#error "lora.cl: define K (the projection's inputs)"
#endif
#ifndef N
#error "lora.cl: define N (the projection's outputs)"
#endif
#ifndef LORAS
#define LORAS 1
#endif
#ifndef VW
#define VW 8
#endif
#if VW != 4 && VW != 8 && VW != 16
#error "lora.cl: VW must be 4, 8 or 16"
#endif
#ifndef NV
#define NV 8
#endif
#if NV != 4 && NV != 8 && NV != 16
#error "lora.cl: NV must be 4, 8 or 16"
#endif

#define LORA_ROW ((size_t)(K + N + 1))      /* packed row length */
#define LORA_TOKENS 4                       /* tokens per item: each down or up vector loads once for 4 */
#define K_MAIN (K / VW * VW)
#define VF LOOM_CAT(float, VW)
#define VLOAD(p) LOOM_CAT(loom_ld_float, VW)(p)
#define HSUM LOOM_CAT(loom_hsum, VW)
#define VN LOOM_CAT(float, NV)
#define VLOADN(p) LOOM_CAT(loom_ld_float, NV)(p)
#define VSTOREN(v, p) LOOM_CAT(loom_st_float, NV)(v, p)

__kernel void lora_down(const __global float *X, int x_off, int ldx, const __global float *A,
                        const __global float *scales, int rows, __global float *U, int R, int T)
{
    const int r = get_global_id(0), t0 = get_global_id(1) * LORA_TOKENS;
    if (r >= R || t0 >= T)
        return;
    const __global float *a = A + (size_t)r * LORA_ROW;
    const int owner = (int)a[K + N];
    const __global float *x[LORA_TOKENS];
    float s[LORA_TOKENS];
    int any = 0;
    #pragma unroll
    for (int j = 0; j < LORA_TOKENS; j++) {
        const int t = t0 + j < T ? t0 + j : T - 1;    /* tail tokens reread the last row, never stored */
        x[j] = X + x_off + (size_t)t * ldx;
        s[j] = t0 + j < T ? scales[(size_t)(t / rows) * LORAS + owner] : 0.0f;
        any |= s[j] != 0.0f;
    }
    VF acc[LORA_TOKENS];
    #pragma unroll
    for (int j = 0; j < LORA_TOKENS; j++)
        acc[j] = (VF)(0.0f);
    float d[LORA_TOKENS] = {0.0f};
    if (any) {
        for (int k = 0; k < K_MAIN; k += VW) {
            const VF w = VLOAD(a + k);
            #pragma unroll
            for (int j = 0; j < LORA_TOKENS; j++)
                acc[j] += VLOAD(x[j] + k) * w;
        }
        #pragma unroll
        for (int j = 0; j < LORA_TOKENS; j++) {
            d[j] = HSUM(acc[j]);
            for (int k = K_MAIN; k < K; k++)
                d[j] += x[j][k] * a[k];
        }
    }
    #pragma unroll
    for (int j = 0; j < LORA_TOKENS; j++)
        if (t0 + j < T)
            U[(size_t)(t0 + j) * R + r] = s[j] != 0.0f ? s[j] * d[j] : 0.0f;
}

__kernel void lora_up(const __global float *U, const __global float *A, __global float *Y, int y_off, int ldy,
                      int R, int T)
{
    const int n0 = get_global_id(0) * NV, t0 = get_global_id(1) * LORA_TOKENS;
    if (n0 >= N || t0 >= T)
        return;
    const __global float *u[LORA_TOKENS];
    #pragma unroll
    for (int j = 0; j < LORA_TOKENS; j++)
        u[j] = U + (size_t)(t0 + j < T ? t0 + j : T - 1) * R;      /* tail tokens: never stored */
    const __global float *up = A + K + n0;
    if (n0 + NV <= N) {
        VN acc[LORA_TOKENS];
        #pragma unroll
        for (int j = 0; j < LORA_TOKENS; j++)
            acc[j] = (VN)(0.0f);
        for (int r = 0; r < R; r++) {
            const VN w = VLOADN(up + (size_t)r * LORA_ROW);
            #pragma unroll
            for (int j = 0; j < LORA_TOKENS; j++)
                acc[j] += u[j][r] * w;
        }
        #pragma unroll
        for (int j = 0; j < LORA_TOKENS; j++) {
            if (t0 + j < T) {
                __global float *y = Y + y_off + (size_t)(t0 + j) * ldy + n0;
                const VN old = VLOADN(y);
                VSTOREN(acc[j] != 0.0f ? old + acc[j] : old, y);     /* zero lanes write their own bits back */
            }
        }
    } else {
        /* the last outputs when NV does not divide N: the same sums, in the same order, one by one */
        for (int i = 0; i < N - n0; i++) {
            float acc[LORA_TOKENS] = {0.0f};
            for (int r = 0; r < R; r++) {
                const float w = up[(size_t)r * LORA_ROW + i];
                #pragma unroll
                for (int j = 0; j < LORA_TOKENS; j++)
                    acc[j] += u[j][r] * w;
            }
            #pragma unroll
            for (int j = 0; j < LORA_TOKENS; j++)
                if (t0 + j < T && acc[j] != 0.0f)
                    Y[y_off + (size_t)(t0 + j) * ldy + n0 + i] += acc[j];
        }
    }
}
