// A decoder's layers as one native call per step, over any weight format
// whose projections are a Projection (common/projection.h): quantized panels
// or float (bfloat16, float32) panels.
//
// At batch 1 a step makes a few hundred small op calls from Python, each
// costing microseconds of interpreter and dispatch around a kernel that may
// take only a few more. This class holds every layer's weights, checked once
// at load, and runs the layer's recipe (tokenloom/model/recipe.py: its steps
// by name, the same for every layer) step by step with the kernels the modules
// call for each step (llama.py's DecoderLayer.forward with native layer ops),
// so its output is the modules' output bit for bit. A recipe with a step this
// file does not implement is refused when the stack is built. The element-wise
// and attention kernels are called through the dispatcher, the projections
// directly. tokenloom/model/decoder_stack.py decides which models and steps it
// serves.

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/projection.h"
#include "common/team.h"

namespace tokenloom {
namespace {

template <class Signature>
c10::TypedOperatorHandle<Signature> cpu_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Tensor = at::Tensor;
using CTensor = const at::Tensor&;

// The steps this stack implements (recipe.py's Op, by the same names).
enum class Op { kAddNorm, kNorm, kQkvProj, kRope, kAttend, kOProj, kGateUp, kDownProj };

struct StepName {
  const char* name;
  Op op;
};
constexpr StepName kSteps[] = {
    {"add_norm", Op::kAddNorm}, {"norm", Op::kNorm},       {"qkv_proj", Op::kQkvProj},
    {"rope", Op::kRope},        {"attend", Op::kAttend},   {"o_proj", Op::kOProj},
    {"gate_up", Op::kGateUp},   {"down_proj", Op::kDownProj},
};

std::vector<std::string> implemented_steps() {
  std::vector<std::string> names;
  for (const StepName& step : kSteps) names.emplace_back(step.name);
  return names;
}

Op parse_step(const std::string& name) {
  for (const StepName& step : kSteps) {
    if (name == step.name) return step.op;
  }
  TORCH_CHECK(false, "the decoder stack has no step '", name, "'");
}

bool takes_norm(Op op) { return op == Op::kAddNorm || op == Op::kNorm; }

bool takes_matrix(Op op) {
  return op == Op::kQkvProj || op == Op::kOProj || op == Op::kGateUp || op == Op::kDownProj;
}

// One layer's weights: a norm weight per norm step and a projection per
// projection step, in recipe order.
struct Layer {
  std::vector<Tensor> norms;
  std::vector<std::shared_ptr<const Projection>> matrices;
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  // recipe: every layer's steps by name; scale: the attention's score scale;
  // the RMSNorms share eps. Needs the tokenloom_cpu library loaded.
  DecoderStack(std::vector<std::string> recipe, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps, double scale, Tensor final_norm)
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
    bool qkv = false, rope = false;
    for (const std::string& name : recipe) {
      const Op op = parse_step(name);
      // Each step's inputs come from an earlier one; the first sets the residual stream.
      TORCH_CHECK(!recipe_.empty() || op == Op::kAddNorm, "a recipe starts with add_norm");
      TORCH_CHECK(op != Op::kRope || qkv, "rope needs an earlier qkv_proj");
      TORCH_CHECK(op != Op::kAttend || rope, "attend needs an earlier rope");
      qkv = qkv || op == Op::kQkvProj;
      rope = rope || op == Op::kRope;
      norm_index_.push_back(norms_per_layer_);
      matrix_index_.push_back(matrix_steps_.size());
      if (op == Op::kAttend) attend_steps_.push_back(recipe_.size());
      recipe_.push_back(op);
      if (takes_matrix(op)) matrix_steps_.push_back(op);
      norms_per_layer_ += takes_norm(op);
    }
  }

  // Starts the next layer: the weights of its norm steps, in recipe order.
  void add_layer(std::vector<Tensor> norms) {
    TORCH_CHECK(layers_.empty() || layers_.back().matrices.size() == matrix_steps_.size(),
                "the previous layer lacks projections");
    TORCH_CHECK(norms.size() == norms_per_layer_, "the recipe has ", norms_per_layer_,
                " norm steps, got ", norms.size(), " norm weights");
    layers_.push_back({std::move(norms), {}});
  }

  // The current layer's next projection step's weight: a projection object of
  // any format (common/projection.h).
  void add_projection(const c10::IValue& projection) {
    TORCH_CHECK(!layers_.empty() && layers_.back().matrices.size() < matrix_steps_.size(),
                "add_projection needs a layer with fewer projections than the recipe's");
    auto& matrices = layers_.back().matrices;
    std::shared_ptr<const Projection> matrix = projection_of(projection);
    const int64_t qkv_width = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
    TORCH_CHECK(matrix_steps_[matrices.size()] != Op::kQkvProj ||
                    matrix->out_features() == qkv_width,
                "layer ", layers_.size() - 1, ": qkv width ", matrix->out_features(),
                ", the heads need ", qkv_width);
    matrices.push_back(std::move(matrix));
  }

  // Steps of at least `rows` decodes run as two micro-batches (forward_split);
  // 0: none do.
  void overlap_decodes_from(int64_t rows) {
    TORCH_CHECK(rows >= 0, "overlap_decodes_from: rows must be at least 0, got ", rows);
    split_min_rows_ = rows;
  }

  // Steps run as two micro-batches so far.
  int64_t micro_batched_steps() const { return micro_batched_steps_; }

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
    TORCH_CHECK(count > 0 && layers_.back().matrices.size() == matrix_steps_.size(),
                "the stack's last layer is incomplete");
    TORCH_CHECK(k_caches.size() == count && v_caches.size() == count, "got ", k_caches.size(),
                " K and ", v_caches.size(), " V caches for ", count, " layers");
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(),
                "h must be contiguous float32 [T, hidden]");
    const int64_t tokens = h.size(0);
    Rows all{h, {}, {}, {}, {}, cos, sin,
             slot_mapping, table_rows, query_start, query_len, seq_lens};
    const Caches caches{k_caches, v_caches, block_table};
    // One team of threads for the whole step (common/team.h): every kernel's
    // threads' work below goes to it, with no fork and join per kernel.
    Tensor out;
    with_team([&] {
      const bool keeps_all = !keep_rows || keeps_every_row(*keep_rows, tokens);
      const int64_t split = keeps_all ? split_rows(tokens, query_start) : 0;
      micro_batched_steps_ += split > 0;
      // Keeping every row is keeping none out: the last layer then needs no
      // index_select or per-row metadata (a decode step's rows, each kept).
      out = split > 0 ? forward_split(all, split, caches)
                      : forward_whole(all, caches, keeps_all ? std::nullopt : keep_rows);
    });
    return out;
  }

 private:
  // One group of rows: recipe.py's registers and the rows' attention metadata.
  struct Rows {
    Tensor x, residual, q, k, v;
    Tensor cos, sin, slot_mapping, table_rows, query_start, query_len, seq_lens;
  };
  struct Caches {
    const std::vector<Tensor>& k, & v;
    const Tensor& block_table;
  };

  // Rows in the first micro-batch, or 0 to run the step whole.
  int64_t split_rows(int64_t tokens, CTensor query_start) const {
    Team* team = led_team;
    if (split_min_rows_ <= 0 || tokens < split_min_rows_ || attend_steps_.size() != 1 ||
        team == nullptr || team->size() < 2 || query_start.size(0) != tokens) {
      return 0;
    }
    // Whole tiles of rows (8 a tile in the AVX-512 kernels) where there are enough.
    const int64_t half = tokens / 2;
    return half >= 8 ? half / 8 * 8 : half;
  }

  // Whether keep_rows lists every row in order (a step of decodes: each row's logits).
  static bool keeps_every_row(CTensor keep_rows, int64_t tokens) {
    if (keep_rows.dim() != 1 || keep_rows.size(0) != tokens ||
        keep_rows.scalar_type() != at::kLong || !keep_rows.is_contiguous()) {
      return false;
    }
    const int64_t* row = keep_rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < tokens; ++i) {
      if (row[i] != i) return false;
    }
    return true;
  }

  Tensor forward_whole(Rows& r, const Caches& caches, const std::optional<Tensor>& keep_rows) {
    const size_t count = layers_.size();
    const int64_t tokens = r.x.size(0);
    for (size_t l = 0; l < count; ++l) {
      for (size_t i = 0; i < recipe_.size(); ++i) {
        if (recipe_[i] != Op::kAttend) {
          run_step(l, i, r);
          continue;
        }
        write_kv(l, r, caches);
        if (keep_rows && l + 1 == count) {
          std::tie(r.table_rows, r.query_start, r.query_len, r.seq_lens) = rows_as_requests(
              *keep_rows, tokens, r.table_rows, r.query_start, r.query_len, r.seq_lens);
          r.q = r.q.index_select(0, *keep_rows);
          r.residual = r.residual.index_select(0, *keep_rows);
        }
        attend(l, r, caches);
      }
    }
    add_rms_norm_.call(r.x, r.residual, final_norm_, eps_);
    return r.x;
  }

  // The step in two micro-batches of decodes, rows [0, split) and the rest,
  // each one's attention beside the other's projections: one team thread
  // attends, reading the K/V from DRAM, while the caller runs the other
  // micro-batch's projections, which the attending thread joins when it is
  // done. A layer's weights stream from DRAM for the first micro-batch and
  // from L3 for the second, right after (the Python side keeps this to layers
  // the L3 holds). Every kernel computes each row on its own, so a row's
  // result is the same bits as in the whole batch.
  Tensor forward_split(Rows& all, int64_t split, const Caches& caches) {
    const int64_t tokens = all.x.size(0);
    const auto rows = [&](int64_t first, int64_t count) {
      // Decodes only: every request one row, its query starting at its index.
      return Rows{all.x.narrow(0, first, count),
                  {},
                  {},
                  {},
                  {},
                  all.cos.narrow(0, first, count),
                  all.sin.narrow(0, first, count),
                  all.slot_mapping.narrow(0, first, count),
                  all.table_rows.narrow(0, first, count),
                  all.query_start.narrow(0, 0, count),
                  all.query_len.narrow(0, first, count),
                  all.seq_lens.narrow(0, first, count)};
    };
    Rows batches[2] = {rows(0, split), rows(split, tokens - split)};
    const size_t count = layers_.size(), attend_at = attend_steps_[0];
    // A micro-batch's work between its attentions i - 1 and i: the end of
    // layer i - 1, the start of layer i and its K/V; the final norm last.
    const auto between_attentions = [&](Rows& r, size_t i) {
      if (i > 0) {
        for (size_t s = attend_at + 1; s < recipe_.size(); ++s) run_step(i - 1, s, r);
      }
      if (i == count) {
        add_rms_norm_.call(r.x, r.residual, final_norm_, eps_);
        return;
      }
      for (size_t s = 0; s < attend_at; ++s) run_step(i, s, r);
      write_kv(i, r, caches);
    };
    Team& team = *led_team;
    const at::ThreadLocalState state;
    const auto beside = [&](Rows& attending, size_t layer, Rows& working, size_t i) {
      const auto task = [&] {
        // The caller's dispatcher state (inference mode): the task calls the kernel through it.
        const at::ThreadLocalStateGuard guard(state);
        attend(layer, attending, caches);
      };
      team.post_side(task);
      try {
        between_attentions(working, i);
      } catch (...) {
        // The task refers to this frame: it must end before the frame does.
        try {
          team.join_side();
        } catch (...) {
        }
        throw;
      }
      team.join_side();
    };
    between_attentions(batches[0], 0);
    for (size_t l = 0; l < count; ++l) {
      beside(batches[0], l, batches[1], l);
      beside(batches[1], l, batches[0], l + 1);
    }
    between_attentions(batches[1], count);
    return at::cat({batches[0].x, batches[1].x});
  }

  // Recipe step i of layer l, other than kAttend.
  void run_step(size_t l, size_t i, Rows& r) {
    const Layer& layer = layers_[l];
    switch (recipe_[i]) {
      case Op::kAddNorm: {
        const Tensor& weight = layer.norms[norm_index_[i]];
        if (!r.residual.defined()) {
          r.residual = r.x;
          r.x = at::empty_like(r.residual);
          rms_norm_.call(r.x, r.residual, weight, eps_);
        } else {
          add_rms_norm_.call(r.x, r.residual, weight, eps_);
        }
        break;
      }
      case Op::kNorm: {
        Tensor normed = at::empty_like(r.x);
        rms_norm_.call(normed, r.x, layer.norms[norm_index_[i]], eps_);
        r.x = normed;
        break;
      }
      case Op::kQkvProj:
      case Op::kOProj:
      case Op::kDownProj:
        r.x = (*layer.matrices[matrix_index_[i]])(r.x);
        break;
      case Op::kRope: {
        const int64_t rows = r.x.size(0);
        const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
        r.q = at::empty({rows, num_heads_, head_dim_}, r.x.options());
        r.k = at::empty({rows, num_kv_heads_, head_dim_}, r.x.options());
        rotary_qk_.call(r.q, r.k, r.x, r.cos, r.sin);
        r.v = r.x.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads_, head_dim_});
        break;
      }
      case Op::kGateUp: {
        // As GatedMLP.activation decides: fused where each half is whole panels.
        const Projection& gate_up = *layer.matrices[matrix_index_[i]];
        if (gate_up.has_silu_product()) {
          r.x = gate_up.silu_product(r.x);
        } else {
          const Tensor both = gate_up(r.x);
          r.x = at::empty({both.size(0), both.size(1) / 2}, both.options());
          silu_and_mul_.call(r.x, both);
        }
        break;
      }
      case Op::kAttend:
        TORCH_CHECK(false, "attend is not a plain step");
    }
  }

  // The attend step's first half: this step's K/V into layer l's cache.
  void write_kv(size_t l, Rows& r, const Caches& caches) {
    write_kv_.call(r.k, r.v, caches.k[l], caches.v[l], r.slot_mapping);
  }

  // Its second half: x = the attention of q over layer l's cache.
  void attend(size_t l, Rows& r, const Caches& caches) {
    Tensor attended = at::empty_like(r.q);
    paged_attention_.call(attended, r.q, caches.k[l], caches.v[l], caches.block_table,
                          r.table_rows, r.query_start, r.query_len, r.seq_lens, scale_);
    r.x = attended.view({r.q.size(0), num_heads_ * head_dim_});
    // Consumed: their buffers (and qkv, which v views) go back to the
    // allocator for the layer's next tensors.
    r.q.reset();
    r.k.reset();
    r.v.reset();
  }

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
  std::vector<Op> recipe_;
  std::vector<Op> matrix_steps_;  // the recipe's projection steps, in order
  // Per recipe step: the layer's norm and projection it takes, if any.
  std::vector<size_t> norm_index_, matrix_index_;
  std::vector<size_t> attend_steps_;  // where the recipe attends
  int64_t split_min_rows_ = 0;
  int64_t micro_batched_steps_ = 0;
  size_t norms_per_layer_ = 0;
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

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("decoder_stack_steps() -> str[]", &tokenloom::implemented_steps);
  m.class_<tokenloom::DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<std::string>, int64_t, int64_t, int64_t, double, double,
                       at::Tensor>())
      .def("add_layer", &tokenloom::DecoderStack::add_layer)
      .def("add_projection", &tokenloom::DecoderStack::add_projection)
      .def("overlap_decodes_from", &tokenloom::DecoderStack::overlap_decodes_from)
      .def("micro_batched_steps", &tokenloom::DecoderStack::micro_batched_steps)
      .def("forward", &tokenloom::DecoderStack::forward);
}

