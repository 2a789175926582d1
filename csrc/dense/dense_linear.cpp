// y = x @ W.T for float weights kept in their own dtype (bfloat16 or
// float32), with float32 activations and accumulators.
//
// Weights arrive in panel order (tokenloom/model/panel_linear.py packs them):
// output rows in panels of 16, and within a panel, per 4-byte word of a row,
// the 16 rows' words side by side: panels [P, words, 16, E] with E elements
// per word (2 bfloat16, 1 float32), rows past N and columns past K zero. So
// one 64-byte load holds one word of 16 rows, and the kernel computes outer
// products as the quantized one does (quantization/quant_linear.cpp): each
// float lane is one output row, every activation row's word is broadcast
// against it, and no lane ever needs a horizontal sum.
//
// - bfloat16 with AVX512_BF16: `vdpbf16ps` multiplies a word's two weights by
//   the activation row's two columns, rounded to bfloat16 (to nearest even,
//   once per matmul, as oneDNN rounds them), and adds both products to the
//   float32 lane: one instruction per 32 multiply-adds, twice the float32
//   FMA's rate.
// - bfloat16 without it (AVX2, AVX-512 before Zen 4 / Cooper Lake): each word
//   is widened in registers (a bfloat16 is the top half of a float32: a shift
//   and a mask) and multiplied by the float32 activations with two FMAs; on
//   AVX2, steps of many rows widen a unit of panels at a time into a buffer
//   and run the float32 tiles (kWidenUnits). The weights stay 16-bit in
//   memory, where a batch-1 step reads them.
// - float32: one FMA per word.
//
// A tile is up to kTileM activation rows by two vectors of output rows (two
// panels with AVX-512, one panel's two halves with AVX2), accumulated in
// registers over every word of K. With few rows (a decode step) the weights'
// bytes bound the time, not the arithmetic: a tile is one panel by at most
// kTileM / 2 rows, so that each thread reads one panel after another, one
// address stream that the hardware prefetcher follows at full speed (with two
// to four panels read side by side, or prefetches a page ahead of them, a
// Zen 4 core streamed a fifth to a third slower). At one or two rows the
// tile requests its panel's next lines as non-temporal (see Ahead). One
// dependent chain of `vdpbf16ps` a row still reads 64 bytes every few
// cycles, more than a core's share of DRAM bandwidth. The SwiGLU product
// streams the same way: the whole gate_up product in one-panel tiles, then
// its silu pass over the rows. Every shape runs the same per-lane loop, each
// activation row and output row with its own accumulator over the words in
// order: a row's result depends neither on the rows beside it, nor on the
// tile's width, nor on the thread count.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "common/denormals.h"
#include "common/panel_schedule.h"
#include "common/row_ids.h"
#include "common/silu_product.h"
#include "common/team.h"
#include "common/vec.h"
#include "dense/dense_matrix.h"

namespace tokenloom {
namespace {

constexpr int64_t kPanel = 16;                      // output rows per panel
constexpr int64_t kWordBytes = 4;                   // bytes of one row per word
constexpr int64_t kWordStep = kPanel * kWordBytes;  // one word of a panel's rows
constexpr int kVecsPerUnit = 2;                     // output vectors per tile
// How a tile requests its panels' lines ahead of its loads.
enum class Ahead {
  // Many rows: a page ahead (kPageAheadBytes), into every cache level. A tile
  // re-reads its panels from L3 or DRAM where they outgrow the L2 (a float32
  // panel of K = 8192 is 512 KB), and the hardware prefetcher restarts at
  // every 4 KB page.
  kPage,
  // Few rows (a decode step): tiles of up to kNonTemporalRows rows request
  // their panel kNonTemporalBytes ahead with prefetchnta, a hint that the
  // line is used once. A decode step's weights pass once (270 MB a batch-1
  // step of the default model in bfloat16) and, loaded plainly, leave the
  // caches full of lines nothing reads again. With the hint a batch-1 step
  // took 5-8% less, everywhere in it (the host's work outside the model
  // 0.80 -> 0.67 ms, the layers 7.75 -> 7.32, the LM head 1.80 -> 1.67),
  // two rows 3% less; the same prefetches without the hint gained nothing,
  // and at three or four rows the hint cost 1-3%. Those tiles request
  // nothing: the hardware prefetcher streams a single panel at full speed
  // (top of this file).
  kNonTemporal,
};
constexpr int64_t kPageAheadBytes = 4096;
constexpr int64_t kNonTemporalBytes = 256;
constexpr int kNonTemporalRows = 2;

// What a many-row tile requests of the next unit's weights while it computes
// (panel_schedule.h's NextUnitShare): its part of each of `spans` runs of
// panels (the unit's panels, or a SwiGLU unit's gate and up panels), spread
// evenly over its words. Into L1 (prefetcht0) where a unit has three tiles or
// more, into L2 (prefetcht1) where it has two. The default model's matmuls
// in bfloat16, against the same tiles requesting nothing: at 9 to 16 rows L2
// took 5-12% less, where L1 took from 13% more to 7% less; at 21 to 48 rows
// L1 took 7-8% less, and up to 4% less than L2.
struct NextUnitRequest {
  const uint8_t* part[2] = {nullptr, nullptr};
  int spans = 0;
  int64_t step16 = 0;  // bytes of the part per word of the tile, times 2^16
  bool into_l1 = false;
};

// Where output row `row`'s first word sits: its panel, then its place among the
// panel's rows (word w of the row lies w * kWordStep bytes further on).
inline const uint8_t* panel_row(const uint8_t* panels, int64_t words, int64_t row) {
  return panels + row / kPanel * words * kWordStep + row % kPanel * kWordBytes;
}

#if defined(__AVX512F__)
constexpr int64_t kRowsPerVec = 16;  // output rows (float lanes) per vector
typedef __m512 fvec_t;
typedef __m512i ivec_t;
inline fvec_t zero_f() { return _mm512_setzero_ps(); }
inline fvec_t load_f(const uint8_t* p) { return _mm512_loadu_ps(p); }
inline ivec_t load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline fvec_t set1_f(float v) { return _mm512_set1_ps(v); }
inline fvec_t fma(fvec_t a, fvec_t b, fvec_t c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec_t even_half(ivec_t v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline fvec_t odd_half(ivec_t v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
}
inline void store_f(float* p, fvec_t v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__)
constexpr int64_t kRowsPerVec = 8;
typedef __m256 fvec_t;
typedef __m256i ivec_t;
inline fvec_t zero_f() { return _mm256_setzero_ps(); }
inline fvec_t load_f(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
inline ivec_t load_i(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline fvec_t set1_f(float v) { return _mm256_set1_ps(v); }
inline fvec_t fma(fvec_t a, fvec_t b, fvec_t c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec_t even_half(ivec_t v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline fvec_t odd_half(ivec_t v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536)));
}
inline void store_f(float* p, fvec_t v) { _mm256_storeu_ps(p, v); }
#else
#error "the dense kernel needs AVX2 (see tokenloom/ops/cpu_variants.py)"
#endif
constexpr int kVecsPerPanel = kPanel / kRowsPerVec;  // a few-rows tile: one panel

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TL_BF16_DOT 1
#else
#define TL_BF16_DOT 0
#endif

// How a tile multiplies: the weights' dtype, and for bfloat16 whether the
// CPU multiplies bfloat16 pairs itself.
enum class Kind { kFloat32, kBf16Widened, kBf16Dot };

constexpr Kind bf16_kind() { return TL_BF16_DOT ? Kind::kBf16Dot : Kind::kBf16Widened; }

// Activation rows per register tile. AVX2 has 16 ymm registers: float32 tiles
// of 6 rows by two vectors keep 12 accumulators, the two weight vectors and a
// broadcast in them (1.1-1.2x the speed of 4 rows); a widened bfloat16 word
// takes four for its halves, so 4 rows (with 6 it spilled, 0.7-0.85x).
#if defined(__AVX512F__)
template <Kind K>
constexpr int64_t kTileM = 8;
#else
template <Kind K>
constexpr int64_t kTileM = K == Kind::kFloat32 ? 6 : 4;
#endif

// Bytes of the activations of tile_m rows as a tile of kind K reads them.
constexpr int64_t activation_tile_bytes(Kind k, int64_t tile_m, int64_t words) {
  return tile_m * words * kWordBytes * (k == Kind::kBf16Dot ? 1 : 2);
}

// Where float32 tiles are taller than widened bfloat16 ones (AVX2), a step
// of many rows widens each unit's bfloat16 weights to float32 once, into a
// buffer this thread keeps, and runs the float32 tiles over it. The products
// are the same FMAs in the same order (a word's even column, then its odd
// one), so the same bits. A widening pays where it serves at least
// kWidenMinTiles tiles: the tiles of one unit within one block of rows
// (panel_schedule.h). The default model's bfloat16 export, main workload
// (`LLM.generate`, builds alternating): 1.09-1.17x the output tokens per
// second of widening every tile in registers, as fast as float32 weights.
// Fewer tiles widen in registers: a decode step of a few rows is bound by the
// weights' bytes, and Llama-3.2-1B's rows (K = 2,048) hold five tiles a block.
// Widening from three tiles ran the default model's main workload 1.02-1.08x
// faster still but the 1B shape's (32 requests) at 0.95-0.96x; its down
// projection (K = 8,192, one tile a block) ran at 0.5x in `kernel_ab.py`.
// Units of one panel (AVX2's two vectors of 8 rows), so that the buffer is a
// float32 panel: per column, the unit's vectors side by side in kWordStep bytes.
constexpr bool kWidenUnits = kTileM<Kind::kBf16Widened> < kTileM<Kind::kFloat32>;
constexpr int64_t kWidenMinTiles = 6;

// The unit a thread widened last, kept while that unit's tiles run.
struct WidenedUnit {
  uint64_t call = 0;  // which matmul: a later one may find other weights at the same addresses
  int64_t unit = -1;
  std::vector<float> columns;
};
inline std::atomic<uint64_t> widening_calls{0};

// The nv vectors at w[j], each `words` bfloat16 pairs, as float32 columns.
void widen_unit(const uint8_t* const* w, int64_t nv, int64_t words, float* columns) {
  for (int64_t t = 0; t < words; ++t) {
    float* even = columns + 2 * t * kPanel;
    for (int64_t j = 0; j < nv; ++j) {
      const ivec_t v = load_i(w[j] + t * kWordStep);
      store_f(even + j * kRowsPerVec, even_half(v));
      store_f(even + kPanel + j * kRowsPerVec, odd_half(v));
    }
  }
}

// out[r * out_stride + j * kRowsPerVec + i], for activation rows r < MR
// and lane i of the NV output vectors at w[j]: the products over `words`
// words. x holds the MR rows x_stride elements apart: float32 (two columns a
// word for kBf16Widened) or, for kBf16Dot, bfloat16 pairs (one int32 a word).
// Not inlined: one copy per shape, as in the quantized kernel.
template <Kind K, int MR, int NV, Ahead A>
__attribute__((noinline)) void dense_tile(const uint8_t* const* w, int64_t words, const void* x,
                                          int64_t x_stride, float* out, int64_t out_stride,
                                          const NextUnitRequest& next) {
  fvec_t acc[MR][NV];
  for (auto& row : acc) {
    for (auto& v : row) v = zero_f();
  }
  const uint8_t* wp[NV];
  for (int j = 0; j < NV; ++j) wp[j] = w[j];
  // Every matrix has a word (K >= 1, checked where it is made). Unless told,
  // GCC keeps the accumulators' zero in memory for a loop that never runs,
  // and the tile's start and end each move all of them through the stack.
  if (words <= 0) __builtin_unreachable();
#pragma GCC unroll 2
  for (int64_t t = 0; t < words; ++t) {
    if constexpr (A == Ahead::kPage) {
      for (int j = 0; j < NV; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(wp[j] + t * kWordStep + kPageAheadBytes),
                     _MM_HINT_T0);
      }
      for (int s = 0; s < next.spans; ++s) {
        const char* line = reinterpret_cast<const char*>(next.part[s] + (t * next.step16 >> 16));
        if (next.into_l1) {
          _mm_prefetch(line, _MM_HINT_T0);
        } else {
          _mm_prefetch(line, _MM_HINT_T1);
        }
      }
    } else if constexpr (MR <= kNonTemporalRows) {
      // The tile's vectors lie in one panel's words (kVecsPerPanel), one line
      // a word. Past a panel's last word lies the next panel's first, and a
      // prefetch past the matrix never faults.
      _mm_prefetch(reinterpret_cast<const char*>(wp[0] + t * kWordStep + kNonTemporalBytes),
                   _MM_HINT_NTA);
    }
    if constexpr (K == Kind::kFloat32) {
      const float* xt = static_cast<const float*>(x) + t;
      fvec_t wv[NV];
      for (int j = 0; j < NV; ++j) wv[j] = load_f(wp[j] + t * kWordStep);
      for (int r = 0; r < MR; ++r) {
        const fvec_t xb = set1_f(xt[r * x_stride]);
        for (int j = 0; j < NV; ++j) acc[r][j] = fma(wv[j], xb, acc[r][j]);
      }
    } else if constexpr (K == Kind::kBf16Widened) {
      const float* xt = static_cast<const float*>(x) + 2 * t;
      fvec_t even[NV], odd[NV];
      for (int j = 0; j < NV; ++j) {
        const ivec_t v = load_i(wp[j] + t * kWordStep);
        even[j] = even_half(v);
        odd[j] = odd_half(v);
      }
      for (int r = 0; r < MR; ++r) {
        const fvec_t x0 = set1_f(xt[r * x_stride]), x1 = set1_f(xt[r * x_stride + 1]);
        for (int j = 0; j < NV; ++j) acc[r][j] = fma(odd[j], x1, fma(even[j], x0, acc[r][j]));
      }
    } else {
#if TL_BF16_DOT
      const int32_t* xt = static_cast<const int32_t*>(x) + t;
      __m512bh wv[NV];
      for (int j = 0; j < NV; ++j) wv[j] = reinterpret_cast<__m512bh>(load_i(wp[j] + t * kWordStep));
      for (int r = 0; r < MR; ++r) {
        const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xt[r * x_stride]));
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xb);
      }
#endif
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NV; ++j) store_f(out + r * out_stride + j * kRowsPerVec, acc[r][j]);
  }
}

// dense_tile for `rows` (1 to MR) activation rows and `nv` (1 to NV) vectors.
template <Kind K, int NV, int MR, Ahead A>
void any_tile(int64_t rows, int64_t nv, const uint8_t* const* w, int64_t words, const void* x,
              int64_t x_stride, float* out, int64_t out_stride, const NextUnitRequest& next) {
  if constexpr (NV > 0 && MR > 0) {
    if (nv < NV) {
      any_tile<K, NV - 1, MR, A>(rows, nv, w, words, x, x_stride, out, out_stride, next);
    } else if (rows == MR) {
      dense_tile<K, MR, NV, A>(w, words, x, x_stride, out, out_stride, next);
    } else {
      any_tile<K, NV, MR - 1, A>(rows, nv, w, words, x, x_stride, out, out_stride, next);
    }
  }
}

// The activations as the tiles read them: x itself (float32 kinds, whose
// rows need only unit stride), or its rows rounded to bfloat16 (kBf16Dot:
// one conversion per matmul, not per tile), zero-padded to whole words.
struct DenseActs {
  const void* data;
  int64_t stride;  // elements (kBf16Dot: words) from one row to the next
  at::Tensor held;  // the float32 kinds: x, or x with a zero column
  // kBf16Dot's rounded rows: plain memory, as the quantized kernel's
  // activations, where a tensor would cost a batch-1 step's 120 matmuls an
  // allocator call and a TensorImpl each.
  std::unique_ptr<int32_t[]> rounded;

  DenseActs(const at::Tensor& x, Kind kind, int64_t words) {
    const int64_t rows = x.size(0), cols = x.size(1);
    if (kind != Kind::kBf16Dot) {
      // Widened pairs read two columns a word: an odd K needs a zero column.
      held = kind == Kind::kBf16Widened && cols % 2 ? at::constant_pad_nd(x, {0, 1}) : x;
      data = held.data_ptr<float>();
      stride = held.stride(0);
      return;
    }
    rounded.reset(new int32_t[rows * words]);
    int32_t* out = rounded.get();
    const float* src = x.data_ptr<float>();
    const int64_t src_stride = x.stride(0);
    parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) to_bf16_pairs(src + m * src_stride, cols, out + m * words, words);
    });
    data = out;
    stride = words;
  }

  // Columns [0, cols) of a row as bfloat16 (round to nearest even), in order,
  // zero up to 2 * words.
  static void to_bf16_pairs(const float* x, int64_t cols, int32_t* out, int64_t words) {
    c10::BFloat16* bf = reinterpret_cast<c10::BFloat16*>(out);
    int64_t c = 0;
#if TL_BF16_DOT
    for (; c + 2 * kLanes <= cols; c += 2 * kLanes) {
      const __m512 low = _mm512_loadu_ps(x + c), high = _mm512_loadu_ps(x + c + kLanes);
      _mm512_storeu_si512(bf + c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
    }
#endif
    for (; c < cols; ++c) bf[c] = c10::BFloat16(x[c]);  // c10 rounds to nearest even
    for (; c < 2 * words; ++c) bf[c] = c10::BFloat16(0.0f);
  }
};

// silu(gate) * up, as layer_ops' silu_and_mul computes it, over one vector of
// output rows of two tile rows at once where a vector is half a vec (AVX2:
// the second row's is the other half; a last odd row is taken twice), else
// of one row (its own twice).
#if defined(__AVX512F__)
constexpr int64_t kSiluRows = 1;
inline void silu_vectors(const float* gate, const float*, const float* up, const float*, float* y,
                         float*) {
  store(y, silu_times(load(gate), load(up)));
}
#else
constexpr int64_t kSiluRows = 2;
inline void silu_vectors(const float* gate, const float* gate2, const float* up, const float* up2,
                         float* y, float* y2) {
  const vec both = silu_times(vec{_mm256_loadu_ps(gate), _mm256_loadu_ps(gate2)},
                              vec{_mm256_loadu_ps(up), _mm256_loadu_ps(up2)});
  _mm256_storeu_ps(y, both.lo);
  _mm256_storeu_ps(y2, both.hi);
}
#endif

// y [rows, n_out] (or [rows, n_out / 2] with silu_pairs) from the panels,
// in tiles of at most TileM rows by NVU output vectors. A unit is NVU output
// vectors: consecutive ones, or with silu_pairs NVU / 2 consecutive vectors
// of the gate half and the same vectors of the up half, whose products the
// tile's epilogue writes.
//
// WidenUnits (K is kBf16Widened): float32 tiles over each unit widened first
// (kWidenUnits).
template <Kind K, int NVU, int TileM, Ahead A, bool WidenUnits = false>
void dense_gemm(const uint8_t* panels, int64_t words, int64_t n_out, const DenseActs& a,
                int64_t rows, float* y, bool silu_pairs) {
  static_assert(!WidenUnits || (K == Kind::kBf16Widened && NVU * kRowsPerVec == kPanel),
                "a widened unit is one float32 panel of bfloat16 weights");
  constexpr int kHalf = NVU / 2;
  const uint64_t call = WidenUnits ? ++widening_calls : 0;
  // The tile over vectors w[0..nv) of unit u, widened first where asked.
  const auto run_tile = [&](int64_t u, const uint8_t* const* w, int64_t nv, int64_t tile_rows,
                            const void* x, float* out, int64_t out_stride,
                            const NextUnitRequest& next) {
    if constexpr (WidenUnits) {
      static thread_local WidenedUnit widened;
      if (widened.call != call || widened.unit != u) {
        widened.columns.resize(2 * words * kPanel);
        widen_unit(w, nv, words, widened.columns.data());
        widened.call = call;
        widened.unit = u;
      }
      const uint8_t* columns[NVU];
      for (int j = 0; j < NVU; ++j) {
        columns[j] = reinterpret_cast<const uint8_t*>(widened.columns.data() + j * kRowsPerVec);
      }
      any_tile<Kind::kFloat32, NVU, TileM, A>(tile_rows, nv, columns, 2 * words, x, a.stride, out,
                                              out_stride, next);
    } else {
      any_tile<K, NVU, TileM, A>(tile_rows, nv, w, words, x, a.stride, out, out_stride, next);
    }
  };
  const int64_t vecs = (n_out + kRowsPerVec - 1) / kRowsPerVec;
  const int64_t half_vecs = n_out / 2 / kRowsPerVec;
  const int64_t units = silu_pairs ? half_vecs / kHalf : (vecs + NVU - 1) / NVU;
  const int64_t out_cols = silu_pairs ? n_out / 2 : n_out;
  const int64_t panel_bytes = words * kWordStep;
  const auto vec_at = [&](int64_t v) { return panel_row(panels, words, v * kRowsPerVec); };
  const int64_t unit_bytes = panel_bytes * NVU * kRowsPerVec / kPanel;
  const int64_t tile_bytes = activation_tile_bytes(K, TileM, words);
  // The panels holding output vector v and those after it (panels follow one
  // another; on AVX2 a silu unit's gate vector is half a panel, whose words
  // interleave with the other half's, so its span is the whole panel).
  const auto span_at = [&](int64_t v) { return panels + v * kRowsPerVec / kPanel * panel_bytes; };
  const int64_t half_span = std::max(panel_bytes, unit_bytes / 2);
  run_panel_tiles(units, rows, TileM, unit_bytes, tile_bytes, [&](int64_t u, int64_t m,
                                                                 int64_t tile_rows,
                                                                 const NextUnitShare& share) {
    alignas(64) float out[TileM * NVU * kRowsPerVec];
    NextUnitRequest next;
    if (share.unit >= 0) {
      const int64_t span_bytes = silu_pairs ? half_span : unit_bytes;
      const int64_t part_bytes = span_bytes / share.parts, skip = share.part * part_bytes;
      if (silu_pairs) {
        next.part[0] = span_at(share.unit * kHalf) + skip;
        next.part[1] = span_at(share.unit * kHalf + half_vecs) + skip;
        next.spans = 2;
      } else {
        next.part[0] = span_at(share.unit * NVU) + skip;
        next.spans = 1;
      }
      next.step16 = (part_bytes << 16) / words;
      next.into_l1 = share.parts > 2;
    }
    const void* x = static_cast<const char*>(a.data) +
                    m * a.stride * (K == Kind::kBf16Dot ? sizeof(int32_t) : sizeof(float));
    const uint8_t* w[NVU];
    const int64_t n0 = silu_pairs ? u * kHalf * kRowsPerVec : u * NVU * kRowsPerVec;
    const int64_t count = silu_pairs ? kHalf * kRowsPerVec : std::min(NVU * kRowsPerVec, n_out - n0);
    // The tile's output lines, requested before its thousands of cycles of
    // arithmetic: with many rows the output outgrows the caches, and stores
    // that wait on memory at the tile's end stall the next tile behind them
    // (a tenth of a wide matrix's time at 2,048 rows).
    for (int64_t r = 0; r < tile_rows; ++r) {
      const char* row = reinterpret_cast<const char*>(y + (m + r) * out_cols + n0);
      for (int64_t b = 0; b < count * int64_t(sizeof(float)); b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
    if (silu_pairs) {
      for (int j = 0; j < kHalf; ++j) {
        w[j] = vec_at(u * kHalf + j);
        w[kHalf + j] = vec_at(u * kHalf + j + half_vecs);
      }
      run_tile(u, w, NVU, tile_rows, x, out, NVU * kRowsPerVec, next);
      for (int64_t r = 0; r < tile_rows; r += kSiluRows) {
        const int64_t r2 = std::min(r + kSiluRows - 1, tile_rows - 1);
        const float* o = out + r * NVU * kRowsPerVec;
        const float* o2 = out + r2 * NVU * kRowsPerVec;
        float* yr = y + (m + r) * out_cols + u * kHalf * kRowsPerVec;
        float* yr2 = y + (m + r2) * out_cols + u * kHalf * kRowsPerVec;
        for (int j = 0; j < kHalf; ++j) {
          const int64_t gate = j * kRowsPerVec, up = (kHalf + j) * kRowsPerVec;
          silu_vectors(o + gate, o2 + gate, o + up, o2 + up, yr + gate, yr2 + gate);
        }
      }
      return;
    }
    const int64_t v0 = u * NVU, nv = std::min<int64_t>(NVU, vecs - v0);
    for (int64_t j = 0; j < nv; ++j) w[j] = vec_at(v0 + j);
    // Whole vectors go straight to y; a ragged last unit through `out`.
    if (count == nv * kRowsPerVec) {
      run_tile(u, w, nv, tile_rows, x, y + m * out_cols + n0, out_cols, next);
      return;
    }
    run_tile(u, w, nv, tile_rows, x, out, nv * kRowsPerVec, next);
    for (int64_t r = 0; r < tile_rows; ++r) {
      std::memcpy(y + (m + r) * out_cols + n0, out + r * nv * kRowsPerVec, count * sizeof(float));
    }
  });
}

// dense_gemm with the tile shape for `rows`. Few rows (a decode step): tiles of
// one panel (top of this file). A SwiGLU product there is the gate_up product
// whole, then silu(gate) * up row by row: a tile that takes gate and up vectors
// together reads them side by side, two to four address streams, and a
// batch-1 step of the default model in bfloat16 ran 2% slower with them.
template <Kind K>
void dense_gemm_any(const uint8_t* panels, int64_t words, int64_t n_out, const DenseActs& a,
                    int64_t rows, float* y, bool silu_pairs) {
  constexpr int64_t tile = kTileM<K>;
  if constexpr (K == Kind::kBf16Widened && kWidenUnits) {
    constexpr int64_t wide = kTileM<Kind::kFloat32>;
    const int64_t tiles = std::min((rows + wide - 1) / wide,
                                   block_rows(wide, activation_tile_bytes(K, wide, words)) / wide);
    if (tiles >= kWidenMinTiles) {
      dense_gemm<K, kVecsPerUnit, wide, Ahead::kPage, true>(panels, words, n_out, a, rows, y,
                                                            silu_pairs);
      return;
    }
  }
  if (rows > tile / 2) {
    dense_gemm<K, kVecsPerUnit, tile, Ahead::kPage>(panels, words, n_out, a, rows, y, silu_pairs);
    return;
  }
  if (!silu_pairs) {
    dense_gemm<K, kVecsPerPanel, tile / 2, Ahead::kNonTemporal>(panels, words, n_out, a, rows, y,
                                                                false);
    return;
  }
  silu_of_whole_product(rows, n_out, y, [&](float* whole) {
    dense_gemm<K, kVecsPerPanel, tile / 2, Ahead::kNonTemporal>(panels, words, n_out, a, rows,
                                                                whole, false);
  });
}

}  // namespace

DenseMatrix::DenseMatrix(const at::Tensor& panels, int64_t k, int64_t n_out)
    : panels_(panels), k_(k), n_out_(n_out) {
  TORCH_CHECK(panels.dim() == 4 && panels.is_contiguous() && panels.size(2) == kPanel,
              "panels must be contiguous [panels, words, 16, elements per word]");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 || panels.scalar_type() == at::kFloat,
              "panels must be bfloat16 or float32, got ", panels.scalar_type());
  TORCH_CHECK(panels.size(3) * panels.element_size() == kWordBytes,
              "a word holds ", kWordBytes / panels.element_size(), " elements of ",
              panels.scalar_type());
  words_ = panels.size(1);
  TORCH_CHECK(k > 0 && k <= words_ * panels.size(3) && k > (words_ - 1) * panels.size(3),
              "k ", k, " does not match the panels' ", words_, " words");
  TORCH_CHECK(n_out > (panels.size(0) - 1) * kPanel && n_out <= panels.size(0) * kPanel,
              "n_out ", n_out, " does not match the panels");
}

at::Tensor DenseMatrix::operator()(const at::Tensor& x) const { return apply(x, false); }

at::Tensor DenseMatrix::silu_product(const at::Tensor& x) const { return apply(x, true); }

bool DenseMatrix::has_silu_product() const { return n_out_ % (2 * kPanel) == 0; }

at::Tensor DenseMatrix::apply(const at::Tensor& x, bool silu_pairs) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == k_,
              "x must be float32 [M, ", k_, "]");
  TORCH_CHECK(!silu_pairs || has_silu_product(),
              "silu_product needs whole panels in each half: n_out a multiple of ", 2 * kPanel,
              ", got ", n_out_);
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, silu_pairs ? n_out_ / 2 : n_out_}, x.options());
  if (rows == 0) return out;
  const FlushDenormals flush;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const auto* panels = static_cast<const uint8_t*>(panels_.data_ptr());
  float* y = out.data_ptr<float>();
  if (panels_.scalar_type() == at::kFloat) {
    const DenseActs acts(xc, Kind::kFloat32, words_);
    dense_gemm_any<Kind::kFloat32>(panels, words_, n_out_, acts, rows, y, silu_pairs);
  } else {
    const DenseActs acts(xc, bf16_kind(), words_);
    dense_gemm_any<bf16_kind()>(panels, words_, n_out_, acts, rows, y, silu_pairs);
  }
  return out;
}

namespace {

// The TorchScript class the decoder stack takes (common/projection.h).
struct DenseProjection : ProjectionClass {
  DenseProjection(const at::Tensor& panels, int64_t k, int64_t n_out)
      : matrix(std::make_shared<const DenseMatrix>(panels, k, n_out)) {}
  std::shared_ptr<const Projection> projection() const override { return matrix; }
  std::shared_ptr<const DenseMatrix> matrix;
};

// dense_linear: x @ W.T; dense_linear_silu (SiluPairs): silu(y[:, :n_out / 2])
// * y[:, n_out / 2:] of that y, without y.
template <bool SiluPairs>
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& panels, int64_t k, int64_t n_out) {
  const DenseMatrix matrix(panels, k, n_out);
  return SiluPairs ? matrix.silu_product(x) : matrix(x);
}

// Rows `ids` (integers, any shape) of an [n_out, k] matrix in panels, as float32
// [ids.numel(), k]: what an embedding that shares a tied LM head's panels
// gathers (panel_linear.py's PanelEmbedding). One call where torch's indexing
// into the panel layout takes half a dozen ops, each of them slow on a decode
// step's caches, which the weights streaming through have just emptied.
at::Tensor panel_rows(const at::Tensor& ids, const at::Tensor& panels, int64_t k, int64_t n_out) {
  const DenseMatrix matrix(panels, k, n_out);  // checks the panels against k and n_out
  const at::Tensor flat = checked_row_ids(ids, n_out);
  const int64_t count = flat.numel(), words = panels.size(1);
  const int64_t* id = flat.data_ptr<int64_t>();
  at::Tensor out = at::empty({count, k}, panels.options().dtype(at::kFloat));
  const auto* base = static_cast<const uint8_t*>(panels.data_ptr());
  float* y = out.data_ptr<float>();
  const bool bf16 = panels.scalar_type() == at::kBFloat16;
  parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = panel_row(base, words, id[i]);
      float* dst = y + i * k;
      for (int64_t c = 0; c < k; ++c) {
        if (bf16) {
          const uint8_t* at = row + c / 2 * kWordStep + c % 2 * sizeof(c10::BFloat16);
          dst[c] = static_cast<float>(*reinterpret_cast<const c10::BFloat16*>(at));
        } else {
          std::memcpy(dst + c, row + c * kWordStep, sizeof(float));
        }
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace tokenloom

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("panel_rows(Tensor ids, Tensor panels, int k, int n_out) -> Tensor");
  m.impl("panel_rows", c10::DispatchKey::CPU, &tokenloom::panel_rows);
  m.def("dense_linear(Tensor x, Tensor panels, int k, int n_out) -> Tensor");
  m.def("dense_linear_silu(Tensor x, Tensor panels, int k, int n_out) -> Tensor");
  // Whether bfloat16 weights multiply bfloat16-rounded activations (vdpbf16ps)
  // or are widened to float32 against float32 ones.
  m.def("dense_bf16_dot_products() -> bool", []() { return TL_BF16_DOT != 0; });
  m.impl("dense_linear", c10::DispatchKey::CPU, &tokenloom::dense_linear<false>);
  m.impl("dense_linear_silu", c10::DispatchKey::CPU, &tokenloom::dense_linear<true>);
  m.class_<tokenloom::DenseProjection>("DenseProjection")
      .def(torch::init<at::Tensor, int64_t, int64_t>())
      .def("forward", [](const c10::intrusive_ptr<tokenloom::DenseProjection>& self,
                         const at::Tensor& x) { return (*self->matrix)(x); });
}
