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
 * TABLE_TILE (0)  16: the table as a param declared tiled(0, 16) holds it
 *   (TABLE_F16: runtime.tile; TABLE_Q8_0, Q4_0, Q4_1, Q5_0: runtime.tile_blocks),
 *   each value read where its tile put it: a tied lm head keeps the embedding's
 *   layout, so where the head takes tiles, embedding lookup reads them too.
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

#if defined(TABLE_TILE) && TABLE_TILE
#if TABLE_TILE != 16 || !(defined(TABLE_F16) || defined(TABLE_Q8_0) || defined(TABLE_Q4_0) || defined(TABLE_Q4_1) \
    || defined(TABLE_Q5_0))
#error "gather.cl: TABLE_TILE needs 16 and TABLE_F16, TABLE_Q8_0, TABLE_Q4_0, TABLE_Q4_1 or TABLE_Q5_0"
#endif
/* Value i of row id: lane id % 16 of tile id / 16. A block tile holds per block the
 * 16 rows' f16 scales side by side (Q4_1: then the 16 minimums; Q5_0: then the 16
 * fifth-bit words), then word j (bytes 4j .. 4j + 3) of the 16 rows side by side. */
inline float tiled_at(const __global TABLE_T *table, int id, int i)
{
    const int lane = id % 16;
#ifdef TABLE_F16
    return loom_ldh(table + ((size_t)(id / 16) * D + i) * 16 + lane);
#else
#if defined(TABLE_Q8_0)
#define TILE_BLOCK (16 * LOOM_Q8_0_BYTES)
#define TILE_QS 32
#elif defined(TABLE_Q4_1)
#define TILE_BLOCK (16 * LOOM_Q4_1_BYTES)
#define TILE_QS 64
#elif defined(TABLE_Q5_0)
#define TILE_BLOCK (16 * LOOM_Q5_0_BYTES)
#define TILE_QS 96
#else
#define TILE_BLOCK (16 * LOOM_Q4_0_BYTES)
#define TILE_QS 32
#endif
    const __global uchar *p = table + ((size_t)(id / 16) * (D / LOOM_QK) + i / LOOM_QK) * TILE_BLOCK;
    const int c = i % LOOM_QK;
    const float d = loom_ldh((const __global half *)p + lane);
#ifdef TABLE_Q8_0
    return d * (float)(char)p[TILE_QS + ((c / 4) * 16 + lane) * 4 + c % 4];
#else
    const int e = c % 16;                          /* byte e of the block's nibbles: c low, c + 16 high */
    const uint byte = p[TILE_QS + ((e / 4) * 16 + lane) * 4 + e % 4];
    uint u = c < 16 ? byte & 15u : byte >> 4;
#if defined(TABLE_Q4_1)
    return (float)u * d + loom_ldh((const __global half *)p + 16 + lane);
#elif defined(TABLE_Q5_0)
    const uint h = ((const __global uint *)(p + 32))[lane];      /* as runtime._Q5_0_FIFTH_BITS placed them */
    u |= ((h >> (8 * (e % 4) + e / 4 + (c < 16 ? 4 : 0))) & 1u) << 4;
    return ((float)u - 16.0f) * d;
#else
    return ((float)u - 8.0f) * d;
#endif
#endif
#endif
}
#define GATHER(id, i) tiled_at(table, (id), (i))
#else
#define GATHER(id, i) AT(table + (size_t)(id) * ROW_STRIDE, (i))
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
        v = GATHER(id, i) * scale;
    out[(size_t)t * D + i] = v;
}
