"""How the model is split over tensor-parallel ranks (no model, no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenloom.distributed.shard import partition, split_evenly
from tokenloom.model.arch_config import ModelArchConfig


def make_arch(**overrides: object) -> ModelArchConfig:
    """SmolLM2-135M's shapes unless overridden."""
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=1,
    )
    return dataclasses.replace(arch, **overrides)  # type: ignore[arg-type]


def test_smollm2_over_two_ranks_splits_kv_groups_unevenly() -> None:
    arch = make_arch()
    first, second = partition(arch, 2, 0), partition(arch, 2, 1)
    assert (first.kv_heads, first.q_heads) == ((0, 2), (0, 6))
    assert (second.kv_heads, second.q_heads) == ((2, 3), (6, 9))
    assert (first.intermediate, second.intermediate) == ((0, 768), (768, 1536))
    assert (first.vocab, second.vocab) == ((0, 24576), (24576, 49152))
    local = second.local_arch(arch)
    assert (local.num_attention_heads, local.num_key_value_heads) == (3, 1)
    assert (local.intermediate_size, local.vocab_size) == (768, 24576)
    assert (local.hidden_size, local.head_dim) == (576, 64)


@pytest.mark.parametrize("total", [4, 5, 7, 9, 49152, 49153])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_split_evenly_covers_everything_contiguously(total: int, parts: int) -> None:
    spans = [split_evenly(total, parts, i) for i in range(parts)]
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    sizes = [end - start for start, end in spans]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger parts come first


def test_every_query_head_stays_with_its_kv_head() -> None:
    arch = make_arch(num_attention_heads=12, num_key_value_heads=4)
    shards = [partition(arch, 3, r) for r in range(3)]
    assert [s.kv_heads for s in shards] == [(0, 2), (2, 3), (3, 4)]
    for shard in shards:
        for head in range(*shard.q_heads):
            assert shard.kv_heads[0] <= head // 3 < shard.kv_heads[1]


def test_more_ranks_than_kv_heads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\).*KV heads \(3\)"):
        partition(make_arch(), 4, 0)


TINY = make_arch(
    hidden_size=8,
    intermediate_size=5,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=2,
    vocab_size=7,
)


def _slices(name: str, tensor: torch.Tensor, world: int = 2) -> list[torch.Tensor]:
    return [partition(TINY, world, r).slice_weight(name, tensor, TINY) for r in range(world)]


def test_column_parallel_slices_rebuild_the_checkpoint() -> None:
    q = torch.randn(12, 8)
    k, v = torch.randn(6, 8), torch.randn(6, 8)
    gate = torch.randn(5, 8)
    for name, tensor in [
        ("model.layers.0.self_attn.q_proj.weight", q),
        ("model.layers.0.self_attn.q_proj.bias", q[:, 0]),
        ("model.layers.3.self_attn.k_proj.weight", k),
        ("model.layers.3.self_attn.v_proj.weight", v),
        ("model.layers.1.mlp.gate_proj.weight", gate),
        ("model.layers.1.mlp.up_proj.weight", gate + 1),
        ("model.embed_tokens.weight", torch.randn(7, 8)),
        ("lm_head.weight", torch.randn(7, 8)),
    ]:
        parts = _slices(name, tensor)
        assert torch.equal(torch.cat(parts), tensor), name
    # Rank 0 holds KV heads 0-1 (rows 0-3 of K) and query heads 0-3 (rows 0-7 of Q).
    first = partition(TINY, 2, 0)
    assert torch.equal(first.slice_weight("model.layers.0.self_attn.k_proj.weight", k, TINY), k[:4])
    assert torch.equal(first.slice_weight("model.layers.0.self_attn.q_proj.weight", q, TINY), q[:8])


def test_row_parallel_slices_take_the_matching_columns() -> None:
    o = torch.randn(8, 12)
    down = torch.randn(8, 5)
    for name, tensor in [
        ("model.layers.0.self_attn.o_proj.weight", o),
        ("model.layers.0.mlp.down_proj.weight", down),
    ]:
        assert torch.equal(torch.cat(_slices(name, tensor), dim=1), tensor), name
    # A row-parallel bias is added once: rank 0 keeps it, the others hold zeros.
    bias = torch.randn(8)
    kept, zeroed = _slices("model.layers.0.self_attn.o_proj.bias", bias)
    assert torch.equal(kept, bias) and not zeroed.any()


def test_fused_checkpoint_tensors_are_sliced_part_by_part() -> None:
    q, k, v = torch.randn(12, 8), torch.randn(6, 8), torch.randn(6, 8)
    qkv = torch.cat((q, k, v))
    second = partition(TINY, 2, 1)
    got = second.slice_weight("model.layers.0.self_attn.qkv_proj.weight", qkv, TINY)
    assert torch.equal(got, torch.cat((q[8:], k[4:], v[4:])))
    gate, up = torch.randn(5, 8), torch.randn(5, 8)
    got = second.slice_weight("model.layers.0.mlp.gate_up_proj.weight", torch.cat((gate, up)), TINY)
    assert torch.equal(got, torch.cat((gate[3:], up[3:])))


def test_replicated_tensors_pass_through() -> None:
    norm = torch.randn(8)
    for name in ("model.norm.weight", "model.layers.2.input_layernorm.weight"):
        assert all(part is norm for part in _slices(name, norm))
