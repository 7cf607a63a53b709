// What the paged attention kernels share: the element types they read and write, and how a
// row of the paged KV cache is found.
//
// Cache layout (model_runner.py): kv[num_blocks, num_layers, 2 (k|v), num_kv_heads, block_size,
// head_dim], so one (block, layer, k|v, head) is a contiguous [block_size, head_dim] row group.

#pragma once

#include <cstdint>
#include <cstring>

namespace disagg {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  const uint32_t bits = uint32_t(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* dst, float x) { *dst = x; }
// Round to nearest even, as torch rounds. Built with -ffast-math (finite math): the scores'
// exp and sums vectorize only so (1.4-1.7x measured), and a finite cache gives finite outputs.
inline void store(uint16_t* dst, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  *dst = uint16_t(bits >> 16);
}

// Blocks sit anywhere in the cache, so the hardware prefetcher cannot see the next one coming.
template <typename T>
inline void prefetch(const T* start, int64_t count) {
  const char* p = reinterpret_cast<const char*>(start);
  for (int64_t offset = 0; offset < count * int64_t(sizeof(T)); offset += 64)
    __builtin_prefetch(p + offset, 0, 3);
}

struct Shape {
  int64_t num_heads, num_kv_heads, num_layers, block_size, table_width;
};

// Strides, in elements, of the cache.
struct Strides {
  int64_t head, v, layer, block;  // next KV head; k -> v of the same row; next layer; next block
  Strides(const Shape& s, int64_t head_dim)
      : head(s.block_size * head_dim),
        v(s.num_kv_heads * s.block_size * head_dim),
        layer(2 * s.num_kv_heads * s.block_size * head_dim),
        block(s.num_layers * 2 * s.num_kv_heads * s.block_size * head_dim) {}
};

}  // namespace disagg

// The shapes both kernels are built for (the models we serve): head sizes 64 and 128, 1 to 8
// query heads per KV head. CASE(groups, head_dim) is expanded once per shape.
#define DISAGG_FOR_EACH_SHAPE(CASE)                                                     \
  CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64)   \
  CASE(8, 64) CASE(1, 128) CASE(2, 128) CASE(3, 128) CASE(4, 128) CASE(5, 128)          \
  CASE(6, 128) CASE(7, 128) CASE(8, 128)

// For pick(): returns `&erased<T, g, d>` when the shape matches (the use site has `groups`,
// `head_dim`, the element type `T` and its kernel template `erased`).
#define DISAGG_RETURN_IF_SHAPE(g, d) \
  if (groups == g && head_dim == d) return &erased<T, g, d>;
