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
 * bisection loops around barriers gave wrong answers on PoCL 3.0.
 */

#ifndef V
#error "sample.cl: define V (vocabulary size)"
#endif

inline uint sample_key(float f)
{
    uint b = as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
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

    /* p over the kept tokens, unnormalized */
    const float xmax = logits[best] / temperature;
    float total = 0.0f;
    for (int i = 0; i < V; i++) {
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
    float kept = 0.0f;
    for (int i = 0; i < V; i++)
        kept += sample_key(logits[i]) >= keep ? p[i] : 0.0f;

    /* the draw: the first kept index whose running mass passes the target */
    const uint seed = seeds[2 * r], counter = seeds[2 * r + 1];
    const float u = (float)(sample_hash(seed ^ sample_hash(counter + 0x9e3779b9u)) >> 8) * (1.0f / 16777216.0f);
    const float target = u * kept;
    float run = 0.0f;
    int chosen = best;
    for (int i = 0; i < V; i++) {
        if (sample_key(logits[i]) >= keep && p[i] > 0.0f) {
            chosen = i;                  /* rounding at the very end falls on the last kept token */
            run += p[i];
            if (run > target)
                break;
        }
    }
    ids[r] = chosen;
}
