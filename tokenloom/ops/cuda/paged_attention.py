"""Paged attention and the K/V write as Triton kernels, for the CUDA backend.

Both read and write the cache in its own layout (``model.kv_cache``): K blocks
``[num_blocks, Hkv, D, block_size]``, V blocks ``[num_blocks, Hkv, block_size, D]``.

``paged_attention`` serves the whole flat batch in one launch: prefill chunks
(with or without a cached prefix) and decodes alike. A program takes up to
``BLOCK_Q`` consecutive query tokens of one request together with the
``Hq / Hkv`` query heads that share one KV head, so a KV tile is read once for
all of them, and walks that request's blocks through the block table, keeping
an online softmax. Which request a program serves is found from the query
start offsets alone, so the launch grid depends only on the number of tokens
and requests: a captured CUDA graph replays it for any batch of that size.
A request with no query tokens (a padded graph row) does nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Rows of one program: BLOCK_Q tokens times the query heads of one KV head.
_BLOCK_M = 16


@triton.jit
def _find_request(query_start, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """The request whose query blocks hold ``q_block``: request r's blocks start
    at query_start[r] // BLOCK_Q + r (binary search over the requests)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out,
    q,
    k_cache,
    v_cache,
    block_table,
    query_start,
    seq_lens,
    num_reqs,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start, num_reqs, q_block, BLOCK_Q)
    q_first = tl.load(query_start + req)
    query_len = tl.load(query_start + req + 1) - q_first
    local_block = q_block - (q_first // BLOCK_Q + req)
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens + req)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    q_index = local_block * BLOCK_Q + rows // GROUP  # token within the chunk
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_index < query_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token = q_first + q_index
    q_tile = tl.load(
        q + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = context_len + q_index  # each row's position in its sequence

    # Keys this program can see: up to its last row's position, from the window's start.
    last_pos = context_len + tl.minimum((local_block + 1) * BLOCK_Q, query_len) - 1
    end_block = last_pos // BLOCK_SIZE + 1
    start_block = 0
    if USE_WINDOW:
        first_pos = tl.maximum(context_len + local_block * BLOCK_Q - window + 1, 0)
        start_block = first_pos // BLOCK_SIZE

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    table_row = block_table + req * stride_bt
    for j in range(start_block, end_block):
        physical = tl.load(table_row + j).to(tl.int64)
        k_tile = tl.load(
            k_cache
            + physical * stride_kb
            + kv_head * stride_kh
            + dims[:, None] * stride_kd
            + offsets[None, :],
            mask=dim_valid[:, None],
            other=0.0,
        ).to(DOT_DTYPE)  # [D, BLOCK_SIZE]
        scores = tl.dot(q_tile, k_tile, input_precision=PRECISION).to(tl.float32) * scale
        if USE_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        key_pos = j * BLOCK_SIZE + offsets
        visible = (key_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # Rows that have seen no key yet keep -inf: shift by 0 there, not by -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_tile = tl.load(
            v_cache
            + physical * stride_vb
            + kv_head * stride_vh
            + offsets[:, None] * stride_vt
            + dims[None, :],
            mask=dim_valid[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # [BLOCK_SIZE, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v_tile, input_precision=PRECISION).to(
            tl.float32
        )
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        acc.to(out.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


@triton.jit
def _tanh(x):
    # tanh(x) = 2 * sigmoid(2x) - 1, in the ops every Triton version has.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> None:
    """Attention of the flat batch into ``out`` [T, H, D] from ``q`` [T, H, D].

    Request r owns tokens ``query_start[r] .. query_start[r + 1] - 1`` (int32
    ``[R + 1]``) and its context after them is ``seq_lens[r]`` (int32 ``[R]``);
    its blocks are row r of ``block_table`` (int32). Tokens past
    ``query_start[R]`` are left untouched. ``window``: attend to the last
    ``window`` positions only; ``softcap``: scores become ``cap * tanh(s / cap)``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = v_cache.shape[1], v_cache.shape[2]
    group = num_heads // num_kv_heads
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out need a contiguous last dimension")
    if block_size & (block_size - 1) or block_size < 16:
        raise ValueError(
            f"the Triton kernel needs a power-of-two block_size >= 16, got {block_size}"
        )
    block_m = max(_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    num_reqs = seq_lens.shape[0]
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_table,
        query_start,
        seq_lens,
        num_reqs,
        scale,
        softcap or 1.0,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_DTYPE=_dot_dtype(q.dtype),
    )


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """What the matrix products take: the activations' dtype, except float32 for
    16-bit ones under the interpreter, whose 16-bit products are wrong."""
    if dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


@triton.jit
def _write_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vch,
    stride_vct,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if slot < 0:  # a padded row
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    valid = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k_row = tl.load(k + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=valid)
    v_row = tl.load(v + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=valid)
    tl.store(
        k_cache
        + block * stride_kcb
        + heads[:, None] * stride_kch
        + dims[None, :] * stride_kcd
        + offset,
        k_row.to(k_cache.dtype.element_ty),
        mask=valid,
    )
    tl.store(
        v_cache
        + block * stride_vcb
        + heads[:, None] * stride_vch
        + offset * stride_vct
        + dims[None, :],
        v_row.to(v_cache.dtype.element_ty),
        mask=valid,
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store K/V ``[T, Hkv, D]`` at their slots (int64 ``[T]``; a negative slot is
    skipped), converted to the cache's dtype."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v need a contiguous last dimension")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=v_cache.shape[2],
    )
