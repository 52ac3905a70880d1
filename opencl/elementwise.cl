/* elementwise.cl - activations and elementwise arithmetic on float32
 *
 * Gated activations over rows (macro F, required for these two):
 *   kernel silu_mul(const __global float *G, int g_off, int ldg,
 *                   const __global float *U, int u_off, int ldu,
 *                   __global float *O, int o_off, int ldo, int T)
 *       O[t, i] = silu(G[t, i]) * U[t, i], i < F, silu(g) = g / (1 + exp(-g))
 *       where A[t, i] = A[a_off + t*lda + i]. Gate and up as two halves of one
 *       [T, 2F] buffer (gate first): pass it as G and U with g_off = 0,
 *       u_off = F, ldg = ldu = 2F. Separate [T, F] buffers: offsets 0, ld = F.
 *       O may be G or U (each element is read before it is written).
 *   kernel gelu_mul(same arguments)   O = gelu(G) * U (GeGLU), GELU_TANH applies
 *   kernel tanh_sigmoid_mul(same arguments)   O = tanh(G) * sigmoid(U), the
 *       WaveNet gate (VITS flows: G, U the two halves of the dilated conv's
 *       [T, 2F] output, tanh half first), sigmoid(u) = 1 / (1 + exp(-u))
 *   Launch: global = (F, T), local = any (NULL).
 *
 * Flat kernels over n elements (launch: global = n rounded up to the local
 * size, local = any; items past n do nothing):
 *   kernel gelu(const __global float *X, __global float *Y, int n)   Y may be X
 *       gelu(x) = x/2 (1 + erf(x / sqrt 2)); with GELU_TANH the approximation
 *       x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 *   kernel quick_gelu(X, Y, n)    Y = x * sigmoid(1.702 x) (CLIP's text encoder), Y may be X
 *   kernel silu(X, Y, n)          Y = x * sigmoid(x), Y may be X
 *   kernel add(__global float *Y, const __global float *X, int n)    Y += X
 *   kernel mul(__global float *Y, const __global float *X, int n)    Y *= X
 *   kernel scale(__global float *Y, int n, float s)                  Y *= s
 *   kernel leaky_relu(const __global float *X, __global float *Y, int n, float slope)
 *       Y = X < 0 ? slope * X : X                                     Y may be X
 *   kernel tanh_act(const __global float *X, __global float *Y, int n)  Y = tanh(X), Y may be X
 *   kernel to_f16(const __global float *X, __global half *Y, int n)
 *       Y = (half) X, IEEE binary16 by vstore_half (round to nearest even,
 *       overflow to +-inf), so no cl_khr_fp16 is needed; Y is n halves
 *
 * Row broadcast (macro F = row length, required):
 *   kernel add_bias(__global float *Y, const __global float *b, int T)  Y[t, i] += b[i]
 *   kernel mask_rows(__global float *Y, int y_off, int ldy, const __global int *keep, int T)
 *       Y[t, i] = 0 for i < F where keep[t] == 0 (other rows untouched); Y[t, i] = Y[y_off + t*ldy + i]
 *   Launch: global = (F, T), local = any.
 *
 * Kernels using F are only compiled when F is defined, so a build with no
 * macros still gives gelu/add/mul/scale.
 */

inline float act_silu(float g) { return g / (1.0f + loom_exp(-g)); }

inline float act_gelu(float x)
{
#ifdef GELU_TANH
    /* tanh(u) = 1 - 2 / (exp(2u) + 1): exact limits +-1 for large |u| */
    const float u = 0.7978845608f * (x + 0.044715f * x * x * x);
    const float th = 1.0f - 2.0f / (loom_exp(2.0f * u) + 1.0f);
    return 0.5f * x * (1.0f + th);
#else
    return 0.5f * x * (1.0f + loom_erf(x * 0.70710678118f));
#endif
}

#ifdef F
/* Rows [0, T) of F floats, ld apart from off: whether the kernels below address them in int.
 * Intel's CPU runtime (where common.cl uses the builtins) vectorizes a kernel across work-items
 * only when its addresses are 32-bit arithmetic (bench/elementwise.py, silu_mul of 4864 x 128:
 * 370 -> 88 us, x 1: 8.9 -> 4.7 us), so there they take the int path whenever it is exact;
 * PoCL vectorizes the size_t path and ran the branching one 2x slower, so it keeps size_t alone.
 * The same elements either way, and the branch is uniform across a launch. */
inline int ew_int_rows(int T, int off, int ld)
{
#if defined(LOOM_USE_BUILTINS) && !defined(EW_SIZE_T)      /* EW_SIZE_T: the bench's comparison */
    return (long)off + (long)(T - 1) * ld + F <= 2147483647L;
#else
    return 0;
#endif
}

/* O[t, i] = OP(g = G[t, i], u = U[t, i]) for i < F, t < T: the gated activations. */
#define EW_GATED(OP)                                                                        \
    const int i = get_global_id(0), t = get_global_id(1);                                   \
    if (i >= F || t >= T)                                                                   \
        return;                                                                             \
    if (ew_int_rows(T, g_off, ldg) && ew_int_rows(T, u_off, ldu) && ew_int_rows(T, o_off, ldo)) { \
        const float g = G[g_off + t * ldg + i], u = U[u_off + t * ldu + i];                 \
        O[o_off + t * ldo + i] = OP;                                                        \
    } else {                                                                                \
        const float g = G[g_off + (size_t)t * ldg + i], u = U[u_off + (size_t)t * ldu + i]; \
        O[o_off + (size_t)t * ldo + i] = OP;                                                \
    }

__kernel void silu_mul(const __global float *G, int g_off, int ldg,
                       const __global float *U, int u_off, int ldu,
                       __global float *O, int o_off, int ldo, int T)
{
    EW_GATED(act_silu(g) * u)
}

__kernel void gelu_mul(const __global float *G, int g_off, int ldg,
                       const __global float *U, int u_off, int ldu,
                       __global float *O, int o_off, int ldo, int T)
{
    EW_GATED(act_gelu(g) * u)
}

__kernel void tanh_sigmoid_mul(const __global float *G, int g_off, int ldg,
                               const __global float *U, int u_off, int ldu,
                               __global float *O, int o_off, int ldo, int T)
{
    EW_GATED(loom_tanh(g) / (1.0f + loom_exp(-u)))
}

__kernel void mask_rows(__global float *Y, int y_off, int ldy, const __global int *keep, int T)
{
    const int i = get_global_id(0), t = get_global_id(1);
    if (i >= F || t >= T || keep[t] != 0)
        return;
    if (ew_int_rows(T, y_off, ldy))
        Y[y_off + t * ldy + i] = 0.0f;
    else
        Y[y_off + (size_t)t * ldy + i] = 0.0f;
}

__kernel void add_bias(__global float *Y, const __global float *b, int T)
{
    const int i = get_global_id(0), t = get_global_id(1);
    if (i >= F || t >= T)
        return;
    if (ew_int_rows(T, 0, F))
        Y[t * F + i] += b[i];
    else
        Y[(size_t)t * F + i] += b[i];
}
#endif

__kernel void gelu(const __global float *X, __global float *Y, int n)
{
    const int i = get_global_id(0);
    if (i < n)
        Y[i] = act_gelu(X[i]);
}

__kernel void quick_gelu(const __global float *X, __global float *Y, int n)
{
    const int i = get_global_id(0);
    if (i < n) {
        const float x = X[i];
        Y[i] = x / (1.0f + loom_exp(-1.702f * x));
    }
}

__kernel void silu(const __global float *X, __global float *Y, int n)
{
    const int i = get_global_id(0);
    if (i < n)
        Y[i] = act_silu(X[i]);
}

__kernel void leaky_relu(const __global float *X, __global float *Y, int n, float slope)
{
    const int i = get_global_id(0);
    if (i < n) {
        const float x = X[i];
        Y[i] = x < 0.0f ? slope * x : x;
    }
}

__kernel void tanh_act(const __global float *X, __global float *Y, int n)
{
    const int i = get_global_id(0);
    if (i < n)
        Y[i] = loom_tanh(X[i]);
}

__kernel void add(__global float *Y, const __global float *X, int n)
{
    const int i = get_global_id(0);
    if (i < n)
        Y[i] += X[i];
}

__kernel void mul(__global float *Y, const __global float *X, int n)
{
    const int i = get_global_id(0);
    if (i < n)
        Y[i] *= X[i];
}

__kernel void scale(__global float *Y, int n, float s)
{
    const int i = get_global_id(0);
    if (i < n)
        Y[i] *= s;
}

__kernel void to_f16(const __global float *X, __global half *Y, int n)
{
    const int i = get_global_id(0);
    if (i < n)
        vstore_half(X[i], i, Y);
}
