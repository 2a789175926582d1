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
// call: its first thread (the leader) runs the call, and
// tokenloom::parallel_for hands the other threads their chunks through one
// cache line they wait on, and waits for them on another. The leader may also
// hand one thread a side task to run beside its own work (the decoder stack:
// one micro-batch's attention beside the other's projections); the side
// task's parallel_for calls go to the leader once it waits for the task.
// Outside with_team, and inside a chunk (a nested call), it is
// at::parallel_for, which splits work the same way.
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

// One parallel_for's chunks at a time, posted by one thread and claimed by
// any: the poster runs the first chunk and each other goes to whichever thread
// claims it first, the poster included, so a thread busy elsewhere joins late
// or not at all and nothing waits for it.
class JobSlot {
 public:
  // f(begin, end) on chunks of `chunk` of [begin, end); returns when every
  // chunk is done and rethrows the first exception a chunk threw.
  template <class F>
  void run(int64_t begin, int64_t end, int64_t chunk, const F& f) {
    const int64_t chunks = (end - begin + chunk - 1) / chunk;
    TORCH_CHECK(chunks < kMaxChunks, "a team job of ", chunks, " chunks");
    call_ = [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); };
    fn_ = &f;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    // Job numbers wrap around, skipping 0 (no job yet) and the closed mark.
    posted_ = posted_ + 1 >= kClosed ? 1 : posted_ + 1;
    claims_.store(claim_word(posted_, 1, chunks));
    run_chunk(0);
    for (int64_t c; (c = claim(posted_)) >= 0;) run_chunk(c);
    // Every chunk is claimed; those who claimed one finish it.
    wait_until([&] { return active_.load() == 0; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  // The number of the job posted last (kClosed once closed).
  uint64_t current() const { return seq_of(claims_.load()); }

  // Whether job `seq` has a chunk left to claim.
  bool open(uint64_t seq) const {
    const uint64_t word = claims_.load();
    return seq_of(word) == seq && next_of(word) < chunks_of(word);
  }

  // Runs chunks of job `seq` (not the caller's own) until none is left.
  void join(uint64_t seq) {
    // Counted before claiming, so that the poster, once every chunk is
    // claimed, sees each thread that may still be running one.
    active_.fetch_add(1);
    for (int64_t c; (c = claim(seq)) >= 0;) run_chunk(c);
    active_.fetch_sub(1);
  }

  void close() { claims_.store(claim_word(kClosed, 0, 0)); }

  static constexpr uint64_t kClosed = 0xffffffffu;

 private:
  // The claims word: the job's number, the next chunk to claim and the number
  // of chunks, so that one compare-and-swap checks all three.
  static constexpr int64_t kMaxChunks = 1 << 16;
  static uint64_t claim_word(uint64_t seq, uint64_t next, uint64_t chunks) {
    return seq << 32 | next << 16 | chunks;
  }
  static uint64_t seq_of(uint64_t word) { return word >> 32; }
  static uint64_t next_of(uint64_t word) { return word >> 16 & 0xffff; }
  static uint64_t chunks_of(uint64_t word) { return word & 0xffff; }

  // The next unclaimed chunk of job `seq`, or -1 when none is left.
  int64_t claim(uint64_t seq) {
    uint64_t word = claims_.load();
    while (seq_of(word) == seq && next_of(word) < chunks_of(word)) {
      if (claims_.compare_exchange_weak(word, word + (1 << 16))) {
        return static_cast<int64_t>(next_of(word));
      }
    }
    return -1;
  }

  void run_chunk(int64_t index) {
    const int64_t b = begin_ + index * chunk_;
    const bool nested = std::exchange(in_team_chunk, true);
    try {
      call_(fn_, b, std::min(end_, b + chunk_));
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    in_team_chunk = nested;
  }

  // The job, written by its poster before the claims word that publishes it.
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  const void* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  uint64_t posted_ = 0;
  alignas(64) std::atomic<uint64_t> claims_{0};
  alignas(64) std::atomic<int64_t> active_{0};
  std::exception_ptr error_;
  std::mutex error_mutex_;
};

class Team;
// The team whose side task the calling thread is running, if any.
inline thread_local Team* side_team = nullptr;

class Team {
 public:
  // f(begin, end) on chunks of [begin, end), as at::parallel_for splits them,
  // from the thread that leads the team: see JobSlot.
  template <class F>
  void parallel_for(int64_t begin, int64_t end, int64_t chunk, const F& f) {
    jobs_.run(begin, end, chunk, f);
  }

  // The same from the thread running the side task, whose chunks the leader
  // claims while it waits in join_side.
  template <class F>
  void side_parallel_for(int64_t begin, int64_t end, int64_t chunk, const F& f) {
    side_jobs_.run(begin, end, chunk, f);
  }

  // Starts task() on another team thread, the first to be free, while the
  // leader goes on; join_side() waits for it. One side task at a time.
  template <class Task>
  void post_side(const Task& task) {
    side_.call = [](const void* fn) { (*static_cast<const Task*>(fn))(); };
    side_.fn = &task;
    side_.state.store(kSidePosted);
  }

  // Returns when the posted side task is done, running it here (on the whole
  // team) if no team thread has started it, else taking part in its
  // parallel_for calls; rethrows what it threw.
  void join_side() {
    if (take_side()) {
      run_side();
    } else {
      uint64_t seq = 0;
      wait_until([&] {
        if (side_.state.load() == kSideDone) return true;
        if (side_jobs_.open(seq = side_jobs_.current())) side_jobs_.join(seq);
        return false;
      });
    }
    side_.state.store(kSideIdle);
    if (side_.error) std::rethrow_exception(std::exchange(side_.error, nullptr));
  }

  int64_t size() const { return size_; }

  // A team thread other than the leader, until close(): runs the side task
  // when one is posted, and takes part in each of the leader's jobs.
  void serve() {
    uint64_t seen = 0, seq = 0;
    while (true) {
      wait_until([&] {
        seq = jobs_.current();
        return seq != seen || side_.state.load() == kSidePosted;
      });
      if (seq == JobSlot::kClosed) return;
      if (take_side()) {
        side_team = this;
        run_side();
        side_team = nullptr;
        side_.state.store(kSideDone);
        continue;
      }
      seen = seq;
      jobs_.join(seq);
    }
  }

  void close() { jobs_.close(); }

  void set_size(int64_t size) { size_ = size; }

 private:
  enum SideState : int { kSideIdle, kSidePosted, kSideTaken, kSideDone };

  bool take_side() {
    int posted = kSidePosted;
    return side_.state.compare_exchange_strong(posted, kSideTaken);
  }

  void run_side() {
    try {
      side_.call(side_.fn);
    } catch (...) {
      side_.error = std::current_exception();
    }
  }

  JobSlot jobs_, side_jobs_;
  struct alignas(64) Side {
    std::atomic<int> state{kSideIdle};
    void (*call)(const void*) = nullptr;
    const void* fn = nullptr;
    std::exception_ptr error;
  } side_;
  int64_t size_ = 1;
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
      team.serve();
    }
  }
  if (error) std::rethrow_exception(error);
}

// at::parallel_for's meaning (f(begin, end) over chunks of at least `grain`,
// one per thread), on the team where the caller leads one.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  // On the team's leader, or on the thread running its side task.
  Team* team = led_team != nullptr ? led_team : side_team;
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
  const int64_t chunk = (range + chunks - 1) / chunks;
  if (team == led_team) {
    team->parallel_for(begin, end, chunk, f);
  } else {
    team->side_parallel_for(begin, end, chunk, f);
  }
}

}  // namespace tokenloom
