// The ids an embedding gathers from a matrix kept for a kernel (the float
// panels' panel_rows, the quantized weight's rows), checked once for both.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace tokenloom {

// `ids` (integers of any dtype, shape and layout) as contiguous int64, each
// checked to be a row of an n_out-row matrix.
inline at::Tensor checked_row_ids(const at::Tensor& ids, int64_t n_out) {
  TORCH_CHECK(!at::isFloatingType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
              "ids must be integers, got ", ids.scalar_type());
  at::Tensor flat = ids.to(at::kLong).contiguous();
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n_out, "id ", id[i], " out of the matrix's ", n_out, " rows");
  }
  return flat;
}

}  // namespace tokenloom
