// y = x @ dequant(W).T for weights kept quantized in memory, with int8
// activations and integer dot products, as llama.cpp does.
//
// Weights arrive in panels.py's layout: output rows in panels of 16, and
// within a panel, per 4-byte word of a row, the 16 rows' words side by side
// (qweight [panels, words, 16, 4]); scales and mins likewise [panels, groups,
// 16]. So one 64-byte load holds the same word of 16 rows, and the kernel
// computes outer products: each int32 lane is one output row, every activation
// row's word is broadcast against it, and no lane ever needs a horizontal sum.
// (llama.cpp repacks Q4_0 the same way for its AVX-512 and ARM GEMMs.)
//   bits 4: a row's 16 bytes per 32 columns hold column j (low nibble) and
//           j + 16 (high nibble) in byte j; word t of a row thus holds columns
//           4i..4i+3 and 16+4i..16+4i+3 of block t / 4 (i = t % 4).
//   bits 6: word t of a row holds columns 8t..8t+3 (low nibbles) and
//           8t+4..8t+7 (high nibbles), the low four bits of their codes; the
//           top two lie in a plane of their own (qhigh [panels, words / 2, 16,
//           4]), whose word s holds them for words 2s and 2s + 1: byte j's bits
//           0-1, 2-3, 4-5 and 6-7 those of byte j's low nibble in word 2s, its
//           high nibble, and the same in word 2s + 1. Shifted to bits 4-5 of
//           each byte and or-ed in, they make every byte a 6-bit code.
//   bits 8: one int8 per column; words 2t and 2t + 1 are columns 8t..8t+7.
// w = scale * q + min, per group of 32 (or, 6 and 8 bits, 16) columns. Scales and mins
// arrive as the file keeps them (Factors): fp16 or fp32 per group, or an fp16
// base per super-block times an int8 code per group.
//
// Activations are quantized per row and per activation group of A = 8 or 16
// columns, A chosen per matrix (see panels.py's act_group): xs = max|x| *
// (1 / 127), xq = round(x * (127 / max|x|)), ties to even (a multiply by the
// inverse, as llama.cpp's; the exact product is rounded once, fused with the
// rounding constant). A group is A / 8 sub-units of 8 columns, sub-unit
// t the columns of word t for 4 and 6 bits and of words 2t, 2t + 1 for 8 bits.
// For each output row n, activation row m and weight group g, in this order,
//   gsum  = sum over groups a in g of float(dot(q[n, a], xq[m, a])) * xs[m, a]
//   y[m, n] += gsum * scale[n, g] + min[n, g] * sum over g's columns of xs * xq,
// i.e. exactly dequant(W) against the rounded activations. (The float x in the
// min term alone would be less accurate: Q4_1's codes and mins are far from
// centred.) The conversion and FMA
// of each group share Zen 4's two pipes with the two `vpdpbusd` of every
// sub-unit, so 16 columns take 5 of those slots where 8 take 3 each. Not per 32
// as llama.cpp's Q8_0: coarser groups move the greedy argmax further from the
// float model's.
//
// Every row count runs this one loop, each activation row with its own
// accumulators in the order above: a row's result does not depend on the
// batch beside it, nor on the thread count (a greedy answer must not change
// with the requests served beside it). The dot products are `vpdpbusd` (u8 x
// s8 -> s32) on AVX-512 VNNI or AVX-VNNI, or `vpmaddubsw` + `vpmaddwd` on AVX2,
// chosen at compile time: each variant of the library is built for one
// instruction set (tokenloom/ops/cpu_variants.py). Codes are the unsigned
// side: 4- and 6-bit codes as they are; signed 8-bit codes with VNNI as q + 128, the
// -128 * scale that adds joining the min term; without VNNI as |q| against
// sign(xq, q). Without AVX2 there is no variant, and quantization/kernels.py
// dequantizes instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "common/denormals.h"
#include "common/panel_schedule.h"
#include "common/row_ids.h"
#include "common/silu_product.h"
#include "common/team.h"
#include "common/vec.h"
#include "quantization/quant_matrix.h"

namespace tokenloom {
namespace {

constexpr int64_t kPanel = 16;     // output rows per panel (panels.py's PANEL)
constexpr int64_t kWordBytes = 4;  // bytes of one row per word
constexpr int64_t kBlock = 32;     // columns per 4-bit block and padding unit
constexpr int64_t kSubUnit = 8;    // activation columns per two dot products of a row
// How far ahead of its loads the kernel prefetches the weight stream. Batch-1
// decode reads each matrix once a step from L3 or DRAM, and the hardware
// prefetcher restarts at every 4 KB page, so the kernel requests the lines a
// page ahead itself.
constexpr int64_t kPrefetchBytes = 4096;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TL_VNNI 1
constexpr int64_t kRowsPerVec = 16;  // output rows (int32 lanes) per vector
constexpr int64_t kTileM = 8;        // activation rows per register tile
typedef __m512i ivec_t;
typedef __m512 fvec_t;
inline ivec_t load_i(const void* p) { return _mm512_loadu_si512(p); }
inline fvec_t zero_f() { return _mm512_setzero_ps(); }
inline fvec_t set1_f(float v) { return _mm512_set1_ps(v); }
inline ivec_t set1_i(int32_t v) { return _mm512_set1_epi32(v); }
inline fvec_t as_float(ivec_t v) { return _mm512_castsi512_ps(v); }
inline fvec_t sub(fvec_t a, fvec_t b) { return _mm512_sub_ps(a, b); }
inline fvec_t fma(fvec_t a, fvec_t b, fvec_t c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec_t mul(fvec_t a, fvec_t b) { return _mm512_mul_ps(a, b); }
inline ivec_t dpbusd(ivec_t acc, ivec_t u, ivec_t s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline ivec_t low_nibbles(ivec_t v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline ivec_t high_nibbles(ivec_t v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
}
inline ivec_t flip_sign_bits(ivec_t v) { return _mm512_xor_si512(v, _mm512_set1_epi8(-128)); }
template <int Shift>  // > 0: left
inline ivec_t shift16(ivec_t v) {
  if constexpr (Shift > 0) return _mm512_slli_epi16(v, Shift);
  if constexpr (Shift < 0) return _mm512_srli_epi16(v, -Shift);
  return v;
}
// nibbles | (high & 0x30) per byte, in one vpternlogd.
inline ivec_t with_top_bits(ivec_t nibbles, ivec_t high) {
  return _mm512_ternarylogic_epi32(nibbles, high, _mm512_set1_epi8(0x30), 0xF8);
}
inline fvec_t load_halfs(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline fvec_t load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline fvec_t load_i8_floats(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store_first(float* p, fvec_t v, int64_t count) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << count) - 1), v);
}
#elif defined(__AVX2__)
#if defined(__AVXVNNI__)
#define TL_VNNI 1
#else
#define TL_VNNI 0
#endif
constexpr int64_t kRowsPerVec = 8;
constexpr int64_t kTileM = 4;  // 16 ymm registers
typedef __m256i ivec_t;
typedef __m256 fvec_t;
inline ivec_t load_i(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline fvec_t zero_f() { return _mm256_setzero_ps(); }
inline fvec_t set1_f(float v) { return _mm256_set1_ps(v); }
inline ivec_t set1_i(int32_t v) { return _mm256_set1_epi32(v); }
inline fvec_t as_float(ivec_t v) { return _mm256_castsi256_ps(v); }
inline fvec_t sub(fvec_t a, fvec_t b) { return _mm256_sub_ps(a, b); }
inline fvec_t fma(fvec_t a, fvec_t b, fvec_t c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec_t mul(fvec_t a, fvec_t b) { return _mm256_mul_ps(a, b); }
inline ivec_t dpbusd(ivec_t acc, ivec_t u, ivec_t s) {
#if TL_VNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  // u8 x s8 pairs: 4- and 6-bit codes (at most 2 * 63 * 128) and |q| (below)
  // cannot saturate vpmaddubsw's int16.
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline ivec_t low_nibbles(ivec_t v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline ivec_t high_nibbles(ivec_t v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
}
inline ivec_t flip_sign_bits(ivec_t v) { return _mm256_xor_si256(v, _mm256_set1_epi8(-128)); }
template <int Shift>  // > 0: left
inline ivec_t shift16(ivec_t v) {
  if constexpr (Shift > 0) return _mm256_slli_epi16(v, Shift);
  if constexpr (Shift < 0) return _mm256_srli_epi16(v, -Shift);
  return v;
}
inline ivec_t with_top_bits(ivec_t nibbles, ivec_t high) {
  return _mm256_or_si256(nibbles, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
}
inline fvec_t load_halfs(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline fvec_t load_floats(const float* p) { return _mm256_loadu_ps(p); }
inline fvec_t load_i8_floats(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void store_first(float* p, fvec_t v, int64_t count) {
  alignas(32) float lanes[kRowsPerVec];
  _mm256_store_ps(lanes, v);
  std::copy(lanes, lanes + count, p);
}
#else
#error "the quantized kernel needs AVX2 (see tokenloom/ops/cpu_variants.py)"
#endif

// Signed 8-bit codes become the unsigned side as q + 128 with VNNI.
constexpr bool kShiftedCodes8 = TL_VNNI;

// Per-group scales or mins in panel order (panels.py's GroupFactors):
// value(n, g) = multiplier * base(n, g / per) * codes(n, g), or multiplier *
// base(n, g) without codes; base [panels, groups / per, 16], codes [panels,
// groups, 16].
struct Factors {
  const void* base = nullptr;  // float16 or float32; nullptr: none
  bool half = false;
  const int8_t* codes = nullptr;
  int64_t groups = 0;
  int64_t base_groups = 0;  // groups / per
  int64_t per = 1;
  int per_shift = 0;  // log2(per) when per is a power of two (as in every GGUF), else -1
  float multiplier = 1.0f;

  explicit operator bool() const { return base != nullptr; }

  // Group g of panel `panel`'s kRowsPerVec rows from row `lane` of it. Inlined,
  // and shifting where it can instead of dividing: it runs once per weight
  // group, where an out-of-line call with two int64 divisions would cost more
  // than the batch-1 dot products.
  __attribute__((always_inline)) fvec_t load(int64_t panel, int64_t lane, int64_t g) const {
    const int64_t base_group = per_shift >= 0 ? g >> per_shift : g / per;
    const int64_t at = (panel * base_groups + base_group) * kPanel + lane;
    const fvec_t b = mul(half ? load_halfs(static_cast<const uint16_t*>(base) + at)
                              : load_floats(static_cast<const float*>(base) + at),
                         set1_f(multiplier));
    if (codes == nullptr) return b;
    return mul(b, load_i8_floats(codes + (panel * groups + g) * kPanel + lane));
  }

  // Group g of one row (`lane` of panel `panel`) as one float, in the order
  // formats.py's GroupFactors.values computes it: base times the multiplier,
  // then times the code.
  float value(int64_t panel, int64_t lane, int64_t g) const {
    const int64_t at = (panel * base_groups + g / per) * kPanel + lane;
    float b = half ? static_cast<float>(c10::Half(static_cast<const uint16_t*>(base)[at],
                                                  c10::Half::from_bits()))
                   : static_cast<const float*>(base)[at];
    b *= multiplier;
    if (codes != nullptr) b *= static_cast<float>(codes[(panel * groups + g) * kPanel + lane]);
    return b;
  }
};

struct QuantWeight {
  int64_t bits;
  int64_t group;
  int64_t k_pad;
  int64_t words;  // per row
  int64_t groups;
  const uint8_t* q;
  const uint8_t* high;  // 6 bits: the top two bits' plane; else nullptr
  Factors scales;
  Factors mins;  // empty: no offsets
  // Q4_0's min (-8 d) and Q6_K's (-32 d sc) are a constant times the scale, on
  // the scale's own tensors: one multiply instead of loading them again.
  bool min_from_scale = false;
  float min_per_scale = 0.0f;

  // Whether the min term runs: mins, or the -128 of shifted 8-bit codes.
  bool min_term() const { return mins || (bits == 8 && kShiftedCodes8); }

  // Byte b of one row of a plane in panel order (qweight, or with half the
  // words the 6-bit top plane).
  static uint8_t row_byte(const uint8_t* plane, int64_t plane_words, int64_t panel,
                          int64_t lane, int64_t b) {
    return plane[((panel * plane_words + b / kWordBytes) * kPanel + lane) * kWordBytes +
                 b % kWordBytes];
  }

  // The code of column c of one row (layouts at the top of this file).
  int32_t code(int64_t panel, int64_t lane, int64_t c) const {
    if (bits == 8) return static_cast<int8_t>(row_byte(q, words, panel, lane, c));
    if (bits == 4) {
      const uint8_t byte = row_byte(q, words, panel, lane, c / kBlock * 16 + c % 16);
      return c % kBlock < 16 ? byte & 15 : byte >> 4;
    }
    const int64_t t = c / 8, j = c % 4, second_half = c % 8 / 4;
    const uint8_t byte = row_byte(q, words, panel, lane, t * kWordBytes + j);
    const uint8_t top = row_byte(high, words / 2, panel, lane, t / 2 * kWordBytes + j);
    const int32_t low = second_half ? byte >> 4 : byte & 15;
    return low | ((top >> (2 * (t % 2 * 2 + second_half))) & 3) << 4;
  }

  __attribute__((always_inline)) fvec_t load_mins(fvec_t scale, int64_t p, int64_t lane,
                                                  int64_t g) const {
    if (min_from_scale) return mul(scale, set1_f(min_per_scale));
    return mins ? mins.load(p, lane, g) : zero_f();
  }
};

typedef int8_t bvec __attribute__((vector_size(kLanes)));

inline vec abs(vec v) { return as_vec(as_ivec(v) & 0x7fffffff); }

// Each lane's maximum over its run of Run (4, 8 or 16) lanes.
template <int Run>
vec run_max(vec v) {
  static_assert(Run == 4 || Run == 8 || Run == 16);
  v = max(v, swap_lanes<1>(v));
  v = max(v, swap_lanes<2>(v));
  if (Run >= 8) v = max(v, swap_lanes<4>(v));
  if (Run == 16) v = max(v, swap_lanes<8>(v));
  return v;
}

// The lanes of q, whole numbers of at most 127 in magnitude, as bytes.
inline bvec to_bytes(vec q) {
#if defined(__AVX512F__)
  return __builtin_convertvector(to_ivec(q), bvec);
#else
  const ivec whole = to_ivec(q);
  // packs work within 128-bit halves: lanes 0-3, 8-11, 4-7, 12-15 as 16-bit
  // words, put in order by the 64-bit permute.
  const __m256i words = _mm256_permute4x64_epi64(
      _mm256_packs_epi32(reinterpret_cast<__m256i>(whole.lo), reinterpret_cast<__m256i>(whole.hi)),
      0xd8);
  return reinterpret_cast<bvec>(
      _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
#endif
}

// The activations, quantized: per tile of kTileM rows and activation group,
// the tile's rows side by side (one pointer walks a tile), each the
// act_group / 4 int32 words its group meets and its scale; per row and weight
// group, sum(xs * xq) for the min term. The last tile's rows lie side by side
// as densely: with fewer rows than kTileM (a decode step), a row's words fill
// whole lines instead of one group's words in every 64 bytes, and a batch-1
// matmul streaming its weights from DRAM no longer shares the core's line
// fills with L2 reads of mostly unused activation lines.
struct QuantActs {
  int64_t act_group;  // columns per scale: 8 or 16
  int64_t act_words;  // int32 words per row and group: act_group / 4
  int64_t act_groups;
  int64_t groups;
  int64_t rows;
  std::unique_ptr<int32_t[]> words;  // [tiles, act_groups, tile_rows(tile), act_words]
  std::unique_ptr<float[]> scales;   // [tiles, act_groups, tile_rows(tile)]
  std::unique_ptr<float[]> sums;     // [rows, groups], or empty

  QuantActs(const float* x, int64_t rows, int64_t cols, int64_t x_stride, const QuantWeight& w,
            int64_t act_group)
      : act_group(act_group),
        act_words(act_group / 4),
        act_groups(w.k_pad / act_group),
        groups(w.groups),
        rows(rows) {
    const int64_t tiles = (rows + kTileM - 1) / kTileM;
    // Not zeroed: quantize_row writes every word and scale a tile's rows use.
    words.reset(new int32_t[tiles * act_groups * kTileM * act_words]);
    scales.reset(new float[tiles * act_groups * kTileM]);
    if (w.min_term()) sums.reset(new float[rows * groups]);
    parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const float* row = x + m * x_stride;
        if (w.bits == 4 && act_group == 8) {
          quantize_row<2, 8>(row, cols, m, w);
        } else if (w.bits == 4) {
          quantize_row<2, 16>(row, cols, m, w);
        } else if (act_group == 8) {
          quantize_row<1, 8>(row, cols, m, w);
        } else {
          quantize_row<1, 16>(row, cols, m, w);
        }
      }
    });
  }

  // Rows in tile `tile`: kTileM, fewer in the last.
  int64_t tile_rows(int64_t tile) const { return std::min(kTileM, rows - tile * kTileM); }

  // Row m: 32 columns at a time for 4 bits (Halves = 2: both halves of a block
  // side by side, so a group of Group columns is float lanes Group / 2 * i ..
  // of each half), 16 for 6 and 8 bits (Halves = 1: Group consecutive lanes).
  // Vectorised: scalar, it would be a large share of a prompt's matmul. Members
  // are copied to locals first: the code stores would otherwise make the
  // compiler reload them after every store.
  template <int Halves, int Group>
  void quantize_row(const float* x, int64_t cols, int64_t m, const QuantWeight& w) {
    constexpr int64_t unit = Halves * kLanes;
    constexpr int Run = Group / Halves;                // float lanes per activation group
    constexpr int64_t groups_per_unit = kLanes / Run;  // activation groups per unit
    constexpr int64_t group_bytes = Group;             // codes of one activation group
    const int64_t tile = m / kTileM, r = m % kTileM;
    const int64_t stride = tile_rows(tile);
    const int64_t word_step = stride * act_words;  // words from one group of this row to the next
    int32_t* const row_words = words.get() + (tile * act_groups * kTileM + r) * act_words;
    float* const row_scales = scales.get() + tile * act_groups * kTileM + r;
    float* const row_sums = sums ? sums.get() + m * groups : nullptr;
    const int64_t units_per_group = w.group / unit;  // a weight group is whole units
    const int64_t k_pad = w.k_pad;
    const vec magic = vec{} + kRoundingMagic;
    vec group_sum{};  // of xs * xq over the weight group so far, for the min term
    int64_t first = 0, weight_group = 0, in_group = 0;
    for (int64_t c0 = 0; c0 < k_pad; c0 += unit, first += groups_per_unit) {
      float chunk[unit];  // the last, zero-padded columns
      const float* src = x + c0;
      if (c0 + unit > cols) {
        const int64_t have = std::max<int64_t>(0, cols - c0);
        std::fill(std::copy(x + c0, x + c0 + have, chunk), chunk + unit, 0.0f);
        src = chunk;
      }
      vec part[Halves];
      vec amax{};
      for (int h = 0; h < Halves; ++h) {
        part[h] = load(src + h * kLanes);
        amax = max(amax, abs(part[h]));
      }
      // One division for the unit's inverses, where dividing x by the scale
      // would take one more per 16 columns.
      const vec peak = run_max<Run>(amax);
      const vec d = peak * (1.0f / 127.0f);
      const vec inverse = select(peak > 0.0f, 127.0f / peak, vec{});  // an all-zero group stays zero
      bvec q8[Halves];
      for (int h = 0; h < Halves; ++h) {
        const vec q = (part[h] * inverse + magic) - magic;
        q8[h] = to_bytes(q);
        group_sum += d * q;
      }
      // The group's codes in the order its words hold them: for 4 bits, per
      // sub-unit its four low-half columns, then its four high-half ones.
      alignas(16) int8_t codes[unit];
      if constexpr (Halves == 2) {
        typedef int32_t dwords __attribute__((vector_size(16)));
        const dwords lo = reinterpret_cast<const dwords&>(q8[0]);
        const dwords hi = reinterpret_cast<const dwords&>(q8[1]);
        const dwords a = __builtin_shuffle(lo, hi, dwords{0, 4, 1, 5});
        const dwords b = __builtin_shuffle(lo, hi, dwords{2, 6, 3, 7});
        std::memcpy(codes, &a, 16);
        std::memcpy(codes + 16, &b, 16);
      } else {
        std::memcpy(codes, q8, unit);
      }
      for (int64_t i = 0; i < groups_per_unit; ++i) {
        std::memcpy(row_words + (first + i) * word_step, codes + group_bytes * i, group_bytes);
        row_scales[(first + i) * stride] = d[Run * i];
      }
      if (row_sums && ++in_group == units_per_group) {
        row_sums[weight_group++] = lane_sum(group_sum);
        group_sum = vec{};
        in_group = 0;
      }
    }
  }
};

// dot plus one sub-unit's products: the codes `first` and `second` (its four
// low-nibble and four high-nibble columns, or for 8 bits its two words) against
// one activation row's two words of the same columns.
template <int Bits>
__attribute__((always_inline)) inline ivec_t sub_unit_dot(ivec_t dot, ivec_t first, ivec_t second,
                                                          int32_t word0, int32_t word1) {
  const ivec_t x0 = set1_i(word0), x1 = set1_i(word1);
#if !TL_VNNI
  if (Bits == 8) {
    return dpbusd(dpbusd(dot, _mm256_abs_epi8(first), _mm256_sign_epi8(x0, first)),
                  _mm256_abs_epi8(second), _mm256_sign_epi8(x1, second));
  }
#endif
  return dpbusd(dpbusd(dot, first, x0), second, x1);
}

// dst[r * dst_stride + j] for r < MR, j < count: the kRowsPerVec rows at
// `lane` of panel p against the activation tile from row m0 (a multiple of
// kTileM), whose MR rows lie side by side, with activation groups of AG columns.
// Not inlined: inlined into panel_gemm, it slows the 16-column loop.
template <int Bits, int MR, int AG>
__attribute__((noinline)) void panel_tile(const QuantWeight& w, const QuantActs& a, int64_t p,
                                          int64_t lane, int64_t m0, float* dst,
                                          int64_t dst_stride, int64_t count) {
  constexpr int64_t act_words = AG / 4;
  const int64_t pairs_per_group = w.group / (2 * kSubUnit);
  const int64_t word_step = kPanel * kWordBytes;  // one word of the panel's 16 rows
  const uint8_t* q = w.q + p * w.words * word_step + lane * kWordBytes;
  const uint8_t* high =
      Bits == 6 ? w.high + p * (w.words / 2) * word_step + lane * kWordBytes : nullptr;
  const int64_t tile = m0 / kTileM;
  const int32_t* words = a.words.get() + tile * a.act_groups * kTileM * act_words;
  const float* xs = a.scales.get() + tile * a.act_groups * kTileM;
  // Each group's dot product starts from the bits of kRoundingMagic: the
  // integer sum then lands in the mantissa, and subtracting the magic gives it
  // as a float, exactly (|sum| < 2^22). vcvtdq2ps would do the same on the port
  // that also runs every vpdpbusd; the subtraction can run on another.
  const ivec_t biased = set1_i(__builtin_bit_cast(int32_t, kRoundingMagic));
  const fvec_t bias = set1_f(kRoundingMagic);
  fvec_t acc[MR];
  for (auto& v : acc) v = zero_f();
  // Every weight has a group (checked where it is made): unless told, GCC
  // keeps the accumulators' zero in memory for a loop that never runs.
  if (w.groups <= 0) __builtin_unreachable();
  for (int64_t g = 0; g < w.groups; ++g) {
    fvec_t gsum[MR];
    for (auto& v : gsum) v = zero_f();
    // Sub-units in pairs (16 columns; a group has one or two): the 6-bit
    // plane's word serves both.
    for (int64_t pair = g * pairs_per_group; pair < (g + 1) * pairs_per_group; ++pair) {
      ivec_t high_pair{};
      if (Bits == 6) {
        high_pair = load_i(high + pair * word_step);
        const uint8_t* high_ahead = high + pair * word_step + kPrefetchBytes / 2;
        _mm_prefetch(reinterpret_cast<const char*>(high_ahead), _MM_HINT_T0);
      }
      ivec_t first[2], second[2];
#pragma GCC unroll 2
      for (int odd = 0; odd < 2; ++odd) {
        const int64_t t = 2 * pair + odd;
        // A panel's words are contiguous, and the next panel follows: ahead of
        // the last words lie the next panel's first (a prefetch never faults).
        const uint8_t* ahead = q + t * word_step * (Bits == 8 ? 2 : 1) + kPrefetchBytes;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
        if (Bits == 8) _mm_prefetch(reinterpret_cast<const char*>(ahead + word_step), _MM_HINT_T0);
        if (Bits != 8) {
          const ivec_t v = load_i(q + t * word_step);
          first[odd] = low_nibbles(v);
          second[odd] = high_nibbles(v);
          if (Bits == 6 && odd == 0) {
            first[odd] = with_top_bits(first[odd], shift16<4>(high_pair));
            second[odd] = with_top_bits(second[odd], shift16<2>(high_pair));
          } else if (Bits == 6) {
            first[odd] = with_top_bits(first[odd], high_pair);
            second[odd] = with_top_bits(second[odd], shift16<-2>(high_pair));
          }
        } else {
          first[odd] = load_i(q + 2 * t * word_step);
          second[odd] = load_i(q + (2 * t + 1) * word_step);
          if (kShiftedCodes8) {
            first[odd] = flip_sign_bits(first[odd]);
            second[odd] = flip_sign_bits(second[odd]);
          }
        }
      }
      if constexpr (AG == 8) {  // a group per sub-unit
#pragma GCC unroll 2
        for (int odd = 0; odd < 2; ++odd) {
          const int64_t t = 2 * pair + odd;
          const int32_t* wt = words + t * MR * act_words;
          const float* st = xs + t * MR;
          for (int r = 0; r < MR; ++r) {
            const ivec_t dot = sub_unit_dot<Bits>(biased, first[odd], second[odd], wt[2 * r],
                                                  wt[2 * r + 1]);
            gsum[r] = fma(sub(as_float(dot), bias), set1_f(st[r]), gsum[r]);
          }
        }
      } else {  // one group for the pair
        static_assert(AG == 16);
        const int32_t* wt = words + pair * MR * act_words;
        const float* st = xs + pair * MR;
        for (int r = 0; r < MR; ++r) {
          const int32_t* x = wt + act_words * r;
          ivec_t dot = sub_unit_dot<Bits>(biased, first[0], second[0], x[0], x[1]);
          dot = sub_unit_dot<Bits>(dot, first[1], second[1], x[2], x[3]);
          gsum[r] = fma(sub(as_float(dot), bias), set1_f(st[r]), gsum[r]);
        }
      }
    }
    const fvec_t scale = w.scales.load(p, lane, g);
    for (int r = 0; r < MR; ++r) acc[r] = fma(gsum[r], scale, acc[r]);
    if (w.min_term()) {
      fvec_t mins = w.load_mins(scale, p, lane, g);
      if (Bits == 8 && kShiftedCodes8) mins = fma(set1_f(-128.0f), scale, mins);
      for (int r = 0; r < MR; ++r) {
        acc[r] = fma(mins, set1_f(a.sums[(m0 + r) * a.groups + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) store_first(dst + r * dst_stride, acc[r], count);
}

// panel_tile for the `rows` (1 to kTileM) activation rows from m0.
template <int Bits, int AG, int MR = kTileM>
void any_tile(int64_t rows, const QuantWeight& w, const QuantActs& a, int64_t p, int64_t lane,
              int64_t m0, float* dst, int64_t dst_stride, int64_t count) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      panel_tile<Bits, MR, AG>(w, a, p, lane, m0, dst, dst_stride, count);
    } else {
      any_tile<Bits, AG, MR - 1>(rows, w, a, p, lane, m0, dst, dst_stride, count);
    }
  }
}

// What a matmul writes: its n_out columns, or (kSiluPairs) silu(y[:, :n_out / 2])
// * y[:, n_out / 2:], the SwiGLU MLP's activation straight from its gate_up
// projection. Then output panel j is computed with panels j (gate) and j +
// n_out / 32 (up), tile by tile on one thread: the [T, n_out] product is never
// stored, nor read back by a separate op, half of whose rows the other core had
// written. Not for a decode step's few rows (QuantMatrix::apply): there gate and
// up panels taken in turn break each thread's stream of weights at every panel,
// and the whole product, then its silu pass, made a batch-1 step of the default
// model 2% faster and one of 4 decodes 3% (one of 8, 0.8% slower).
enum class Epilogue { kStore, kSiluPairs };
static_assert(kPanel == kLanes, "an output panel's row is one vec");

template <int Bits, int AG>
void panel_gemm(const QuantWeight& w, const QuantActs& a, int64_t rows, int64_t n_out, float* out,
                Epilogue epilogue) {
  const bool pairs = epilogue == Epilogue::kSiluPairs;
  const int64_t panels = (n_out + kPanel - 1) / kPanel;
  const int64_t units = pairs ? panels / 2 : panels;  // output panels
  const int64_t out_cols = pairs ? n_out / 2 : n_out;
  const int64_t panel_bytes = w.words * kPanel * kWordBytes * (Bits == 6 ? 3 : 2) / 2;
  const int64_t tile_bytes =
      a.act_groups * kTileM * (a.act_words * sizeof(int32_t) + sizeof(float));
  const int64_t unit_bytes = panel_bytes * (pairs ? 2 : 1);
  // The tiles request none of the next unit (NextUnitShare): these weights
  // are a quarter to half of bfloat16's bytes, so less of a unit's time waits
  // on DRAM. Requested as the float tiles request them, the GGUF's decode
  // steps of 9 to 96 rows took 0.999-1.006x the time and over 96 rows 1.022x
  // (steps of the main workload alternating with a temporary switch).
  run_panel_tiles(units, rows, kTileM, unit_bytes, tile_bytes, [&](int64_t u, int64_t m,
                                                                   int64_t tile_rows,
                                                                   const NextUnitShare&) {
    if (!pairs) {
      for (int64_t lane = 0; lane < kPanel; lane += kRowsPerVec) {
        const int64_t n0 = u * kPanel + lane;
        const int64_t count = std::min(kRowsPerVec, n_out - n0);
        if (count <= 0) break;
        any_tile<Bits, AG>(tile_rows, w, a, u, lane, m, out + m * n_out + n0, n_out, count);
      }
      return;
    }
    alignas(64) float gate[kTileM * kPanel], up[kTileM * kPanel];
    for (int64_t lane = 0; lane < kPanel; lane += kRowsPerVec) {
      any_tile<Bits, AG>(tile_rows, w, a, u, lane, m, gate + lane, kPanel, kRowsPerVec);
      any_tile<Bits, AG>(tile_rows, w, a, u + units, lane, m, up + lane, kPanel, kRowsPerVec);
    }
    for (int64_t r = 0; r < tile_rows; ++r) {
      store(out + (m + r) * out_cols + u * kPanel,
            silu_times(load(gate + r * kPanel), load(up + r * kPanel)));
    }
  });
}

template <int Bits>
void panel_gemm(const QuantWeight& w, const QuantActs& a, int64_t rows, int64_t n_out,
                float* out, Epilogue epilogue) {
  if (a.act_group == 8) {
    panel_gemm<Bits, 8>(w, a, rows, n_out, out, epilogue);
  } else {
    panel_gemm<Bits, 16>(w, a, rows, n_out, out, epilogue);
  }
}

// Factors from their panel-ordered tensors (see panels.py's GroupFactors).
Factors factors(const std::optional<at::Tensor>& base, const std::optional<at::Tensor>& codes,
                int64_t panels, int64_t groups, const char* name, double multiplier = 1.0) {
  Factors f;
  f.multiplier = static_cast<float>(multiplier);
  if (!base.has_value()) {
    TORCH_CHECK(!codes.has_value(), name, " codes without a base");
    return f;
  }
  TORCH_CHECK(base->is_contiguous() && base->dim() == 3 && base->size(0) == panels &&
                  base->size(2) == kPanel,
              name, " base must be contiguous [panels, groups / per, 16]");
  TORCH_CHECK(base->scalar_type() == at::kHalf || base->scalar_type() == at::kFloat, name,
              " base must be float16 or float32");
  f.base = base->data_ptr();
  f.half = base->scalar_type() == at::kHalf;
  f.groups = groups;
  f.base_groups = base->size(1);
  if (codes.has_value()) {
    TORCH_CHECK(codes->is_contiguous() && codes->scalar_type() == at::kChar &&
                    codes->sizes() == at::IntArrayRef({panels, groups, kPanel}),
                name, " codes must be int8 [panels, groups, 16]");
    TORCH_CHECK(groups % base->size(1) == 0, name, " base must divide the groups evenly");
    f.codes = codes->data_ptr<int8_t>();
    f.per = groups / base->size(1);
    f.per_shift = (f.per & (f.per - 1)) == 0 ? __builtin_ctzll(f.per) : -1;
  } else {
    TORCH_CHECK(base->size(1) == groups, name, " base must be [panels, groups, 16] without codes");
  }
  return f;
}

}  // namespace

// What a QuantMatrix checked once: the kernel's view of the weight, and the
// tensors it points into, kept alive.
struct QuantMatrix::Layout {
  std::vector<at::Tensor> held;
  QuantWeight weight;
  int64_t n_out;
  int64_t act_group;
};

QuantMatrix::QuantMatrix(const at::Tensor& qweight, const std::optional<at::Tensor>& qhigh,
                         const at::Tensor& scale_base,
                         const std::optional<at::Tensor>& scale_codes,
                         const std::optional<at::Tensor>& min_base,
                         const std::optional<at::Tensor>& min_codes, double min_multiplier,
                         int64_t bits, int64_t group, int64_t n_out, int64_t act_group) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
  TORCH_CHECK(act_group == 8 || act_group == 16, "act_group must be 8 or 16");
  TORCH_CHECK(group == 32 || (bits != 4 && group == 16),
              "group must be 32, or 16 for 6- and 8-bit codes");
  TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 4 && qweight.size(2) == kPanel &&
                  qweight.size(3) == kWordBytes && qweight.element_size() == 1,
              "weights must be contiguous bytes [panels, words, 16, 4]");
  const int64_t panels = qweight.size(0);
  TORCH_CHECK(n_out > (panels - 1) * kPanel && n_out <= panels * kPanel,
              "n_out does not match the weight's panels");
  TORCH_CHECK(qhigh.has_value() == (bits == 6), "6-bit weights, and only they, take qhigh");
  if (qhigh.has_value()) {
    TORCH_CHECK(qhigh->is_contiguous() && qhigh->element_size() == 1 &&
                    qhigh->sizes() == at::IntArrayRef({panels, qweight.size(1) / 2, kPanel,
                                                       kWordBytes}),
                "qhigh must be contiguous bytes [panels, words / 2, 16, 4]");
  }
  const int64_t row_bytes = qweight.size(1) * kWordBytes;
  const int64_t k_pad = bits == 8 ? row_bytes : row_bytes * 2;
  TORCH_CHECK(k_pad > 0 && k_pad % kBlock == 0, "a weight row must be whole blocks of 32 columns");
  const int64_t groups = k_pad / group;
  std::vector<at::Tensor> held{qweight, scale_base};
  for (const auto* t : {&qhigh, &scale_codes, &min_base, &min_codes}) {
    if (t->has_value()) held.push_back(**t);
  }
  QuantWeight weight{bits, group, k_pad, qweight.size(1), groups,
                     reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                     qhigh.has_value() ? reinterpret_cast<const uint8_t*>(qhigh->data_ptr())
                                       : nullptr,
                     factors(scale_base, scale_codes, panels, groups, "scale"),
                     factors(min_base, min_codes, panels, groups, "min", min_multiplier)};
  const Factors &scales = weight.scales, &mins = weight.mins;
  if (mins && mins.base == scales.base && mins.codes == scales.codes) {
    weight.min_from_scale = true;
    weight.min_per_scale = mins.multiplier / scales.multiplier;
  }
  layout_ = std::make_shared<const Layout>(Layout{std::move(held), weight, n_out, act_group});
}

// The output is allocated here: an `out` argument would make each batch-1 call
// (about 120 a step) slower, with the Python that makes it.
at::Tensor QuantMatrix::operator()(const at::Tensor& x) const { return apply(x, false); }

at::Tensor QuantMatrix::silu_product(const at::Tensor& x) const { return apply(x, true); }

bool QuantMatrix::has_silu_product() const { return layout_->n_out % (2 * kPanel) == 0; }

int64_t QuantMatrix::out_features() const { return layout_->n_out; }

at::Tensor QuantMatrix::apply(const at::Tensor& x, bool silu_pairs) const {
  const QuantWeight& w = layout_->weight;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(x.size(1) <= w.k_pad, "x has more columns than the weight");
  const int64_t rows = x.size(0), n_out = layout_->n_out;
  TORCH_CHECK(!silu_pairs || has_silu_product(),
              "silu_product needs whole panels in each half: n_out a multiple of ", 2 * kPanel,
              ", got ", n_out);
  const FlushDenormals flush;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({rows, silu_pairs ? n_out / 2 : n_out}, x.options());
  if (rows == 0) return out;
  const QuantActs acts(xc.data_ptr<float>(), rows, x.size(1), xc.stride(0), w, layout_->act_group);
  float* y = out.data_ptr<float>();
  const auto gemm = [&](float* dst, Epilogue epilogue) {
    if (w.bits == 4) {
      panel_gemm<4>(w, acts, rows, n_out, dst, epilogue);
    } else if (w.bits == 6) {
      panel_gemm<6>(w, acts, rows, n_out, dst, epilogue);
    } else {
      panel_gemm<8>(w, acts, rows, n_out, dst, epilogue);
    }
  };
  if (silu_pairs && rows <= kTileM / 2) {
    silu_of_whole_product(rows, n_out, y, [&](float* whole) { gemm(whole, Epilogue::kStore); });
  } else {
    gemm(y, silu_pairs ? Epilogue::kSiluPairs : Epilogue::kStore);
  }
  return out;
}

at::Tensor QuantMatrix::rows(const at::Tensor& ids, int64_t k) const {
  const QuantWeight& w = layout_->weight;
  TORCH_CHECK(k > 0 && k <= w.k_pad, "k ", k, " does not fit the weight's ", w.k_pad, " columns");
  const at::Tensor flat = checked_row_ids(ids, layout_->n_out);
  const int64_t count = flat.numel();
  const int64_t* id = flat.data_ptr<int64_t>();
  at::Tensor out = at::empty({count, k}, ids.options().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t panel = id[i] / kPanel, lane = id[i] % kPanel;
      float* row = y + i * k;
      for (int64_t g = 0; g * w.group < k; ++g) {
        const float scale = w.scales.value(panel, lane, g);
        const float min = w.mins ? w.mins.value(panel, lane, g) : 0.0f;
        for (int64_t c = g * w.group; c < std::min(k, (g + 1) * w.group); ++c) {
          // Rounded before the min is added, as the reference's two ops
          // round: the build contracts a multiply and an add into an FMA.
          float product = static_cast<float>(w.code(panel, lane, c)) * scale;
          asm("" : "+x"(product));
          row[c] = product + min;
        }
      }
    }
  });
  return out;
}

namespace {

// quant_linear: x @ dequant(W).T; quant_linear_silu (SiluPairs): silu(y[:, :n_out
// / 2]) * y[:, n_out / 2:] of that y, without y.
template <bool SiluPairs>
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight,
                        const std::optional<at::Tensor>& qhigh, const at::Tensor& scale_base,
                        const std::optional<at::Tensor>& scale_codes,
                        const std::optional<at::Tensor>& min_base,
                        const std::optional<at::Tensor>& min_codes, double min_multiplier,
                        int64_t bits, int64_t group, int64_t n_out, int64_t act_group) {
  const QuantMatrix matrix(qweight, qhigh, scale_base, scale_codes, min_base, min_codes,
                           min_multiplier, bits, group, n_out, act_group);
  return SiluPairs ? matrix.silu_product(x) : matrix(x);
}

// quant_rows: rows `ids` (integers, any shape) of dequant(W), float32
// [ids.numel(), k]: an embedding that shares a tied LM head's quantized
// weight (quantization/linear.py's QuantEmbedding). One call where torch's
// ops on the layout take a dozen, each slow on a decode step's caches, which
// the weights streaming through have just emptied.
at::Tensor quant_rows(const at::Tensor& ids, const at::Tensor& qweight,
                      const std::optional<at::Tensor>& qhigh, const at::Tensor& scale_base,
                      const std::optional<at::Tensor>& scale_codes,
                      const std::optional<at::Tensor>& min_base,
                      const std::optional<at::Tensor>& min_codes, double min_multiplier,
                      int64_t bits, int64_t group, int64_t n_out, int64_t act_group, int64_t k) {
  const QuantMatrix matrix(qweight, qhigh, scale_base, scale_codes, min_base, min_codes,
                           min_multiplier, bits, group, n_out, act_group);
  return matrix.rows(ids, k);
}

// The TorchScript class the decoder stack takes (common/projection.h); built
// from quant_linear's arguments after x.
struct QuantProjection : ProjectionClass {
  QuantProjection(const at::Tensor& qweight, const std::optional<at::Tensor>& qhigh,
                  const at::Tensor& scale_base, const std::optional<at::Tensor>& scale_codes,
                  const std::optional<at::Tensor>& min_base,
                  const std::optional<at::Tensor>& min_codes, double min_multiplier,
                  int64_t bits, int64_t group, int64_t n_out, int64_t act_group)
      : matrix(std::make_shared<const QuantMatrix>(qweight, qhigh, scale_base, scale_codes,
                                                   min_base, min_codes, min_multiplier, bits,
                                                   group, n_out, act_group)) {}
  std::shared_ptr<const Projection> projection() const override { return matrix; }
  std::shared_ptr<const QuantMatrix> matrix;
};

}  // namespace

// Both ops' arguments (a literal: the schema must be one at compile time).
#define TL_QUANT_LINEAR_SCHEMA                                                              \
  "(Tensor x, Tensor qweight, Tensor? qhigh, Tensor scale_base, Tensor? scale_codes, "     \
  "Tensor? min_base, Tensor? min_codes, float min_multiplier, int bits, int group, "       \
  "int n_out, int act_group) -> Tensor"

TORCH_LIBRARY(tokenloom_quant, m) {
  m.def("quant_linear" TL_QUANT_LINEAR_SCHEMA);
  m.def("quant_linear_silu" TL_QUANT_LINEAR_SCHEMA);
  m.def(
      "quant_rows(Tensor ids, Tensor qweight, Tensor? qhigh, Tensor scale_base, "
      "Tensor? scale_codes, Tensor? min_base, Tensor? min_codes, float min_multiplier, int bits, "
      "int group, int n_out, int act_group, int k) -> Tensor");
  m.class_<QuantProjection>("QuantProjection")
      .def(torch::init<at::Tensor, std::optional<at::Tensor>, at::Tensor,
                       std::optional<at::Tensor>, std::optional<at::Tensor>,
                       std::optional<at::Tensor>, double, int64_t, int64_t, int64_t, int64_t>());
}

TORCH_LIBRARY_IMPL(tokenloom_quant, CPU, m) {
  m.impl("quant_linear", &quant_linear<false>);
  m.impl("quant_linear_silu", &quant_linear<true>);
  m.impl("quant_rows", &quant_rows);
}

}  // namespace tokenloom
