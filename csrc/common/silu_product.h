// The SwiGLU activation silu(y[:, :n / 2]) * y[:, n / 2:] of a gate_up matmul
// y [rows, n] that a kernel computes whole first, as the matmul kernels do for
// a decode step's few rows (dense/dense_linear.cpp's top says why).
#pragma once

#include <cstdint>
#include <vector>

#include "common/vec.h"

namespace tokenloom {

// product(buffer) writes y [rows, n] into a buffer this thread keeps (grown to
// the widest gate_up and reused by every layer); then out [rows, n / 2] gets
// the activation, with the same silu_times as the fused epilogues, so the same
// bits. n / 2 is whole vectors: the kernels' silu products take whole 16-row
// panels in each half.
template <class Product>
void silu_of_whole_product(int64_t rows, int64_t n, float* out, const Product& product) {
  static thread_local std::vector<float> whole;
  whole.resize(rows * n);
  product(whole.data());
  const int64_t half = n / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = whole.data() + r * n;
    for (int64_t j = 0; j < half; j += kLanes) {
      store(out + r * half + j, silu_times(load(gate + j), load(gate + half + j)));
    }
  }
}

}  // namespace tokenloom
