// y = x @ dequant(W).T for weights kept quantized in memory (see
// tokenloom/quantization/formats.py for the layouts).
//
// Layouts, per output row of K_pad (K rounded up to 32) columns:
//   bits 4: 16 bytes per 32 columns, byte j holds column j (low nibble) and
//           j + 16 (high nibble); w = scale * q + min, one fp32 scale and min
//           per 32 columns.
//   bits 8: one int8 per column; w = scale * q (+ min), scale (and min) per
//           `group` (16 or 32) columns.
// Rows are dequantized into a small buffer that stays in L1/L2 and reused for
// every activation row: up to kSmallRows rows by a register-blocked dot product
// (four output rows share each activation load), beyond that a tile of rows is
// handed to at::mm, whose GEMM kernel then runs on the dequantized tile.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../../model/csrc/vec.h"

namespace tokenloom {
namespace {

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));

// Byte lanes to floats through 32-bit integers: a direct conversion compiles
// to one scalar conversion per lane.
template <typename Bytes>
inline vec to_float(Bytes bytes) {
  return __builtin_convertvector(__builtin_convertvector(bytes, ivec), vec);
}

// Sixteen int8 codes to floats. GCC's generic conversion of signed bytes is
// scalar, so the x86 paths use the sign-extending loads directly.
inline vec load_i8(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return reinterpret_cast<const vec&>(f);
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
  vec v;
  std::memcpy(&v, halves, sizeof(v));
  return v;
#else
  vec v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

constexpr int64_t kRowBlock = 4;    // output rows per register block
constexpr int64_t kSmallRows = 8;   // activation rows served by the dot-product path
constexpr int64_t kTileRows = 256;  // output rows per GEMM tile

struct QuantWeight {
  int64_t bits;
  int64_t group;
  int64_t k_pad;
  int64_t row_bytes;
  int64_t row_groups;
  const uint8_t* q;
  const float* scales;
  const float* mins;  // nullptr: no offsets

  void dequant_row(int64_t n, float* dst) const {
    const float* s = scales + n * row_groups;
    const float* m = mins ? mins + n * row_groups : nullptr;
    const uint8_t* q_row = q + n * row_bytes;
    if (bits == 4) {
      for (int64_t b = 0; b < k_pad / 32; ++b) {
        const u8x16 bytes = *reinterpret_cast<const u8x16*>(q_row + 16 * b);
        const vec lo = to_float(bytes & 15);
        const vec hi = to_float(bytes >> 4);
        store(dst + 32 * b, lo * s[b] + m[b]);
        store(dst + 32 * b + 16, hi * s[b] + m[b]);
      }
      return;
    }
    const int8_t* codes = reinterpret_cast<const int8_t*>(q_row);
    for (int64_t g = 0; g < k_pad / group; ++g) {
      const float scale = s[g];
      const float offset = m ? m[g] : 0.0f;
      for (int64_t c = g * group; c < (g + 1) * group; c += 16) {
        store(dst + c, load_i8(codes + c) * scale + offset);
      }
    }
  }
};

// out[m, n0 + j] for j < count, every row m of x (k_pad columns, zero tail).
void dot_block(const QuantWeight& w, const float* x, int64_t rows, int64_t n0, int64_t count,
               int64_t out_stride, float* out, float* buf) {
  const int64_t k_pad = w.k_pad;
  for (int64_t j = 0; j < kRowBlock; ++j) {
    if (j < count) {
      w.dequant_row(n0 + j, buf + j * k_pad);
    } else {
      std::fill(buf + j * k_pad, buf + (j + 1) * k_pad, 0.0f);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k_pad;
    vec a0{}, a1{}, a2{}, a3{};
    for (int64_t k = 0; k < k_pad; k += kLanes) {
      const vec xv = load(xr + k);
      a0 += xv * load(buf + k);
      a1 += xv * load(buf + k_pad + k);
      a2 += xv * load(buf + 2 * k_pad + k);
      a3 += xv * load(buf + 3 * k_pad + k);
    }
    const float sums[kRowBlock] = {lane_sum(a0), lane_sum(a1), lane_sum(a2), lane_sum(a3)};
    for (int64_t j = 0; j < count; ++j) out[r * out_stride + n0 + j] = sums[j];
  }
}

void quant_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& qweight,
                  const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t bits,
                  int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat, "out must be float32");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous(), "weights must be contiguous");
  const int64_t rows = x.size(0);
  const int64_t n_out = qweight.size(0);
  const int64_t k_pad = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  TORCH_CHECK(k_pad % 32 == 0 && x.size(1) <= k_pad, "x has more columns than the weight");
  TORCH_CHECK(out.size(0) == rows && out.size(1) == n_out, "out must be [M, N]");
  at::Tensor xp = x.contiguous();
  if (x.size(1) != k_pad) {
    xp = at::zeros({rows, k_pad}, x.options());
    xp.narrow(1, 0, x.size(1)).copy_(x);
  }
  QuantWeight w{bits,
                group,
                k_pad,
                qweight.size(1),
                scales.size(1),
                reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                scales.data_ptr<float>(),
                mins.has_value() ? mins->contiguous().data_ptr<float>() : nullptr};
  TORCH_CHECK(!mins.has_value() || mins->is_contiguous(), "mins must be contiguous");
  float* out_ptr = out.data_ptr<float>();
  const float* x_ptr = xp.data_ptr<float>();
  if (rows <= kSmallRows) {
    const int64_t blocks = (n_out + kRowBlock - 1) / kRowBlock;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(kRowBlock * k_pad);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * kRowBlock;
        dot_block(w, x_ptr, rows, n0, std::min(kRowBlock, n_out - n0), n_out, out_ptr,
                  buf.data());
      }
    });
    return;
  }
  const int64_t tiles = (n_out + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    at::Tensor tile = at::empty({kTileRows, k_pad}, x.options());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows;
      const int64_t count = std::min(kTileRows, n_out - n0);
      float* tile_ptr = tile.data_ptr<float>();
      for (int64_t j = 0; j < count; ++j) w.dequant_row(n0 + j, tile_ptr + j * k_pad);
      // Copied by hand: worker threads do not run in the caller's inference mode,
      // so ATen may not write to `out` there.
      const at::Tensor part = at::mm(xp, tile.narrow(0, 0, count).t()).contiguous();
      const float* part_ptr = part.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r) {
        std::copy(part_ptr + r * count, part_ptr + (r + 1) * count, out_ptr + r * n_out + n0);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(tokenloom_quant, m) {
  m.def(
      "quant_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor? mins, "
      "int bits, int group) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom_quant, CPU, m) { m.impl("quant_linear", &quant_linear); }

}  // namespace tokenloom
