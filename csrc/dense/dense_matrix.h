// A float weight (bfloat16 or float32) in panel order, checked once and
// applied many times: the `dense_linear` ops build one per call, the decoder
// stack one per projection at load (through DenseProjection).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "common/projection.h"

namespace tokenloom {

class DenseMatrix : public Projection {
 public:
  // panels: bfloat16 or float32 [P, words, 16, E] (dense_linear.cpp), the
  // [n_out, k] weight's rows in panels of 16.
  DenseMatrix(const at::Tensor& panels, int64_t k, int64_t n_out);

  at::Tensor operator()(const at::Tensor& x) const override;
  at::Tensor silu_product(const at::Tensor& x) const override;
  // Whether each half of the output is whole panels (n_out a multiple of 32).
  bool has_silu_product() const override;
  int64_t out_features() const override { return n_out_; }

 private:
  at::Tensor apply(const at::Tensor& x, bool silu_pairs) const;

  at::Tensor panels_;
  int64_t k_, n_out_, words_;
};

}  // namespace tokenloom
