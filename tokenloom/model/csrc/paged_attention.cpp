// Paged attention for short queries (decodes, short prompt chunks) on CPU.
//
// Reads each request's K/V in place through its block table: nothing is
// gathered or padded. One task is one (query token, KV head) pair; it scores
// the token's visible context for the query heads of that KV group, applies a
// softmax and sums V. Tasks are handed out dynamically to torch's intra-op
// threads because context lengths differ widely within a batch.
//
// Layouts (float32, contiguous):
//   out, q          [T, H, D]             flat batch of query tokens
//   k_cache         [num_blocks, Hkv, D, block_size]  (keys transposed per block)
//   v_cache         [num_blocks, block_size, Hkv, D]
//   block_table     int32 [rows, max_blocks]
//   table_rows, query_start, query_len, seq_lens: int32 [R], one per request
// Request r owns q rows query_start[r] .. + query_len[r]; its context after this
// step is seq_lens[r] tokens, so query token i sits at position
// seq_lens[r] - query_len[r] + i and sees keys 0 .. that position (causal).
// Rows of q/out outside these requests are left untouched.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// e^x for the softmax's x <= 0, branch-free so loops over it vectorize
// (a libm call would not). Range reduction x = n ln2 + r, |r| <= ln2 / 2, then
// a degree-6 polynomial for e^r; relative error about 1e-7.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

struct Task {
  int32_t request;
  int32_t token;  // row of q / out
  int32_t visible;  // keys this token attends to
};

void check_input(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

struct Problem {
  const float* q;
  const float* k_cache;
  const float* v_cache;
  float* out;
  const int32_t* table;
  const int32_t* rows;
  const std::vector<Task>* tasks;
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks, longest;
  float scale;
};

// HEAD_DIM > 0 fixes the head size at compile time so the inner loops unroll
// into whole vector registers; 0 is the generic fallback.
constexpr int64_t kTile = 16;  // keys scored together: one vector of scores

// Scores of up to kTile keys of one K block for one query head. K blocks are
// [Hkv, D, block_size] (see model/kv_cache.py), so row d of the tile holds
// dimension d of consecutive keys: the dot products become vector FMAs across
// keys, in four independent accumulators to hide FMA latency.
template <int64_t HEAD_DIM, int64_t COUNT>
inline void score_tile(const float* __restrict qh, const float* __restrict kt, int64_t head_dim,
                       int64_t block_size, int64_t count, float scale, float* __restrict out) {
  const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t n = COUNT > 0 ? COUNT : count;
  float part[4][kTile] = {};
  int64_t d = 0;
  for (; d + 4 <= dim; d += 4) {
    for (int64_t r = 0; r < 4; ++r) {
      const float qd = qh[d + r];
      const float* row = kt + (d + r) * block_size;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) part[r][j] += qd * row[j];
    }
  }
  for (; d < dim; ++d) {
    const float* row = kt + d * block_size;
    for (int64_t j = 0; j < n; ++j) part[0][j] += qh[d] * row[j];
  }
  for (int64_t j = 0; j < count; ++j) out[j] = (part[0][j] + part[1][j] + part[2][j] + part[3][j]) * scale;
}

// HEAD_DIM > 0 fixes the head size at compile time so the inner loops unroll
// into whole vector registers; 0 is the generic fallback.
template <int64_t HEAD_DIM>
void run(const Problem& p) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : p.head_dim;
  const int64_t num_heads = p.num_heads, group = p.group, block_size = p.block_size;
  const int64_t k_block_stride = p.num_kv_heads * head_dim * block_size;
  const int64_t v_token_stride = p.num_kv_heads * head_dim;  // V: [blocks, block_size, Hkv, D]
  const bool whole_tiles = block_size % kTile == 0;
  const std::vector<Task>& tasks = *p.tasks;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(num_heads * p.longest);
    std::vector<float> acc(num_heads * head_dim);
    std::vector<float> denom(num_heads);
    for (int64_t t = next++; t < num_tasks; t = next++) {
      const Task& task = tasks[t];
      const int64_t n = task.visible;
      const int32_t* blocks = p.table + static_cast<int64_t>(p.rows[task.request]) * p.max_blocks;
      const float* q = p.q + task.token * num_heads * head_dim;

      // Scores for every visible key and query head, one K tile at a time.
      for (int64_t first = 0; first < n; first += block_size) {
        const float* kb = p.k_cache + blocks[first / block_size] * k_block_stride;
        const int64_t in_block = std::min(block_size, n - first);
        for (int64_t t0 = 0; t0 < in_block; t0 += kTile) {
          const int64_t count = std::min(kTile, in_block - t0);
          // A whole tile may read keys past `count` (still inside the block,
          // discarded); a partial one reads exactly `count`.
          const bool full = whole_tiles || count == kTile;
          for (int64_t h = 0; h < num_heads; ++h) {
            const float* kt = kb + (h / group) * head_dim * block_size + t0;
            float* out = scores.data() + h * n + first + t0;
            if (full) {
              score_tile<HEAD_DIM, kTile>(q + h * head_dim, kt, head_dim, block_size, count,
                                          p.scale, out);
            } else {
              score_tile<HEAD_DIM, 0>(q + h * head_dim, kt, head_dim, block_size, count,
                                      p.scale, out);
            }
          }
        }
      }
      // Softmax numerators and denominators.
      for (int64_t h = 0; h < num_heads; ++h) {
        float* sh = scores.data() + h * n;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) peak = std::max(peak, sh[j]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          sh[j] = exp_nonpositive(sh[j] - peak);
          sum += sh[j];
        }
        denom[h] = sum;
      }
      // Weighted sum of V, one head at a time so its accumulator stays in registers.
      for (int64_t h = 0; h < num_heads; ++h) {
        float a[HEAD_DIM > 0 ? HEAD_DIM : 1];
        float* __restrict sum = HEAD_DIM > 0 ? a : acc.data() + h * head_dim;
        std::fill(sum, sum + head_dim, 0.0f);
        const float* w = scores.data() + h * n;
        const int64_t v_head = (h / group) * head_dim;
        for (int64_t first = 0; first < n; first += block_size) {
          const float* __restrict v =
              p.v_cache + blocks[first / block_size] * block_size * v_token_stride + v_head;
          const int64_t in_block = std::min(block_size, n - first);
          for (int64_t j = 0; j < in_block; ++j, v += v_token_stride) {
            const float wj = w[first + j];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) sum[d] += wj * v[d];
          }
        }
        float* o = p.out + (task.token * num_heads + h) * head_dim;
        const float inv = 1.0f / denom[h];
        for (int64_t d = 0; d < head_dim; ++d) o[d] = sum[d] * inv;
      }
    }
  });
}

void paged_attention(
    at::Tensor out,
    const at::Tensor& q,
    const at::Tensor& k_cache,
    const at::Tensor& v_cache,
    const at::Tensor& block_table,
    const at::Tensor& table_rows,
    const at::Tensor& query_start,
    const at::Tensor& query_len,
    const at::Tensor& seq_lens,
    double scale) {
  check_input(out, "out", at::kFloat, 3);
  check_input(q, "q", at::kFloat, 3);
  check_input(k_cache, "k_cache", at::kFloat, 4);
  check_input(v_cache, "v_cache", at::kFloat, 4);
  check_input(block_table, "block_table", at::kInt, 2);
  for (const at::Tensor* t : {&table_rows, &query_start, &query_len, &seq_lens}) {
    check_input(*t, "per-request metadata", at::kInt, 1);
    TORCH_CHECK(t->size(0) == seq_lens.size(0), "per-request metadata lengths differ");
  }
  TORCH_CHECK(out.sizes() == q.sizes(), "out and q shapes differ");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = v_cache.size(1), num_kv_heads = v_cache.size(2);
  TORCH_CHECK(v_cache.size(3) == head_dim, "v_cache head_dim ", v_cache.size(3), " != ", head_dim);
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == num_kv_heads &&
                  k_cache.size(2) == head_dim && k_cache.size(3) == block_size,
              "k_cache must be [num_blocks, Hkv, D, block_size] matching v_cache");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads ", num_heads, " not a multiple of ", num_kv_heads);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1), num_blocks = k_cache.size(0);

  const int32_t* rows = table_rows.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = query_len.data_ptr<int32_t>();
  const int32_t* seqs = seq_lens.data_ptr<int32_t>();
  std::vector<Task> tasks;
  int64_t longest = 0;
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t r = 0; r < seq_lens.size(0); ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= seqs[r], "request ", r, ": bad query_len/seq_len");
    TORCH_CHECK(starts[r] >= 0 && starts[r] + lens[r] <= num_tokens, "request ", r, ": rows out of q");
    TORCH_CHECK(rows[r] >= 0 && rows[r] < block_table.size(0), "request ", r, ": bad table row");
    const int64_t used_blocks = (seqs[r] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= max_blocks, "request ", r, ": seq_len exceeds its block table");
    // Its last token sees the whole context, so these are all the blocks it reads.
    const int32_t* blocks = table + static_cast<int64_t>(rows[r]) * max_blocks;
    for (int64_t b = 0; b < used_blocks; ++b) {
      TORCH_CHECK(blocks[b] >= 0 && blocks[b] < num_blocks, "block id ", blocks[b], " out of range");
    }
    for (int32_t i = 0; i < lens[r]; ++i) {
      tasks.push_back({static_cast<int32_t>(r), starts[r] + i, seqs[r] - lens[r] + i + 1});
    }
    longest = std::max<int64_t>(longest, seqs[r]);
  }

  const Problem problem{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                        out.data_ptr<float>(), table, rows, &tasks, num_heads, num_kv_heads,
                        group, head_dim, block_size, max_blocks, longest,
                        static_cast<float>(scale)};
  switch (head_dim) {
    case 64: run<64>(problem); break;
    case 128: run<128>(problem); break;
    case 32: run<32>(problem); break;
    case 96: run<96>(problem); break;
    case 80: run<80>(problem); break;
    default: run<0>(problem); break;
  }
}

// Pins intra-op thread i to cpus[i], except thread 0, the caller: it keeps its
// affinity so that threads and processes it starts later are not confined to
// one core. The threads are the OpenMP pool torch's own parallel regions use
// (same runtime, same team size), so they stop migrating between cores.
void bind_threads(c10::IntArrayRef cpus) {
  const int count = static_cast<int>(cpus.size());
  TORCH_CHECK(count == at::get_num_threads(), "need one cpu per intra-op thread (",
              at::get_num_threads(), "), got ", count);
  int failures = 0;
#pragma omp parallel num_threads(count) reduction(+ : failures)
  if (omp_get_thread_num() > 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[omp_get_thread_num()]), &set);
    failures += sched_setaffinity(0, sizeof(set), &set) != 0;
  }
  TORCH_CHECK(failures == 0, "sched_setaffinity failed for ", failures, " threads");
}

}  // namespace

TORCH_LIBRARY(tokenloom_cpu, m) {
  m.def("bind_threads(int[] cpus) -> ()", &bind_threads);
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor table_rows, Tensor query_start, Tensor query_len, "
      "Tensor seq_lens, float scale) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
