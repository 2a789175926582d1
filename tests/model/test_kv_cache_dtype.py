"""A 16-bit KV cache (``cache_dtype``) under a float32 model: paged attention on
both paths (torch and the native kernel) against dense references, on odd shapes
(block size 5, ragged context lengths, tiles crossing block ends, a prefill
chunk long enough to take the torch path inside a native batch).

Two references: one over the K/V rounded to the cache dtype, which the kernels
must reproduce up to float32 summation order (the conversion is exact), and one
over the unrounded float32 K/V, which bounds what the narrower cache costs:
bfloat16 keeps 8 mantissa bits, float16 11, so for unit-variance inputs the
outputs stay within BF16_ATOL and FP16_ATOL of full precision. Where the native
kernel multiplies a bfloat16 cache in bfloat16 pairs (AVX512_BF16), it rounds
the queries and softmax numerators to bfloat16 too, and the first reference
does the same: their results then differ where the two round a numerator near
a tie differently, within BF16_PRODUCTS_ATOL."""

from __future__ import annotations

import pytest
import torch

from tests.model.attention_reference import attend
from tokenloom.config import CacheConfig
from tokenloom.engine.args import EngineArgs
from tokenloom.model.attention import NATIVE_MAX_QUERY, AttentionMetadata, paged_attention, write_kv
from tokenloom.model.dtype import resolve_kv_cache_dtype
from tokenloom.ops.cpu_kernels import paged_attention_op

H, HKV, D, BS = 6, 2, 64, 5
NATIVE_OP = paged_attention_op(torch.device("cpu"), torch.float32, D)
ROUNDED_ATOL = 2e-5
BF16_PRODUCTS_ATOL = 1e-3
BF16_ATOL = 2e-2
FP16_ATOL = 2e-3
# (seq_len, query_len): decodes of ragged lengths, a short chunk (native), a long
# chunk with cached context (torch path), a fresh prompt.
REQUESTS = [(1, 1), (23, 1), (77, 1), (40, 7), (91, 40), (37, 37)]


def _bf16_products(cache_dtype: torch.dtype, native: bool) -> bool:
    """Whether the native kernel multiplies this cache in bfloat16 pairs."""
    return native and cache_dtype == torch.bfloat16 and torch.ops.tokenloom_cpu.bf16_dot_products()


def _errors(cache_dtype: torch.dtype, native: bool, seed: int = 0) -> tuple[float, float]:
    """Max |paged - reference| against the rounded and the full-precision reference."""
    g = torch.Generator().manual_seed(seed)
    blocks, next_block = [], 1
    for seq_len, _ in REQUESTS:
        n = -(-seq_len // BS)
        blocks.append(list(range(next_block, next_block + n)))
        next_block += n
    # Earlier context: random full-precision K/V, stored rounded into the cache.
    full_k = torch.randn(next_block * BS, HKV, D, generator=g)
    full_v = torch.randn(next_block * BS, HKV, D, generator=g)
    k_cache = full_k.view(-1, BS, HKV, D).permute(0, 2, 3, 1).contiguous().to(cache_dtype)
    v_cache = full_v.view(-1, BS, HKV, D).transpose(1, 2).contiguous().to(cache_dtype)
    slots, qs, ks, vs = [], [], [], []
    for (seq_len, query_len), own in zip(REQUESTS, blocks, strict=True):
        new = [own[p // BS] * BS + p % BS for p in range(seq_len - query_len, seq_len)]
        slots += new
        qs.append(torch.randn(query_len, H, D, generator=g))
        ks.append(torch.randn(query_len, HKV, D, generator=g))
        vs.append(torch.randn(query_len, HKV, D, generator=g))
        full_k[new], full_v[new] = ks[-1], vs[-1]
    table = torch.zeros(len(REQUESTS), max(map(len, blocks)) + 1, dtype=torch.int32)
    for i, own in enumerate(blocks):
        table[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
    meta = AttentionMetadata.build(
        [q for _, q in REQUESTS],
        [s for s, _ in REQUESTS],
        table,
        torch.tensor(slots),
        BS,
        native_op=NATIVE_OP if native else None,
    )
    assert (meta.native is not None) == native
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta)
    rounded_k, rounded_v = full_k.to(cache_dtype).float(), full_v.to(cache_dtype).float()
    worst_rounded = worst_full = 0.0
    start = 0
    for (seq_len, query_len), own, q in zip(REQUESTS, blocks, qs, strict=True):
        got = out[start : start + query_len].view(query_len, H, D)
        start += query_len
        ctx_slots = [own[p // BS] * BS + p % BS for p in range(seq_len)]
        ctx = seq_len - query_len
        # A fresh prompt on the torch path attends to its own K/V before rounding;
        # decodes and native chunks read them back from the cache.
        if ctx == 0 and query_len > (NATIVE_MAX_QUERY if native else 1):
            ref_k, ref_v, products = full_k[ctx_slots], full_v[ctx_slots], False
        else:
            ref_k, ref_v = rounded_k[ctx_slots], rounded_v[ctx_slots]
            products = _bf16_products(cache_dtype, native)
        rounded_reference = attend(q, ref_k, ref_v, ctx, products)
        worst_rounded = max(worst_rounded, (got - rounded_reference).abs().max().item())
        exact = attend(q, full_k[ctx_slots], full_v[ctx_slots], ctx)
        worst_full = max(worst_full, (got - exact).abs().max().item())
    return worst_rounded, worst_full


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize(
    ("cache_dtype", "full_atol"),
    [(torch.bfloat16, BF16_ATOL), (torch.float16, FP16_ATOL), (torch.float32, ROUNDED_ATOL)],
    ids=["bfloat16", "float16", "float32"],
)
def test_paged_attention_over_a_narrow_cache(
    native: bool, cache_dtype: torch.dtype, full_atol: float
) -> None:
    if native and NATIVE_OP is None:
        pytest.fail("the native CPU attention kernel did not build on this machine")
    rounded, full = _errors(cache_dtype, native)
    assert rounded < (BF16_PRODUCTS_ATOL if _bf16_products(cache_dtype, native) else ROUNDED_ATOL)
    assert full < full_atol
    if cache_dtype != torch.float32:
        assert full > ROUNDED_ATOL  # the cache really is narrower than float32


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_native_write_rounds_like_torch(cache_dtype: torch.dtype) -> None:
    """The native KV write stores exactly what torch's conversion gives."""
    if NATIVE_OP is None:
        pytest.fail("the native CPU attention kernel did not build on this machine")
    g = torch.Generator().manual_seed(1)
    k = torch.randn(9, HKV, D, generator=g) * 100
    v = torch.randn(9, HKV, D, generator=g) / 100
    slots = torch.tensor([5, 6, 7, 13, 14, 30, 31, 32, 49])
    caches = [
        (
            torch.zeros(11, HKV, D, BS, dtype=cache_dtype),
            torch.zeros(11, HKV, BS, D, dtype=cache_dtype),
        )
        for _ in range(2)
    ]
    write_kv(k, v, *caches[0], slots)
    torch.ops.tokenloom_cpu.write_kv(k, v, *caches[1], slots)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[1][1].transpose(1, 2).reshape(-1, HKV, D)[slots], v.to(cache_dtype))


def test_resolve_kv_cache_dtype() -> None:
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, quantized=True) == torch.bfloat16
    assert resolve_kv_cache_dtype("float32", torch.float32, quantized=True) == torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32) == torch.float16


@pytest.mark.parametrize("bad", ["fp8", "int8", "", "Float16"])
def test_invalid_kv_cache_dtype_is_refused_naming_the_field(bad: str) -> None:
    with pytest.raises(ValueError, match="^kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="^cache_dtype must be one of"):
        CacheConfig(cache_dtype=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^cache_dtype must be one of"):
        resolve_kv_cache_dtype(bad, torch.float32)
