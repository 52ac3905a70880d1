/* gather.cl - embedding lookup: out[t, :] = scale * table[ids[t], :]
 *
 * kernel gather(
 *     const __global TABLE_T *table,   [VOCAB, D] rows (see TABLE_*)
 *     const __global int *ids,         ids[T]
 *     __global float *out,             out[T, D]
 *     int T,
 *     float scale)                     1.0f for none (Gemma: sqrt(D))
 *
 * Macros: D, VOCAB (required); TABLE_F32 | TABLE_F16 | TABLE_Q8_0 | TABLE_Q4_0 | TABLE_Q4_1 | TABLE_Q5_0 | TABLE_Q5_1
 *   | TABLE_Q2_K | TABLE_Q3_K | TABLE_Q4_K | TABLE_Q5_K | TABLE_Q6_K
 *   (required, exactly one; quantized rows are raw ggml blocks, D % 32 == 0; K-quants D % 256 == 0).
 * Launch: global = (D, T), local = any (NULL).
 * An id outside [0, VOCAB) yields a row of zeros: the kernel never reads out of
 * bounds, but the caller must validate ids (this is not an error report).
 * With TABLE_F32 this also gathers activation rows (e.g. the last token of
 * each sequence before the output head).
 */

#ifndef D
#error "gather.cl: define D (row length)"
#endif
#ifndef VOCAB
#error "gather.cl: define VOCAB (table rows)"
#endif
#if defined(TABLE_F32) + defined(TABLE_F16) + defined(TABLE_Q8_0) + defined(TABLE_Q4_0) + defined(TABLE_Q4_1) \
    + defined(TABLE_Q5_0) + defined(TABLE_Q5_1) + defined(TABLE_Q2_K) + defined(TABLE_Q3_K) + defined(TABLE_Q4_K) \
    + defined(TABLE_Q5_K) + defined(TABLE_Q6_K) != 1
#error "gather.cl: define exactly one of TABLE_F32, TABLE_F16, TABLE_Q8_0, TABLE_Q4_0, TABLE_Q4_1, TABLE_Q5_0, TABLE_Q5_1, TABLE_Q2_K, TABLE_Q3_K, TABLE_Q4_K, TABLE_Q5_K, TABLE_Q6_K"
#endif

#if defined(TABLE_F32)
#define TABLE_T float
#define ROW_STRIDE ((size_t)D)
#define AT(row, i) ((row)[i])
#elif defined(TABLE_F16)
#define TABLE_T half
#define ROW_STRIDE ((size_t)D)
#define AT(row, i) loom_ldh((row) + (i))
#elif defined(TABLE_Q8_0)
#define TABLE_T uchar
#define ROW_STRIDE ((size_t)(D / LOOM_QK) * LOOM_Q8_0_BYTES)
#define AT(row, i) loom_q8_0_at(row, i)
#elif defined(TABLE_Q5_0)
#define TABLE_T uchar
#define ROW_STRIDE ((size_t)(D / LOOM_QK) * LOOM_Q5_0_BYTES)
#define AT(row, i) loom_q5_at(row, i, LOOM_Q5_0_BYTES, 6, 2, 0)
#elif defined(TABLE_Q5_1)
#define TABLE_T uchar
#define ROW_STRIDE ((size_t)(D / LOOM_QK) * LOOM_Q5_1_BYTES)
#define AT(row, i) loom_q5_at(row, i, LOOM_Q5_1_BYTES, 8, 4, 1)
#elif defined(TABLE_Q2_K)
#define KQ_TABLE(row, i) loom_q2_k_at(row, i)
#define KQ_BYTES LOOM_Q2_K_BYTES
#elif defined(TABLE_Q3_K)
#define KQ_TABLE(row, i) loom_q3_k_at(row, i)
#define KQ_BYTES LOOM_Q3_K_BYTES
#elif defined(TABLE_Q4_K)
#define KQ_TABLE(row, i) loom_q4_k_at(row, i)
#define KQ_BYTES LOOM_Q4_K_BYTES
#elif defined(TABLE_Q5_K)
#define KQ_TABLE(row, i) loom_q5_k_at(row, i)
#define KQ_BYTES LOOM_Q5_K_BYTES
#elif defined(TABLE_Q6_K)
#define KQ_TABLE(row, i) loom_q6_k_at(row, i)
#define KQ_BYTES LOOM_Q6_K_BYTES
#elif defined(TABLE_Q4_1)
#define TABLE_T uchar
#define ROW_STRIDE ((size_t)(D / LOOM_QK) * LOOM_Q4_1_BYTES)
#define AT(row, i) loom_q4_1_at(row, i)
#else
#define TABLE_T uchar
#define ROW_STRIDE ((size_t)(D / LOOM_QK) * LOOM_Q4_0_BYTES)
#define AT(row, i) loom_q4_0_at(row, i)
#endif

#ifdef KQ_BYTES     /* K-quants: rows of D / 256 superblocks */
#define TABLE_T uchar
#define ROW_STRIDE ((size_t)(D / LOOM_QK_K) * KQ_BYTES)
#define AT(row, i) KQ_TABLE(row, i)
#if D % LOOM_QK_K != 0
#error "gather.cl: K-quant tables need D % 256 == 0"
#endif
#endif

#if !defined(TABLE_F32) && !defined(TABLE_F16) && D % LOOM_QK != 0
#error "gather.cl: quantized tables need D % 32 == 0"
#endif

__kernel void gather(const __global TABLE_T *table, const __global int *ids,
                     __global float *out, int T, float scale)
{
    const int i = get_global_id(0), t = get_global_id(1);
    if (i >= D || t >= T)
        return;
    const int id = ids[t];
    float v = 0.0f;
    if (id >= 0 && id < VOCAB)
        v = AT(table + (size_t)id * ROW_STRIDE, i) * scale;
    out[(size_t)t * D + i] = v;
}
