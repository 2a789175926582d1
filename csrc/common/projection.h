// A projection's weight as the decoder stack (decoder/decoder_stack.cpp)
// applies it, whatever its format: quantized panels
// (quantization/quant_matrix.h) or float panels (dense/dense_matrix.h).
//
// Each format registers a TorchScript class deriving from ProjectionClass;
// Python hands an instance from a module to the stack, which keeps the
// Projection inside and calls it without the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <memory>

namespace tokenloom {

class Projection {
 public:
  virtual ~Projection() = default;

  // x float32 [M, K] (rows may be strided) -> a new float32 [M, out_features()].
  virtual at::Tensor operator()(const at::Tensor& x) const = 0;

  // silu(y[:, :N / 2]) * y[:, N / 2:] of y = (*this)(x), a new [M, N / 2],
  // equal bit for bit to layer_ops' silu_and_mul of y, where y is never
  // stored; only where has_silu_product().
  virtual at::Tensor silu_product(const at::Tensor& x) const = 0;

  virtual bool has_silu_product() const = 0;
  virtual int64_t out_features() const = 0;
};

// The TorchScript face of a Projection: the object Python holds.
struct ProjectionClass : torch::CustomClassHolder {
  virtual std::shared_ptr<const Projection> projection() const = 0;
};

// The Projection inside a ProjectionClass instance of any format (Python
// passes it as `Any`).
inline std::shared_ptr<const Projection> projection_of(const c10::IValue& value) {
  TORCH_CHECK(value.isObject(), "expected a projection object, got ", value.tagKind());
  const auto holder = value.toObjectRef().getSlot(0).toCapsule();
  const auto* projection = dynamic_cast<const ProjectionClass*>(holder.get());
  TORCH_CHECK(projection != nullptr, "expected a projection object, got ",
              value.type()->repr_str());
  return projection->projection();
}

}  // namespace tokenloom
