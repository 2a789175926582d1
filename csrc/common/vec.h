// Sixteen-float vectors shared by the CPU kernels.
//
// GCC's vector extension compiles `vec` to one zmm register with AVX-512 and
// to pairs of ymm registers with AVX2, so the kernels stay portable yet keep
// their accumulators in registers.
#pragma once

#include <cstdint>

namespace tokenloom {

constexpr int64_t kLanes = 16;
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// 1.5 * 2^23. Adding it to a float below 2^22 in magnitude rounds that float to
// an integer (ties to even), and subtracting it again gives the integer as a
// float; an integer below 2^22 added to its bits likewise lands in its mantissa.
constexpr float kRoundingMagic = 12582912.0f;

inline vec load(const float* p) { return *reinterpret_cast<const vec_unaligned*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_unaligned*>(p) = v; }

// Pairwise, halving the vector each step: four dependent adds where a lane-by-
// lane loop chains sixteen.
inline float lane_sum(vec v) {
  v += __builtin_shuffle(v, ivec{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, ivec{4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, ivec{2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
  return v[0] + v[1];
}

// e^x for x <= 0, sixteen lanes at a time. Range reduction x = n ln2 + r,
// |r| <= ln2 / 2 (n rounded with the 1.5 * 2^23 trick), then a degree-6
// polynomial for e^r; relative error about 1e-7.
inline vec exp_nonpositive(vec x) {
  const vec lowest = vec{} - 87.0f;
  x = x > lowest ? x : lowest;
  const vec magic = vec{} + kRoundingMagic;
  const vec n = (x * 1.44269504088896341f + magic) - magic;
  const vec r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  vec p = vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  return p * reinterpret_cast<const vec&>(bits);
}

// silu(g) * u, the SwiGLU MLP's activation (layer_ops' silu_and_mul and the
// quantized gate_up matmul's fused output share it, so both give the same
// bits): sigmoid(g) from e^-|g| <= 1, so the exponential never overflows.
inline vec silu_times(vec g, vec u) {
  const vec e = exp_nonpositive(g > 0 ? -g : g);
  const vec sigmoid = (g > 0 ? vec{} + 1.0f : e) / (e + 1.0f);
  return g * sigmoid * u;
}

}  // namespace tokenloom
