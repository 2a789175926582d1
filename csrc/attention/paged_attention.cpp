// Paged attention for short queries (decodes, short prompt chunks) on CPU,
// plus the KV-cache write that precedes it.
//
// Reads each request's K/V in place through its block table: nothing is
// gathered or padded. One unit of work is a few consecutive query tokens of one
// request (as many as kMaxRows holds with all their heads) and one KV group: it
// scores their visible context for that group's query heads together (one K/V
// load feeds every head of every token), applies a softmax and sums V; in a
// batch of many decodes, a unit is one decode and all its groups. Units are
// handed out dynamically to torch's intra-op threads because context
// lengths differ widely within a batch; a small batch runs on the calling
// thread alone. Head sizes are compiled in (see `paged_attention`).
//
// Layouts (contiguous; q and out float32, the caches float32, bfloat16 or
// float16: a 16-bit cache is converted to float32 as it is loaded, which halves
// the bytes a decode reads; the arithmetic stays float32, but for a bfloat16
// cache on CPUs with AVX512_BF16, see kBf16Dot):
//   out, q          [T, H, D]             flat batch of query tokens
//   k_cache         [num_blocks, Hkv, D, block_size]  (keys transposed per block)
//   v_cache         [num_blocks, Hkv, block_size, D]
//   block_table     int32 [rows, max_blocks]
//   table_rows, query_start, query_len, seq_lens: int32 [R], one per request
// Request r owns q rows query_start[r] .. + query_len[r]; its context after this
// step is seq_lens[r] tokens, so query token i sits at position
// seq_lens[r] - query_len[r] + i and sees keys 0 .. that position (causal).
// Rows of q/out outside these requests are left untouched.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/team.h"
#include "common/vec.h"

namespace tokenloom {
namespace {

// Sixteen cache elements as float32 lanes. bfloat16 is the top half of a
// float32; float16 converts with vcvtph2ps (F16C / AVX-512).
inline vec load_kv(const float* p) { return load(p); }
#if defined(__AVX512F__)
typedef _Float16 fp16_lanes __attribute__((vector_size(kLanes * 2), aligned(2)));

inline vec load_kv(const c10::BFloat16* p) {
  const __m512i bits = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<const vec&>(bits);
}
inline vec load_kv(const c10::Half* p) {
  return __builtin_convertvector(*reinterpret_cast<const fp16_lanes*>(p), vec);
}
#else
// Eight 16-bit elements at p, zero-extended to 32-bit lanes.
inline __m256i widen8(const void* p) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
inline vec load_kv(const c10::BFloat16* p) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(widen8(p), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(widen8(p + kLanes / 2), 16))};
}
inline vec load_kv(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kLanes / 2)))};
}
#endif

// Without AVX512_BF16 (kBf16Dot below), a bfloat16 cache is read two rows at a
// time: 32 elements as 16 32-bit lanes of two neighbours each. Shifting a lane
// left by 16 gives its first element as a float32 and masking gives its second,
// where widening every 16 elements takes a lane-crossing vpmovzxwd and a shift.
// Paired vectors hold the even elements of the two rows in one vector and the
// odd ones in another, so the math around them works on that order (queries and
// value sums below); each lane sees the same products in the same order, so
// results are those of load_kv bit for bit. Head sizes that are not whole
// 32-element rows keep load_kv.
template <int64_t D, typename T>
constexpr bool kWholeRowPairs = std::is_same_v<T, c10::BFloat16> && D % (2 * kLanes) == 0;

// With AVX512_BF16 a bfloat16 cache is not converted at all: vdpbf16ps
// multiplies pairs of bfloat16 elements and adds both products to a float32
// lane, one instruction where the conversion and two FMAs take three or more,
// on the FMA pipes that bound the prompt's attention. Its other operand is
// bfloat16 too: queries (times the score scale) and softmax numerators are
// rounded to bfloat16, to nearest even, as vLLM's bfloat16 attention rounds them;
// the scores and value sums accumulate in float32. Keys pair two dimensions of
// one key (a vpermw interleaves two rows of a K tile), values two keys' same
// dimension (vpunpck{l,h}wd interleave two V rows, and the sums are put back in
// order at the end).
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TL_BF16_DOT 1
#else
#define TL_BF16_DOT 0
#endif
#if TL_BF16_DOT
constexpr bool kBf16DotBuilt = true;
template <int64_t D, typename T>
constexpr bool kBf16Dot = kWholeRowPairs<D, T>;
#else
constexpr bool kBf16DotBuilt = false;
template <int64_t D, typename T>
constexpr bool kBf16Dot = false;
#endif

template <int64_t D, typename T>
constexpr bool kPaired = kWholeRowPairs<D, T> && !kBf16Dot<D, T>;

// How score_tile reads a head's queries: floats, floats per pair of rows
// (kPaired), or bfloat16 pairs of dimensions (kBf16Dot).
enum class Queries { kFloats, kPairedRows, kBf16Pairs };

// A prompt unit's layout, and a whole decode's (which never pairs rows: below).
template <int64_t D, typename T>
constexpr Queries kUnitQueries =
    kBf16Dot<D, T> ? Queries::kBf16Pairs : (kPaired<D, T> ? Queries::kPairedRows : Queries::kFloats);
template <int64_t D, typename T>
constexpr Queries kDecodeQueries = kBf16Dot<D, T> ? Queries::kBf16Pairs : Queries::kFloats;

// Elements 0, 2, .. 14 of a then of b (`even`), and 1, 3, .. 15 of each
// (`odd`). Adjacent: b is a + 16, one load (GCC does not merge two).
template <bool Adjacent>
inline void load_pairs(const c10::BFloat16* a, const c10::BFloat16* b, vec& even, vec& odd) {
#if defined(__AVX512F__)
  typedef uint32_t uint_lanes __attribute__((vector_size(kLanes * 4)));
  typedef uint32_t pair_half __attribute__((vector_size(kLanes * 2), aligned(2)));
  typedef uint32_t pair_lanes __attribute__((vector_size(kLanes * 4), aligned(2)));
  uint_lanes both;
  if constexpr (Adjacent) {
    both = *reinterpret_cast<const pair_lanes*>(a);
  } else {
    const pair_half lo = *reinterpret_cast<const pair_half*>(a);
    const pair_half hi = *reinterpret_cast<const pair_half*>(b);
    both = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  const uint_lanes first = both << 16, second = both & 0xffff0000u;
  even = reinterpret_cast<const vec&>(first);
  odd = reinterpret_cast<const vec&>(second);
#else
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i top = _mm256_set1_epi32(-65536);
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(lo, top)),
         _mm256_castsi256_ps(_mm256_and_si256(hi, top))};
#endif
}

// The inverse of pairing: lanes i and i + 8 of `even` and of `odd` hold
// element 2i and 2i + 1 of two rows; returns the first row's 16 (Second: the
// second row's) in order.
template <bool Second>
inline vec unpair(vec even, vec odd) {
  return interleave<Second>(even, odd);
}

// Floats of one head's queries as score_tile reads them: D; with paired rows,
// per pair of dimensions (d, d + 1) a vector of eight q[d] then eight q[d + 1],
// matching the two rows of a paired load; as bfloat16 pairs, D / 2 words of
// q[d] (low half) and q[d + 1].
template <int64_t D, Queries L>
constexpr int64_t kQueryFloats =
    L == Queries::kPairedRows ? D / 2 * kLanes : (L == Queries::kBf16Pairs ? D / 2 : D);

// Writes `heads` heads' queries from q, times scale, in kQueryFloats layout.
template <int64_t D, Queries L>
void prepare_queries(const float* q, int64_t heads, float scale, float* out) {
  for (int64_t h = 0; h < heads; ++h, q += D, out += kQueryFloats<D, L>) {
    if constexpr (L == Queries::kBf16Pairs) {
#if TL_BF16_DOT
      // The pairs are the queries' bfloat16 values in order, 32 per conversion.
      for (int64_t d = 0; d < D; d += 2 * kLanes) {
        const __m512 low = _mm512_mul_ps(_mm512_loadu_ps(q + d), _mm512_set1_ps(scale));
        const __m512 high = _mm512_mul_ps(_mm512_loadu_ps(q + d + kLanes), _mm512_set1_ps(scale));
        _mm512_storeu_si512(out + d / 2, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
      }
#endif
    } else if constexpr (L == Queries::kPairedRows) {
      for (int64_t d = 0; d < D; d += 2) {
        const vec first = vec{} + q[d] * scale, second = vec{} + q[d + 1] * scale;
        store(out + d / 2 * kLanes, low_high(first, second));
      }
    } else {
      for (int64_t d = 0; d < D; ++d) out[d] = q[d] * scale;
    }
  }
}

struct Task {
  int32_t request;
  int32_t token;  // row of q / out
  int32_t visible;  // keys this token attends to
};

void check_input(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

template <typename T>
struct Problem {
  const float* q;
  const T* k_cache;
  const T* v_cache;
  float* out;
  const int32_t* table;
  const int32_t* rows;
  const std::vector<Task>* tasks;
  int64_t num_heads, num_kv_heads, group, block_size, max_blocks, longest;
  float scale;
  int64_t work;  // multiply-adds of the whole batch (scores and value sums)
};

// score_tile's products over paired keys: acc[h][0] gathers the tile's even
// keys (lanes 0-7 from even d, 8-15 from odd d) and acc[h][1] the odd ones.
// Adjacent: row d + 1 follows row d (rows of 16 keys).
template <int64_t D, int64_t HEADS, bool Adjacent>
inline void score_paired_rows(const float* __restrict q, const c10::BFloat16* __restrict k_rows,
                              int64_t row_stride, vec (&acc)[HEADS][2]) {
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; d += 2) {
    vec even, odd;
    load_pairs<Adjacent>(k_rows + d * row_stride, k_rows + (d + 1) * row_stride, even, odd);
    for (int64_t h = 0; h < HEADS; ++h) {
      const vec qd = load(q + h * kQueryFloats<D, Queries::kPairedRows> + d / 2 * kLanes);
      acc[h][0] += even * qd;
      acc[h][1] += odd * qd;
    }
  }
}

#if TL_BF16_DOT
// score_tile with vdpbf16ps: lane t of a product is key t's dimensions d and
// d + 1 against the head's pair of queries.
template <int64_t D, int64_t HEADS>
inline void score_bf16_pairs(const float* __restrict q, const c10::BFloat16* __restrict k_rows,
                             int64_t row_stride, vec (&acc)[HEADS][2]) {
  // Word 2t of the interleaved vector is key t of row d, word 2t + 1 that of row d + 1.
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q);
  const auto two_rows = [&](int64_t d) {
    const c10::BFloat16* row = k_rows + d * row_stride;
    const __m512i rows =
        row_stride == kLanes
            ? _mm512_loadu_si512(row)
            : _mm512_inserti64x4(
                  _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + row_stride)), 1);
    return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(interleave, rows));
  };
  // Two pairs of rows per step, one per accumulator.
#pragma GCC unroll 2
  for (int64_t d = 0; d < D; d += 4) {
    const __m512bh first = two_rows(d), second = two_rows(d + 2);
    for (int64_t h = 0; h < HEADS; ++h) {
      const uint32_t* qh = pairs + h * (D / 2) + d / 2;
      acc[h][0] = reinterpret_cast<vec>(_mm512_dpbf16_ps(
          reinterpret_cast<__m512>(acc[h][0]), first,
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(qh[0]))));
      acc[h][1] = reinterpret_cast<vec>(_mm512_dpbf16_ps(
          reinterpret_cast<__m512>(acc[h][1]), second,
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(qh[1]))));
    }
  }
}
#endif

// Scores of 16 consecutive keys for HEADS query heads of one KV group. K blocks
// are [Hkv, D, block_size] (see model/kv_cache.py): row d of the tile holds
// dimension d of the 16 keys, so each row load feeds one FMA per head. Two
// accumulators per head (even and odd d) hide the FMA latency.
template <int64_t D, int64_t HEADS, Queries L, typename T>
inline void score_tile(const float* __restrict q, const T* __restrict k_rows, int64_t row_stride,
                       float* __restrict scores, int64_t scores_stride) {
  static_assert(L != Queries::kPairedRows || kPaired<D, T>);
  static_assert(L != Queries::kBf16Pairs || kBf16Dot<D, T>);
  vec acc[HEADS][2];
  for (int64_t h = 0; h < HEADS; ++h) acc[h][0] = acc[h][1] = vec{};
#if TL_BF16_DOT
  if constexpr (L == Queries::kBf16Pairs) {
    score_bf16_pairs<D, HEADS>(q, k_rows, row_stride, acc);
    for (int64_t h = 0; h < HEADS; ++h) store(scores + h * scores_stride, acc[h][0] + acc[h][1]);
    return;
  }
#endif
  if constexpr (L == Queries::kPairedRows) {
    if (row_stride == kLanes) {
      score_paired_rows<D, HEADS, true>(q, k_rows, row_stride, acc);
    } else {
      score_paired_rows<D, HEADS, false>(q, k_rows, row_stride, acc);
    }
    for (int64_t h = 0; h < HEADS; ++h) {
      store(scores + h * scores_stride,
            unpair<false>(acc[h][0], acc[h][1]) + unpair<true>(acc[h][0], acc[h][1]));
    }
    return;
  }
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; d += 2) {
    const vec k0 = load_kv(k_rows + d * row_stride), k1 = load_kv(k_rows + (d + 1) * row_stride);
    for (int64_t h = 0; h < HEADS; ++h) {
      acc[h][0] += k0 * q[h * D + d];
      acc[h][1] += k1 * q[h * D + d + 1];
    }
  }
  for (int64_t h = 0; h < HEADS; ++h) store(scores + h * scores_stride, acc[h][0] + acc[h][1]);
}

// Sets of value accumulators per row: with few vectors a row (D <= 32), even
// and odd keys go to separate sets to hide the FMA latency. Fixed by the head
// size, not by the rows taken together: a row's sums must not depend on them.
template <int64_t D>
constexpr int64_t kValueSets = D / kLanes <= 2 ? 2 : 1;

// out[h] = sum_j weights[h][j] V[j] over the keys of one block, for HEADS query
// rows of one KV group; each V row load feeds every row. With paired rows,
// accumulators 2c and 2c + 1 hold the even and the odd dimensions of
// dimensions 32c .. 32c + 31.
template <int64_t D, int64_t HEADS, typename T>
struct ValueSum {
  static constexpr int64_t kChunks = D / kLanes;
  static constexpr int64_t kSets = kValueSets<D>;
  vec acc[kSets][HEADS][kChunks];

  ValueSum() {
    for (int64_t s = 0; s < kSets; ++s)
      for (int64_t h = 0; h < HEADS; ++h)
        for (int64_t c = 0; c < kChunks; ++c) acc[s][h][c] = vec{};
  }

  // One row of V as the accumulators take it.
  static inline void load_row(const T* __restrict row, vec (&out)[kChunks]) {
    if constexpr (kPaired<D, T>) {
      for (int64_t c = 0; c < kChunks; c += 2)
        load_pairs<true>(row + c * kLanes, row + (c + 1) * kLanes, out[c], out[c + 1]);
    } else {
      for (int64_t c = 0; c < kChunks; ++c) out[c] = load_kv(row + c * kLanes);
    }
  }

  inline void add(const float* __restrict weights, int64_t weights_stride, const T* __restrict v,
                  int64_t v_stride, int64_t count) {
    int64_t j = 0;
    for (; j + kSets <= count; j += kSets) {
      for (int64_t s = 0; s < kSets; ++s) {
        vec vj[kChunks];
        load_row(v + (j + s) * v_stride, vj);
        for (int64_t h = 0; h < HEADS; ++h) {
          const float w = weights[h * weights_stride + j + s];
          for (int64_t c = 0; c < kChunks; ++c) acc[s][h][c] += vj[c] * w;
        }
      }
    }
    for (; j < count; ++j) {
      vec vj[kChunks];
      load_row(v + j * v_stride, vj);
      for (int64_t h = 0; h < HEADS; ++h) {
        const float w = weights[h * weights_stride + j];
        for (int64_t c = 0; c < kChunks; ++c) acc[0][h][c] += vj[c] * w;
      }
    }
  }

  template <typename RowOut>
  inline void store_scaled(RowOut row_out, const float* inv_denominators) const {
    for (int64_t h = 0; h < HEADS; ++h) {
      float* out = row_out(h);
      vec total[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) {
        total[c] = acc[0][h][c];
        for (int64_t s = 1; s < kSets; ++s) total[c] += acc[s][h][c];
        total[c] *= inv_denominators[h];
      }
      for (int64_t c = 0; c < kChunks; ++c) {
        vec ordered = total[c];
        if constexpr (kPaired<D, T>) {
          ordered = c % 2 == 0 ? unpair<false>(total[c], total[c + 1])
                               : unpair<true>(total[c - 1], total[c]);
        }
        store(out + c * kLanes, ordered);
      }
    }
  }
};

#if TL_BF16_DOT
// ValueSum with vdpbf16ps (kBf16Dot): a pair of keys j, j + 1 at a time, each
// lane of a product their same dimension against the head's pair of softmax
// numerators. Interleaving two V rows per 128-bit lane leaves, in each 32
// dimensions' `low` accumulator, dimensions 8i .. 8i + 3 at lanes 4i .. 4i + 3,
// and in `high` dimensions 8i + 4 .. 8i + 7; store_scaled puts them in order.
template <int64_t D, int64_t HEADS>
struct ValueSumBf16 {
  static constexpr int64_t kChunks = D / (2 * kLanes);  // of 32 dimensions
  vec low[HEADS][kChunks], high[HEADS][kChunks];

  ValueSumBf16() {
    for (int64_t h = 0; h < HEADS; ++h)
      for (int64_t c = 0; c < kChunks; ++c) low[h][c] = high[h][c] = vec{};
  }

  inline void add(const float* __restrict weights, int64_t weights_stride,
                  const c10::BFloat16* __restrict v, int64_t v_stride, int64_t count) {
    // Each head's numerators of these keys (count <= 16) as bfloat16 pairs;
    // a missing partner of the last key is 0.
    uint32_t pairs[HEADS][kLanes / 2];
    const __mmask16 present = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t h = 0; h < HEADS; ++h) {
      const __m512 w = _mm512_maskz_loadu_ps(present, weights + h * weights_stride);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[h]),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w)));
    }
    for (int64_t j = 0; j < count; j += 2) {
      const c10::BFloat16* first = v + j * v_stride;
      const c10::BFloat16* second = first + v_stride;
      for (int64_t c = 0; c < kChunks; ++c) {
        const __m512i a = _mm512_loadu_si512(first + c * 2 * kLanes);
        const __m512i b = j + 1 < count ? _mm512_loadu_si512(second + c * 2 * kLanes)
                                        : _mm512_setzero_si512();
        const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
        const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
        for (int64_t h = 0; h < HEADS; ++h) {
          const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pairs[h][j / 2]));
          low[h][c] = reinterpret_cast<vec>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(low[h][c]), lo, w));
          high[h][c] =
              reinterpret_cast<vec>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(high[h][c]), hi, w));
        }
      }
    }
  }

  template <typename RowOut>
  inline void store_scaled(RowOut row_out, const float* inv_denominators) const {
    for (int64_t h = 0; h < HEADS; ++h) {
      for (int64_t c = 0; c < kChunks; ++c) {
        const vec lo = low[h][c] * inv_denominators[h], hi = high[h][c] * inv_denominators[h];
        float* dst = row_out(h) + c * 2 * kLanes;
        store(dst, __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                           22, 23));
        store(dst + kLanes, __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13,
                                                    14, 15, 28, 29, 30, 31));
      }
    }
  }
};

template <int64_t D, int64_t HEADS, typename T>
using ValueSumFor =
    std::conditional_t<kBf16Dot<D, T>, ValueSumBf16<D, HEADS>, ValueSum<D, HEADS, T>>;
#else
template <int64_t D, int64_t HEADS, typename T>
using ValueSumFor = ValueSum<D, HEADS, T>;
#endif

// How far ahead of the keys being read their cache lines are requested.
// Blocks sit anywhere in the cache, so the hardware prefetcher loses the
// stream at every block's end. Every line is requested, key by key, so the
// distance in bytes is the same whatever the block size, and the V pass's
// first lines are on their way while the K pass ends.
constexpr int64_t kAheadKeys = 64;

// One KV group's keys as one stream: K of keys 0..n-1 at positions 0..n-1,
// then V of the same from position `values` (n rounded up to whole tiles, so
// that the K pass's last positions, whole tiles ahead, request whole V tiles).
// It requests the lines of `heads` KV heads from kv_head on: 1 for one group's
// pass, all of them for a decode's groups taken block by block.
template <int64_t D, typename T>
struct KeyStream {
  const Problem<T>& p;
  const int32_t* blocks;
  int64_t kv_head, n, heads;
  int64_t values = (n + kLanes - 1) / kLanes * kLanes;

  // The group's K of the b-th block of the request's table, [D, block_size],
  // and its V, [block_size, D]: both caches are head-major within a block, so
  // the group's part starts at the same offset in each; the next heads' follow.
  int64_t head_offset(int64_t b) const {
    return (blocks[b] * p.num_kv_heads + kv_head) * D * p.block_size;
  }
  const T* k_block(int64_t b) const { return p.k_cache + head_offset(b); }
  const T* v_block(int64_t b) const { return p.v_cache + head_offset(b); }

  // Requests the cache lines of the 16 keys from stream position i (a multiple
  // of 16).
  inline void prefetch(int64_t i) const {
    const bool value = i >= values;
    const int64_t key = value ? i - values : i;
    if (key >= n) return;
    const int64_t b = key / p.block_size, at = key % p.block_size;
    constexpr int64_t line = 64 / sizeof(T);
    if (!value) {
      if (at % line != 0) return;  // this row's line holds the previous tile's keys
      const T* rows = k_block(b) + at;
      for (int64_t d = 0; d < heads * D; ++d) __builtin_prefetch(rows + d * p.block_size);
    } else {
      const int64_t count = std::min<int64_t>({kLanes, p.block_size - at, n - key});
      const T* rows = v_block(b) + at * D;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < count * D; c += line) __builtin_prefetch(rows + h * D * p.block_size + c);
    }
  }
};

// Scratch of one thread, sized for the longest context in the batch.
struct Scratch {
  std::vector<float> q;       // [H, kQueryFloats] the token's queries, pre-scaled
  std::vector<float> scores;  // [H, stride] scores, then softmax numerators
  std::vector<float> tile;    // [D, 16] keys (as the cache's type) of a tile that crosses its block's end
  int64_t stride;
};

// Scores of HEADS heads against the in_block keys from the start of k_block
// (one head's [D, block_size]), one tile of 16 keys at a time, before_tile(t0)
// ahead of each. A tile that would run past its block (block_size not a
// multiple of 16) is first copied out and zero-padded; otherwise a tile may
// cover keys past the context inside the last block: their scores are computed
// and then discarded.
template <int64_t D, int64_t HEADS, Queries L, typename T, typename BeforeTile>
inline void score_block(const float* q, const T* k_block, int64_t block_size, int64_t in_block,
                        float* scores, int64_t stride, T* tile, BeforeTile before_tile) {
  for (int64_t t0 = 0; t0 < in_block; t0 += kLanes) {
    before_tile(t0);
    if (t0 + kLanes <= block_size) {
      score_tile<D, HEADS, L>(q, k_block + t0, block_size, scores + t0, stride);
    } else {
      const int64_t count = std::min(kLanes, in_block - t0);
      std::fill(tile, tile + D * kLanes, T(0.0f));
      for (int64_t d = 0; d < D; ++d)
        for (int64_t i = 0; i < count; ++i) tile[d * kLanes + i] = k_block[d * block_size + t0 + i];
      score_tile<D, HEADS, L>(q, tile, kLanes, scores + t0, stride);
    }
  }
}

// Softmax numerators of `heads` rows of n scores, `stride` apart, and each
// row's 1 / sum; lanes from n to `padded` (n in whole tiles) are cleared so
// that whole vectors can be summed.
inline void softmax_rows(float* scores, int64_t stride, int64_t n, int64_t padded, int64_t heads,
                         float* inv_denominators) {
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * stride;
    std::fill(s + n, s + padded, -std::numeric_limits<float>::infinity());
    vec peak_v = load(s);
    for (int64_t j = kLanes; j < padded; j += kLanes) {
      const vec x = load(s + j);
      peak_v = max(x, peak_v);
    }
    float peak = peak_v[0];
    for (int64_t l = 1; l < kLanes; ++l) peak = std::max(peak, peak_v[l]);
    vec sum_v = vec{};
    for (int64_t j = 0; j < padded; j += kLanes) {
      const vec e = exp_nonpositive(load(s + j) - peak);
      store(s + j, e);
      sum_v += e;
    }
    float sum = lane_sum(sum_v);
    for (int64_t j = n; j < padded; ++j) sum -= s[j];  // discard the padding lanes
    std::fill(s + n, s + padded, 0.0f);
    inv_denominators[h] = 1.0f / sum;
  }
}

// ROWS query rows against one KV group: `heads` heads (from `head`) of each of
// the tokens tasks[0 .. ROWS / heads), consecutive tokens of one request. Row
// r is token r / heads, head head + r % heads; its queries and scores are row
// r of the scratch's. The rows share every K and V load (and a bfloat16 key
// pair's permute, a large share of a prompt's vector work when a token has few
// heads). Keys past a row's own context (the tile's later tokens
// see one more each) are scored and then given no weight, so a row's result
// is the same bits as alone.
template <int64_t D, int64_t ROWS, typename T>
void attend_rows(const Problem<T>& p, const Task* tasks, int64_t head, int64_t heads,
                 Scratch& scratch) {
  const int64_t tokens = ROWS / heads;
  const int64_t n = tasks[tokens - 1].visible, block_size = p.block_size, stride = scratch.stride;
  const int32_t* blocks = p.table + static_cast<int64_t>(p.rows[tasks[0].request]) * p.max_blocks;
  const float* q = scratch.q.data();
  float* scores = scratch.scores.data();

  const KeyStream<D, T> stream{p, blocks, head / p.group, n, 1};
  for (int64_t i = 0; i < kAheadKeys; i += kLanes) stream.prefetch(i);
  for (int64_t first = 0; first < n; first += block_size) {
    score_block<D, ROWS, kUnitQueries<D, T>>(
        q, stream.k_block(first / block_size), block_size, std::min(block_size, n - first),
        scores + first, stride, reinterpret_cast<T*>(scratch.tile.data()),
        [&](int64_t t0) { stream.prefetch(first + t0 + kAheadKeys); });
  }
  float inv_denominators[ROWS];
  for (int64_t t = 0; t < tokens; ++t) {
    softmax_rows(scores + t * heads * stride, stride, tasks[t].visible, stream.values, heads,
                 inv_denominators + t * heads);
  }

  // Weighted sum of V. V blocks are [Hkv, block_size, D].
  ValueSumFor<D, ROWS, T> value_sum;
  for (int64_t first = 0; first < n; first += block_size) {
    const T* v = stream.v_block(first / block_size);
    const int64_t in_block = std::min(block_size, n - first);
    for (int64_t t0 = 0; t0 < in_block; t0 += kLanes) {
      stream.prefetch(stream.values + first + t0 + kAheadKeys);
      value_sum.add(scores + first + t0, stride, v + t0 * D, D,
                    std::min(kLanes, in_block - t0));
    }
  }
  value_sum.store_scaled(
      [&](int64_t r) {
        return p.out + (tasks[r / heads].token * p.num_heads + head + r % heads) * D;
      },
      inv_denominators);
}

// The most KV heads attend_blocks takes.
constexpr int64_t kMaxBlockGroups = 8;
// How far ahead attend_blocks requests lines, in keys (each key's K and V of
// every head).
constexpr int64_t kAheadBlockKeys = 32;

// One decode token against every KV group of HEADS heads, block by block: each
// block's K (the groups' [D, block_size] one after another) and then its V (the
// groups' [block_size, D]) are read in address order, where group by group a
// pass would read a few KB in every block. A request's blocks mostly follow one
// another in the cache, so the reads become nearly one stream.
template <int64_t D, int64_t HEADS, typename T>
void attend_blocks(const Problem<T>& p, const Task& task, Scratch& scratch) {
  const int64_t n = task.visible, block_size = p.block_size, stride = scratch.stride;
  const int64_t groups = p.num_kv_heads;
  const int32_t* blocks = p.table + static_cast<int64_t>(p.rows[task.request]) * p.max_blocks;
  float* scores = scratch.scores.data();

  const KeyStream<D, T> stream{p, blocks, 0, n, groups};
  for (int64_t i = 0; i < kAheadBlockKeys; i += kLanes) stream.prefetch(i);
  for (int64_t first = 0; first < n; first += block_size) {
    const T* k_block = stream.k_block(first / block_size);
    const int64_t in_block = std::min(block_size, n - first);
    // Without kBf16Dot, rows of keys unpaired: every head's paired queries (8x
    // the floats, 18 KB for 9 heads of 64) would share L1 with the K/V
    // streaming through. The values, which need no query, are paired. With it, queries take D / 2 words a head.
    constexpr Queries L = kDecodeQueries<D, T>;
    for (int64_t g = 0; g < groups; ++g) {
      score_block<D, HEADS, L>(
          scratch.q.data() + g * HEADS * kQueryFloats<D, L>, k_block + g * D * block_size,
          block_size, in_block, scores + g * HEADS * stride + first, stride,
          reinterpret_cast<T*>(scratch.tile.data()), [&](int64_t t0) {
            if (g == 0) stream.prefetch(first + t0 + kAheadBlockKeys);
          });
    }
  }
  float inv_denominators[kMaxBlockGroups * HEADS];
  softmax_rows(scores, stride, n, stream.values, groups * HEADS, inv_denominators);

  ValueSumFor<D, HEADS, T> value_sums[kMaxBlockGroups];
  for (int64_t first = 0; first < n; first += block_size) {
    const T* v = stream.v_block(first / block_size);
    const int64_t in_block = std::min(block_size, n - first);
    for (int64_t t0 = 0; t0 < in_block; t0 += kLanes) {
      stream.prefetch(stream.values + first + t0 + kAheadBlockKeys);
      for (int64_t g = 0; g < groups; ++g) {
        value_sums[g].add(scores + g * HEADS * stride + first + t0, stride,
                          v + (g * block_size + t0) * D, D,
                          std::min(kLanes, in_block - t0));
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* out = p.out + (task.token * p.num_heads + g * HEADS) * D;
    value_sums[g].store_scaled([&](int64_t h) { return out + h * D; },
                               inv_denominators + g * HEADS);
  }
}

// Query heads attend_blocks takes together, up to what fits in the registers.
template <int64_t D>
constexpr int64_t kMaxHeads = std::max<int64_t>(1, std::min<int64_t>(4, 16 / (D / kLanes)));
// Query rows attend_rows takes together: its value sums keep D / 16 vectors a
// row per set (4 for 64 dimensions) in registers, 24 of them at most.
template <int64_t D>
constexpr int64_t kMaxRows =
    std::clamp<int64_t>(24 / ((D + kLanes - 1) / kLanes * kValueSets<D>), 1, 8);

// attend_rows with ROWS a run-time count (1 .. kMaxRows).
template <int64_t D, typename T, int64_t ROWS = kMaxRows<D>>
void attend_any_rows(int64_t rows, const Problem<T>& p, const Task* tasks, int64_t head,
                     int64_t heads, Scratch& scratch) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return attend_any_rows<D, T, ROWS - 1>(rows, p, tasks, head, heads, scratch);
  }
  attend_rows<D, ROWS, T>(p, tasks, head, heads, scratch);
}

// The query tokens tasks[0 .. tokens) (consecutive tokens of one request)
// against KV group g: all the group's heads of every token at once where they
// fit in kMaxRows, else one token's heads kMaxRows at a time.
template <int64_t D, typename T>
void attend(const Problem<T>& p, const Task* tasks, int64_t tokens, int64_t g, Scratch& scratch) {
  constexpr Queries L = kUnitQueries<D, T>;
  const int64_t first = g * p.group;
  // Queries of `heads` heads from `head` of token t, as rows from t * heads.
  const auto prepare = [&](int64_t t, int64_t head, int64_t heads) {
    prepare_queries<D, L>(p.q + (tasks[t].token * p.num_heads + head) * D, heads, p.scale,
                          scratch.q.data() + t * heads * kQueryFloats<D, L>);
  };
  if (tokens * p.group <= kMaxRows<D>) {
    for (int64_t t = 0; t < tokens; ++t) prepare(t, first, p.group);
    attend_any_rows<D, T>(tokens * p.group, p, tasks, first, p.group, scratch);
    return;
  }
  TORCH_CHECK(tokens == 1, "a query tile's rows exceed kMaxRows");
  for (int64_t head = first; head < first + p.group; head += kMaxRows<D>) {
    const int64_t heads = std::min(kMaxRows<D>, first + p.group - head);
    prepare(0, head, heads);
    attend_any_rows<D, T>(heads, p, tasks, head, heads, scratch);
  }
}

// One query token against every KV group: block by block (attend_blocks) where
// a group's heads fit in the registers together, else group after group.
template <int64_t D, typename T>
void attend_all_groups(const Problem<T>& p, const Task& task, Scratch& scratch) {
  if (p.group > kMaxHeads<D> || p.num_kv_heads > kMaxBlockGroups) {
    for (int64_t g = 0; g < p.num_kv_heads; ++g) attend<D, T>(p, &task, 1, g, scratch);
    return;
  }
  const float* q = p.q + task.token * p.num_heads * D;
  prepare_queries<D, kDecodeQueries<D, T>>(q, p.num_heads, p.scale, scratch.q.data());
  switch (p.group) {
    case 1: attend_blocks<D, 1, T>(p, task, scratch); break;
    case 2: attend_blocks<D, 2, T>(p, task, scratch); break;
    case 3: attend_blocks<D, 3, T>(p, task, scratch); break;
    default: attend_blocks<D, 4, T>(p, task, scratch); break;
  }
}

// Below this many multiply-adds per thread, waking another thread (a fork and a
// join per layer) costs more than it saves: a small batch over short contexts
// runs on the calling thread alone.
constexpr int64_t kMinWorkPerThread = 1 << 15;

// Work units (query tile, KV group) are handed out dynamically to torch's
// intra-op threads because context lengths differ widely within a batch.
// A request's units go out group by group: consecutive query tiles of a prompt
// chunk then read the same group's K/V, which stays in L2 (token by token, every
// group's K/V would pass through it in turn). A decode is one unit instead, all
// its groups read block by block (attend_blocks), which streams when a
// request's blocks follow one another in the cache: in a batch with enough
// decodes to keep every thread busy, and in a smaller one where its K/V are at
// most kWholeDecodeElements. Its K/V come cold from DRAM (the weights streaming
// through the step evict them), and one thread reading them in address order
// beats two threads taking its groups apart, each reading a few KB in every
// block: a batch-1 decode of the default model's shape (3 groups of 64) over
// 190 keys took 12 us where its groups on two threads took 19, and the 1B
// shape's (8 groups) over 160 keys 20 us where they took 25. From about 1,000
// keys of 8 groups on, the groups on every thread catch up.
constexpr int64_t kWholeDecodesPerThread = 4;
constexpr int64_t kWholeDecodeElements = 1 << 19;
constexpr int32_t kAllGroups = -1;

template <int64_t D, typename T>
void run(const Problem<T>& p) {
  const std::vector<Task>& tasks = *p.tasks;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  // Units: a query tile (tokens from task, group), or a whole decode (task,
  // kAllGroups).
  struct Unit {
    int32_t task, group, tokens;
  };
  std::vector<Unit> units;
  const bool decodes_whole = num_tasks >= kWholeDecodesPerThread * at::get_num_threads();
  // attend_all_groups streams blocks for these shapes; for others it goes group by group.
  const bool streams_blocks = p.group <= kMaxHeads<D> && p.num_kv_heads <= kMaxBlockGroups;
  const auto whole = [&](const Task& decode) {
    return decodes_whole ||
           (streams_blocks && 2 * decode.visible * p.num_kv_heads * D <= kWholeDecodeElements);
  };
  const int64_t tile_tokens = std::max<int64_t>(1, kMaxRows<D> / p.group);
  for (int64_t first = 0; first < num_tasks;) {
    int64_t end = first;
    while (end < num_tasks && tasks[end].request == tasks[first].request) ++end;
    if (end - first == 1 && whole(tasks[first])) {
      units.push_back({static_cast<int32_t>(first), kAllGroups, 1});
    } else {
      for (int32_t g = 0; g < p.num_kv_heads; ++g) {
        for (int64_t t = first; t < end; t += tile_tokens) {
          units.push_back({static_cast<int32_t>(t), g,
                           static_cast<int32_t>(std::min(tile_tokens, end - t))});
        }
      }
    }
    first = end;
  }
  const int64_t num_units = static_cast<int64_t>(units.size());
  std::atomic<int64_t> next{0};
  const auto work = [&](int64_t, int64_t) {
    Scratch scratch;
    // A tile starting at the last key writes kLanes scores.
    scratch.stride = (p.longest + 2 * kLanes - 1) / kLanes * kLanes;
    const int64_t rows = std::max(p.num_heads, kMaxRows<D>);
    scratch.q.resize(rows * std::max(kQueryFloats<D, kUnitQueries<D, T>>,
                                     kQueryFloats<D, kDecodeQueries<D, T>>));
    scratch.scores.resize(rows * scratch.stride);
    scratch.tile.resize(D * kLanes);
    for (int64_t u = next++; u < num_units; u = next++) {
      const Unit& unit = units[u];
      if (unit.group != kAllGroups) {
        attend<D, T>(p, &tasks[unit.task], unit.tokens, unit.group, scratch);
      } else {
        attend_all_groups<D, T>(p, tasks[unit.task], scratch);
      }
    }
  };
  const int64_t threads = std::min<int64_t>(
      {static_cast<int64_t>(at::get_num_threads()), num_units, p.work / kMinWorkPerThread});
  if (threads <= 1) {
    work(0, 1);
  } else {
    parallel_for(0, threads, 1, work);
  }
}

template <typename T>
void run_head_dim(const Problem<T>& p, int64_t head_dim) {
  switch (head_dim) {
    case 64: run<64, T>(p); break;
    case 128: run<128, T>(p); break;
    case 32: run<32, T>(p); break;
    case 96: run<96, T>(p); break;
    case 80: run<80, T>(p); break;
    case 256: run<256, T>(p); break;
    default: TORCH_CHECK(false, "head_dim ", head_dim, " has no native kernel");
  }
}

// Calls f with a null pointer of the cache's element type.
template <typename F>
void with_cache_type(at::ScalarType dtype, const F& f) {
  if (dtype == at::kBFloat16) {
    f(static_cast<c10::BFloat16*>(nullptr));
  } else if (dtype == at::kHalf) {
    f(static_cast<c10::Half*>(nullptr));
  } else {
    f(static_cast<float*>(nullptr));
  }
}

// The cache dtypes the kernels read and write: float32, bfloat16, float16.
void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const at::ScalarType dtype = v_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "the KV cache must be float32, bfloat16 or float16, got ", dtype);
  check_input(k_cache, "k_cache", dtype, 4);
  check_input(v_cache, "v_cache", dtype, 4);
}

void paged_attention(
    at::Tensor out,
    const at::Tensor& q,
    const at::Tensor& k_cache,
    const at::Tensor& v_cache,
    const at::Tensor& block_table,
    const at::Tensor& table_rows,
    const at::Tensor& query_start,
    const at::Tensor& query_len,
    const at::Tensor& seq_lens,
    double scale) {
  check_input(out, "out", at::kFloat, 3);
  check_input(q, "q", at::kFloat, 3);
  check_cache(k_cache, v_cache);
  check_input(block_table, "block_table", at::kInt, 2);
  for (const at::Tensor* t : {&table_rows, &query_start, &query_len, &seq_lens}) {
    check_input(*t, "per-request metadata", at::kInt, 1);
    TORCH_CHECK(t->size(0) == seq_lens.size(0), "per-request metadata lengths differ");
  }
  TORCH_CHECK(out.sizes() == q.sizes(), "out and q shapes differ");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = v_cache.size(1), block_size = v_cache.size(2);
  TORCH_CHECK(v_cache.size(3) == head_dim, "v_cache head_dim ", v_cache.size(3), " != ", head_dim);
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == num_kv_heads &&
                  k_cache.size(2) == head_dim && k_cache.size(3) == block_size,
              "k_cache must be [num_blocks, Hkv, D, block_size] matching v_cache");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads ", num_heads, " not a multiple of ", num_kv_heads);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1), num_blocks = k_cache.size(0);

  const int32_t* rows = table_rows.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = query_len.data_ptr<int32_t>();
  const int32_t* seqs = seq_lens.data_ptr<int32_t>();
  std::vector<Task> tasks;
  int64_t longest = 0, visible_keys = 0;
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t r = 0; r < seq_lens.size(0); ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= seqs[r], "request ", r, ": bad query_len/seq_len");
    TORCH_CHECK(starts[r] >= 0 && starts[r] + lens[r] <= num_tokens, "request ", r, ": rows out of q");
    TORCH_CHECK(rows[r] >= 0 && rows[r] < block_table.size(0), "request ", r, ": bad table row");
    const int64_t used_blocks = (seqs[r] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= max_blocks, "request ", r, ": seq_len exceeds its block table");
    // Its last token sees the whole context, so these are all the blocks it reads.
    const int32_t* blocks = table + static_cast<int64_t>(rows[r]) * max_blocks;
    for (int64_t b = 0; b < used_blocks; ++b) {
      TORCH_CHECK(blocks[b] >= 0 && blocks[b] < num_blocks, "block id ", blocks[b], " out of range");
    }
    for (int32_t i = 0; i < lens[r]; ++i) {
      tasks.push_back({static_cast<int32_t>(r), starts[r] + i, seqs[r] - lens[r] + i + 1});
    }
    longest = std::max<int64_t>(longest, seqs[r]);
    // Token i sees context - query_len + i + 1 keys.
    visible_keys += static_cast<int64_t>(lens[r]) * (seqs[r] - lens[r]) +
                    static_cast<int64_t>(lens[r]) * (lens[r] + 1) / 2;
  }
  const int64_t work = 2 * visible_keys * num_heads * head_dim;

  with_cache_type(v_cache.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Problem<T> problem{q.data_ptr<float>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                             out.data_ptr<float>(), table, rows, &tasks, num_heads, num_kv_heads,
                             group, block_size, max_blocks, longest, static_cast<float>(scale),
                             work};
    run_head_dim(problem, head_dim);
  });
}

// Sixteen floats as the cache's type at dst, rounded to nearest even as torch's
// conversion rounds: one instruction each for bfloat16 (AVX512_BF16) and
// float16 (AVX-512) rather than one conversion per element.
// (Both treat float32 denormals as zero; the matmuls producing K and V flush them.)
template <typename T>
inline void convert16(const float* src, T* dst) {
#if TL_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src))));
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::Half>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT));
    return;
  }
#endif
  for (int64_t i = 0; i < kLanes; ++i) dst[i] = static_cast<T>(src[i]);
}

// write_kv's grain: a step of more tokens than this is split between threads.
// Each key's dimensions land in as many cache lines of its K block (a column
// of it), lines that the step's weights have evicted: a decode batch's writes
// wait on memory, and two threads issue twice the misses at once (64 decodes
// of the default model: a step 1-2% faster than on one thread).
constexpr int64_t kWriteGrainTokens = 8;

// Stores this step's keys and values at their cache slots: k, v [T, Hkv, D]
// (rows may be strided, e.g. views of the fused QKV output), slot_mapping
// int64 [T]. K blocks are [Hkv, D, block_size], so a key's dimensions go to
// column `slot % block_size`; V blocks are [Hkv, block_size, D], so its heads go
// to row `slot % block_size` of each head's rows. A 16-bit cache
// stores them rounded to nearest even, as torch's own conversion does.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  check_cache(k_cache, v_cache);
  check_input(slot_mapping, "slot_mapping", at::kLong, 1);
  const int64_t tokens = slot_mapping.size(0), num_blocks = v_cache.size(0);
  const int64_t num_kv_heads = v_cache.size(1), block_size = v_cache.size(2), head_dim = v_cache.size(3);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == tokens &&
                    t->size(1) == num_kv_heads && t->size(2) == head_dim,
                "k and v must be float32 [", tokens, ", ", num_kv_heads, ", ", head_dim, "]");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == head_dim, "k and v rows must be dense");
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_blocks * block_size, "slot ", slots[t], " out of range");
  }
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t row = num_kv_heads * head_dim, ks = k.stride(0), vs = v.stride(0);
  with_cache_type(v_cache.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    const bool whole_vectors = head_dim % kLanes == 0;
    parallel_for(0, tokens, kWriteGrainTokens, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        T* v_rows = vc + (block * row * block_size) + offset * head_dim;
        T* k_block = kc + block * row * block_size + offset;
        const float* key = kp + t * ks;
        const float* value = vp + t * vs;
        if (whole_vectors) {
          T keys[kLanes];
          for (int64_t i = 0; i < row; i += kLanes) {
            const int64_t h = i / head_dim, d = i % head_dim;
            convert16(value + i, v_rows + h * block_size * head_dim + d);
            convert16(key + i, keys);
            for (int64_t l = 0; l < kLanes; ++l) k_block[(i + l) * block_size] = keys[l];
          }
          continue;
        }
        for (int64_t h = 0; h < num_kv_heads; ++h)
          for (int64_t i = 0; i < head_dim; ++i)
            v_rows[h * block_size * head_dim + i] = static_cast<T>(value[h * head_dim + i]);
        for (int64_t i = 0; i < row; ++i) k_block[i * block_size] = static_cast<T>(key[i]);
      }
    });
  });
}

// Pins intra-op thread i to cpus[i], except thread 0, the caller: it keeps its
// affinity so that threads and processes it starts later are not confined to
// one core. The threads are the OpenMP pool torch's own parallel regions use
// (same runtime, same team size), so they stop migrating between cores.
void bind_threads(c10::IntArrayRef cpus) {
  const int count = static_cast<int>(cpus.size());
  TORCH_CHECK(count == at::get_num_threads(), "need one cpu per intra-op thread (",
              at::get_num_threads(), "), got ", count);
  int failures = 0;
#pragma omp parallel num_threads(count) reduction(+ : failures)
  if (omp_get_thread_num() > 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[omp_get_thread_num()]), &set);
    failures += sched_setaffinity(0, sizeof(set), &set) != 0;
  }
  TORCH_CHECK(failures == 0, "sched_setaffinity failed for ", failures, " threads");
}

}  // namespace
}  // namespace tokenloom

TORCH_LIBRARY(tokenloom_cpu, m) {
  m.def("bind_threads(int[] cpus) -> ()", &tokenloom::bind_threads);
  // Whether paged_attention multiplies a bfloat16 cache's elements in bfloat16
  // pairs (see kBf16Dot), which rounds queries and softmax numerators.
  m.def("bf16_dot_products() -> bool", []() { return tokenloom::kBf16DotBuilt; });
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor table_rows, Tensor query_start, Tensor query_len, "
      "Tensor seq_lens, float scale) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &tokenloom::paged_attention);
  m.def(
      "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) "
      "-> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &tokenloom::write_kv);
}
