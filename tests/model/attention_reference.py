"""Dense causal attention to check the paged kernels against."""

from __future__ import annotations

import math

import torch


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, bf16_products: bool = False
) -> torch.Tensor:
    """q [n, H, D]; k, v [ctx + n, Hkv, D] -> [n, H, D] float32, query i seeing
    keys 0 .. ctx + i; computed in float64. bf16_products: the scaled queries and
    the softmax numerators rounded to bfloat16 (to nearest even) and the sum
    left unrounded, as the native kernel computes over a bfloat16 cache on CPUs
    with AVX512_BF16."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    q = q / math.sqrt(head_dim)
    if bf16_products:
        q = q.bfloat16()
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k)
    allowed = torch.arange(k.shape[0])[None, :] <= (ctx + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    numerators = (scores - scores.amax(-1, keepdim=True)).exp()
    weights = numerators.bfloat16().double() if bf16_products else numerators
    return torch.einsum("hqk,khd->qhd", weights / numerators.sum(-1, keepdim=True), v).float()
