"""Which execution pipes the int8 matmul's instructions share, on this CPU.

The quantized kernel (``quantization/csrc/quant_linear.cpp``) spends most of a
prompt step in its int8 loop: per 8 activation columns two ``vpdpbusd`` and
one FMA that applies the activation's scale. Whether that loop can go faster
depends on which other instructions can run beside ``vpdpbusd`` for free. This
script compiles a small C++ file with ``-O3 -march=native`` and times, for each
instruction, four of them interleaved with eight independent ``vpdpbusd``: 8
cycles means they ran on other pipes, 12 that they took the same ones. It then
times the loop itself per (activation row, 32-column weight group) as the kernel
runs it (a float scale per 8 or 16 columns, one FMA each), with power-of-two
sub-scales shifting the integer sums instead (one FMA per 32 columns), and with
power-of-two scales per 8 or 16 applied by the dot product's starting value (no
multiply at all); and the bound of each counted in ``vpdpbusd``/FMA slots.

Needs AVX-512 with VNNI and BF16 (zmm registers). Cycles assume the clock
measured by a chain of dependent integer adds (one a cycle).

    .venv/bin/python benchmarks/cpu_pipes.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>

static double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

static double clock_hz() {
  long x = 0;
  const long n = 400000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  return 4.0 * n / seconds_since(t0);
}

#define R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define R4(X) X(0) X(1) X(2) X(3)
#define DP(i) a##i = _mm512_dpbusd_epi32(a##i, u, s);
#define KEEP_A(i) asm volatile("" : "+v"(a##i));
#define KEEP_B(i) asm volatile("" : "+v"(b##i), "+v"(f##i));

// Cycles per iteration of 8 independent vpdpbusd plus 4 of OP (on registers b, f).
#define PIPE_TEST(NAME, OP)                                                            \
  static double NAME(double hz) {                                                      \
    __m512 x = _mm512_set1_ps(1), y = _mm512_set1_ps(1e-9f);                          \
    __m512i u = _mm512_set1_epi8(1), s = _mm512_set1_epi8(2);                          \
    asm volatile("" : "+v"(x), "+v"(y), "+v"(u), "+v"(s));                             \
    R8(DECL_A) R4(DECL_B)                                                              \
    const long n = 20000000;                                                           \
    const auto t0 = std::chrono::steady_clock::now();                                  \
    for (long k = 0; k < n; ++k) { R8(DP) R4(OP) R8(KEEP_A) R4(KEEP_B) }               \
    return seconds_since(t0) * hz / n;                                                 \
  }
#define DECL_A(i) __m512i a##i = _mm512_set1_epi32(i);
#define DECL_B(i) __m512i b##i = _mm512_set1_epi32(i); __m512 f##i = _mm512_set1_ps(i);

#define OP_NONE(i)
#define OP_FMA(i) f##i = _mm512_fmadd_ps(x, y, f##i);
#define OP_MUL(i) f##i = _mm512_mul_ps(y, f##i);
#define OP_ADD(i) f##i = _mm512_add_ps(y, f##i);
#define OP_CVT(i) f##i = _mm512_cvtepi32_ps(b##i); b##i = _mm512_castps_si512(f##i);
#define OP_IADD(i) b##i = _mm512_add_epi32(b##i, u);
#define OP_SHIFT(i) b##i = _mm512_slli_epi32(b##i, 1);
#define OP_VSHIFT(i) b##i = _mm512_sllv_epi32(b##i, u);
#define OP_AND_SHIFT16(i) b##i = _mm512_srli_epi16(_mm512_and_si512(b##i, u), 4);
#define OP_MULLO(i) b##i = _mm512_mullo_epi32(b##i, u);
#define OP_MADDWD(i) b##i = _mm512_madd_epi16(b##i, u);
#define OP_DPBF16(i) f##i = _mm512_dpbf16_ps(f##i, (__m512bh)u, (__m512bh)s);
#define OP_PERMW(i) b##i = _mm512_permutexvar_epi16(u, b##i);
#define OP_UNPACK16(i) b##i = _mm512_unpacklo_epi16(b##i, u);

PIPE_TEST(t_none, OP_NONE)
PIPE_TEST(t_fma, OP_FMA)
PIPE_TEST(t_mul, OP_MUL)
PIPE_TEST(t_add, OP_ADD)
PIPE_TEST(t_cvt, OP_CVT)
PIPE_TEST(t_iadd, OP_IADD)
PIPE_TEST(t_shift, OP_SHIFT)
PIPE_TEST(t_vshift, OP_VSHIFT)
PIPE_TEST(t_and_shift16, OP_AND_SHIFT16)
PIPE_TEST(t_mullo, OP_MULLO)
PIPE_TEST(t_maddwd, OP_MADDWD)
PIPE_TEST(t_dpbf16, OP_DPBF16)
PIPE_TEST(t_permw, OP_PERMW)
PIPE_TEST(t_unpack16, OP_UNPACK16)

// The int8 loop on data in L1: 8 activation rows, 18 weight groups of 32
// columns (K = 576), 4-bit codes, min term; per (row, group) cycles.
constexpr int kRows = 8, kGroups = 18, kSub = 4 * kGroups;
alignas(64) static uint8_t codes[kSub][64];
alignas(64) static int32_t words[kSub][kRows][2];
alignas(64) static float act_scale[kSub][kRows];
alignas(64) static int32_t act_shift[kSub][kRows];
alignas(64) static int32_t act_start[kSub][kRows];
alignas(64) static float group_scale[kGroups][kRows];
alignas(64) static float scales[kGroups][16], mins[kGroups][16], sums[kRows][kGroups];
static float out[kRows][16];

// How a variant of the loop scales each dot product before the weight group's
// two FMAs (scale, and min times the activations' sum).
enum class Scales {
  kPer8Float,    // as the kernel: each 8 columns' dot product times its float (an FMA)
  kPer16Float,   // as the kernel for the MLP's input: per 16 columns (two sub-units)
  kShiftedSub,   // power-of-two sub-scales under one float per 32 columns: the
                 // integer dot products shifted and added, one multiply per group
  kPow2Per8,     // a power of two per 8 columns, 2^e: the dot product starts from
                 // the bits of 1.5 * 2^(23 + e), so it becomes the scaled float
                 // minus that start (a subtraction and an add, no multiply)
  kPow2Per16,    // the same per 16 columns (two sub-units in one dot product)
};

template <Scales S>
__attribute__((noinline)) static void int8_loop() {
  constexpr int step = S == Scales::kPer16Float || S == Scales::kPow2Per16 ? 2 : 1;  // sub-units per dot
  const __m512i m15 = _mm512_set1_epi8(15);
  const __m512i biased = _mm512_set1_epi32(0x4b400000);  // 1.5 * 2^23
  const __m512 bias = _mm512_set1_ps(12582912.f);
  __m512 acc[kRows];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int g = 0; g < kGroups; ++g) {
    __m512 gsum[kRows];   // float sums (all but kShiftedSub)
    __m512i isum[kRows];  // integer sums (kShiftedSub)
    for (int r = 0; r < kRows; ++r) gsum[r] = _mm512_setzero_ps(), isum[r] = _mm512_setzero_si512();
    for (int t = 4 * g; t < 4 * g + 4; t += step) {
      __m512i lo[step], hi[step];
      for (int k = 0; k < step; ++k) {
        const __m512i v = _mm512_load_si512(codes[t + k]);
        lo[k] = _mm512_and_si512(v, m15);
        hi[k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
      }
      for (int r = 0; r < kRows; ++r) {
        __m512i start = biased;
        if constexpr (S == Scales::kShiftedSub) start = _mm512_setzero_si512();
        if constexpr (S == Scales::kPow2Per8 || S == Scales::kPow2Per16)
          start = _mm512_set1_epi32(act_start[t][r]);
        __m512i d = start;
        for (int k = 0; k < step; ++k) {
          d = _mm512_dpbusd_epi32(d, lo[k], _mm512_set1_epi32(words[t + k][r][0]));
          d = _mm512_dpbusd_epi32(d, hi[k], _mm512_set1_epi32(words[t + k][r][1]));
        }
        if constexpr (S == Scales::kPer8Float || S == Scales::kPer16Float) {
          gsum[r] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_castsi512_ps(d), bias),
                                    _mm512_set1_ps(act_scale[t][r]), gsum[r]);
        } else if constexpr (S == Scales::kShiftedSub) {
          isum[r] = _mm512_add_epi32(isum[r], _mm512_sllv_epi32(d, _mm512_set1_epi32(act_shift[t][r])));
        } else {
          gsum[r] = _mm512_add_ps(gsum[r], _mm512_sub_ps(_mm512_castsi512_ps(d), _mm512_castsi512_ps(start)));
        }
      }
    }
    const __m512 sc = _mm512_load_ps(scales[g]), mn = _mm512_load_ps(mins[g]);
    for (int r = 0; r < kRows; ++r) {
      if constexpr (S == Scales::kShiftedSub) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]),
                                 _mm512_mul_ps(sc, _mm512_set1_ps(group_scale[g][r])), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(gsum[r], sc, acc[r]);
      }
      acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sums[r][g]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

template <class F>
static double per_row_group(F f, double hz) {
  for (int i = 0; i < 2000; ++i) f();
  const int n = 200000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) { f(); asm volatile("" ::: "memory"); }
  return seconds_since(t0) * hz / n / (kRows * kGroups);
}

int main() {
  for (int i = 0; i < kSub; ++i) {
    for (int j = 0; j < 64; ++j) codes[i][j] = static_cast<uint8_t>(i * 7 + j);
    for (int r = 0; r < kRows; ++r) {
      words[i][r][0] = i + r;
      words[i][r][1] = i - r;
      act_scale[i][r] = 0.01f;
      act_shift[i][r] = (i + r) & 3;
      act_start[i][r] = 0x4b400000 + (((i + r) & 3) << 23);  // 1.5 * 2^(23 + 0..3)
    }
  }
  for (int g = 0; g < kGroups; ++g)
    for (int l = 0; l < 16; ++l) scales[g][l] = 0.1f, mins[g][l] = 0.01f;
  const double hz = clock_hz();
  std::printf("clock %.2f GHz (dependent integer adds)\n\n", hz / 1e9);
  std::printf("| beside 8 vpdpbusd (zmm) | cycles per iteration |\n|---|---:|\n");
  const struct { const char* name; double (*f)(double); } tests[] = {
      {"nothing", t_none}, {"4 vfmadd", t_fma}, {"4 vmulps", t_mul}, {"4 vaddps", t_add},
      {"4 vcvtdq2ps", t_cvt}, {"4 vpaddd", t_iadd}, {"4 vpslld (immediate)", t_shift},
      {"4 vpsllvd", t_vshift}, {"4 vpandd + vpsrlw", t_and_shift16}, {"4 vpmulld", t_mullo},
      {"4 vpmaddwd", t_maddwd}, {"4 vdpbf16ps", t_dpbf16}, {"4 vpermw", t_permw},
      {"4 vpunpcklwd", t_unpack16}};
  for (const auto& t : tests) std::printf("| %s | %.2f |\n", t.name, t.f(hz));
  std::printf("\n| int8 loop, per (activation row, 32-column group) | cycles | bound (vpdpbusd/FMA slots) |\n"
              "|---|---:|---:|\n");
  std::printf("| per-8 float scales (the kernel) | %.2f | 14 |\n",
              per_row_group(int8_loop<Scales::kPer8Float>, hz));
  std::printf("| per-16 float scales (the kernel, the MLP's input) | %.2f | 12 |\n",
              per_row_group(int8_loop<Scales::kPer16Float>, hz));
  std::printf("| power-of-two sub-scales, shifted integer sums | %.2f | 11 |\n",
              per_row_group(int8_loop<Scales::kShiftedSub>, hz));
  std::printf("| power of two per 8, from the dot product's start | %.2f | 10 |\n",
              per_row_group(int8_loop<Scales::kPow2Per8>, hz));
  std::printf("| power of two per 16, from the dot product's start | %.2f | 10 |\n",
              per_row_group(int8_loop<Scales::kPow2Per16>, hz));
  return 0;
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "pipes.cpp", Path(tmp) / "pipes"
        source.write_text(SOURCE)
        build = subprocess.run(
            ["g++", "-O3", "-march=native", "-o", str(binary), str(source)],
            capture_output=True,
            text=True,
        )
        if build.returncode != 0:
            sys.exit(
                f"needs AVX-512 with VNNI and BF16 and g++; the build failed:\n{build.stderr[-2000:]}"
            )
        subprocess.run([str(binary)], check=True)


if __name__ == "__main__":
    main()
