// How a panel matmul's work is split between torch's intra-op threads and
// blocked for the caches: shared by the quantized (quantization/quant_linear.cpp)
// and the float (dense/dense_linear.cpp) kernels, whose weights both lie in
// panels of output rows.
//
// The output is `units` runs of panels by `rows` activation rows. A thread
// works on blocks of both that fit its L2 together (kBlockBytes of weights
// and of activations), so that with many rows neither is re-read from L3 per
// unit, and within a block calls tile(unit, m0, tile_rows, next) for each unit
// and each tile of at most tile_m rows. With one block of rows (a decode
// step, a short prompt) it takes the units in runs (run_balanced), each
// unit's tiles in turn, and `next` names a share of the next unit's weights
// for the tile to request while it computes (NextUnitShare). Which thread
// computes a tile never changes its result: every tile runs the same loop.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "common/denormals.h"
#include "common/team.h"

namespace tokenloom {

// Bytes of weights, and of activations, a thread works on at once.
constexpr int64_t kBlockBytes = 256 << 10;
// Chunks a thread takes of a matmul, on average, where they are handed out:
// the last is short, and each is still a run of panels streaming in order.
constexpr int64_t kChunksPerThread = 8;

// body(u) for every unit u in [0, units), on up to `threads` of torch's
// intra-op threads, for matmuls whose weights stream through once (one block
// of activation rows). Each thread owns a contiguous run of units, which it
// takes front to back one unit at a time: one address stream, which the
// hardware prefetcher follows. A thread whose run is done takes the back half
// of the run with the most units left. Two threads streaming equal halves end
// a fifth of a matmul's time apart on a shared host (a batch-1 step of the
// default model, both weight formats), so an even split leaves one of them
// waiting for the other at every matmul's end.
template <class Body>
void run_balanced(int64_t units, int64_t threads, const Body& body) {
  threads = std::max<int64_t>(1, std::min(threads, units));
  // A run is [front, back) in one word, so that its owner taking the front and
  // a thief taking the back never both get a unit.
  struct alignas(64) Run {
    std::atomic<uint64_t> span;
  };
  const auto pack = [](uint64_t front, uint64_t back) { return back << 32 | front; };
  const auto front_of = [](uint64_t span) { return static_cast<int64_t>(span & 0xffffffffu); };
  const auto back_of = [](uint64_t span) { return static_cast<int64_t>(span >> 32); };
  // On the stack for the usual thread counts: this runs for every matmul of a
  // decode step.
  constexpr int64_t kStackRuns = 8;
  Run stack_runs[kStackRuns];
  const std::unique_ptr<Run[]> heap_runs(threads > kStackRuns ? new Run[threads] : nullptr);
  Run* const runs = heap_runs ? heap_runs.get() : stack_runs;
  for (int64_t t = 0; t < threads; ++t) {
    runs[t].span.store(pack(units * t / threads, units * (t + 1) / threads), std::memory_order_relaxed);
  }
  // body(u) for the units at a run's front, until none is left.
  const auto take_front = [&](Run& run) {
    uint64_t span = run.span.load(std::memory_order_relaxed);
    while (front_of(span) < back_of(span)) {
      const int64_t u = front_of(span);
      if (run.span.compare_exchange_weak(span, pack(u + 1, back_of(span)),
                                         std::memory_order_relaxed)) {
        body(u);
        span = run.span.load(std::memory_order_relaxed);
      }
    }
  };
  // Moves the back half of the longest run left into `own` (empty); false
  // when no run has two units or more.
  const auto steal_into = [&](Run& own) {
    while (true) {
      int64_t victim = -1, most = 1;
      for (int64_t t = 0; t < threads; ++t) {
        const uint64_t span = runs[t].span.load(std::memory_order_relaxed);
        if (back_of(span) - front_of(span) > most) {
          victim = t;
          most = back_of(span) - front_of(span);
        }
      }
      if (victim < 0) return false;
      uint64_t span = runs[victim].span.load(std::memory_order_relaxed);
      const int64_t front = front_of(span), back = back_of(span), take = (back - front) / 2;
      if (take > 0 && runs[victim].span.compare_exchange_strong(span, pack(front, back - take),
                                                                std::memory_order_relaxed)) {
        own.span.store(pack(back - take, back), std::memory_order_relaxed);
        return true;
      }
    }
  };
  parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    // One run a thread, unless the team is smaller than asked for (a nested
    // region runs on its caller alone).
    for (int64_t t = begin; t < end; ++t) take_front(runs[t]);
    while (steal_into(runs[begin])) take_front(runs[begin]);
  });
}

// The share of the next unit's weights that one of a unit's tiles requests
// while it computes: part `part` of `parts` equal parts of unit `unit`
// (none when unit < 0). A unit's first tile reads its weights from DRAM and
// the rest re-read them from the caches: unrequested, the next unit's weights
// would only start to stream with its first tile, which then waits on DRAM
// while the core's arithmetic idles, and the later tiles compute while DRAM
// idles. Requested a part a tile, they stream during the arithmetic.
struct NextUnitShare {
  int64_t unit;
  int64_t part;
  int64_t parts;
};
constexpr NextUnitShare kNoNextUnit{-1, 0, 1};

// Activation rows in a block, for tiles of tile_m rows whose activations
// take tile_bytes.
inline int64_t block_rows(int64_t tile_m, int64_t tile_bytes) {
  return tile_m * std::max<int64_t>(1, kBlockBytes / tile_bytes);
}

// unit_bytes: the weights of one unit; tile_bytes: the activations of tile_m rows.
template <class Tile>
void run_panel_tiles(int64_t units, int64_t rows, int64_t tile_m, int64_t unit_bytes,
                     int64_t tile_bytes, const Tile& tile) {
  const int64_t block_units = std::max<int64_t>(1, kBlockBytes / unit_bytes);
  const int64_t block_rows = tokenloom::block_rows(tile_m, tile_bytes);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), units);
  // One block of rows: each unit's tiles in turn, the units in runs, whose
  // weights stream through once. A thread's next unit is the next one of its
  // run, unless a thief took it.
  if (rows <= block_rows) {
    const int64_t parts = (rows + tile_m - 1) / tile_m;
    const auto unit_tiles = [&](int64_t u) {
      // A unit of one tile is one stream, which the tile's own prefetches lead.
      for (int64_t part = 0; part < parts; ++part) {
        const NextUnitShare share{u + 1, part, parts};
        tile(u, part * tile_m, std::min(tile_m, rows - part * tile_m),
             parts > 1 && u + 1 < units ? share : kNoNextUnit);
      }
    };
    if (threads <= 1) {
      const FlushDenormals flush;
      for (int64_t u = 0; u < units; ++u) unit_tiles(u);
      return;
    }
    run_balanced(units, threads, unit_tiles);
    return;
  }
  // Units [begin, end) on rows [row_begin, row_end), in L2-sized blocks.
  const auto run_units = [&](int64_t begin, int64_t end, int64_t row_begin, int64_t row_end) {
    const FlushDenormals flush;
    for (int64_t u0 = begin; u0 < end; u0 += block_units) {
      for (int64_t m0 = row_begin; m0 < row_end; m0 += block_rows) {
        const int64_t m_end = std::min(row_end, m0 + block_rows);
        for (int64_t u = u0; u < std::min(end, u0 + block_units); ++u) {
          for (int64_t m = m0; m < m_end; m += tile_m) {
            tile(u, m, std::min(tile_m, m_end - m), kNoNextUnit);
          }
        }
      }
    }
  };
  if (threads <= 1) {
    run_units(0, units, 0, rows);
    return;
  }
  // Many rows: chunks of a few units by one block of rows, block by block, to
  // whichever thread is free: with two equal halves, whenever the host slowed
  // one thread the other would wait at the matmul's end.
  const int64_t unit_chunk = std::max<int64_t>(1, units / (threads * kChunksPerThread));
  const int64_t unit_chunks = (units + unit_chunk - 1) / unit_chunk;
  const int64_t chunks = unit_chunks * ((rows + block_rows - 1) / block_rows);
  std::atomic<int64_t> next{0};
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next++; c < chunks; c = next++) {
      const int64_t u = c % unit_chunks * unit_chunk, m = c / unit_chunks * block_rows;
      run_units(u, std::min(units, u + unit_chunk), m, std::min(rows, m + block_rows));
    }
  });
}

}  // namespace tokenloom
