// Sixteen-float vectors shared by the CPU kernels.
//
// With AVX-512 a `vec` is GCC's vector extension type, one zmm register. With
// AVX2 it is a pair of 8-float halves, each a ymm register, behind the same
// operators: GCC has no register for a 64-byte vector type without AVX-512; it
// keeps such values on the stack and builds every broadcast there, several
// times slower than the arithmetic. Kernels write their lanes' math with the
// operators and the functions below (select, max, the bit casts, lane
// access), which compile to either.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tokenloom {

constexpr int64_t kLanes = 16;

// 1.5 * 2^23. Adding it to a float below 2^22 in magnitude rounds that float to
// an integer (ties to even), and subtracting it again gives the integer as a
// float; an integer below 2^22 added to its bits likewise lands in its mantissa.
constexpr float kRoundingMagic = 12582912.0f;

#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef float vec_unaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline vec load(const float* p) { return *reinterpret_cast<const vec_unaligned*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_unaligned*>(p) = v; }
// Lane i of a where lane i of mask is set (all ones, as comparisons give), else of b.
inline vec select(ivec mask, vec a, vec b) { return mask ? a : b; }
inline ivec as_ivec(vec v) { return reinterpret_cast<const ivec&>(v); }
inline vec as_vec(ivec v) { return reinterpret_cast<const vec&>(v); }
// Each lane converted to an integer, truncating.
inline ivec to_ivec(vec v) { return __builtin_convertvector(v, ivec); }
// Lane i ^ N of v, for N = 1, 2, 4 or 8.
template <int N>
inline vec swap_lanes(vec v) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8);
  return __builtin_shuffle(v, ivec{0 ^ N, 1 ^ N, 2 ^ N, 3 ^ N, 4 ^ N, 5 ^ N, 6 ^ N, 7 ^ N, 8 ^ N,
                                   9 ^ N, 10 ^ N, 11 ^ N, 12 ^ N, 13 ^ N, 14 ^ N, 15 ^ N});
}
// Lanes 0-7 of a, then lanes 8-15 of b.
inline vec low_high(vec a, vec b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27, 28, 29, 30, 31);
}
// a[o], b[o], a[o + 1], b[o + 1], .. a[o + 7], b[o + 7], o = 8 for the Second half.
template <bool Second>
inline vec interleave(vec a, vec b) {
  constexpr int o = Second ? 8 : 0;
  return __builtin_shufflevector(a, b, o + 0, o + 16, o + 1, o + 17, o + 2, o + 18, o + 3, o + 19,
                                 o + 4, o + 20, o + 5, o + 21, o + 6, o + 22, o + 7, o + 23);
}
#else
typedef float half_vec __attribute__((vector_size(kLanes / 2 * sizeof(float))));
typedef int32_t half_ivec __attribute__((vector_size(kLanes / 2 * sizeof(int32_t))));
typedef float half_vec_unaligned
    __attribute__((vector_size(kLanes / 2 * sizeof(float)), aligned(4)));

struct vec {
  half_vec lo, hi;  // lanes 0-7, 8-15
  float operator[](int64_t i) const { return i < kLanes / 2 ? lo[i] : hi[i - kLanes / 2]; }
};
struct ivec {
  half_ivec lo, hi;
};

inline vec load(const float* p) {
  return {*reinterpret_cast<const half_vec_unaligned*>(p),
          *reinterpret_cast<const half_vec_unaligned*>(p + kLanes / 2)};
}
inline void store(float* p, vec v) {
  *reinterpret_cast<half_vec_unaligned*>(p) = v.lo;
  *reinterpret_cast<half_vec_unaligned*>(p + kLanes / 2) = v.hi;
}

inline vec operator+(vec a, vec b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline vec operator-(vec a, vec b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline vec operator*(vec a, vec b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline vec operator/(vec a, vec b) { return {a.lo / b.lo, a.hi / b.hi}; }
inline vec operator+(vec a, float s) { return {a.lo + s, a.hi + s}; }
inline vec operator-(vec a, float s) { return {a.lo - s, a.hi - s}; }
inline vec operator*(vec a, float s) { return {a.lo * s, a.hi * s}; }
inline vec operator/(float s, vec a) { return {s / a.lo, s / a.hi}; }
inline vec operator-(vec a) { return {-a.lo, -a.hi}; }
inline vec& operator+=(vec& a, vec b) { return a = a + b; }
inline vec& operator*=(vec& a, float s) { return a = a * s; }
inline ivec operator>(vec a, vec b) { return {a.lo > b.lo, a.hi > b.hi}; }
inline ivec operator>(vec a, float s) { return {a.lo > s, a.hi > s}; }

inline ivec operator+(ivec a, int32_t s) { return {a.lo + s, a.hi + s}; }
inline ivec operator&(ivec a, int32_t s) { return {a.lo & s, a.hi & s}; }
inline ivec operator<<(ivec a, int s) { return {a.lo << s, a.hi << s}; }

inline vec select(ivec mask, vec a, vec b) {
  return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi};
}
inline ivec as_ivec(vec v) {
  return {reinterpret_cast<const half_ivec&>(v.lo), reinterpret_cast<const half_ivec&>(v.hi)};
}
inline vec as_vec(ivec v) {
  return {reinterpret_cast<const half_vec&>(v.lo), reinterpret_cast<const half_vec&>(v.hi)};
}
inline ivec to_ivec(vec v) {
  return {__builtin_convertvector(v.lo, half_ivec), __builtin_convertvector(v.hi, half_ivec)};
}
template <int N>
inline vec swap_lanes(vec v) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8);
  if constexpr (N == 8) {
    return {v.hi, v.lo};
  } else {
    const half_ivec order{0 ^ N, 1 ^ N, 2 ^ N, 3 ^ N, 4 ^ N, 5 ^ N, 6 ^ N, 7 ^ N};
    return {__builtin_shuffle(v.lo, order), __builtin_shuffle(v.hi, order)};
  }
}
inline vec low_high(vec a, vec b) { return {a.lo, b.hi}; }
template <bool Second>
inline vec interleave(vec a, vec b) {
  const half_vec x = Second ? a.hi : a.lo, y = Second ? b.hi : b.lo;
  return {__builtin_shufflevector(x, y, 0, 8, 1, 9, 2, 10, 3, 11),
          __builtin_shufflevector(x, y, 4, 12, 5, 13, 6, 14, 7, 15)};
}
#endif

// Lane by lane, as a comparison and select give it (a NaN in a gives b).
inline vec max(vec a, vec b) { return select(a > b, a, b); }

// Pairwise, halving the vector each step: four dependent adds where a lane-by-
// lane loop chains sixteen.
inline float lane_sum(vec v) {
  v += swap_lanes<8>(v);
  v += swap_lanes<4>(v);
  v += swap_lanes<2>(v);
  return v[0] + v[1];
}

// e^x for x <= 0, sixteen lanes at a time. Range reduction x = n ln2 + r,
// |r| <= ln2 / 2 (n rounded with the 1.5 * 2^23 trick), then a degree-6
// polynomial for e^r; relative error about 1e-7.
inline vec exp_nonpositive(vec x) {
  x = max(x, vec{} - 87.0f);
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
  return p * as_vec((to_ivec(n) + 127) << 23);
}

// silu(g) * u, the SwiGLU MLP's activation (layer_ops' silu_and_mul and the
// quantized gate_up matmul's fused output share it, so both give the same
// bits): sigmoid(g) from e^-|g| <= 1, so the exponential never overflows.
inline vec silu_times(vec g, vec u) {
  const ivec positive = g > 0.0f;
  const vec e = exp_nonpositive(select(positive, -g, g));
  const vec sigmoid = select(positive, vec{} + 1.0f, e) / (e + 1.0f);
  return g * sigmoid * u;
}

}  // namespace tokenloom
