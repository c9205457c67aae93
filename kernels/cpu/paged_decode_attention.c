/* Decode attention over paged KV for CPUs, float32.
 *
 * Reads each sequence's K and V pages once, in place: the torch reference
 * gathers the pages into a padded copy first, which on a CPU costs more than
 * the attention itself. One task per (sequence, kv head); the query heads of a
 * GQA group share each K/V row while it is in cache.
 *
 * Layouts (contiguous): q, out [B, Hq, D]; k_cache, v_cache [Hkv, N, bs, D];
 * block_tables [B, max_blocks] int64; context_lens [B] int64.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16

/* Pages are visited in block-table order, which the hardware prefetcher cannot
 * guess across page boundaries: ask for the next page while using this one. */
static inline __attribute__((always_inline)) void prefetch_block(const float *block, int64_t num_floats) {
    for (int64_t i = 0; i < num_floats; i += 16) __builtin_prefetch(block + i, 0, 1);
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int n) {
    float acc = 0.f;
    for (int i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

/* Always inlined, so calls with a constant head_dim get fully vectorized loops. */
static inline __attribute__((always_inline)) void attend_one(
    const float *q, float *out, const float *k_head, const float *v_head,
    const int64_t *table, int64_t start, int64_t len, int group, const int head_dim,
    int block_size, float scale, float *scores /* [group, len] */)
{
    const int64_t block_stride = (int64_t)block_size * head_dim;
    float maxes[MAX_GROUP];
    for (int g = 0; g < group; ++g) maxes[g] = -FLT_MAX;
    /* Walk whole blocks: one table lookup per block, no division per token. */
    for (int64_t first = start - start % block_size; first < len; first += block_size) {
        const float *k_block = k_head + table[first / block_size] * block_stride;
        if (first + block_size < len) prefetch_block(k_head + table[first / block_size + 1] * block_stride, block_stride);
        const int64_t lo = first < start ? start - first : 0;
        const int64_t hi = len - first < block_size ? len - first : block_size;
        for (int64_t i = lo; i < hi; ++i) {
            const float *k = k_block + i * head_dim;
            for (int g = 0; g < group; ++g) {
                const float s = dot(q + g * head_dim, k, head_dim) * scale;
                scores[g * len + first + i] = s;
                if (s > maxes[g]) maxes[g] = s;
            }
        }
    }
    float inv_sums[MAX_GROUP];
    for (int g = 0; g < group; ++g) {
        float sum = 0.f;
        float *row = scores + g * len;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = start; t < len; ++t) {
            row[t] = expf(row[t] - maxes[g]);
            sum += row[t];
        }
        inv_sums[g] = 1.f / sum;
        memset(out + g * head_dim, 0, sizeof(float) * head_dim);
    }
    for (int64_t first = start - start % block_size; first < len; first += block_size) {
        const float *v_block = v_head + table[first / block_size] * block_stride;
        if (first + block_size < len) prefetch_block(v_head + table[first / block_size + 1] * block_stride, block_stride);
        const int64_t lo = first < start ? start - first : 0;
        const int64_t hi = len - first < block_size ? len - first : block_size;
        for (int64_t i = lo; i < hi; ++i) {
            const float *v = v_block + i * head_dim;
            for (int g = 0; g < group; ++g) {
                const float p = scores[g * len + first + i];
                float *o = out + g * head_dim;
                for (int d = 0; d < head_dim; ++d) o[d] += p * v[d];
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        float *o = out + g * head_dim;
        for (int d = 0; d < head_dim; ++d) o[d] *= inv_sums[g];
    }
}

/* Returns 0, or -1 when the GQA group is larger than MAX_GROUP or memory runs out. */
int paged_decode_attention_f32(
    const float *q, float *out, const float *k_cache, const float *v_cache,
    const int64_t *block_tables, const int64_t *context_lens,
    int64_t batch, int num_heads, int num_kv_heads, int64_t num_blocks, int block_size,
    int head_dim, int64_t max_blocks, float scale, int64_t sliding_window, int num_threads)
{
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP) return -1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; ++b) if (context_lens[b] > max_len) max_len = context_lens[b];
    const int64_t head_stride = num_blocks * block_size * head_dim;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * group * (max_len > 0 ? max_len : 1));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; ++b) {
            for (int h = 0; h < num_kv_heads; ++h) {
                if (!scores) continue;
                const int64_t len = context_lens[b];
                const int64_t start = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
                const int64_t offset = (b * num_heads + (int64_t)h * group) * head_dim;
                const float *qs = q + offset, *ks = k_cache + h * head_stride, *vs = v_cache + h * head_stride;
                const int64_t *table = block_tables + b * max_blocks;
                float *os = out + offset;
                switch (head_dim) {  /* the common head sizes get constant-size inner loops */
                case 64: attend_one(qs, os, ks, vs, table, start, len, group, 64, block_size, scale, scores); break;
                case 128: attend_one(qs, os, ks, vs, table, start, len, group, 128, block_size, scale, scores); break;
                default: attend_one(qs, os, ks, vs, table, start, len, group, head_dim, block_size, scale, scores);
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
