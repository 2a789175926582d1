// A Llama decoder's layers on quantized weights as one native call per step.
//
// At batch 1 a step of the default model makes some 300 op calls from Python
// (four projections and six element-wise or attention ops per layer, 30
// layers), each costing microseconds of Python and dispatch around a kernel
// that may take only a few more: together about a third of the step. This
// class holds every layer's weights, checked once at load, and runs the same
// kernels in the same order as the modules do (llama.py's DecoderLayer with
// native layer ops), so its output is the modules' output bit for bit. The
// element-wise and attention kernels live in the `tokenloom_cpu` library
// (model/csrc) and are called through the dispatcher, the projections
// directly. decoder_stack.py decides which models and steps it serves.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "quantization/quant_matrix.h"

namespace tokenloom {
namespace {

template <class Signature>
c10::TypedOperatorHandle<Signature> cpu_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Tensor = at::Tensor;
using CTensor = const at::Tensor&;

// The projections of a layer, in the order add_matrix receives them.
enum Projection { kQkv, kO, kGateUp, kDown, kProjections };

struct Layer {
  Tensor input_norm;
  Tensor post_norm;
  std::vector<QuantMatrix> projections;
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  // scale: the attention's score scale; the RMSNorms share eps. Needs the
  // tokenloom_cpu library loaded.
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
               Tensor final_norm)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale),
        final_norm_(std::move(final_norm)),
        rms_norm_(cpu_op<void(Tensor, CTensor, CTensor, double)>("tokenloom_cpu::rms_norm")),
        add_rms_norm_(cpu_op<void(Tensor, Tensor, CTensor, double)>("tokenloom_cpu::add_rms_norm")),
        silu_and_mul_(cpu_op<void(Tensor, CTensor)>("tokenloom_cpu::silu_and_mul")),
        rotary_qk_(cpu_op<void(Tensor, Tensor, CTensor, CTensor, CTensor)>("tokenloom_cpu::rotary_qk")),
        write_kv_(cpu_op<void(CTensor, CTensor, Tensor, Tensor, CTensor)>("tokenloom_cpu::write_kv")),
        paged_attention_(
            cpu_op<void(Tensor, CTensor, CTensor, CTensor, CTensor, CTensor, CTensor, CTensor,
                        CTensor, double)>("tokenloom_cpu::paged_attention")) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                "bad head counts or head_dim");
  }

  // Starts the next layer: its two RMSNorm weights.
  void add_layer(Tensor input_norm, Tensor post_norm) {
    TORCH_CHECK(layers_.empty() || layers_.back().projections.size() == kProjections,
                "the previous layer lacks projections");
    layers_.push_back({std::move(input_norm), std::move(post_norm), {}});
  }

  // The current layer's next projection (qkv, o, gate_up, down), as quant_linear's arguments.
  void add_matrix(Tensor qweight, std::optional<Tensor> qhigh, Tensor scale_base,
                  std::optional<Tensor> scale_codes, std::optional<Tensor> min_base,
                  std::optional<Tensor> min_codes, double min_multiplier, int64_t bits,
                  int64_t group, int64_t n_out, int64_t act_group) {
    TORCH_CHECK(!layers_.empty() && layers_.back().projections.size() < kProjections,
                "add_matrix needs a layer with fewer than four projections");
    const int64_t qkv_width = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
    TORCH_CHECK(!layers_.back().projections.empty() || n_out == qkv_width, "layer ",
                layers_.size() - 1, ": qkv width ", n_out, ", the heads need ", qkv_width);
    layers_.back().projections.emplace_back(qweight, qhigh, scale_base, scale_codes, min_base,
                                            min_codes, min_multiplier, bits, group, n_out,
                                            act_group);
  }

  // h [T, hidden]: the embedded tokens (overwritten: it becomes the residual
  // stream). cos, sin [T, head_dim / 2]; the caches and attention metadata as
  // tokenloom_cpu's write_kv and paged_attention take them. Returns the final
  // norm's output [T, hidden], or with keep_rows (int64 [R]) that of those rows
  // only [R, hidden]: the last layer then writes every row's K/V but attends,
  // projects and runs the MLP for those rows alone, where a prompt chunk's
  // other rows would be computed only to be dropped.
  Tensor forward(Tensor h, Tensor cos, Tensor sin, std::vector<Tensor> k_caches,
                 std::vector<Tensor> v_caches, Tensor slot_mapping, Tensor block_table,
                 Tensor table_rows, Tensor query_start, Tensor query_len, Tensor seq_lens,
                 std::optional<Tensor> keep_rows) {
    const size_t count = layers_.size();
    TORCH_CHECK(count > 0 && layers_.back().projections.size() == kProjections,
                "the stack's last layer is incomplete");
    TORCH_CHECK(k_caches.size() == count && v_caches.size() == count, "got ", k_caches.size(),
                " K and ", v_caches.size(), " V caches for ", count, " layers");
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(),
                "h must be contiguous float32 [T, hidden]");
    int64_t tokens = h.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const auto options = h.options();
    Tensor residual = h;
    for (size_t l = 0; l < count; ++l) {
      const Layer& layer = layers_[l];
      const std::vector<QuantMatrix>& proj = layer.projections;
      Tensor x = h;
      if (l == 0) {
        x = at::empty_like(h);
        rms_norm_.call(x, h, layer.input_norm, eps_);
      } else {
        add_rms_norm_.call(x, residual, layer.input_norm, eps_);
      }
      const Tensor qkv = proj[kQkv](x);
      Tensor q = at::empty({tokens, num_heads_, head_dim_}, options);
      Tensor k = at::empty({tokens, num_kv_heads_, head_dim_}, options);
      rotary_qk_.call(q, k, qkv, cos, sin);
      const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
      write_kv_.call(k, v, k_caches[l], v_caches[l], slot_mapping);
      if (keep_rows && l + 1 == count) {
        std::tie(table_rows, query_start, query_len, seq_lens) =
            rows_as_requests(*keep_rows, tokens, table_rows, query_start, query_len, seq_lens);
        q = q.index_select(0, *keep_rows);
        residual = residual.index_select(0, *keep_rows);
        tokens = q.size(0);
      }
      Tensor attended = at::empty_like(q);
      paged_attention_.call(attended, q, k_caches[l], v_caches[l], block_table, table_rows,
                            query_start, query_len, seq_lens, scale_);
      Tensor o = proj[kO](attended.view({tokens, q_size}));
      add_rms_norm_.call(o, residual, layer.post_norm, eps_);
      Tensor act;
      // As GatedMLP decides: fused where each half is whole panels.
      if (proj[kGateUp].has_silu_product()) {
        act = proj[kGateUp].silu_product(o);
      } else {
        const Tensor gate_up = proj[kGateUp](o);
        act = at::empty({tokens, gate_up.size(1) / 2}, options);
        silu_and_mul_.call(act, gate_up);
      }
      h = proj[kDown](act);
    }
    add_rms_norm_.call(h, residual, final_norm_, eps_);
    return h;
  }

 private:
  // Attention metadata for rows `rows` of the flat batch on their own: each
  // row a request of one query token that sees its context up to and
  // including itself, in its request's block table row.
  static std::tuple<Tensor, Tensor, Tensor, Tensor> rows_as_requests(
      CTensor rows, int64_t tokens, CTensor table_rows, CTensor query_start, CTensor query_len,
      CTensor seq_lens) {
    TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
                "keep_rows must be contiguous int64 [R]");
    const int64_t kept = rows.size(0), requests = query_start.size(0);
    const auto options = query_start.options();
    Tensor starts = at::arange(kept, options), lens = at::ones({kept}, options);
    Tensor seqs = at::empty({kept}, options), tables = at::empty({kept}, options);
    const int32_t* first = query_start.data_ptr<int32_t>();
    const int32_t* count = query_len.data_ptr<int32_t>();
    const int32_t* context = seq_lens.data_ptr<int32_t>();
    const int32_t* table = table_rows.data_ptr<int32_t>();
    const int64_t* row = rows.data_ptr<int64_t>();
    int32_t* seq_of = seqs.data_ptr<int32_t>();
    int32_t* table_of = tables.data_ptr<int32_t>();
    for (int64_t i = 0; i < kept; ++i) {
      TORCH_CHECK(row[i] >= 0 && row[i] < tokens, "keep_rows: row ", row[i], " out of ", tokens);
      // Requests own ascending, contiguous runs of rows.
      const int64_t r = std::upper_bound(first, first + requests, row[i]) - first - 1;
      TORCH_CHECK(r >= 0 && row[i] < first[r] + count[r], "keep_rows: row ", row[i],
                  " belongs to no request");
      seq_of[i] = context[r] - count[r] + (row[i] - first[r]) + 1;
      table_of[i] = table[r];
    }
    return {tables, starts, lens, seqs};
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  Tensor final_norm_;
  std::vector<Layer> layers_;
  c10::TypedOperatorHandle<void(Tensor, CTensor, CTensor, double)> rms_norm_;
  c10::TypedOperatorHandle<void(Tensor, Tensor, CTensor, double)> add_rms_norm_;
  c10::TypedOperatorHandle<void(Tensor, CTensor)> silu_and_mul_;
  c10::TypedOperatorHandle<void(Tensor, Tensor, CTensor, CTensor, CTensor)> rotary_qk_;
  c10::TypedOperatorHandle<void(CTensor, CTensor, Tensor, Tensor, CTensor)> write_kv_;
  c10::TypedOperatorHandle<void(Tensor, CTensor, CTensor, CTensor, CTensor, CTensor, CTensor,
                                CTensor, CTensor, double)>
      paged_attention_;
};

}  // namespace
}  // namespace tokenloom

TORCH_LIBRARY_FRAGMENT(tokenloom_quant, m) {
  m.class_<tokenloom::DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor>())
      .def("add_layer", &tokenloom::DecoderStack::add_layer)
      .def("add_matrix", &tokenloom::DecoderStack::add_matrix)
      .def("forward", &tokenloom::DecoderStack::forward);
}
