// How fast a batch-1 bfloat16 matmul can stream weights in panels on this CPU:
// the dense kernel's inner loop (csrc/dense/dense_linear.cpp, vdpbf16ps on one
// activation row) over a matrix the size of the default model's LM head,
// reading NV panels side by side, with or without software prefetches ahead,
// on 4 KB or 2 MB pages, beside a plain read of the same memory. Needs
// AVX512_BF16.
//
//   g++ -O3 -march=native -fopenmp benchmarks/kernels/panel_stream.cpp -o /tmp/panel_stream
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=true /tmp/panel_stream
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int64_t kWords = 288;                  // K = 576 bfloat16 columns, in pairs
constexpr int64_t kPanels = 49152 / 16;          // N = 49152 output rows, 16 a panel
constexpr int64_t kPanelBytes = kWords * 64;     // per word, 16 rows' pairs
constexpr int64_t kMatrixBytes = kPanels * kPanelBytes;
constexpr int kCopies = 5;                       // matrices cycled: the L3 holds none
constexpr int kRepeats = 40;

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// NV panels from `first`, each output lane one dependent chain over the words.
template <int NV>
__attribute__((noinline)) void tile(const uint8_t* first, const int32_t* x, float* out,
                                    int64_t prefetch) {
  __m512 acc[NV];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t t = 0; t < kWords; ++t) {
    if (prefetch > 0) {
      for (int j = 0; j < NV; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(first + j * kPanelBytes + t * 64 + prefetch),
                     _MM_HINT_T0);
      }
    }
    const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x[t]));
    for (int j = 0; j < NV; ++j) {
      const __m512i w = _mm512_loadu_si512(first + j * kPanelBytes + t * 64);
      acc[j] = _mm512_dpbf16_ps(acc[j], reinterpret_cast<__m512bh>(w), xb);
    }
  }
  for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + j * 16, acc[j]);
}

double median_gbs(std::vector<double> times) {
  std::sort(times.begin(), times.end());
  return kMatrixBytes / times[times.size() / 2] / 1e9;
}

// GB/s of the matmul: each thread one contiguous run of panels, NV at a time.
template <int NV>
double matmul_gbs(const uint8_t* memory, const int32_t* x, float* y, int64_t prefetch) {
  std::vector<double> times;
  for (int r = 0; r < kRepeats; ++r) {
    const uint8_t* w = memory + r % kCopies * kMatrixBytes;
    const double start = seconds();
#pragma omp parallel
    {
      const int64_t groups = kPanels / NV, threads = omp_get_num_threads();
      const int64_t thread = omp_get_thread_num();
      for (int64_t g = groups * thread / threads; g < groups * (thread + 1) / threads; ++g) {
        tile<NV>(w + g * NV * kPanelBytes, x, y + g * NV * 16, prefetch);
      }
    }
    times.push_back(seconds() - start);
  }
  return median_gbs(times);
}

double plain_read_gbs(const uint8_t* memory) {
  std::vector<double> times;
  float total = 0;
  for (int r = 0; r < kRepeats; ++r) {
    const uint8_t* w = memory + r % kCopies * kMatrixBytes;
    const double start = seconds();
#pragma omp parallel reduction(+ : total)
    {
      const int64_t lines = kMatrixBytes / 256, threads = omp_get_num_threads();
      const int64_t thread = omp_get_thread_num();
      __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
      for (int64_t i = lines * thread / threads; i < lines * (thread + 1) / threads; ++i) {
        const uint8_t* p = w + i * 256;
        a = _mm512_add_ps(a, _mm512_loadu_ps(p));
        b = _mm512_add_ps(b, _mm512_loadu_ps(p + 64));
        c = _mm512_add_ps(c, _mm512_loadu_ps(p + 128));
        d = _mm512_add_ps(d, _mm512_loadu_ps(p + 192));
      }
      total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
    }
    times.push_back(seconds() - start);
  }
  if (total == 0.5f) std::printf(" ");  // keeps the sums
  return median_gbs(times);
}

}  // namespace

int main() {
  const int64_t bytes = kMatrixBytes * kCopies;
  std::vector<int32_t> x(kWords, 0x3f803f80);  // pairs of bfloat16 1.0
  std::vector<float> y(kPanels * 16);
  std::printf("GB/s, median of %d, %d threads, %.1f MB matrices\n", kRepeats,
              omp_get_max_threads(), kMatrixBytes / 1e6);
  std::printf("%-10s %-10s %10s %10s %10s %10s %10s\n", "pages", "prefetch", "plain read",
              "1 panel", "2 panels", "4 panels", "8 panels");
  for (const bool huge : {false, true}) {
    auto* memory = static_cast<uint8_t*>(aligned_alloc(2 << 20, bytes));
    if (huge) madvise(memory, bytes, MADV_HUGEPAGE);
    for (int64_t i = 0; i < bytes / 2; ++i) {
      reinterpret_cast<uint16_t*>(memory)[i] = 0x3c00 + (i & 0xff);  // small bfloat16s
    }
    for (const int64_t prefetch : {0, 1024, 4096}) {
      std::printf("%-10s %-10ld %10.1f %10.1f %10.1f %10.1f %10.1f\n", huge ? "2 MB" : "4 KB",
                  prefetch, plain_read_gbs(memory),
                  matmul_gbs<1>(memory, x.data(), y.data(), prefetch),
                  matmul_gbs<2>(memory, x.data(), y.data(), prefetch),
                  matmul_gbs<4>(memory, x.data(), y.data(), prefetch),
                  matmul_gbs<8>(memory, x.data(), y.data(), prefetch));
    }
    free(memory);
  }
}
