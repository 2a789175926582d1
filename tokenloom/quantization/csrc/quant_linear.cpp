// y = x @ dequant(W).T for weights kept quantized in memory (see
// tokenloom/quantization/formats.py for the layouts), with int8 activations and
// integer dot products, as llama.cpp does.
//
// Weight layouts, per output row of K_pad (K rounded up to 32) columns:
//   bits 4: 16 bytes per 32 columns, byte j holds column j (low nibble) and
//           j + 16 (high nibble); w = scale * q + min, one scale and min per
//           32 columns.
//   bits 8: one int8 per column; w = scale * q (+ min), scale (and min) per
//           `group` (16 or 32) columns.
// Scales and mins arrive as the file keeps them (Factors): fp16 or fp32 per
// group, or an fp16 base per super-block times an int8 code per group; each
// path decodes the rows it works on into float buffers first.
//
// Activations are quantized per row and per 8 columns (a group a): xs = max|x| / 127,
// xq = round(x / xs), ties to even. Per 4-column lane l of the weight's group g,
//   y[m, n] = sum_l ws[n, g(l)] * xs[m, a(l)] * dot4(q[n, l], xq[m, l])
//           + sum_g min[n, g] * sum_{c in g} xs[m, a(c)] * xq[m, c],
// i.e. exactly dequant(W) against the rounded activations. (The float x in the
// min term alone is worse: Q4_1's codes and mins are far from centred, and the
// default model's argmax agreement fell from 98% to 95%.)
// Per 8 and not per 32 columns as llama.cpp's Q8_0: it costs the same (the
// scales arrive per int32 lane either way) and per 32 moved the default model's
// greedy argmax away from the float model's at 3.3% of teacher-forced positions
// (per 8: 1.9%; the tests allow 3%). For 8-bit weights a group a is 8
// consecutive columns. For 4-bit ones the activations are laid out as the
// weight bytes are, so that a vector of packed codes needs only a mask and a
// shift: per step the low-nibble columns (0-15 of each 32-column block), then
// the high-nibble ones (16-31); a group a is then columns 4i..4i+3 and
// 16+4i..16+4i+3 of a block (i < 4), the two halves of one int32 lane.
// The dot products are integer: AVX-512 VNNI `vpdpbusd` (u8 x s8 -> s32) over
// 64 bytes at a time, or on AVX2 machines AVX-VNNI or `vpmaddubsw` +
// `vpmaddwd` over 32, chosen at compile time (the build is -march=native).
// `vpdpbusd` multiplies unsigned by signed bytes: 4-bit codes are the unsigned
// side; for signed 8-bit codes the activations become u8 (xq + 128) and the
// accumulator starts at -128 * sum(q), computed with one more `vpdpbusd` per
// weight block; without VNNI, 8-bit codes use |q| and sign(xq, q) instead.
//
// With up to eight activation rows (decode) each thread takes four output rows at
// a time, unpacks each weight step into registers and uses it at once, adding
// the min term per output; at one row this streams weights from DRAM at 11-20
// GB/s on two threads, where dequantizing them to float managed 7-10. With more rows it
// first unpacks 32 output rows' codes and per-lane scales into a buffer that
// stays in L1/L2 and runs chunks of activation rows against them, the min term
// one addmm for the call. Tiles of four output by up to four activation rows
// keep one float accumulator per pair in a register (the int32 dot of each step
// is scaled by ws * xs and added to it). From kGemmRows rows (tiled_gemm)
// dequantized tiles go through at::mm. Without AVX2 the build fails and
// kernels.py falls back to dequantizing.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "../../model/csrc/vec.h"

namespace tokenloom {
namespace {

constexpr int64_t kBlock = 32;             // weight columns per 4-bit block and padding unit
constexpr int64_t kActGroup = 8;           // activation columns per scale
constexpr int64_t kRowBlock = 4;           // output rows per register tile
constexpr int64_t kActBlock = 4;           // activation rows per register tile
// Up to this many activation rows the weights are unpacked in registers for each
// tile of four; from 9 rows unpacking 32 rows once into a buffer won (16 rows,
// 8-bit codes: 1.2-1.3x), below it lost (5-8 rows: up to 2x).
constexpr int64_t kDirectRows = 8;
constexpr int64_t kSpan = 32;              // output rows a thread takes at once
constexpr int64_t kChunkBytes = 16 << 10;  // activation bytes run against a span at once
// Rows ahead whose codes the register path (up to kDirectRows rows) prefetches
// into L1. Weights read from DRAM (the 1B shape's, each matrix once a step,
// per-matrix rates with two threads): none 7-15 GB/s, 8 rows 9-17, 16 rows
// 11-20 (32 rows, or 16-64 KB ahead whatever the row size, no better; T1 hints
// worse).
constexpr int64_t kPrefetchRows = 16;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TL_VNNI 1
constexpr int64_t kStep = 64;  // columns per vector step
typedef __m512i ivec_t;
typedef __m512 fvec_t;
#elif defined(__AVX2__)
#if defined(__AVXVNNI__)
#define TL_VNNI 1
#else
#define TL_VNNI 0
#endif
constexpr int64_t kStep = 32;
typedef __m256i ivec_t;
typedef __m256 fvec_t;
#else
#error "the quantized kernel needs AVX2; kernels.py falls back to dequantizing"
#endif

// Products of tiny weight and activation scales fall below float32's normal
// range (a random-weight 1B model's activations reach 1e-33), and every op on a
// denormal costs a microcode assist: the 1B shape's down projection ran 5x
// slower on such activations. Each thread of a call flushes them to zero
// (FTZ and DAZ) and restores its MXCSR after.
struct FlushDenormals {
  const unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

// Per-group scales or mins (formats.py's GroupFactors): value(n, g) =
// multiplier * base(n, g / per) * codes(n, g), or multiplier * base(n, g)
// without codes.
struct Factors {
  const void* base = nullptr;  // float16 or float32 [N, groups / per]; nullptr: none
  bool half = false;
  const int8_t* codes = nullptr;  // [N, groups], or nullptr
  int64_t groups = 0;
  int64_t per = 1;
  float multiplier = 1.0f;

  explicit operator bool() const { return base != nullptr; }

  float base_at(int64_t i) const {
    return multiplier * (half ? _cvtsh_ss(static_cast<const uint16_t*>(base)[i])
                              : static_cast<const float*>(base)[i]);
  }

  // Row n's `groups` values into dst (defined below, after load_i8).
  void decode(int64_t n, float* dst) const;
};

struct QuantWeight {
  int64_t bits;
  int64_t group;
  int64_t k_pad;
  int64_t row_bytes;
  int64_t row_groups;
  const uint8_t* q;
  Factors scales;
  Factors mins;  // empty: no offsets
};

constexpr int64_t kLanes32 = kStep / 4;  // int32 lanes per vector

// Columns one vector step of codes covers: 4-bit codes are two to a byte.
constexpr int64_t step_cols(int64_t bits) { return bits == 4 ? 2 * kStep : kStep; }

// One step of one output row, ready for the dot products. 4 bits: `q` holds the
// low nibbles (columns 0-15 of each 32-column block of the step) and `hi` the
// high ones (columns 16-31), both u8 0..15; 8 bits: `q` the s8 codes and, with
// VNNI, `init` each lane's accumulator start -128 * sum(q). `ws`: the weight
// scale of each int32 lane.
struct Step {
  ivec_t q;
  ivec_t hi;
  ivec_t init;
  fvec_t ws;
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline ivec_t load_i(const void* p) { return _mm512_loadu_si512(p); }
inline void store_i(void* p, ivec_t v) { _mm512_storeu_si512(p, v); }
inline fvec_t load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, fvec_t v) { _mm512_storeu_ps(p, v); }
inline fvec_t zero_f() { return _mm512_setzero_ps(); }
inline ivec_t zero_i() { return _mm512_setzero_si512(); }
inline fvec_t to_float(ivec_t v) { return _mm512_cvtepi32_ps(v); }
inline fvec_t fma(fvec_t a, fvec_t b, fvec_t c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec_t mul(fvec_t a, fvec_t b) { return _mm512_mul_ps(a, b); }
inline float hsum(fvec_t v) { return _mm512_reduce_add_ps(v); }
inline ivec_t dpbusd(ivec_t acc, ivec_t u, ivec_t s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline ivec_t low_nibbles(ivec_t v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline ivec_t high_nibbles(ivec_t v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
}
inline ivec_t minus_128_sums(ivec_t q) {
  return _mm512_sub_epi32(zero_i(), dpbusd(zero_i(), _mm512_set1_epi8(-128), q));
}

// The row's code bytes at p, `avail` of which belong to it (zeros past them).
inline ivec_t load_codes(const uint8_t* p, int64_t avail) {
  if (avail >= kStep) return load_i(p);
  return _mm512_maskz_loadu_epi8((1ull << avail) - 1, p);
}

// Runs of `per` lanes (4 or 8) of the floats at p: lane l gets p[l / per].
inline fvec_t spread(const float* p, int64_t per) {
  const ivec_t lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const ivec_t idx = per == 8 ? _mm512_srli_epi32(lane, 3) : _mm512_srli_epi32(lane, 2);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(p)));
}

inline ivec_t dot8(const Step& s, ivec_t x) { return dpbusd(s.init, x, s.q); }

#else
inline ivec_t load_i(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline void store_i(void* p, ivec_t v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline fvec_t load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, fvec_t v) { _mm256_storeu_ps(p, v); }
inline fvec_t zero_f() { return _mm256_setzero_ps(); }
inline ivec_t zero_i() { return _mm256_setzero_si256(); }
inline fvec_t to_float(ivec_t v) { return _mm256_cvtepi32_ps(v); }
inline fvec_t fma(fvec_t a, fvec_t b, fvec_t c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec_t mul(fvec_t a, fvec_t b) { return _mm256_mul_ps(a, b); }
inline float hsum(fvec_t v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline ivec_t dpbusd(ivec_t acc, ivec_t u, ivec_t s) {
#if TL_VNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline ivec_t low_nibbles(ivec_t v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline ivec_t high_nibbles(ivec_t v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
}
inline ivec_t minus_128_sums(ivec_t q) {
#if TL_VNNI
  return _mm256_sub_epi32(zero_i(), dpbusd(zero_i(), _mm256_set1_epi8(-128), q));
#else
  (void)q;
  return zero_i();
#endif
}

inline ivec_t load_codes(const uint8_t* p, int64_t avail) {
  if (avail >= kStep) return load_i(p);
  alignas(32) uint8_t tail[kStep] = {};
  std::memcpy(tail, p, avail);
  return load_i(tail);
}

inline fvec_t spread(const float* p, int64_t per) {
  return per == 8 ? _mm256_set1_ps(p[0]) : _mm256_set_m128(_mm_set1_ps(p[1]), _mm_set1_ps(p[0]));
}

inline ivec_t dot8(const Step& s, ivec_t x) {
#if TL_VNNI
  return dpbusd(s.init, x, s.q);
#else
  // Pairs of u8 (xq + 128) * s8 would saturate maddubs's int16; |q| * sign(xq, q) cannot.
  return dpbusd(s.init, _mm256_abs_epi8(s.q), _mm256_sign_epi8(x, s.q));
#endif
}
#endif

// Columns [c0, c0 + step_cols) of row n, whose decoded scales are `scales` (read
// past the row's groups: the buffer is zero-padded); codes past K_pad are zero.
template <int Bits>
inline Step unpack_step(const QuantWeight& w, int64_t n, int64_t c0, const float* scales) {
  const int64_t offset = c0 * Bits / 8;
  const ivec_t raw = load_codes(w.q + n * w.row_bytes + offset, w.row_bytes - offset);
  Step s;
  if (Bits == 4) {
    s.q = low_nibbles(raw);
    s.hi = high_nibbles(raw);
    s.init = zero_i();
  } else {
    s.q = raw;
    s.hi = zero_i();
    s.init = minus_128_sums(raw);
  }
  // A 4-bit lane holds columns of one 32-column block; an 8-bit lane 4 columns.
  s.ws = spread(scales + c0 / w.group, Bits == 4 ? 4 : w.group / 4);
  return s;
}

// The int32 lanes of one step's dot products against activations x (laid out
// as the step's bytes, see quantize_acts).
template <int Bits>
inline ivec_t dot(const Step& s, const int8_t* x) {
  if (Bits == 4) return dpbusd(dpbusd(zero_i(), s.q, load_i(x)), s.hi, load_i(x + kStep));
  return dot8(s, load_i(x));
}

// 8-bit weights with VNNI take activations as u8 = xq + 128 (xq ^ 0x80).
constexpr bool kUnsignedX8 = TL_VNNI;

// Quantized activations, each row in the byte order of the weight steps and
// padded with zeros to whole steps: for 8-bit weights the columns in order, for
// 4-bit ones per step the low-nibble columns (0-15 of each block) and then the
// high-nibble ones. Each int32 lane's 4 (or 4 + 4) columns share a scale with
// the lane beside them for 8 bits; for 4 bits the lane's 8 columns have it.
struct QuantActs {
  int64_t k_cols;                   // columns per row, whole steps
  int64_t lanes;                    // int32 lanes per row
  std::unique_ptr<int8_t[]> q;      // [M, k_cols] xq (or xq ^ 0x80 for 8-bit VNNI)
  std::unique_ptr<float[]> scales;  // [M, lanes] xs of each lane
  int64_t sum_stride;               // x_sums' row length: the groups, zero-padded to vectors
  // Row length of a buffer of decoded weight scales: the groups of k_cols and
  // the floats spread() reads past a step's first group, zero-padded.
  int64_t scale_stride;
  std::unique_ptr<float[]> x_sums;  // [M, sum_stride]: sum(xs * xq) per weight group (mins)
};

QuantActs quantize_acts(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                        const QuantWeight& w) {
  QuantActs a;
  const int64_t step = step_cols(w.bits);
  a.k_cols = (w.k_pad + step - 1) / step * step;
  a.lanes = a.k_cols / step * kLanes32;
  a.q.reset(new int8_t[rows * a.k_cols]);
  a.scales.reset(new float[rows * a.lanes]);
  a.sum_stride = (w.row_groups + kLanes32 - 1) / kLanes32 * kLanes32;
  a.scale_stride = a.k_cols / w.group + 4;
  if (w.mins) a.x_sums.reset(new float[rows * a.sum_stride]());
  const int8_t flip = (w.bits == 8 && kUnsignedX8) ? int8_t(-128) : int8_t(0);
  const vec magic = vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to nearest even
  // Columns quantized together: a 4-bit block (its two halves side by side), or
  // 16 columns for 8 bits. Either way lane i of the 16 floats' four lanes has
  // the scale of float lanes 4i..4i+3.
  const int64_t unit = w.bits == 4 ? kBlock : kLanes;
  const int64_t halves = unit / kLanes;
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = x + m * x_stride;
    int8_t* qr = a.q.get() + m * a.k_cols;
    float* xs = a.scales.get() + m * a.lanes;
    for (int64_t c0 = 0; c0 < a.k_cols; c0 += unit) {
      float chunk[kBlock] = {};
      if (c0 < cols) std::copy(xr + c0, xr + std::min(c0 + unit, cols), chunk);
      const vec part[2] = {load(chunk), load(chunk + kLanes)};
      float amax[kLanes] = {};
      for (int64_t h = 0; h < halves; ++h) {
        for (int64_t l = 0; l < kLanes; ++l) amax[l] = std::max(amax[l], std::fabs(part[h][l]));
      }
      // kActGroup columns per scale: 4 float lanes of both halves for 4 bits.
      const int64_t run = kActGroup / halves;
      vec d{}, divisor{};
      for (int64_t r0 = 0; r0 < kLanes; r0 += run) {
        const float scale = *std::max_element(amax + r0, amax + r0 + run) / 127.0f;
        for (int64_t l = r0; l < r0 + run; ++l) {
          d[l] = scale;
          divisor[l] = scale > 0.0f ? scale : 1.0f;  // an all-zero run stays zero
        }
      }
      const int64_t in_step = c0 % step;
      const int64_t first_lane = (c0 - in_step) / step * kLanes32;
      float sum = 0.0f;  // of xs * xq over these columns, for the min term
      for (int64_t h = 0; h < halves; ++h) {
        const vec q = (part[h] / divisor + magic) - magic;
        // 4 bits: block b of the step goes to bytes 16b (low half) and kStep + 16b.
        const int64_t at = w.bits == 4 ? (c0 - in_step) + h * kStep + in_step / 2 : c0;
        for (int64_t l = 0; l < kLanes; ++l) {
          qr[at + l] = static_cast<int8_t>(static_cast<int32_t>(q[l])) ^ flip;
          sum += d[l] * q[l];
        }
      }
      const int64_t lane = first_lane + (w.bits == 4 ? in_step / 8 : in_step / 4);
      for (int64_t i = 0; i < 4; ++i) xs[lane + i] = d[4 * i];
      if (w.mins && c0 < w.k_pad) a.x_sums[m * a.sum_stride + c0 / w.group] += sum;
    }
  }
  return a;
}

// kSpan output rows' steps unpacked once, for many activation rows; laid out as
// the activations are.
struct RowBuffer {
  int64_t k_cols;
  int64_t lanes;
  std::unique_ptr<int8_t[]> codes;      // [kSpan, k_cols]
  std::unique_ptr<float[]> lane_s;      // [kSpan, lanes]
  std::unique_ptr<int32_t[]> init;      // [kSpan, lanes] (8 bits)
  std::unique_ptr<float[]> row_scales;  // one row's while it is unpacked, zero-padded

  RowBuffer(const QuantActs& a, const QuantWeight& w)
      : k_cols(a.k_cols),
        lanes(a.lanes),
        codes(new int8_t[kSpan * a.k_cols]),
        lane_s(new float[kSpan * a.lanes]),
        init(new int32_t[kSpan * a.lanes]),
        row_scales(new float[a.scale_stride]()) {}

  template <int Bits>
  void fill(const QuantWeight& w, int64_t row, int64_t n) {
    w.scales.decode(n, row_scales.get());
    for (int64_t c = 0, lane = 0; c < w.k_pad; c += step_cols(Bits), lane += kLanes32) {
      const Step s = unpack_step<Bits>(w, n, c, row_scales.get());
      int8_t* dst = codes.get() + row * k_cols + c;
      store_i(dst, s.q);
      if (Bits == 4) store_i(dst + kStep, s.hi);
      store_f(lane_s.get() + row * lanes + lane, s.ws);
      if (Bits == 8) store_i(init.get() + row * lanes + lane, s.init);
    }
  }

  template <int Bits>
  Step get(int64_t row, int64_t c) const {
    const int8_t* q = codes.get() + row * k_cols + c;
    const int64_t at = row * lanes + c / step_cols(Bits) * kLanes32;
    return Step{load_i(q), Bits == 4 ? load_i(q + kStep) : zero_i(),
                Bits == 8 ? load_i(init.get() + at) : zero_i(), load_f(lane_s.get() + at)};
  }
};

// Steps unpacked straight from the weights of kRowBlock output rows from n0, for
// few activation rows; their scales decoded into a zero-padded per-thread buffer.
struct Direct {
  const QuantWeight& w;
  int64_t n0;
  const float* row_scales;  // [kRowBlock, stride]
  int64_t stride;

  template <int Bits>
  Step get(int64_t row, int64_t c) const {
    const uint8_t* ahead = w.q + (n0 + row + kPrefetchRows) * w.row_bytes + c * Bits / 8;
    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    return unpack_step<Bits>(w, n0 + row, c, row_scales + row * stride);
  }
};

// out[m, n0 + j] for j < count and activation rows [m0, m0 + Rows); `src` gives
// the steps of its row `r0 + j` (rows past `count` repeat the last one). With
// `mins` (the tile's decoded mins, [kRowBlock, a.sum_stride], zero-padded) the
// min term joins the accumulators before their sum.
template <int Bits, int Rows, typename Source>
void dot_tile(const Source& src, int64_t r0, const QuantActs& a, int64_t m0, int64_t n0,
              int64_t count, int64_t n_out, const QuantWeight& w, const float* mins,
              float* out) {
  fvec_t acc[kRowBlock][Rows];
  for (auto& row : acc)
    for (auto& v : row) v = zero_f();
  for (int64_t c = 0, lane = 0; c < w.k_pad; c += step_cols(Bits), lane += kLanes32) {
    Step s[kRowBlock];
    for (int64_t j = 0; j < kRowBlock; ++j) {
      s[j] = src.template get<Bits>(r0 + std::min(j, count - 1), c);
    }
    for (int r = 0; r < Rows; ++r) {
      const int8_t* x = a.q.get() + (m0 + r) * a.k_cols + c;
      const fvec_t xs = load_f(a.scales.get() + (m0 + r) * a.lanes + lane);
      for (int64_t j = 0; j < kRowBlock; ++j) {
        acc[j][r] = fma(to_float(dot<Bits>(s[j], x)), mul(s[j].ws, xs), acc[j][r]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int64_t j = 0; j < count; ++j) {
      if (mins) {
        const float* m = mins + j * a.sum_stride;
        const float* s = a.x_sums.get() + (m0 + r) * a.sum_stride;
        for (int64_t g = 0; g < a.sum_stride; g += kLanes32) {
          acc[j][r] = fma(load_f(m + g), load_f(s + g), acc[j][r]);
        }
      }
      out[(m0 + r) * n_out + n0 + j] = hsum(acc[j][r]);
    }
  }
}

// Activation rows [m0, m1) against output rows [n0, n0 + count) (count <= 4).
template <int Bits, typename Source>
void dot_rows(const Source& src, int64_t r0, const QuantActs& a, int64_t m0, int64_t m1,
              int64_t n0, int64_t count, int64_t n_out, const QuantWeight& w, const float* mins,
              float* out) {
  int64_t m = m0;
  for (; m + kActBlock <= m1; m += kActBlock) {
    dot_tile<Bits, kActBlock>(src, r0, a, m, n0, count, n_out, w, mins, out);
  }
  switch (m1 - m) {
    case 3: dot_tile<Bits, 3>(src, r0, a, m, n0, count, n_out, w, mins, out); break;
    case 2: dot_tile<Bits, 2>(src, r0, a, m, n0, count, n_out, w, mins, out); break;
    case 1: dot_tile<Bits, 1>(src, r0, a, m, n0, count, n_out, w, mins, out); break;
    default: break;
  }
}

// Up to kDirectRows activation rows: four output rows at a time, unpacked in
// registers, the min term per output. More: kSpan rows unpacked into a buffer and
// run against chunks of activation rows; the min term is left to the caller.
template <int Bits>
void run(const QuantWeight& w, const QuantActs& a, int64_t rows, int64_t n_out, float* out) {
  if (rows <= kDirectRows) {
    const int64_t blocks = (n_out + kRowBlock - 1) / kRowBlock;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      const FlushDenormals flush;
      const int64_t stride = a.scale_stride;
      std::unique_ptr<float[]> scales(new float[kRowBlock * stride]());
      std::unique_ptr<float[]> mins(w.mins ? new float[kRowBlock * a.sum_stride]() : nullptr);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * kRowBlock;
        const int64_t count = std::min(kRowBlock, n_out - n0);
        for (int64_t j = 0; j < count; ++j) {
          w.scales.decode(n0 + j, scales.get() + j * stride);
          if (mins) w.mins.decode(n0 + j, mins.get() + j * a.sum_stride);
        }
        const Direct direct{w, n0, scales.get(), stride};
        dot_rows<Bits>(direct, 0, a, 0, rows, n0, count, n_out, w, mins.get(), out);
      }
    });
    return;
  }
  const int64_t spans = (n_out + kSpan - 1) / kSpan;
  const int64_t chunk = std::max(kActBlock, kChunkBytes / a.k_cols / kActBlock * kActBlock);
  at::parallel_for(0, spans, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    RowBuffer buffer(a, w);
    for (int64_t span = begin; span < end; ++span) {
      const int64_t first = span * kSpan;
      const int64_t last = std::min(n_out, first + kSpan);
      for (int64_t n = first; n < last; ++n) buffer.fill<Bits>(w, n - first, n);
      for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
        for (int64_t n0 = first; n0 < last; n0 += kRowBlock) {
          const int64_t count = std::min(kRowBlock, last - n0);
          dot_rows<Bits>(buffer, n0 - first, a, m0, std::min(rows, m0 + chunk), n0, count, n_out,
                         w, nullptr, out);
        }
      }
    }
  });
}

// Tiles of dequantized rows (tiled_gemm) use the helpers below.
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));

// Byte lanes to floats through 32-bit integers: a direct conversion compiles
// to one scalar conversion per lane.
inline vec bytes_to_float(u8x16 bytes) {
  return __builtin_convertvector(__builtin_convertvector(bytes, ivec), vec);
}

// Sixteen int8 codes to floats by sign-extending loads (GCC's generic
// conversion of signed bytes is scalar).
inline vec load_i8(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  return reinterpret_cast<const vec&>(f);
#else
  const __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
  vec v;
  std::memcpy(&v, halves, sizeof(v));
  return v;
#endif
}

// Sixteen groups at a time where the bases repeat evenly over the vector (per 16:
// Q6_K; per 8: Q4_K/Q5_K), so a batch-1 row does not pay a scalar multiply per
// group; other forms and the tail go one group at a time.
void Factors::decode(int64_t n, float* dst) const {
  int64_t g = 0;
  if (codes) {
    const int64_t bases = groups / per;
    const int8_t* c = codes + n * groups;
    if (per % kLanes == 0) {
      for (; g + kLanes <= groups; g += kLanes) {
        store(dst + g, load_i8(c + g) * base_at(n * bases + g / per));
      }
    } else if (per == kLanes / 2) {
      const ivec high = ivec{8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0} == 0;
      for (; g + kLanes <= groups; g += kLanes) {
        const float lo = base_at(n * bases + g / per), hi = base_at(n * bases + g / per + 1);
        store(dst + g, load_i8(c + g) * (high ? vec{} + hi : vec{} + lo));
      }
    }
    for (; g < groups; ++g) dst[g] = base_at(n * bases + g / per) * static_cast<float>(c[g]);
  } else if (half) {
    const uint16_t* h = static_cast<const uint16_t*>(base) + n * groups;
    const __m256 m = _mm256_set1_ps(multiplier);
    for (; g + 8 <= groups; g += 8) {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + g));
      _mm256_storeu_ps(dst + g, _mm256_mul_ps(_mm256_cvtph_ps(bits), m));
    }
    for (; g < groups; ++g) dst[g] = base_at(n * groups + g);
  } else {
    const float* f = static_cast<const float*>(base) + n * groups;
    for (; g < groups; ++g) dst[g] = multiplier * f[g];
  }
}

// Row n into dst, given its decoded scales `s` and mins `m` (nullptr: none).
void dequant_row(const QuantWeight& w, int64_t n, const float* s, const float* m, float* dst) {
  const uint8_t* row = w.q + n * w.row_bytes;
  if (w.bits == 4) {
    for (int64_t b = 0; b < w.k_pad / kBlock; ++b) {
      const u8x16 bytes = *reinterpret_cast<const u8x16*>(row + 16 * b);
      const float offset = m ? m[b] : 0.0f;
      store(dst + 32 * b, bytes_to_float(bytes & 15) * s[b] + offset);
      store(dst + 32 * b + 16, bytes_to_float(bytes >> 4) * s[b] + offset);
    }
    return;
  }
  const int8_t* codes = reinterpret_cast<const int8_t*>(row);
  for (int64_t g = 0; g < w.k_pad / w.group; ++g) {
    const float offset = m ? m[g] : 0.0f;
    for (int64_t c = g * w.group; c < (g + 1) * w.group; c += kLanes) {
      store(dst + c, load_i8(codes + c) * s[g] + offset);
    }
  }
}

// Per-thread buffers for one row's decoded scales and mins.
struct RowFactors {
  std::unique_ptr<float[]> scales, mins;

  explicit RowFactors(const QuantWeight& w)
      : scales(new float[w.row_groups]), mins(w.mins ? new float[w.row_groups] : nullptr) {}

  void dequant(const QuantWeight& w, int64_t n, float* dst) {
    w.scales.decode(n, scales.get());
    if (mins) w.mins.decode(n, mins.get());
    dequant_row(w, n, scales.get(), mins.get(), dst);
  }
};

// From kGemmRows activation rows up (prefill, large decode batches), dequantizing
// tiles of output rows into float32 and handing each to at::mm beats the integer
// kernel: a tile's dequantization is spread over many rows and MKL's sgemm runs at
// about twice our int8 throughput at these sizes (benchmarks/quant_kernels.py).
// Tiles of up to kTileRows rows stay in cache; small matrices get smaller tiles,
// so that every thread has two or more.
constexpr int64_t kGemmRows = 32;
constexpr int64_t kTileRows = 256;

void tiled_gemm(const QuantWeight& w, const at::Tensor& xp, int64_t n_out, float* out) {
  const int64_t rows = xp.size(0);
  const int64_t k_pad = w.k_pad;
  const int64_t per_thread = (n_out + 2 * at::get_num_threads() - 1) / (2 * at::get_num_threads());
  const int64_t tile_rows = std::clamp<int64_t>((per_thread + 15) / 16 * 16, 16, kTileRows);
  at::parallel_for(0, (n_out + tile_rows - 1) / tile_rows, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    at::Tensor tile = at::empty({tile_rows, k_pad}, xp.options());
    float* tile_ptr = tile.data_ptr<float>();
    RowFactors factors(w);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_rows;
      const int64_t count = std::min(tile_rows, n_out - n0);
      for (int64_t j = 0; j < count; ++j) factors.dequant(w, n0 + j, tile_ptr + j * k_pad);
      // Copied by hand: worker threads do not run in the caller's inference mode,
      // so ATen may not write to `out` there.
      const at::Tensor part = at::mm(xp, tile.narrow(0, 0, count).t()).contiguous();
      const float* part_ptr = part.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r) {
        std::copy(part_ptr + r * count, part_ptr + (r + 1) * count, out + r * n_out + n0);
      }
    }
  });
}

// Factors from their tensors (see formats.py's GroupFactors).
Factors factors(const std::optional<at::Tensor>& base, const std::optional<at::Tensor>& codes,
                int64_t rows, int64_t groups, const char* name, double multiplier = 1.0) {
  Factors f;
  f.multiplier = static_cast<float>(multiplier);
  if (!base.has_value()) {
    TORCH_CHECK(!codes.has_value(), name, " codes without a base");
    return f;
  }
  TORCH_CHECK(base->is_contiguous() && base->dim() == 2 && base->size(0) == rows, name,
              " base must be contiguous [N, groups / per]");
  TORCH_CHECK(base->scalar_type() == at::kHalf || base->scalar_type() == at::kFloat, name,
              " base must be float16 or float32");
  f.base = base->data_ptr();
  f.half = base->scalar_type() == at::kHalf;
  f.groups = groups;
  if (codes.has_value()) {
    TORCH_CHECK(codes->is_contiguous() && codes->scalar_type() == at::kChar &&
                    codes->size(0) == rows && codes->size(1) == groups,
                name, " codes must be int8 [N, groups]");
    TORCH_CHECK(groups % base->size(1) == 0, name, " base must divide the groups evenly");
    f.codes = codes->data_ptr<int8_t>();
    f.per = groups / base->size(1);
  } else {
    TORCH_CHECK(base->size(1) == groups, name, " base must be [N, groups] without codes");
  }
  return f;
}

// The output is allocated here: an `out` argument made each batch-1 call
// (about 120 a step) a microsecond slower, with the Python that makes it.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight,
                        const at::Tensor& scale_base, const std::optional<at::Tensor>& scale_codes,
                        const std::optional<at::Tensor>& min_base,
                        const std::optional<at::Tensor>& min_codes, double min_multiplier,
                        int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  const FlushDenormals flush;
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(group == 32 || (bits == 8 && group == 16),
              "group must be 32, or 16 for 8-bit codes");
  TORCH_CHECK(qweight.is_contiguous(), "weights must be contiguous");
  const int64_t rows = x.size(0);
  const int64_t n_out = qweight.size(0);
  const int64_t k_pad = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  TORCH_CHECK(k_pad % 32 == 0 && x.size(1) <= k_pad, "x has more columns than the weight");
  const int64_t groups = k_pad / group;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({rows, n_out}, x.options());
  const QuantWeight w{bits,
                      group,
                      k_pad,
                      qweight.size(1),
                      groups,
                      reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                      factors(scale_base, scale_codes, n_out, groups, "scale"),
                      factors(min_base, min_codes, n_out, groups, "min", min_multiplier)};
  if (rows >= kGemmRows) {
    at::Tensor xp = xc;
    if (x.size(1) != k_pad) {
      xp = at::zeros({rows, k_pad}, x.options());
      xp.narrow(1, 0, x.size(1)).copy_(x);
    }
    tiled_gemm(w, xp.contiguous(), n_out, out.data_ptr<float>());
    return out;
  }
  const QuantActs acts = quantize_acts(xc.data_ptr<float>(), rows, x.size(1), xc.stride(0), w);
  if (bits == 4) {
    run<4>(w, acts, rows, n_out, out.data_ptr<float>());
  } else {
    run<8>(w, acts, rows, n_out, out.data_ptr<float>());
  }
  // From kDirectRows + 1 rows the min term is a small float matmul, [M, groups] @
  // [groups, N], on the decoded mins (per output it cost more than the dot
  // products at the default model's K = 576 and 8 rows).
  if (w.mins && rows > kDirectRows) {
    at::Tensor mins = at::empty({n_out, groups}, x.options());
    float* mins_ptr = mins.data_ptr<float>();
    at::parallel_for(0, n_out, 256, [&](int64_t begin, int64_t end) {
      const FlushDenormals flush;
      for (int64_t n = begin; n < end; ++n) w.mins.decode(n, mins_ptr + n * groups);
    });
    out.addmm_(at::from_blob(acts.x_sums.get(), {rows, groups}, {acts.sum_stride, 1}, x.options()),
               mins.t());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenloom_quant, m) {
  m.def(
      "quant_linear(Tensor x, Tensor qweight, Tensor scale_base, Tensor? scale_codes, "
      "Tensor? min_base, Tensor? min_codes, float min_multiplier, int bits, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_quant, CPU, m) { m.impl("quant_linear", &quant_linear); }

}  // namespace tokenloom
