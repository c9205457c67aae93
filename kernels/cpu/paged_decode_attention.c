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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16

static inline float dot(const float *a, const float *b, int n) {
    float acc = 0.f;
    for (int i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

static void attend_one(
    const float *q, float *out, const float *k_head, const float *v_head,
    const int64_t *table, int64_t start, int64_t len, int group, int head_dim,
    int block_size, float scale, float *scores /* [group, len] */)
{
    const int64_t block_stride = (int64_t)block_size * head_dim;
    float maxes[MAX_GROUP];
    for (int g = 0; g < group; ++g) maxes[g] = -INFINITY;
    for (int64_t t = start; t < len; ++t) {
        const float *k = k_head + table[t / block_size] * block_stride + (t % block_size) * head_dim;
        for (int g = 0; g < group; ++g) {
            float s = dot(q + g * head_dim, k, head_dim) * scale;
            scores[g * len + t] = s;
            if (s > maxes[g]) maxes[g] = s;
        }
    }
    float sums[MAX_GROUP];
    for (int g = 0; g < group; ++g) {
        float sum = 0.f;
        float *row = scores + g * len;
        for (int64_t t = start; t < len; ++t) {
            row[t] = expf(row[t] - maxes[g]);
            sum += row[t];
        }
        sums[g] = sum;
        memset(out + g * head_dim, 0, sizeof(float) * head_dim);
    }
    for (int64_t t = start; t < len; ++t) {
        const float *v = v_head + table[t / block_size] * block_stride + (t % block_size) * head_dim;
        for (int g = 0; g < group; ++g) {
            const float p = scores[g * len + t];
            float *o = out + g * head_dim;
            for (int d = 0; d < head_dim; ++d) o[d] += p * v[d];
        }
    }
    for (int g = 0; g < group; ++g) {
        const float inv = 1.f / sums[g];
        float *o = out + g * head_dim;
        for (int d = 0; d < head_dim; ++d) o[d] *= inv;
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
                attend_one(q + offset, out + offset, k_cache + h * head_stride, v_cache + h * head_stride,
                           block_tables + b * max_blocks, start, len, group, head_dim, block_size, scale, scores);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
