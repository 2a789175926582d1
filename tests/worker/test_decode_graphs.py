"""Decode steps replayed from captured graphs (``worker.cuda.graphs``) give what the
eager forward gives, and their padding rows write nothing to the KV cache.

Without a GPU the graphs are stood in for by a recorder that re-runs the
forward on replay, over the same static buffers, so what is checked is the
buffer logic: inputs copied in, batches padded up to a captured size, padding
left from a larger step reset."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tokenloom.config import ModelConfig
from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model_loader.loader import load_model
from tokenloom.worker.cuda.graphs import DecodeGraphs, capture_sizes

BLOCK = 16


def rerun(forward):
    output = forward()
    return (lambda: output.copy_(forward())), output


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    # The kernels a decode graph captures on CUDA (Triton's, interpreted on the CPU).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENLOOM_FORWARD_PLAN", "matmul=torch,layer_ops=triton,attention=triton")
        loaded = load_model(ModelConfig(model=str(path), dtype="float32"))
    assert (loaded.plan.layer_ops, loaded.plan.attention) == ("triton", "triton")
    return loaded.model


def kernel_meta(query_lens, seq_lens, table, slots):
    start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata.for_kernel(
        start, torch.tensor(seq_lens, dtype=torch.int32), table, slots, BLOCK
    )


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1000)[-1] == 512


def test_replayed_decodes_match_eager(model) -> None:
    lens = [3, 7, 12, 16, 20]
    table = torch.arange(1, 1 + 2 * len(lens), dtype=torch.int32).view(len(lens), 2)
    graph_kv = allocate_kv_caches(model.arch, 1 + table.numel(), BLOCK, torch.float32, "cpu")
    eager_kv = allocate_kv_caches(model.arch, 1 + table.numel(), BLOCK, torch.float32, "cpu")
    graphs = DecodeGraphs(model, graph_kv, BLOCK, 5, 32, torch.device("cpu"))
    graphs.capture(record=rerun)
    # The captures ran on padding alone: nothing reached the cache.
    assert all(int(k.count_nonzero()) == 0 for k, _ in graph_kv)

    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 64, (n,), generator=gen) for n in lens]
    slots = torch.cat(
        [
            table[i, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
            for i, n in enumerate(lens)
        ]
    )
    prefill = kernel_meta(lens, lens, table, slots)
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        for kv in (graph_kv, eager_kv):
            model(torch.cat(tokens), positions, kv, prefill)
        seq = list(lens)
        # 3 decodes (padded to 4), all 5, then 3 again over the padding the 5 left.
        for rows in ([0, 1, 2], [0, 1, 2, 3, 4], [1, 3, 4]):
            ids = torch.randint(0, 64, (len(rows),), generator=gen)
            pos = torch.tensor([seq[r] for r in rows])
            step_slots = torch.stack(
                [table[r, seq[r] // BLOCK].long() * BLOCK + seq[r] % BLOCK for r in rows]
            )
            for r in rows:
                seq[r] += 1
            step_table = table[rows]
            step_lens = [seq[r] for r in rows]
            eager = model(
                ids, pos, eager_kv, kernel_meta([1] * len(rows), step_lens, step_table, step_slots)
            )
            replayed = graphs.run(
                ids, pos, step_slots, step_table, torch.tensor(step_lens, dtype=torch.int32)
            )
            torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
            # A padding row writing to a stale slot would overwrite a real entry.
            for (gk, gv), (ek, ev) in zip(graph_kv, eager_kv, strict=True):
                torch.testing.assert_close(gk, ek, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(gv, ev, atol=1e-5, rtol=1e-5)
