/* sample.cl - the next token of each row, chosen on the device
 *
 * kernel sample(
 *     const __global float *X, int x_off, int ldx,   logits X[x_off + r*ldx + i], i < V
 *     const __global float *params,                  params[4r .. 4r+3]: temperature, top_p, top_k, unused
 *     const __global uint *seeds,                    seeds[2r]: the request's seed, seeds[2r+1]: draw counter
 *     __global float *work,                          scratch, R * V floats
 *     __global int *ids,                             ids[R]: the chosen tokens
 *     int R)
 *
 * Macros: V (required) vocabulary.
 * Launch: global = (R), local = any: one work-item per row, rows in parallel.
 *   (1) on CPUs: PoCL runs a work-group on one core, and left to choose it puts
 *   all R rows in one group (8 rows took 8x one row on 2 cores; with (1), 4x).
 *
 * Semantics (tests/test_sampling.py holds a numpy reference of exactly this):
 *  - temperature <= 0 or top_k == 1: the argmax, lowest index on ties;
 *  - otherwise x = logit / temperature. With 0 < top_k < V only x >= the top_k-th
 *    largest x stay (ties at the boundary stay too). p = exp(x - max(x)) over those.
 *    With 0 < top_p < 1 only x >= t stay, t the largest value whose kept mass
 *    sum(p[x >= t]) reaches top_p * sum(p);
 *  - u in [0, 1) comes from a counter-based hash of (seed, counter), so a seed gives
 *    the same draws whichever rows share the step; the token is the first index (in
 *    vocabulary order) at which the running sum of kept p exceeds u * (kept mass).
 * Thresholds are found by bisection on the order-preserving integer image of the
 * logits (the same order as x for a positive temperature), so top-k is exact and
 * nothing is sorted. One work-item per row: a work-group version with the
 * bisection loops around barriers gave wrong answers on PoCL 3.0. The
 * exponentials, the kept mass and the draw go eight tokens at a time (the draw
 * skips whole groups below its target, then scans one by one): V = 32000 on Zen 5,
 * Intel's runtime, a row at temperature 0.7 took 0.100 -> 0.031 ms, with top_p 0.9
 * 0.138 -> 0.072. The bisections stay scalar loops: the compiler vectorizes those
 * itself, and eight-wide by hand they ran 30-40 % slower.
 */

#ifndef V
#error "sample.cl: define V (vocabulary size)"
#endif
#define V8 (V / 8 * 8)                   /* the tokens the eight-wide loops cover */

inline uint sample_key(float f)
{
    uint b = as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* Eight keys at once (as sample_key: ~b for negatives, b with the sign set else). */
inline uint8 sample_key8(float8 f)
{
    const uint8 b = as_uint8(f);
    return b ^ (as_uint8(as_int8(b) >> 31) | 0x80000000u);
}

/* The kept p of eight tokens: p where key >= keep, else 0 (bits, no select: PoCL
 * calls its builtins). */
inline float8 sample_kept8(float8 p, float8 l, uint keep)
{
    return as_float8(as_int8(p) & (sample_key8(l) >= keep));
}

inline uint sample_hash(uint x)   /* lowbias32 */
{
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

__kernel void sample(const __global float *X, int x_off, int ldx, const __global float *params,
                     const __global uint *seeds, __global float *work, __global int *ids, int R)
{
    const int r = get_global_id(0);
    if (r >= R)
        return;
    const __global float *logits = X + x_off + (size_t)r * ldx;
    __global float *p = work + (size_t)r * V;
    const float temperature = params[4 * r], top_p = params[4 * r + 1];
    const int top_k = (int)params[4 * r + 2];

    int best = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > logits[best])
            best = i;
    if (!(temperature > 0.0f) || top_k == 1) {
        ids[r] = best;
        return;
    }

    /* top-k: the largest key with at least k logits at or above it */
    uint keep = 0;
    if (top_k > 0 && top_k < V) {
        uint a = 0, b = 0xFFFFFFFFu;
        while (a < b) {
            uint mid = a + (b - a) / 2 + 1, count = 0;
            for (int i = 0; i < V; i++)
                count += sample_key(logits[i]) >= mid;
            if (count >= (uint)top_k) a = mid; else b = mid - 1;
        }
        keep = a;
    }

    /* p over the kept tokens, unnormalized; eight at a time (the exponentials are
     * most of a sampled token's time), the tail one by one */
    const float xmax = logits[best] / temperature;
    float8 total8 = (float8)(0.0f);
    for (int i = 0; i < V8; i += 8) {
        const float8 l = loom_ld_float8(logits + i);
        const float8 e = sample_kept8(loom_exp8(l / temperature - xmax), l, keep);
        loom_st_float8(e, p + i);
        total8 += e;
    }
    float total = loom_hsum8(total8);
    for (int i = V8; i < V; i++) {
        float e = sample_key(logits[i]) >= keep ? loom_exp(logits[i] / temperature - xmax) : 0.0f;
        p[i] = e;
        total += e;
    }

    /* top-p: the largest key whose kept mass still reaches top_p of the total */
    if (top_p > 0.0f && top_p < 1.0f) {
        const float want = top_p * total;
        uint a = keep, b = 0xFFFFFFFFu;
        while (a < b) {
            uint mid = a + (b - a) / 2 + 1;
            float mass = 0.0f;
            for (int i = 0; i < V; i++)
                if (sample_key(logits[i]) >= mid)
                    mass += p[i];
            if (mass >= want) a = mid; else b = mid - 1;
        }
        keep = a;
    }
    float8 kept8 = (float8)(0.0f);
    for (int i = 0; i < V8; i += 8)
        kept8 += sample_kept8(loom_ld_float8(p + i), loom_ld_float8(logits + i), keep);
    float kept = loom_hsum8(kept8);
    for (int i = V8; i < V; i++)
        kept += sample_key(logits[i]) >= keep ? p[i] : 0.0f;

    /* the draw: the first kept index whose running mass passes the target */
    const uint seed = seeds[2 * r], counter = seeds[2 * r + 1];
    const float u = (float)(sample_hash(seed ^ sample_hash(counter + 0x9e3779b9u)) >> 8) * (1.0f / 16777216.0f);
    const float target = u * kept;
    float run = 0.0f;
    int chosen = best;
    int from = 0, last = -1;             /* skip whole groups of eight that stay below the target */
    for (; from < V8; from += 8) {
        const float mass = loom_hsum8(sample_kept8(loom_ld_float8(p + from), loom_ld_float8(logits + from), keep));
        if (run + mass > target)
            break;
        run += mass;
        if (mass > 0.0f)
            last = from;
    }
    for (int i = last; i >= 0 && i < last + 8; i++)   /* where the scan stood: the last kept token so far */
        if (sample_key(logits[i]) >= keep && p[i] > 0.0f)
            chosen = i;
    for (int i = from; i < V; i++) {
        if (sample_key(logits[i]) >= keep && p[i] > 0.0f) {
            chosen = i;                  /* rounding at the very end falls on the last kept token */
            run += p[i];
            if (run > target)
                break;
        }
    }
    ids[r] = chosen;
}
