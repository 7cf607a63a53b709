// Pointwise work of a decoder layer fused into one pass over memory each, where torch makes
// several: the residual add with the RMSNorm after it, and SiLU(gate) x up. Both compute in
// fp32 and round once (torch's bf16 SiLU and multiply round twice; its rms_norm once).
// Built beside the attention kernels; see disagg/engine/fused_ops.py.

#include <cmath>
#include <cstdint>

#include "paged_kv.h"

namespace {

using disagg::store;
using disagg::to_float;

// summed = x + residual (rounded to T, as torch's add rounds), out = rms_norm(summed) * weight.
template <typename T>
void add_rms_norm(const T* x, const T* residual, const T* weight, T* out, T* summed,
                  int64_t rows, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * hidden;
    const T* rr = residual + r * hidden;
    T* sr = summed + r * hidden;
    float squares = 0.f;
    for (int64_t i = 0; i < hidden; ++i) {
      store(&sr[i], to_float(xr[i]) + to_float(rr[i]));
      const float v = to_float(sr[i]);  // the norm reads the stream as stored
      squares += v * v;
    }
    const float inv = 1.f / std::sqrt(squares / float(hidden) + eps);
    T* o = out + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) store(&o[i], to_float(sr[i]) * inv * to_float(weight[i]));
  }
}

// out[r] = silu(gate_up[r, :width]) * gate_up[r, width:].
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t width, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * width;
    const T* u = g + width;
    T* o = out + r * width;
    for (int64_t i = 0; i < width; ++i) {
      const float a = to_float(g[i]);
      store(&o[i], a / (1.f + std::exp(-a)) * to_float(u[i]));
    }
  }
}

}  // namespace

extern "C" {

// All tensors contiguous, [rows, hidden] (weight [hidden]); is_bf16: bf16, else fp32.
void disagg_add_rms_norm(const void* x, const void* residual, const void* weight, void* out,
                         void* summed, int64_t rows, int64_t hidden, float eps, int is_bf16,
                         int num_threads) {
  if (is_bf16)
    add_rms_norm(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(residual),
                 static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out),
                 static_cast<uint16_t*>(summed), rows, hidden, eps, num_threads);
  else
    add_rms_norm(static_cast<const float*>(x), static_cast<const float*>(residual),
                 static_cast<const float*>(weight), static_cast<float*>(out),
                 static_cast<float*>(summed), rows, hidden, eps, num_threads);
}

// gate_up [rows, 2 * width] contiguous -> out [rows, width].
void disagg_silu_mul(const void* gate_up, void* out, int64_t rows, int64_t width, int is_bf16,
                     int num_threads) {
  if (is_bf16)
    silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, width,
             num_threads);
  else
    silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, width,
             num_threads);
}

}  // extern "C"
