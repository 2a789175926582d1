"""paged_attention against a dense per-request reference, over batch layouts
that exercise every path: single decode group, length-bucketed decode groups in
scrambled order, prefill with and without cached context, and a prefix hit on a
block that another request writes in the same step."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.model.attention import AttentionMetadata, _bucket_by_length, paged_attention

H, HKV, D, BS = 6, 2, 8, 4


def _reference(q, k_all, v_all, ctx):
    """q [n, H, D]; k_all/v_all [ctx + n, HKV, D]; causal offset by ctx."""
    n, total = q.shape[0], k_all.shape[0]
    k = k_all.repeat_interleave(H // HKV, dim=1)
    v = v_all.repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    allowed = torch.arange(total)[None, :] <= (ctx + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run(requests: list[dict], seed: int = 0) -> float:
    """requests: dicts with seq_len, query_len, and optional shared=(other, n_blocks)
    taking the other's first n_blocks blocks. Returns max |paged - reference|."""
    g = torch.Generator().manual_seed(seed)
    next_block = 1
    blocks: list[list[int]] = []
    for req in requests:
        own: list[int] = []
        if "shared" in req:
            other, n = req["shared"]
            own = blocks[other][:n]
        while len(own) * BS < req["seq_len"]:
            own = own + [next_block]
            next_block += 1
        blocks.append(own)
    num_blocks = next_block
    k_cache = torch.randn(num_blocks, BS, HKV, D, generator=g)  # prior context, random
    v_cache = torch.randn(num_blocks, BS, HKV, D, generator=g)
    final_k = k_cache.view(-1, HKV, D).clone()
    final_v = v_cache.view(-1, HKV, D).clone()

    slots, qs, ks, vs = [], [], [], []
    for req, own in zip(requests, blocks, strict=True):
        s, n = req["seq_len"], req["query_len"]
        new_slots = [own[p // BS] * BS + p % BS for p in range(s - n, s)]
        slots += new_slots
        qs.append(torch.randn(n, H, D, generator=g))
        ks.append(torch.randn(n, HKV, D, generator=g))
        vs.append(torch.randn(n, HKV, D, generator=g))
        final_k[new_slots] = ks[-1]
        final_v[new_slots] = vs[-1]

    table = torch.zeros(len(requests) + 1, max(map(len, blocks)) + 2, dtype=torch.int32)
    for i, own in enumerate(blocks):
        table[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
    meta = AttentionMetadata.build(
        [r["query_len"] for r in requests],
        [r["seq_len"] for r in requests],
        table,
        torch.tensor(slots),
        BS,
    )
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta)
    worst = 0.0
    start = 0
    for req, own, q in zip(requests, blocks, qs, strict=True):
        s, n = req["seq_len"], req["query_len"]
        all_slots = [own[p // BS] * BS + p % BS for p in range(s)]
        ref = _reference(q, final_k[all_slots], final_v[all_slots], s - n)
        worst = max(worst, (out[start : start + n].view(n, H, D) - ref).abs().max().item())
        start += n
    return worst


def test_decodes_of_equal_length() -> None:
    assert _run([{"seq_len": 17, "query_len": 1} for _ in range(5)]) < 1e-5


def test_decodes_bucketed_by_length() -> None:
    lens = [3, 90, 12, 41, 1, 88, 7]
    assert len(_bucket_by_length(list(range(len(lens))), lens, BS)) > 2
    assert _run([{"seq_len": s, "query_len": 1} for s in lens]) < 1e-5


def test_mixed_batch_with_prefix_hit_in_same_step() -> None:
    requests = [
        {"seq_len": 30, "query_len": 1},  # decode
        {"seq_len": 9, "query_len": 9},  # fresh prefill writing blocks 0..2
        {"seq_len": 3, "query_len": 1},  # short decode
        # prefix hit on request 1's first two blocks, written in this very step
        {"seq_len": 13, "query_len": 5, "shared": (1, 2)},
        {"seq_len": 20, "query_len": 6},  # chunk after 14 cached tokens
        {"seq_len": 100, "query_len": 1},  # long decode: its own bucket
    ]
    assert _run(requests) < 1e-5


@pytest.mark.parametrize("seed", range(3))
def test_random_layouts(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    requests = []
    for _ in range(8):
        seq_len = int(torch.randint(1, 60, (1,), generator=g))
        query_len = 1 if torch.rand(1, generator=g) < 0.6 else seq_len - seq_len // 3
        requests.append({"seq_len": seq_len, "query_len": max(1, query_len)})
    assert _run(requests, seed) < 1e-5


def test_detects_wrong_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference comparison fails when the cache holds the wrong context."""
    import tests.model.test_attention as this_module

    original = paged_attention

    def broken(q, k, v, k_cache, v_cache, meta):
        k_cache.add_(1.0)  # corrupt the prior context before attending
        return original(q, k, v, k_cache, v_cache, meta)

    monkeypatch.setattr(this_module, "paged_attention", broken)
    requests = [{"seq_len": 9, "query_len": 1}, {"seq_len": 9, "query_len": 1}]
    assert _run(requests) > 1e-3
