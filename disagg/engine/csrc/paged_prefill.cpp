// Prefill attention over the paged KV cache: the new tokens of one sequence (a chunk, maybe
// after a cached prefix) attend causally to every key before them, read from their blocks.
//
// Flash-style, in fp32: per KV head, the G query heads of 16 consecutive tokens form a tile of
// 16 * G query rows that walks the keys 16 at a time, keeping a running max and sum per row
// (online softmax), so no [tokens x keys] score matrix is ever built. The keys and values of
// a KV head are first converted once into fp32 panels (keys transposed, so a score tile is an
// outer product the compiler vectorizes over 16 keys), then shared by all its query tiles.
// Built with the other CPU kernels by disagg/engine/cpu_kernels.py; bound in paged_attention.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paged_kv.h"

namespace {

using disagg::Shape;
using disagg::Strides;
using disagg::store;
using disagg::to_float;

constexpr int QT = 16;  // query tokens per tile
constexpr int KT = 16;  // keys per step of a tile's walk
constexpr float kMasked = -1e30f;  // finite: built with -ffast-math, where inf is not honoured

// Every key and value of KV head `h` up to `ctx`, converted: keys into [tile][D][KT] panels
// (zero past ctx), values into [ctx][D] rows.
template <typename T, int D>
void convert_head(const T* kv_layer, const int64_t* table, int64_t ctx, const Shape& s,
                  int64_t h, float* __restrict__ keys, float* __restrict__ values) {
  const Strides st(s, D);
  const int64_t tiles = (ctx + KT - 1) / KT;
  std::fill(keys, keys + tiles * D * KT, 0.f);
  for (int64_t pos = 0; pos < ctx; ++pos) {
    const T* row = kv_layer + table[pos / s.block_size] * st.block + h * st.head +
                   (pos % s.block_size) * D;
    float* panel = keys + (pos / KT) * D * KT + pos % KT;
    for (int d = 0; d < D; ++d) panel[d * KT] = to_float(row[d]);
    for (int d = 0; d < D; ++d) values[pos * D + d] = to_float(row[st.v + d]);
  }
}

// Sixteen floats as one value: GCC lowers it to this CPU's widest vectors (one AVX-512
// register, two AVX2 ones). Written this way the tiles stay in registers; as plain loops GCC
// kept them in memory (measured, a 1024-token fp32 layer: 33 ms as loops, 17 ms so).
typedef float f16v __attribute__((vector_size(64), aligned(4)));
static_assert(KT == 16, "a key step is one f16v");

inline f16v load(const float* p) { return *reinterpret_cast<const f16v*>(p); }
inline void store_v(float* p, f16v x) { *reinterpret_cast<f16v*>(p) = x; }

// scores[M][KT] = qf[M][D] . panel[D][KT], eight query rows at a time (eight accumulators:
// enough independent FMAs to hide their latency).
template <int M, int D>
void score_tile(const float* __restrict__ qf, const float* __restrict__ panel,
                float* __restrict__ scores) {
  static_assert(M % 8 == 0, "query rows come in eights");
  for (int r0 = 0; r0 < M; r0 += 8) {
    f16v acc[8] = {};
    for (int d = 0; d < D; ++d) {
      const f16v keys = load(panel + d * KT);
      for (int r = 0; r < 8; ++r) acc[r] += qf[(r0 + r) * D + d] * keys;
    }
    for (int r = 0; r < 8; ++r) store_v(scores + (r0 + r) * KT, acc[r]);
  }
}

// Online softmax step for a tile: folds its scores into each row's running max and sum and
// leaves the probabilities in `scores` and in `rescale` the factor each row's output so far
// must be scaled by. Phase by phase over all rows, so every exp runs as a vector (one row
// at a time, the per-row branches and reductions cost 30% of the kernel).
template <int M>
void fold_tile(float* __restrict__ scores, float* __restrict__ top, float* __restrict__ sum,
               float* __restrict__ rescale) {
  float new_top[M];
  for (int r = 0; r < M; ++r) {
    float m = top[r];
    for (int j = 0; j < KT; ++j) m = std::max(m, scores[r * KT + j]);
    new_top[r] = m;
  }
  for (int r = 0; r < M; ++r) rescale[r] = std::exp(top[r] - new_top[r]);
  for (int i = 0; i < M * KT; ++i) scores[i] = std::exp(scores[i] - new_top[i / KT]);
  for (int r = 0; r < M; ++r) {
    float tile_sum = 0.f;
    for (int j = 0; j < KT; ++j) tile_sum += scores[r * KT + j];
    sum[r] = sum[r] * rescale[r] + tile_sum;
    top[r] = new_top[r];
  }
}

// out[M][D] = out * rescale + p[M][KT] . values[KT][D], two rows at a time (2 x D / 16
// accumulators).
template <int M, int D>
void accumulate_tile(const float* __restrict__ p, const float* __restrict__ values,
                     const float* __restrict__ rescale, float* __restrict__ out) {
  constexpr int V = D / 16;
  for (int r0 = 0; r0 < M; r0 += 2) {
    f16v acc[2][V];
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < V; ++c) acc[r][c] = load(out + (r0 + r) * D + c * 16) * rescale[r0 + r];
    for (int j = 0; j < KT; ++j)
      for (int c = 0; c < V; ++c) {
        const f16v value = load(values + j * D + c * 16);
        for (int r = 0; r < 2; ++r) acc[r][c] += p[(r0 + r) * KT + j] * value;
      }
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < V; ++c) store_v(out + (r0 + r) * D + c * 16, acc[r][c]);
  }
}

// One query tile: tokens i0 .. i0 + QT - 1 of the chunk (fewer at its end), at positions
// start + i, against KV head h's panels. Row r of the tile is token r / G, query head r % G.
template <typename T, int G, int D>
void query_tile(const T* q, T* out, const float* keys, const float* values, int64_t n,
                int64_t start, const Shape& s, int64_t h, int64_t i0, float scale,
                float* __restrict__ work) {
  constexpr int M = QT * G;
  float* qf = work;        // [M][D]
  float* acc = qf + M * D;  // [M][D]
  float* scores = acc + M * D;  // [M][KT]
  float top[M], sum[M], rescale[M];
  const int64_t tokens = std::min<int64_t>(QT, n - i0);
  for (int r = 0; r < M; ++r) {
    const T* row = q + ((i0 + r / G) * s.num_heads + h * G + r % G) * D;
    for (int d = 0; d < D; ++d) qf[r * D + d] = r / G < tokens ? to_float(row[d]) * scale : 0.f;
    top[r] = kMasked;
    sum[r] = 0.f;
  }
  std::fill(acc, acc + M * D, 0.f);
  const int64_t first = start + i0, last = start + i0 + tokens - 1;  // the tile's positions
  for (int64_t k0 = 0; k0 <= last; k0 += KT) {
    score_tile<M, D>(qf, keys + (k0 / KT) * D * KT, scores);
    if (k0 + KT - 1 > first)  // the diagonal: each row sees keys up to its own position
      for (int r = 0; r < M; ++r)
        for (int j = 0; j < KT; ++j)
          if (k0 + j > first + r / G) scores[r * KT + j] = kMasked;
    fold_tile<M>(scores, top, sum, rescale);
    accumulate_tile<M, D>(scores, values + k0 * D, rescale, acc);
  }
  for (int r = 0; r < tokens * G; ++r) {
    T* row = out + ((i0 + r / G) * s.num_heads + h * G + r % G) * D;
    const float inv = 1.f / sum[r];
    for (int d = 0; d < D; ++d) store(&row[d], acc[r * D + d] * inv);
  }
}

// Scratch that outlives a call (per thread): a fresh multi-MB buffer per layer is a fresh mmap
// whose page faults cost more than the attention (as the runner's gather workspace found).
float* scratch(std::vector<float>& buffer, size_t size) {
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

// One KV head at a time: its panels (fp32 keys and values of the whole context, 8 bytes per
// key and head dimension: 33 MB at 32k keys x 128) are built once, then every query tile
// reads them, in parallel when there are threads.
template <typename T, int G, int D>
void prefill(const T* q, const T* kv, T* out, const int64_t* table, int64_t n, int64_t start,
             const Shape& s, int64_t layer, float scale, int num_threads) {
  const T* kv_layer = kv + layer * Strides(s, D).layer;
  const int64_t ctx = start + n;
  const int64_t padded = (ctx + KT - 1) / KT * KT;  // the last tile reads values past ctx,
                                                    // weighted zero
  thread_local std::vector<float> panels_buffer;
  float* keys = scratch(panels_buffer, size_t(2 * padded * D));
  float* values = keys + padded * D;
  const int64_t tiles = (n + QT - 1) / QT;
  for (int64_t h = 0; h < s.num_kv_heads; ++h) {
    std::fill(values + ctx * D, values + padded * D, 0.f);
    convert_head<T, D>(kv_layer, table, ctx, s, h, keys, values);
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i < tiles; ++i) {
      thread_local std::vector<float> work_buffer;
      float* work = scratch(work_buffer, size_t(2 * QT * G * D + QT * G * KT));
      query_tile<T, G, D>(q, out, keys, values, n, start, s, h, i * QT, scale, work);
    }
  }
}

DISAGG_DEFINE_PICK(prefill)

}  // namespace

extern "C" {

// q, out: [num_tokens, num_heads, head_dim], the chunk's tokens at positions start ..
// start + num_tokens - 1, whose K/V are already in the cache; table: the sequence's block ids
// covering start + num_tokens keys. Returns 0, or -1 for an unsupported shape.
int disagg_paged_prefill(const void* q, const void* kv, void* out, const int64_t* table,
                         int64_t num_tokens, int64_t start, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t num_layers,
                         int64_t block_size, int64_t layer, float scale, int is_bf16,
                         int num_threads) {
  const Kernel kernel = pick(is_bf16, num_heads, num_kv_heads, head_dim);
  if (kernel == nullptr || num_tokens < 1) return -1;
  const Shape shape{num_heads, num_kv_heads, num_layers, block_size, 0};
  kernel(q, kv, out, table, num_tokens, start, shape, layer, scale, num_threads);
  return 0;
}

}  // extern "C"
