"""The CUDA backend's Triton kernels against the torch reference (``model.attention``).

Without a GPU they run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``), on
small but awkward shapes: head sizes that are not powers of two, grouped query
heads, block tables with holes, cached prefixes, chunks that start and end
inside a block, sliding windows and soft-capped scores.
"""

from __future__ import annotations

import pytest
import torch

from tokenloom.model import attention as reference
from tokenloom.ops.cuda import paged_attention as kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(query_lens, seq_lens, block_size, num_blocks, seed):
    """A block table that gives each request blocks scattered over the cache
    (never block 0, with unused blocks in between), and the slots of its new tokens."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    free = torch.randperm(num_blocks - 1, generator=gen)[: sum(needed)] + 1
    width = max(needed) + 2  # padding columns point at the null block
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots = []
    used = 0
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        table[i, : needed[i]] = free[used : used + needed[i]].to(torch.int32)
        used += needed[i]
        for pos in range(s - q, s):
            slots.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
    return table, torch.tensor(slots, dtype=torch.int64)


CASES = [
    # (heads, kv_heads, head_dim, query_lens, seq_lens)
    (4, 2, 64, [1, 1, 1], [1, 17, 40]),  # decodes, one of them the first token
    (6, 2, 80, [7, 1, 20], [7, 33, 45]),  # fresh prompt, decode, chunk over a prefix
    (8, 1, 128, [5, 3], [21, 19]),  # chunks starting and ending inside blocks
    (4, 4, 64, [1, 12, 1, 30], [50, 12, 3, 64]),  # no grouping; mixed order
    (32, 4, 64, [2, 1], [18, 9]),  # a group wider than the default tile
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,query_lens,seq_lens", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_torch(heads, kv_heads, head_dim, query_lens, seq_lens, dtype):
    block_size, num_blocks = 16, 24
    table, slots = _batch(query_lens, seq_lens, block_size, num_blocks, seed=head_dim)
    gen = torch.Generator().manual_seed(1)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    # The cached prefix: random K/V everywhere, so reading a wrong block shows.
    k_cache = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen).to(dtype)

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    meta = reference.AttentionMetadata.build(query_lens, seq_lens, table, slots, block_size)
    expected = reference.paged_attention(q, k, v, ref_k, ref_v, meta)

    on = {"device": DEVICE}
    got_k, got_v = k_cache.to(**on), v_cache.to(**on)
    kernels.write_kv(k.to(**on), v.to(**on), got_k, got_v, slots.to(**on))
    assert torch.equal(got_k.cpu(), ref_k) and torch.equal(got_v.cpu(), ref_v)
    out = torch.zeros_like(q, **on)
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    kernels.paged_attention(
        out,
        q.to(**on),
        got_k,
        got_v,
        table.to(**on),
        query_start.to(**on),
        torch.tensor(seq_lens, dtype=torch.int32, **on),
        head_dim**-0.5,
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().view(num_tokens, -1), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 30.0), (20, 2.0)])
def test_window_and_softcap_match_torch(window, softcap):
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 64, 16, 20
    query_lens, seq_lens = [1, 9, 1], [30, 25, 6]
    table, slots = _batch(query_lens, seq_lens, block_size, num_blocks, seed=3)
    gen = torch.Generator().manual_seed(2)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen) * 3
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    k_cache = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen)
    meta = reference.AttentionMetadata.build(
        query_lens, seq_lens, table, slots, block_size, window=window
    )
    expected = reference.paged_attention(
        q, k, v, k_cache.clone(), v_cache.clone(), meta, softcap=softcap
    )
    on = {"device": DEVICE}
    got_k, got_v = k_cache.to(**on), v_cache.to(**on)
    kernels.write_kv(k.to(**on), v.to(**on), got_k, got_v, slots.to(**on))
    out = torch.zeros(num_tokens, heads, head_dim, **on)
    kernels.paged_attention(
        out,
        q.to(**on),
        got_k,
        got_v,
        table.to(**on),
        torch.tensor([0, 1, 10, 11], dtype=torch.int32, **on),
        torch.tensor(seq_lens, dtype=torch.int32, **on),
        head_dim**-0.5,
        softcap=softcap,
        window=window,
    )
    torch.testing.assert_close(out.cpu().view(num_tokens, -1), expected, atol=2e-5, rtol=2e-5)


def test_padded_rows_are_skipped():
    """A captured graph's padding: slots of -1 write nothing, and tokens past the
    last request's end are not attended (their output stays as it was)."""
    heads, kv_heads, head_dim, block_size = 2, 1, 64, 16
    k_cache = torch.zeros(4, kv_heads, head_dim, block_size, device=DEVICE)
    v_cache = torch.zeros(4, kv_heads, block_size, head_dim, device=DEVICE)
    k = torch.ones(3, kv_heads, head_dim, device=DEVICE)
    kernels.write_kv(k, k, k_cache, v_cache, torch.tensor([17, -1, -1], device=DEVICE))
    assert k_cache.count_nonzero() == head_dim and v_cache.count_nonzero() == head_dim
    assert bool((k_cache[1, :, :, 1] == 1).all())
    out = torch.full((3, heads, head_dim), 7.0, device=DEVICE)
    kernels.paged_attention(
        out,
        torch.zeros(3, heads, head_dim, device=DEVICE),  # equal scores
        k_cache,
        v_cache,
        torch.tensor([[1, 0]], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        torch.tensor([2], dtype=torch.int32, device=DEVICE),
        1.0,
    )
    assert bool((out[1:] == 7.0).all())
    # Position 0 holds zeros, position 1 the ones written above: their mean.
    torch.testing.assert_close(out[0], torch.full_like(out[0], 0.5))


def test_bad_block_size_is_refused():
    cache = torch.zeros(2, 1, 64, 8)
    with pytest.raises(ValueError, match="power-of-two block_size >= 16"):
        kernels.paged_attention(
            torch.zeros(1, 1, 64),
            torch.zeros(1, 1, 64),
            cache,
            cache.transpose(2, 3),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            1.0,
        )
