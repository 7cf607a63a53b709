// Decode attention straight over the paged KV cache: one query token per sequence, its keys
// and values read in place from their blocks (no gather into a contiguous copy first).
//
// Built at first use by disagg/engine/cpu_kernels.py (g++ -O3 -march=native) and called
// through ctypes with raw pointers (disagg/engine/paged_attention.py): no torch headers.
//
// Per (sequence, KV head) the G query heads that share it are scored together: each key row
// is converted to fp32 once and used G times. Softmax and accumulation are in fp32.

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paged_kv.h"

namespace {

using disagg::prefetch;
using disagg::Shape;
using disagg::Strides;
using disagg::store;
using disagg::to_float;

// The G query heads of KV head `h` of one sequence of `n` tokens; `table`: its block ids.
template <typename T, int G, int D>
void one_kv_head(const T* __restrict__ q, const T* __restrict__ kv_layer, T* __restrict__ out,
                 const int64_t* __restrict__ table, int64_t n, const Shape& s, int64_t h,
                 float scale, float* __restrict__ scores) {
  const Strides st(s, D);
  float qf[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qf[g][d] = to_float(q[g * D + d]) * scale;
  float top[G];
  for (int g = 0; g < G; ++g) top[g] = -FLT_MAX;
  for (int64_t t0 = 0; t0 < n; t0 += s.block_size) {
    const T* keys = kv_layer + table[t0 / s.block_size] * st.block + h * st.head;
    const int64_t count = n - t0 < s.block_size ? n - t0 : s.block_size;
    if (t0 + s.block_size < n)  // blocks sit anywhere: the hardware cannot see the next coming
      prefetch(kv_layer + table[t0 / s.block_size + 1] * st.block + h * st.head, st.head);
    for (int64_t j = 0; j < count; ++j) {
      float key[D];
      for (int d = 0; d < D; ++d) key[d] = to_float(keys[j * D + d]);
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qf[g][d] * key[d];
        scores[g * n + t0 + j] = dot;
        top[g] = dot > top[g] ? dot : top[g];
      }
    }
  }
  // The first value block is fetched while the softmax runs (then, as for keys, each block
  // fetches the next): measured 1.5x on fp32 steps, where without it every pass starts cold.
  prefetch(kv_layer + table[0] * st.block + st.v + h * st.head, st.head);
  float inv_sum[G];
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * n;
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      row[t] = std::exp(row[t] - top[g]);
      sum += row[t];
    }
    inv_sum[g] = 1.f / sum;
  }
  float acc[G][D] = {};
  for (int64_t t0 = 0; t0 < n; t0 += s.block_size) {
    const T* values = kv_layer + table[t0 / s.block_size] * st.block + st.v + h * st.head;
    const int64_t count = n - t0 < s.block_size ? n - t0 : s.block_size;
    if (t0 + s.block_size < n)
      prefetch(kv_layer + table[t0 / s.block_size + 1] * st.block + st.v + h * st.head, st.head);
    for (int64_t j = 0; j < count; ++j) {
      float value[D];
      for (int d = 0; d < D; ++d) value[d] = to_float(values[j * D + d]);
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * n + t0 + j];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * value[d];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) store(&out[g * D + d], acc[g][d] * inv_sum[g]);
}

template <typename T, int G, int D>
void decode(const T* q, const T* kv, T* out, const int64_t* table, const int64_t* lens,
            int64_t num_seqs, const Shape& s, int64_t layer, float scale, int num_threads) {
  const T* kv_layer = kv + layer * Strides(s, D).layer;
  const int64_t num_tasks = num_seqs * s.num_kv_heads;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> scores;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_tasks; ++i) {
      const int64_t b = i / s.num_kv_heads, h = i % s.num_kv_heads, n = lens[b];
      scores.resize(size_t(G * n));
      const int64_t row = (b * s.num_heads + h * G) * D;
      one_kv_head<T, G, D>(q + row, kv_layer, out + row, table + b * s.table_width, n, s, h,
                           scale, scores.data());
    }
  }
}

DISAGG_DEFINE_PICK(decode)

}  // namespace

extern "C" {

// 1 when a kernel exists for this many query heads per KV head at this head size.
int disagg_paged_decode_supports(int64_t groups, int64_t head_dim) {
  return pick<float>(groups, head_dim) != nullptr;
}

// q, out: [num_seqs, num_heads, head_dim]; kv: the cache; table: [num_seqs, table_width] block
// ids (padding past a sequence's blocks is never read); lens: [num_seqs] keys per sequence
// (>= 1). is_bf16: bf16 tensors, else fp32. Returns 0, or -1 for an unsupported shape.
int disagg_paged_decode(const void* q, const void* kv, void* out, const int64_t* table,
                        const int64_t* lens, int64_t num_seqs, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t num_layers,
                        int64_t block_size, int64_t table_width, int64_t layer, float scale,
                        int is_bf16, int num_threads) {
  const Kernel kernel = pick(is_bf16, num_heads, num_kv_heads, head_dim);
  if (kernel == nullptr) return -1;
  const Shape shape{num_heads, num_kv_heads, num_layers, block_size, table_width};
  kernel(q, kv, out, table, lens, num_seqs, shape, layer, scale, num_threads);
  return 0;
}

}  // extern "C"
