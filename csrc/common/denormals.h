// Denormal floats flushed to zero for the duration of a kernel call, on x86.
//
// Products of tiny weight and activation scales fall below float32's normal
// range (a random-weight 1B model's activations reach 1e-33), and every op on a
// denormal costs a microcode assist, many times an ordinary op. The quantized matmul and the element-wise layer
// ops flush them alike, so that the matmul's fused SwiGLU output equals
// silu_and_mul's to the bit (silu(g) * u of a very negative g is denormal).
#pragma once

#include <immintrin.h>

namespace tokenloom {

// Sets FTZ and DAZ on this thread, and restores its MXCSR when destroyed: each
// thread of a parallel region makes its own.
struct FlushDenormals {
  const unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

}  // namespace tokenloom
