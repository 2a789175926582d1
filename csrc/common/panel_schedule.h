// How a panel matmul's work is split between torch's intra-op threads and
// blocked for the caches: shared by the quantized (quantization/quant_linear.cpp)
// and the float (dense/dense_linear.cpp) kernels, whose weights both lie in
// panels of output rows.
//
// The output is `units` runs of panels by `rows` activation rows. A thread
// works on blocks of both that fit its L2 together (kBlockBytes of weights
// and of activations), so that with many rows neither is re-read from L3 per
// unit, and within a block calls tile(unit, m0, tile_rows) for each unit and
// each tile of at most tile_m rows. Which thread computes a tile never
// changes its result: every tile runs the same loop.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "common/denormals.h"

namespace tokenloom {

// Bytes of weights, and of activations, a thread works on at once.
constexpr int64_t kBlockBytes = 256 << 10;
// Chunks a thread takes of a matmul, on average, where they are handed out:
// the last is short, and each is still a run of panels streaming in order.
constexpr int64_t kChunksPerThread = 8;

// unit_bytes: the weights of one unit; tile_bytes: the activations of tile_m rows.
template <class Tile>
void run_panel_tiles(int64_t units, int64_t rows, int64_t tile_m, int64_t unit_bytes,
                     int64_t tile_bytes, const Tile& tile) {
  const int64_t block_units = std::max<int64_t>(1, kBlockBytes / unit_bytes);
  const int64_t block_rows = tile_m * std::max<int64_t>(1, kBlockBytes / tile_bytes);
  // Units [begin, end) on rows [row_begin, row_end), in L2-sized blocks.
  const auto run_units = [&](int64_t begin, int64_t end, int64_t row_begin, int64_t row_end) {
    const FlushDenormals flush;
    for (int64_t u0 = begin; u0 < end; u0 += block_units) {
      for (int64_t m0 = row_begin; m0 < row_end; m0 += block_rows) {
        const int64_t m_end = std::min(row_end, m0 + block_rows);
        for (int64_t u = u0; u < std::min(end, u0 + block_units); ++u) {
          for (int64_t m = m0; m < m_end; m += tile_m) tile(u, m, std::min(tile_m, m_end - m));
        }
      }
    }
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), units);
  // One row takes microseconds: too little to hand out in chunks.
  if (rows == 1 || threads <= 1) {
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) { run_units(begin, end, 0, rows); });
    return;
  }
  // Otherwise chunks of a few units by one block of rows, block by block, to
  // whichever thread is free: with two equal halves, whenever the host slowed
  // one thread the other would wait at the matmul's end.
  const int64_t unit_chunk = std::max<int64_t>(1, units / (threads * kChunksPerThread));
  const int64_t unit_chunks = (units + unit_chunk - 1) / unit_chunk;
  const int64_t chunks = unit_chunks * ((rows + block_rows - 1) / block_rows);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next++; c < chunks; c = next++) {
      const int64_t u = c % unit_chunks * unit_chunk, m = c / unit_chunks * block_rows;
      run_units(u, std::min(units, u + unit_chunk), m, std::min(rows, m + block_rows));
    }
  });
}

}  // namespace tokenloom
