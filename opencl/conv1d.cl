/* conv1d.cl - 1-D convolution as im2col + matmul
 *
 * A conv1d with weights W[O, C, KW] (PyTorch's layout) is a matmul of the
 * unfolded input against W viewed as [O, C*KW]: this kernel unfolds, and
 * matmul.cl (N = O, K = C*KW, with bias) does the arithmetic.
 *
 * kernel im2col1d(
 *     const __global float *X,     S sequences of T_in frames, channels last: X[s, t, c]
 *     __global float *Y,           Y[s, t, c*KW + k] = X[s, t*STRIDE + k*DILATION - PAD, c] (0 outside)
 *     int T_in, int T_out, int S)
 *
 * Macros: C, KW (required); STRIDE (1), PAD (0), DILATION (1).
 * Launch: global = (C * KW, T_out, S), local = any (NULL).
 */

#ifndef C
#error "conv1d.cl: define C (input channels)"
#endif
#ifndef KW
#error "conv1d.cl: define KW (kernel width)"
#endif
#ifndef STRIDE
#define STRIDE 1
#endif
#ifndef PAD
#define PAD 0
#endif
#ifndef DILATION
#define DILATION 1
#endif

__kernel void im2col1d(const __global float *X, __global float *Y, int T_in, int T_out, int S) {
    const int j = get_global_id(0), t = get_global_id(1), s = get_global_id(2);
    if (j >= C * KW || t >= T_out || s >= S) return;
    const int c = j / KW, k = j % KW;
    const int u = t * STRIDE + k * DILATION - PAD;
    Y[((long)s * T_out + t) * (C * KW) + j] = (u >= 0 && u < T_in) ? X[((long)s * T_in + u) * C + c] : 0.0f;
}
