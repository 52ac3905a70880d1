/* select.cl - Whisper's next-token choice, one work-item per picked position
 *
 * The rules of openai/whisper's decoding.py, in its order, on the logits of
 * one position: SuppressBlank (mask bit 2, at the first sampled token),
 * SuppressTokens (mask bit 1), ApplyTimestampRules (timestamps come in pairs
 * except before end-of-text and never decrease; the first token is a
 * timestamp no later than max_initial; when the timestamps' total
 * probability beats every text token, a timestamp it is), then greedy
 * argmax (ties: lowest id) or, at temperature > 0, a seeded draw from
 * softmax(logits / temperature). The log-probability reported is that of the
 * filtered logits at temperature 1, and the no-speech probability is taken
 * from the raw logits, as Whisper does.
 *
 * kernel pick_tokens(
 *     const __global float *logits,    [P, V]
 *     const __global int *ctl,         [P, 16]: mode (0 next token, 1 best of a range), tokens
 *                                      sampled so far in this window, the last and the one before it,
 *                                      the last timestamp sampled (-1: none), timestamp_begin (>= V:
 *                                      no timestamp rules), end-of-text, no-speech, max_initial
 *                                      (timestamp index, -1: none), range [first, end) (mode 1),
 *                                      seed, counter
 *     const __global float *temps,     [P] temperature
 *     const __global uchar *mask,      [V] bit 1: always suppressed, bit 2: suppressed first
 *     __global float *out,             [P, 4]: token, log-probability, no-speech probability, 0
 *     int P)
 * Macros: V (required). Launch: global = (P), local = (1).
 */

#ifndef V
#error "select.cl: define V (vocabulary size)"
#endif

/* A counter-based uniform in [0, 1): two rounds of a 32-bit integer hash (splitmix-style). */
static float whisper_uniform(uint seed, uint counter) {
    uint z = seed * 0x9E3779B9u ^ (counter + 0x7F4A7C15u);
    z = (z ^ (z >> 16)) * 0x85EBCA6Bu;
    z = (z ^ (z >> 13)) * 0xC2B2AE35u;
    z ^= z >> 16;
    return (float)(z >> 8) * (1.0f / 16777216.0f);
}

__kernel void pick_tokens(const __global float *logits, const __global int *ctl, const __global float *temps,
                     const __global uchar *mask, __global float *out, int P) {
    const int p = get_global_id(0);
    if (p >= P) return;
    const __global float *x = logits + (long)p * V;
    const __global int *c = ctl + p * 16;
    const int mode = c[0], n = c[1], last = c[2], pen = c[3], last_ts = c[4];
    const int tb = c[5], eot = c[6], no_speech = c[7], max_initial = c[8];

    float top = -FLT_MAX;
    for (int i = 0; i < V; ++i) top = fmax(top, x[i]);
    float total = 0.0f;
    for (int i = 0; i < V; ++i) total += exp(x[i] - top);
    out[p * 4 + 2] = (no_speech >= 0 && no_speech < V) ? exp(x[no_speech] - top) / total : 0.0f;
    out[p * 4 + 3] = 0.0f;

    if (mode == 1) {        /* the likeliest token of a range (language detection) */
        const int first = max(c[9], 0), end = min(c[10], V);
        int best = first;
        float m = -FLT_MAX, s = 0.0f;
        for (int i = first; i < end; ++i) if (x[i] > x[best]) best = i;
        m = x[best];
        for (int i = first; i < end; ++i) s += exp(x[i] - m);
        out[p * 4 + 0] = (float)best;
        out[p * 4 + 1] = -log(s);
        return;
    }

    /* What the timestamp rules allow, as bounds on the token id. */
    const int rules = tb < V;
    const int was_ts = n >= 1 && last >= tb, before_was_ts = n < 2 || pen >= tb;
    const int no_text = rules && (n == 0 || (was_ts && !before_was_ts));   /* ids below eot (all below tb when n == 0) */
    const int no_ts = rules && was_ts && before_was_ts;
    const int ts_floor = last_ts < 0 ? tb : (was_ts && !before_was_ts ? last_ts : last_ts + 1);
    const int ts_cap = rules && n == 0 && max_initial >= 0 ? tb + max_initial : V - 1;
    const int text_end = n == 0 ? tb : eot;      /* text ids that no_text forbids: [0, text_end) */
#define ALLOWED(i) (!(mask[i] & 1) && !(n == 0 && (mask[i] & 2)) && \
                    (!rules || ((i) >= tb ? (!no_ts && (i) >= ts_floor && (i) <= ts_cap) \
                                          : !(no_text && (i) < text_end))))

    /* When the timestamps together are likelier than any single text token, emit a timestamp. */
    float m = -FLT_MAX;
    for (int i = 0; i < V; ++i) if (ALLOWED(i)) m = fmax(m, x[i]);
    int force_ts = 0;
    if (rules && m > -FLT_MAX) {
        float ts_sum = 0.0f, text_max = -FLT_MAX;
        for (int i = 0; i < V; ++i) {
            if (!ALLOWED(i)) continue;
            if (i >= tb) ts_sum += exp(x[i] - m); else text_max = fmax(text_max, x[i]);
        }
        force_ts = ts_sum > 0.0f && m + log(ts_sum) > text_max;
    }
#define FINAL(i) (ALLOWED(i) && !(force_ts && (i) < tb))

    int best = -1;
    float bm = -FLT_MAX, sum = 0.0f;
    for (int i = 0; i < V; ++i) if (FINAL(i) && (best < 0 || x[i] > bm)) { best = i; bm = x[i]; }
    if (best < 0) {         /* nothing allowed (cannot happen with Whisper's masks): end the text */
        out[p * 4 + 0] = (float)eot;
        out[p * 4 + 1] = 0.0f;
        return;
    }
    for (int i = 0; i < V; ++i) if (FINAL(i)) sum += exp(x[i] - bm);
    const float t = temps[p];
    if (t > 0.0f) {
        float scaled = 0.0f;
        for (int i = 0; i < V; ++i) if (FINAL(i)) scaled += exp((x[i] - bm) / t);
        const float target = whisper_uniform((uint)c[11], (uint)c[12]) * scaled;
        float acc = 0.0f;
        for (int i = 0; i < V; ++i) {
            if (!FINAL(i)) continue;
            acc += exp((x[i] - bm) / t);
            best = i;
            if (acc > target) break;
        }
    }
    out[p * 4 + 0] = (float)best;
    out[p * 4 + 1] = x[best] - bm - log(sum);
}
