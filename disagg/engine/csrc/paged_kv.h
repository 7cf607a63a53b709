// What the paged attention kernels share: the element types they read and write, how a row of
// the paged KV cache is found, and how an entry point picks the build for a dtype and shape.
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

// One pointer type for a kernel's fp32 and bf16 builds: `Erased<&kernel<T, G, D>>::call` takes
// the kernel's three tensors (q, kv, out) as void pointers and the rest of its arguments as
// they are, so the entry point picks by shape and dtype at run time and calls through it.
template <auto kernel>
struct Erased;
template <typename T, typename... Rest, void (*kernel)(const T*, const T*, T*, Rest...)>
struct Erased<kernel> {
  static void call(const void* q, const void* kv, void* out, Rest... rest) {
    kernel(static_cast<const T*>(q), static_cast<const T*>(kv), static_cast<T*>(out), rest...);
  }
};

}  // namespace disagg

// The shapes both kernels are built for (the models we serve): head sizes 64 and 128, 1 to 8
// query heads per KV head. CASE(arg, groups, head_dim) is expanded once per shape.
#define DISAGG_FOR_EACH_SHAPE(CASE, arg)                                                    \
  CASE(arg, 1, 64) CASE(arg, 2, 64) CASE(arg, 3, 64) CASE(arg, 4, 64) CASE(arg, 5, 64)      \
  CASE(arg, 6, 64) CASE(arg, 7, 64) CASE(arg, 8, 64) CASE(arg, 1, 128) CASE(arg, 2, 128)    \
  CASE(arg, 3, 128) CASE(arg, 4, 128) CASE(arg, 5, 128) CASE(arg, 6, 128) CASE(arg, 7, 128) \
  CASE(arg, 8, 128)

// A case of DISAGG_DEFINE_PICK's pick<T>: KERNEL<T, g, d>, erased, when the shape matches.
#define DISAGG_RETURN_IF_SHAPE(KERNEL, g, d) \
  if (groups == g && head_dim == d) return &disagg::Erased<&KERNEL<T, g, d>>::call;

// Defines, where a kernel file expands it after `template <typename T, int G, int D> KERNEL`
// (T: float, or uint16_t for bf16; its first arguments q, kv, out point to T):
//   Kernel: the erased pointer type of every build of KERNEL;
//   pick<T>(groups, head_dim): the build for T and one shape of DISAGG_FOR_EACH_SHAPE, or
//     nullptr;
//   pick(is_bf16, num_heads, num_kv_heads, head_dim): the same from an entry point's
//     arguments, also nullptr when the query heads do not split evenly over the KV heads.
#define DISAGG_DEFINE_PICK(KERNEL)                                                          \
  using Kernel = decltype(&disagg::Erased<&KERNEL<float, 1, 64>>::call);                    \
  template <typename T>                                                                     \
  Kernel pick(int64_t groups, int64_t head_dim) {                                           \
    DISAGG_FOR_EACH_SHAPE(DISAGG_RETURN_IF_SHAPE, KERNEL)                                   \
    return nullptr;                                                                         \
  }                                                                                         \
  Kernel pick(int is_bf16, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {     \
    const int64_t groups = num_heads / num_kv_heads;                                        \
    if (groups * num_kv_heads != num_heads) return nullptr;                                 \
    return is_bf16 ? pick<uint16_t>(groups, head_dim) : pick<float>(groups, head_dim);      \
  }
