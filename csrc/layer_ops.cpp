// Fused element-wise layers of a Llama-family decoder on CPU (float32).
//
// Each replaces a chain of torch ops that would otherwise read and write the
// activations several times per layer: RMSNorm (with the residual add folded
// in), SiLU(gate) * up, and rotate-half RoPE of Q and K straight out of the
// fused QKV projection. Rows are independent, so they are split across torch's
// intra-op threads in chunks big enough to be worth a thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "common/denormals.h"
#include "common/team.h"
#include "common/vec.h"

namespace tokenloom {
namespace {

constexpr int64_t kMinFloatsPerThread = 16384;

void check_rows(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.dim());
  TORCH_CHECK(t.stride(-1) == 1, name, " must have unit stride in its last dim");
}

// Denormals are flushed to zero (see denormals.h), as in the quantized matmul.
template <typename F>
void for_rows(int64_t rows, int64_t row_floats, const F& body) {
  const int64_t grain = std::max<int64_t>(1, kMinFloatsPerThread / std::max<int64_t>(1, row_floats));
  parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

// out = x / rms(x) * weight for one row of n floats.
inline void normalize_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  vec squares = vec{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vec v = load(x + i);
    squares += v * v;
  }
  float sum = lane_sum(squares);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, load(x + i) * inv_rms * load(weight + i));
  for (; i < n; ++i) out[i] = x[i] * inv_rms * weight[i];
}

// out [T, n] = rms_norm(x [T, n]) * weight
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(out, "out", 2);
  check_rows(x, "x", 2);
  check_rows(weight, "weight", 1);
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(out.sizes() == x.sizes() && weight.size(0) == n, "rms_norm: shapes differ");
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  for_rows(rows, n, [&](int64_t r) {
    normalize_row(xp + r * xs, wp, op + r * os, n, static_cast<float>(eps));
  });
}

// residual += x, then x = rms_norm(residual) * weight (both [T, n], in place).
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x", 2);
  check_rows(residual, "residual", 2);
  check_rows(weight, "weight", 1);
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.size(0) == n, "add_rms_norm: shapes differ");
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  for_rows(rows, n, [&](int64_t r) {
    float* xr = xp + r * xs;
    float* res = rp + r * rs;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(res + i, load(res + i) + load(xr + i));
    for (; i < n; ++i) res[i] += xr[i];
    normalize_row(res, wp, xr, n, static_cast<float>(eps));
  });
}

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_rows(out, "out", 2);
  check_rows(gate_up, "gate_up", 2);
  const int64_t rows = out.size(0), n = out.size(1);
  TORCH_CHECK(gate_up.size(0) == rows && gate_up.size(1) == 2 * n,
              "silu_and_mul: gate_up must be [T, 2 * I] for out [T, I]");
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  for_rows(rows, 3 * n, [&](int64_t r) {
    const float* gate = gp + r * gs;
    const float* up = gate + n;
    float* o = op + r * os;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(o + i, silu_times(load(gate + i), load(up + i)));
    for (; i < n; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  });
}

// Rotate-half RoPE of the Q and K heads at the front of each qkv row:
// q_out [T, H, D], k_out [T, Hkv, D] from qkv [T, >= (H + Hkv) * D];
// cos, sin [T, D / 2] for each token's position.
void rotary_qk(at::Tensor q_out, at::Tensor k_out, const at::Tensor& qkv, const at::Tensor& cos,
               const at::Tensor& sin) {
  check_rows(q_out, "q_out", 3);
  check_rows(k_out, "k_out", 3);
  check_rows(qkv, "qkv", 2);
  check_rows(cos, "cos", 2);
  check_rows(sin, "sin", 2);
  TORCH_CHECK(q_out.is_contiguous() && k_out.is_contiguous(), "q_out and k_out must be contiguous");
  const int64_t rows = qkv.size(0), num_heads = q_out.size(1), num_kv_heads = k_out.size(1);
  const int64_t head_dim = q_out.size(2), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && k_out.size(2) == head_dim, "rotary_qk: bad head_dim");
  TORCH_CHECK(q_out.size(0) == rows && k_out.size(0) == rows && cos.size(0) == rows &&
                  sin.size(0) == rows && cos.size(1) == half && sin.size(1) == half,
              "rotary_qk: row counts or cos/sin widths differ");
  TORCH_CHECK(qkv.size(1) >= (num_heads + num_kv_heads) * head_dim, "rotary_qk: qkv too narrow");
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q_out.data_ptr<float>();
  float* kp = k_out.data_ptr<float>();
  const int64_t heads = num_heads + num_kv_heads, qkv_stride = qkv.stride(0);
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  for_rows(rows, heads * head_dim, [&](int64_t r) {
    const float* c = cp + r * cs;
    const float* s = sp + r * ss;
    for (int64_t h = 0; h < heads; ++h) {
      const float* x = src + r * qkv_stride + h * head_dim;
      float* o = h < num_heads ? qp + (r * num_heads + h) * head_dim
                               : kp + (r * num_kv_heads + h - num_heads) * head_dim;
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {
        const vec x1 = load(x + i), x2 = load(x + half + i), cv = load(c + i), sv = load(s + i);
        store(o + i, x1 * cv - x2 * sv);
        store(o + half + i, x2 * cv + x1 * sv);
      }
      for (; i < half; ++i) {
        o[i] = x[i] * c[i] - x[half + i] * s[i];
        o[half + i] = x[half + i] * c[i] + x[i] * s[i];
      }
    }
  });
}

}  // namespace
}  // namespace tokenloom

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary_qk(Tensor(a!) q_out, Tensor(b!) k_out, Tensor qkv, Tensor cos, Tensor sin) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &tokenloom::rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &tokenloom::add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &tokenloom::silu_and_mul);
  m.impl("rotary_qk", c10::DispatchKey::CPU, &tokenloom::rotary_qk);
}
