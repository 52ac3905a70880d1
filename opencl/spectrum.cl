/* spectrum.cl - a short-time power spectrum and its mel projection (speech front ends)
 *
 * The transform is a matmul: frames are rows of X read straight from the
 * audio with ldx = HOP (matmul.cl's views), against a basis W[2*BINS, N_FFT]
 * whose rows are window[n]·cos(2πkn/N_FFT) for k < BINS and then
 * window[n]·sin(2πkn/N_FFT), BINS = N_FFT/2 + 1. power_spectrum folds the
 * two halves into |X_k|^2, and a second matmul against mel_filterbank's
 * weights gives the mel energies.
 *
 * kernel dft_basis(__global float *W)              W[2*BINS, N_FFT]
 *   Macros: N_FFT (required). Periodic Hann window (as torch.hann_window).
 *   The angle's integer part k·n mod N_FFT is reduced exactly before cospi.
 *   Launch: global = (N_FFT, 2*BINS).
 *
 * kernel power_spectrum(const __global float *X, __global float *P, int T)
 *   X[T, 2*BINS] (cos then sin projections), P[T, BINS] = cos^2 + sin^2.
 *   Macros: N_FFT (required). Launch: global = (BINS, T).
 *
 * kernel mel_filterbank(__global float *F)         F[N_MELS, BINS]
 *   Slaney-style triangular filters with area normalization, as librosa's
 *   filters.mel(sr, n_fft, n_mels, htk=False, norm="slaney") from 0 Hz to
 *   RATE/2 (Whisper's mel_filters.npz): band edges equally spaced on the
 *   Slaney mel scale (linear below 1 kHz, logarithmic above), weights
 *   max(0, min(rising, falling)) times 2 / (upper edge - lower edge) in Hz.
 *   Macros: N_FFT, N_MELS, RATE (required). Launch: global = (BINS, N_MELS).
 *
 * kernel log10_floor(__global float *X, int n, float floor)
 *   X[i] = log10(max(X[i], floor)). Launch: global = (round_up(n, L)), any L.
 */

#ifndef N_FFT
#error "spectrum.cl: define N_FFT"
#endif
#define BINS (N_FFT / 2 + 1)

__kernel void dft_basis(__global float *W) {
    const int n = get_global_id(0), row = get_global_id(1);
    if (n >= N_FFT || row >= 2 * BINS) return;
    const int k = row < BINS ? row : row - BINS;
    const float window = 0.5f - 0.5f * cospi(2.0f * (float)n / (float)N_FFT);
    const float turn = 2.0f * (float)((k * n) % N_FFT) / (float)N_FFT;    /* angle / π, in [0, 2) */
    W[row * N_FFT + n] = window * (row < BINS ? cospi(turn) : sinpi(turn));
}

__kernel void power_spectrum(const __global float *X, __global float *P, int T) {
    const int k = get_global_id(0), t = get_global_id(1);
    if (k >= BINS || t >= T) return;
    const float re = X[t * 2 * BINS + k], im = X[t * 2 * BINS + BINS + k];
    P[t * BINS + k] = re * re + im * im;
}

#ifdef N_MELS
#ifndef RATE
#error "spectrum.cl: mel_filterbank needs RATE"
#endif
/* Slaney's mel scale: 3 mels per 200 Hz up to 1 kHz, then log-spaced (27 mels per factor 6.4). */
#define MEL_F_SP (200.0f / 3.0f)
#define MEL_MIN_LOG_HZ 1000.0f
#define MEL_MIN_LOG 15.0f
#define MEL_LOGSTEP (1.8562979903656263f / 27.0f)   /* log(6.4) / 27 */

static float loom_mel_to_hz(float m) {
    return m < MEL_MIN_LOG ? MEL_F_SP * m : MEL_MIN_LOG_HZ * exp(MEL_LOGSTEP * (m - MEL_MIN_LOG));
}

static float loom_hz_to_mel(float f) {
    return f < MEL_MIN_LOG_HZ ? f / MEL_F_SP : MEL_MIN_LOG + log(f / MEL_MIN_LOG_HZ) / MEL_LOGSTEP;
}

static float loom_mel_edge(int i) {      /* edge i of N_MELS + 2, in Hz */
    const float top = loom_hz_to_mel(0.5f * (float)RATE);
    return loom_mel_to_hz(top * (float)i / (float)(N_MELS + 1));
}

__kernel void mel_filterbank(__global float *F) {
    const int k = get_global_id(0), m = get_global_id(1);
    if (k >= BINS || m >= N_MELS) return;
    const float f = (float)k * (float)RATE / (float)N_FFT;
    const float lo = loom_mel_edge(m), mid = loom_mel_edge(m + 1), hi = loom_mel_edge(m + 2);
    const float rising = (f - lo) / (mid - lo), falling = (hi - f) / (hi - mid);
    F[m * BINS + k] = fmax(0.0f, fmin(rising, falling)) * (2.0f / (hi - lo));
}
#endif

__kernel void log10_floor(__global float *X, int n, float floor) {
    const int i = get_global_id(0);
    if (i < n) X[i] = log10(fmax(X[i], floor));
}
