// torch's intra-op threads held as a team for the length of one native call
// (the decoder stack's step), and the parallel_for every kernel here runs its
// threads' work through.
//
// at::parallel_for opens an OpenMP region per call: a fork and a join, each a
// round of cache lines passed between the cores. A batch-1 step of the default
// model opens about 150 of them, and in minutes when this 2-vCPU host reads
// memory fastest (likely its two cores on different dies) an empty region
// took 1.35-1.6 us, against a matmul's 20 to 30, where the team below hands
// over an empty share in 0.5. Inside with_team, one region spans the whole
// call: its first thread runs the call, and tokenloom::parallel_for hands the
// other threads their chunks through one cache line they wait on, and waits
// for them on another. Outside with_team, and inside a chunk (a nested call),
// it is at::parallel_for, which splits work the same way.
#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

namespace tokenloom {

// Pauses before a waiting team thread starts yielding its core at every check:
// about 25 us on Zen 4, longer than a step's longest wait (a batch-1 decode's
// attention, 12-14 us). Past it, the thread waited on likely lacks a core
// (torch told to use more threads than the host has cores, or a busy host),
// and spinning on would hold the core it needs: a step then took 100 times as
// long.
constexpr int kSpinsBeforeYield = 1 << 10;

// Returns once done(): spinning, then yielding the core at each check.
template <class Done>
void wait_until(const Done& done) {
  for (int spins = 0; !done();) {
    if (spins < kSpinsBeforeYield) {
      ++spins;
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

// Whether this thread is running a team's chunk: a parallel_for there runs inline.
inline thread_local bool in_team_chunk = false;

class Team {
 public:
  // f(begin, end) on each of the team's threads' chunks of [begin, end), as
  // at::parallel_for splits them; returns when every chunk is done and
  // rethrows the first exception a chunk threw.
  template <class F>
  void parallel_for(int64_t begin, int64_t end, int64_t chunk, const F& f) {
    job_.call = [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); };
    job_.fn = &f;
    job_.begin = begin;
    job_.end = end;
    job_.chunk = chunk;
    pending_.store(size_ - 1, std::memory_order_relaxed);
    job_.posted.store(job_.posted.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    run_chunk(0);
    wait_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  int64_t size() const { return size_; }

  // The team's thread `index` (not the first) until close(): waits for each
  // job and runs its chunk.
  void serve(int64_t index) {
    uint64_t seen = 0;
    while (true) {
      uint64_t posted = seen;
      wait_until([&] { return (posted = job_.posted.load(std::memory_order_acquire)) != seen; });
      seen = posted;
      if (posted == kClosed) return;
      run_chunk(index);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  void close() { job_.posted.store(kClosed, std::memory_order_release); }

  void set_size(int64_t size) { size_ = size; }

 private:
  static constexpr uint64_t kClosed = ~uint64_t{0};

  void run_chunk(int64_t index) {
    const int64_t b = job_.begin + index * job_.chunk;
    if (b >= job_.end) return;
    in_team_chunk = true;
    try {
      job_.call(job_.fn, b, std::min(job_.end, b + job_.chunk));
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    in_team_chunk = false;
  }

  // What the first thread posts, on the line the others wait on.
  struct alignas(64) Job {
    std::atomic<uint64_t> posted{0};
    void (*call)(const void*, int64_t, int64_t) = nullptr;
    const void* fn = nullptr;
    int64_t begin = 0, end = 0, chunk = 0;
  } job_;
  alignas(64) std::atomic<int64_t> pending_{0};
  int64_t size_ = 1;
  std::exception_ptr error_;
  std::mutex error_mutex_;
};

// The team the calling thread leads, if any.
inline thread_local Team* led_team = nullptr;

// body() with torch's intra-op threads held as a team (top of this file);
// with one thread, or inside a parallel region, body() alone.
template <class Body>
void with_team(const Body& body) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region() || led_team != nullptr) {
    body();
    return;
  }
  Team team;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int index = omp_get_thread_num();
    if (index == 0) {
      team.set_size(omp_get_num_threads());
      led_team = &team;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      led_team = nullptr;
      team.close();
    } else {
      team.serve(index);
    }
  }
  if (error) std::rethrow_exception(error);
}

// at::parallel_for's meaning (f(begin, end) over chunks of at least `grain`,
// one per thread), on the team where the caller leads one.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  Team* team = led_team;
  if (team == nullptr || in_team_chunk) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t range = end - begin, least = std::max<int64_t>(grain, 1);
  const int64_t chunks = std::min(team->size(), (range + least - 1) / least);
  if (chunks <= 1) {
    f(begin, end);
    return;
  }
  team->parallel_for(begin, end, (range + chunks - 1) / chunks, f);
}

}  // namespace tokenloom
