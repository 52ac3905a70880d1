/* kv_store.cl - write new keys/values into one layer of the paged KV cache
 *
 * Cache layout (per layer, K and V alike): [n_pages][PAGE_SIZE][N_KV_HEADS][HEAD_DIM]
 * starting at element layer_off of the pool buffer. Logical position p of row
 * r lives in page page_table[r * MAX_PAGES + p / PAGE_SIZE], slot p % PAGE_SIZE.
 *
 * kernel kv_store(
 *     const __global float *Kn, int k_off, int ldk,  token t's keys: Kn[k_off + t*ldk + j],
 *                                                    j < N_KV_HEADS*HEAD_DIM (head-major)
 *     const __global float *Vn, int v_off, int ldv,  values, likewise
 *     __global KV_T *Kc, __global KV_T *Vc,          cache pools (float, or half with KV_F16)
 *     int layer_off,                                 element offset of this layer in Kc/Vc
 *     const __global int *pos,                       pos[T]: position of token t in its row
 *     const __global int *row_of,                    row_of[T]: its row (sequence slot)
 *     const __global int *page_table,                [R][MAX_PAGES] page ids
 *     int T)
 *
 * Macros: PAGE_SIZE, N_KV_HEADS, HEAD_DIM, MAX_PAGES (required); KV_F16 (store
 *   half, rounded to nearest even).
 * Launch: global = (N_KV_HEADS * HEAD_DIM, T), local = any (NULL).
 * Positions outside [0, MAX_PAGES * PAGE_SIZE) and negative page ids are
 * skipped (never written out of bounds); the caller validates them first.
 * With a fused QKV projection, pass the same buffer for Kn and Vn with the
 * K and V column offsets as k_off and v_off and the fused row length as ld.
 */

#ifndef PAGE_SIZE
#error "kv_store.cl: define PAGE_SIZE"
#endif
#ifndef N_KV_HEADS
#error "kv_store.cl: define N_KV_HEADS"
#endif
#ifndef HEAD_DIM
#error "kv_store.cl: define HEAD_DIM"
#endif
#ifndef MAX_PAGES
#error "kv_store.cl: define MAX_PAGES (page-table row length)"
#endif

#ifdef KV_F16
#define KV_T half
#else
#define KV_T float
#endif
#define KV_ROW (N_KV_HEADS * HEAD_DIM)

__kernel void kv_store(const __global float *Kn, int k_off, int ldk,
                       const __global float *Vn, int v_off, int ldv,
                       __global KV_T *Kc, __global KV_T *Vc, int layer_off,
                       const __global int *pos, const __global int *row_of,
                       const __global int *page_table, int T)
{
    const int j = get_global_id(0), t = get_global_id(1);
    if (j >= KV_ROW || t >= T)
        return;
    const int p = pos[t];
    if (p < 0 || p >= MAX_PAGES * PAGE_SIZE)
        return;
    const int page = page_table[(size_t)row_of[t] * MAX_PAGES + p / PAGE_SIZE];
    if (page < 0)
        return;
    const size_t dst = (size_t)layer_off + ((size_t)page * PAGE_SIZE + p % PAGE_SIZE) * KV_ROW + j;
    const float k = Kn[k_off + (size_t)t * ldk + j];
    const float v = Vn[v_off + (size_t)t * ldv + j];
#ifdef KV_F16
    vstore_half_rte(k, 0, Kc + dst);
    vstore_half_rte(v, 0, Vc + dst);
#else
    Kc[dst] = k;
    Vc[dst] = v;
#endif
}
