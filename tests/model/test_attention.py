"""paged_attention against a dense per-request reference, over batch layouts
that exercise every path: single decode group, length-bucketed decode groups in
scrambled order, prefill with and without cached context, and a prefix hit on a
block that another request writes in the same step. Each test runs on the
pure-torch path and on the native CPU kernel (which takes short queries)."""

from __future__ import annotations

import pytest
import torch

from tests.model.attention_reference import attend
from tokenloom.model.attention import (
    NATIVE_MAX_QUERY,
    AttentionMetadata,
    _bucket_by_length,
    paged_attention,
    write_kv,
)
from tokenloom.ops.cpu_kernels import paged_attention_op

H, HKV, D, BS = 6, 2, 32, 4  # D: the smallest head size the native kernel has
NATIVE_OP = paged_attention_op(torch.device("cpu"), torch.float32, 64)
PATHS = ["torch", "native"]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> str:
    if request.param == "native" and NATIVE_OP is None:
        pytest.fail("the native CPU attention kernel did not build on this machine")
    return str(request.param)


def _run(requests: list[dict], seed: int = 0, path: str = "torch") -> float:
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
    k_tokens = torch.randn(num_blocks, BS, HKV, D, generator=g)  # prior context, random
    v_tokens = torch.randn(num_blocks, BS, HKV, D, generator=g)
    k_cache = k_tokens.permute(0, 2, 3, 1).contiguous()  # K blocks are [Hkv, D, BS]
    v_cache = v_tokens.transpose(1, 2).contiguous()  # V blocks are [Hkv, BS, D]
    final_k = k_tokens.view(-1, HKV, D).clone()
    final_v = v_tokens.view(-1, HKV, D).clone()

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
        native_op=NATIVE_OP if path == "native" else None,
    )
    if path == "native":
        short = sum(r["query_len"] for r in requests if r["query_len"] <= NATIVE_MAX_QUERY)
        assert meta.native is not None and int(meta.native.query_len.sum()) == short
    else:
        assert meta.native is None
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta)
    worst = 0.0
    start = 0
    for req, own, q in zip(requests, blocks, qs, strict=True):
        s, n = req["seq_len"], req["query_len"]
        all_slots = [own[p // BS] * BS + p % BS for p in range(s)]
        ref = attend(q, final_k[all_slots], final_v[all_slots], s - n)
        worst = max(worst, (out[start : start + n].view(n, H, D) - ref).abs().max().item())
        start += n
    return worst


def test_decodes_of_equal_length(path: str) -> None:
    assert _run([{"seq_len": 17, "query_len": 1} for _ in range(5)], path=path) < 1e-5


def test_decodes_bucketed_by_length(path: str) -> None:
    lens = [3, 90, 12, 41, 1, 88, 7]
    assert len(_bucket_by_length(list(range(len(lens))), lens, BS)) > 2
    assert _run([{"seq_len": s, "query_len": 1} for s in lens], path=path) < 1e-5


def test_mixed_batch_with_prefix_hit_in_same_step(path: str) -> None:
    requests = [
        {"seq_len": 30, "query_len": 1},  # decode
        {"seq_len": 9, "query_len": 9},  # fresh prefill writing blocks 0..2
        {"seq_len": 3, "query_len": 1},  # short decode
        # prefix hit on request 1's first two blocks, written in this very step
        {"seq_len": 13, "query_len": 5, "shared": (1, 2)},
        {"seq_len": 20, "query_len": 6},  # chunk after 14 cached tokens
        {"seq_len": 100, "query_len": 1},  # long decode: its own bucket
        {"seq_len": 140, "query_len": 40},  # a chunk too long for the native kernel
    ]
    assert _run(requests, path=path) < 1e-5


@pytest.mark.parametrize("seed", range(3))
def test_random_layouts(seed: int, path: str) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    requests = []
    for _ in range(8):
        seq_len = int(torch.randint(1, 60, (1,), generator=g))
        query_len = 1 if torch.rand(1, generator=g) < 0.6 else seq_len - seq_len // 3
        requests.append({"seq_len": seq_len, "query_len": max(1, query_len)})
    assert _run(requests, seed, path) < 1e-5


def test_detects_wrong_attention(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The reference comparison fails when the cache holds the wrong context."""
    import tests.model.test_attention as this_module

    original = paged_attention

    def broken(q, k, v, k_cache, v_cache, meta):
        k_cache.add_(1.0)  # corrupt the prior context before attending
        return original(q, k, v, k_cache, v_cache, meta)

    monkeypatch.setattr(this_module, "paged_attention", broken)
    requests = [{"seq_len": 9, "query_len": 1}, {"seq_len": 9, "query_len": 1}]
    assert _run(requests, path=path) > 1e-3


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 80, 16), (4, 1, 64, 8), (6, 2, 64, 8)],
)
def test_native_kernel_matches_torch_at_model_shapes(
    heads: int, kv_heads: int, head_dim: int, block_size: int, cache_dtype: torch.dtype
) -> None:
    """The kernel's specialised head sizes and whole-tile paths (the small shapes
    above take its generic ones) agree with the torch path on decodes and chunks,
    over a float32 cache and a bfloat16 one (whose rows the kernel reads in pairs
    where the head size allows, multiplying them in bfloat16 where the CPU can).
    K/V values are the cache dtype's, so that the torch path's fresh chunk, which
    skips the cache, sees the same keys."""
    if NATIVE_OP is None:
        pytest.fail("the native CPU attention kernel did not build on this machine")
    g = torch.Generator().manual_seed(7)
    query_lens = [1, 1, 5, 1, 32, 1, 17]
    seq_lens = [300, 7, 45, 129, 160, 64, 17]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = 1 + len(seq_lens) * max_blocks
    table = (torch.randperm(num_blocks - 1, generator=g) + 1)[: len(seq_lens) * max_blocks]
    table = table.view(len(seq_lens), max_blocks).to(torch.int32)
    slots = torch.cat(
        [
            table[i, torch.arange(s - q, s) // block_size].long() * block_size
            + torch.arange(s - q, s) % block_size
            for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
        ]
    )
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, head_dim, generator=g)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(cache_dtype).float()
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(cache_dtype).float()
    k_cache = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(cache_dtype)
    outs, caches = [], []
    for op in (None, NATIVE_OP):
        meta = AttentionMetadata.build(query_lens, seq_lens, table, slots, block_size, op)
        caches.append((k_cache.clone(), v_cache.clone()))
        outs.append(paged_attention(q, k, v, *caches[-1], meta))
    if (
        cache_dtype == torch.bfloat16
        and head_dim % 32 == 0
        and torch.ops.tokenloom_cpu.bf16_dot_products()
    ):
        # The kernel rounds queries and softmax numerators to bfloat16: exact
        # against a reference that rounds them too; within bfloat16's rounding
        # of the float one.
        reference = _bf16_pairs_reference(q, *caches[1], table, query_lens, seq_lens, block_size)
        assert (reference.view_as(outs[1]) - outs[1]).abs().max().item() < 1e-3
        assert (outs[0] - outs[1]).abs().max().item() < 2e-2
    else:
        assert (outs[0] - outs[1]).abs().max().item() < 1e-5


def _bf16_pairs_reference(q, k_cache, v_cache, table, query_lens, seq_lens, block_size):
    """Each request's attention over its cached K/V with bfloat16 products (see
    attention_reference.attend), the kernel's rounding over a bfloat16 cache with
    AVX512_BF16."""
    out, start = [], 0
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pos = torch.arange(seq_len)
        blocks = table[row, pos // block_size].long()
        keys = k_cache[blocks, :, :, pos % block_size].float()  # [seq, Hkv, D]
        values = v_cache[blocks, :, pos % block_size].float()
        queries = q[start : start + query_len]
        out.append(attend(queries, keys, values, seq_len - query_len, bf16_products=True))
        start += query_len
    return torch.cat(out)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [D, 24])  # whole vectors of 16, and not
@pytest.mark.parametrize("block_size", [16, 4])
def test_native_write_kv_matches_torch(
    block_size: int, head_dim: int, cache_dtype: torch.dtype
) -> None:
    if NATIVE_OP is None:
        pytest.fail("the native CPU attention kernel did not build on this machine")
    g = torch.Generator().manual_seed(block_size)
    num_blocks, tokens = 6, 11
    qkv = torch.randn(tokens, (H + 2 * HKV) * head_dim, generator=g)
    # Strided views, as the model's.
    k = qkv[:, H * head_dim : (H + HKV) * head_dim].view(tokens, HKV, head_dim)
    v = qkv[:, (H + HKV) * head_dim :].view(tokens, HKV, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    caches = []
    for native in (False, True):
        k_cache = torch.zeros(num_blocks, HKV, head_dim, block_size, dtype=cache_dtype)
        v_cache = torch.zeros(num_blocks, HKV, block_size, head_dim, dtype=cache_dtype)
        if native:
            torch.ops.tokenloom_cpu.write_kv(k, v, k_cache, v_cache, slots)
        else:
            write_kv(k, v, k_cache, v_cache, slots)
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert caches[1][1].abs().sum() > 0
    with pytest.raises(RuntimeError, match="out of range"):
        bad = slots.clone()
        bad[3] = num_blocks * block_size
        torch.ops.tokenloom_cpu.write_kv(k, v, caches[1][0], caches[1][1], bad)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 80), (6, 2, 64)]
)
def test_a_chunk_token_gets_the_bits_it_gets_alone(
    heads: int, kv_heads: int, head_dim: int, cache_dtype: torch.dtype
) -> None:
    """The kernel takes a chunk's tokens several at a time (their heads share
    every K/V load, the later tokens seeing one key more each): each token's
    output is the same bits as when it is its request's only query token."""
    if NATIVE_OP is None:
        pytest.fail("the native CPU attention kernel did not build on this machine")
    g = torch.Generator().manual_seed(3)
    block_size, seq_len, chunk = 16, 75, 7
    num_blocks = 1 + -(-seq_len // block_size)
    table = (torch.randperm(num_blocks - 1, generator=g) + 1).view(1, -1).to(torch.int32)
    k_cache = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=g)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = torch.randn(chunk, heads, head_dim, generator=g)
    ints = lambda *xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731

    def attend_chunk(queries: torch.Tensor, context: int) -> torch.Tensor:
        out = torch.full_like(queries, float("nan"))
        meta = (ints(0), ints(0), ints(len(queries)), ints(context))  # row, start, length, context
        NATIVE_OP(out, queries, k_cache, v_cache, table, *meta, head_dim**-0.5)
        return out

    whole = attend_chunk(q, seq_len)
    for i in range(chunk):
        alone = attend_chunk(q[i : i + 1], seq_len - chunk + i + 1)
        assert torch.equal(alone[0], whole[i]), f"token {i}"
