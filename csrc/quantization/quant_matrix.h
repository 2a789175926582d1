// A quantized weight in panels.py's layout, checked once and applied many
// times: the `quant_linear` op builds one per call, the decoder stack
// (decoder/decoder_stack.cpp) one per projection at load (through
// QuantProjection).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "common/projection.h"

namespace tokenloom {

class QuantMatrix : public Projection {
 public:
  // The arguments of `quant_linear` after x (see quant_linear.cpp).
  QuantMatrix(const at::Tensor& qweight, const std::optional<at::Tensor>& qhigh,
              const at::Tensor& scale_base,
              const std::optional<at::Tensor>& scale_codes,
              const std::optional<at::Tensor>& min_base,
              const std::optional<at::Tensor>& min_codes, double min_multiplier, int64_t bits,
              int64_t group, int64_t n_out, int64_t act_group);

  // x float32 [M, <= K] (rows may be strided) -> a new [M, n_out].
  at::Tensor operator()(const at::Tensor& x) const override;
  at::Tensor silu_product(const at::Tensor& x) const override;
  // Whether each half of the output is whole panels (n_out a multiple of 32),
  // as silu_product needs.
  bool has_silu_product() const override;
  int64_t out_features() const override;
  // Rows `ids` (integers, any shape) of the dequantized matrix, columns [0, k),
  // as float32 [ids.numel(), k]: scale * q + min per group, the product rounded
  // before the min is added (formats.py's dequantize, bit for bit).
  at::Tensor rows(const at::Tensor& ids, int64_t k) const;

 private:
  at::Tensor apply(const at::Tensor& x, bool silu_pairs) const;

  struct Layout;
  std::shared_ptr<const Layout> layout_;
};

}  // namespace tokenloom
