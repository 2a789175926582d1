"""Paged attention over a flattened ragged batch.

The runner concatenates every request's new tokens (no padding) and describes
the batch once per step with ``AttentionMetadata.build(query_lens, seq_lens,
block_table, slot_mapping, block_size)``:

- request ``i`` (batch order) owns ``query_lens[i]`` consecutive tokens of the
  flat batch, and its context after this step is ``seq_lens[i]`` tokens
  (cached + new), so the new tokens sit at positions ``seq_lens[i] -
  query_lens[i] ..  seq_lens[i] - 1``;
- ``block_table`` is int32 ``[>= num_reqs, max_blocks]`` (row ``i`` for request
  ``i``, padded with the null block 0); ``slot_mapping`` is int64 ``[T]``,
  ``block_id * block_size + offset`` of each new token.

Everything that depends only on the batch (which tokens are decodes, gather
indices, masks) is computed here once and reused by every layer.

Per layer, ``paged_attention`` first writes all new K/V into the cache, then
reads context through the block tables: a request in this batch may hit
(prefix-cache) blocks another request writes in this same step. Decodes
(query_len 1) are batched: their blocks are gathered into one padded
``[B, L, Hkv, D]`` tensor and attended with one masked SDPA call, the query
heads of a KV group acting as that group's query rows. Decodes whose context
lengths differ by more than 1.5x are split into length buckets (one call each)
so that padding adds at most half the gathered bytes: the gather dominates a
decode step, and a few more SDPA calls cost less than copying padding. Prefill chunks go one
SDPA call each, causal with the chunk offset by its cached context; a chunk with
no cached context attends to its own fresh K/V without touching the cache.

Where the native CPU kernel is available (``cpu_kernels``; the runner passes it
as ``native_op``), every request with at most ``NATIVE_MAX_QUERY`` new tokens is
attended by it in one call that reads K/V in place through the block table, and
only longer chunks take the SDPA path above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One request with query_len > 1 (a prompt chunk or a multi-token step)."""

    start: int  # first token in the flat batch
    end: int  # one past the last
    context_len: int  # tokens already cached before this chunk
    seq_len: int  # context_len + (end - start)
    # Only when context_len > 0: blocks covering seq_len, and a [q, seq_len]
    # boolean mask (True: may attend).
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended with one padded SDPA call."""

    # Their tokens in the flat batch: a (start, stop) slice when contiguous,
    # else an int64 index tensor.
    token_slice: tuple[int, int] | None
    token_idx: torch.Tensor | None
    block_ids: torch.Tensor  # int64 [b, num_blocks]
    mask: torch.Tensor  # bool [b, 1, 1, num_blocks * block_size]


# Longest chunk the native kernel takes: it scores each query token against its
# context separately, which beats gather + SDPA for short chunks only.
NATIVE_MAX_QUERY = 32


@dataclass
class NativeBatch:
    """Requests attended by one call of the native kernel (int32 metadata)."""

    op: Callable[..., None]
    block_table: torch.Tensor  # [>= rows, max_blocks]
    table_rows: torch.Tensor  # [R] row of each request in block_table
    query_start: torch.Tensor  # [R] first token in the flat batch
    query_len: torch.Tensor  # [R]
    seq_lens: torch.Tensor  # [R]


@dataclass
class AttentionMetadata:
    """Per-step description of the flat batch, shared by all layers."""

    num_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # int64 [T]
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    native: NativeBatch | None = None
    # The native kernels are loaded (a native_op was given): K/V are written by
    # ``tokenloom_cpu.write_kv`` too.
    native_kv_write: bool = False

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        native_op: Callable[..., None] | None = None,
    ) -> AttentionMetadata:
        num_reqs = len(query_lens)
        if len(seq_lens) != num_reqs:
            raise ValueError(f"seq_lens has {len(seq_lens)} entries, query_lens {num_reqs}")
        if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
            raise ValueError(
                f"block_table must be [>= {num_reqs}, max_blocks], got {tuple(block_table.shape)}"
            )
        num_tokens = int(sum(query_lens))
        if slot_mapping.numel() != num_tokens:
            raise ValueError(
                f"slot_mapping has {slot_mapping.numel()} entries, query_lens sum to {num_tokens}"
            )
        max_blocks = block_table.shape[1]
        device = block_table.device

        dec_rows: list[int] = []
        dec_tokens: list[int] = []
        dec_seq_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        native_reqs: list[tuple[int, int, int, int]] = []  # (row, start, query_len, seq_len)
        native_max_query = NATIVE_MAX_QUERY if native_op is not None else 0
        start = 0
        for i in range(num_reqs):
            q, s = int(query_lens[i]), int(seq_lens[i])
            if q < 1 or s < q:
                raise ValueError(f"request {i}: need 1 <= query_len <= seq_len, got {q}, {s}")
            n_blocks = -(-s // block_size)
            if n_blocks > max_blocks:
                raise ValueError(
                    f"request {i}: seq_len {s} needs {n_blocks} blocks, block_table has {max_blocks}"
                )
            if q <= native_max_query:
                native_reqs.append((i, start, q, s))
            elif q == 1:
                dec_rows.append(i)
                dec_tokens.append(start)
                dec_seq_lens.append(s)
            else:
                ctx = s - q
                block_ids = mask = None
                if ctx > 0:
                    block_ids = block_table[i, :n_blocks].to(torch.long)
                    key_pos = torch.arange(s, device=device)
                    query_pos = torch.arange(ctx, s, device=device)
                    mask = key_pos[None, :] <= query_pos[:, None]
                prefills.append(PrefillChunk(start, start + q, ctx, s, block_ids, mask))
            start += q

        groups = [
            _decode_group(members, dec_rows, dec_tokens, dec_seq_lens, block_table, block_size)
            for members in _bucket_by_length(dec_rows, dec_seq_lens, block_size)
        ]
        native = None
        if native_op is not None and native_reqs:
            columns = torch.tensor(native_reqs, dtype=torch.int32).t().contiguous()
            native = NativeBatch(
                op=native_op,
                block_table=block_table.to(torch.int32).contiguous(),
                table_rows=columns[0],
                query_start=columns[1],
                query_len=columns[2],
                seq_lens=columns[3],
            )
        return cls(
            num_tokens=num_tokens,
            block_size=block_size,
            slot_mapping=slot_mapping.to(device=device, dtype=torch.long),
            num_decodes=len(dec_rows),
            decode_groups=groups,
            prefills=prefills,
            native=native,
            native_kv_write=native_op is not None,
        )


def _bucket_by_length(rows: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Split decodes (positions into ``rows``) so that padding to a group's longest
    context gathers at most 1.5x the blocks needed; one group, in batch order,
    when the lengths are already within that factor."""
    if not rows:
        return []
    blocks = [-(-s // block_size) for s in seq_lens]
    if 2 * max(blocks) <= 3 * min(blocks):
        return [list(range(len(rows)))]
    order = sorted(range(len(rows)), key=lambda j: -blocks[j])
    groups: list[list[int]] = [[order[0]]]
    group_max = blocks[order[0]]
    for j in order[1:]:
        if 3 * blocks[j] < 2 * group_max:
            groups.append([])
            group_max = blocks[j]
        groups[-1].append(j)
    return [sorted(g) for g in groups]


def _decode_group(
    members: list[int],
    dec_rows: list[int],
    dec_tokens: list[int],
    dec_seq_lens: list[int],
    block_table: torch.Tensor,
    block_size: int,
) -> DecodeGroup:
    device = block_table.device
    rows = [dec_rows[j] for j in members]
    tokens = [dec_tokens[j] for j in members]
    lens = [dec_seq_lens[j] for j in members]
    count = len(members)
    token_slice = token_idx = None
    if tokens == list(range(tokens[0], tokens[0] + count)):
        token_slice = (tokens[0], tokens[0] + count)
    else:
        token_idx = torch.tensor(tokens, dtype=torch.long, device=device)
    n_blocks = -(-max(lens) // block_size)
    if rows == list(range(rows[0], rows[0] + count)):
        table = block_table[rows[0] : rows[0] + count, :n_blocks]
    else:
        table = block_table[torch.tensor(rows, device=device), :n_blocks]
    key_pos = torch.arange(n_blocks * block_size, device=device)
    mask = key_pos[None, :] < torch.tensor(lens, device=device)[:, None]
    return DecodeGroup(token_slice, token_idx, table.to(torch.long), mask.view(count, 1, 1, -1))


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V ([T, Hkv, D]) at their slots (layouts: ``kv_cache``)."""
    num_kv_heads, head_dim = v_cache.shape[2], v_cache.shape[3]
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    block_size = v_cache.shape[1]
    # K blocks are [Hkv, D, block_size]: slot (block, offset) is column `offset`.
    k_cache.permute(0, 3, 1, 2).index_put_(
        (slot_mapping // block_size, slot_mapping % block_size), k
    )


def _gather_keys(k_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` [..., n] of K as token-major [..., Hkv, n * block_size, D]."""
    blocks = k_cache.index_select(0, block_ids.reshape(-1))
    num_blocks, num_kv_heads, head_dim, block_size = blocks.shape
    blocks = blocks.view(*block_ids.shape, num_kv_heads, head_dim, block_size)
    lead = block_ids.dim() - 1
    order = (*range(lead), lead + 1, lead, lead + 3, lead + 2)  # -> [..., Hkv, n, bs, D]
    return blocks.permute(order).reshape(*block_ids.shape[:-1], num_kv_heads, -1, head_dim)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup
) -> torch.Tensor:
    """q: [b, H, D] -> [b, H, D], one masked SDPA over the group's gathered blocks."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = v_cache.shape[2]
    flat_ids = group.block_ids.view(-1)
    k = _gather_keys(k_cache, group.block_ids)  # [b, Hkv, L, D]
    # [b, L, Hkv, D] -> [b, Hkv, L, D]
    v = v_cache.index_select(0, flat_ids).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    # The query heads sharing a KV head become that head's query rows.
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask)
    return out.reshape(batch, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
) -> torch.Tensor:
    """q: [q, H, D]; k, v: this chunk's fresh [q, Hkv, D] -> [q, H, D].

    SDPA gets 4-D [1, heads, tokens, D] inputs: on CPU only those reach the fused
    flash kernel (3-D ones take the unfused path, 3-4x slower at 512 tokens)."""
    num_kv_heads, head_dim = v_cache.shape[2], v_cache.shape[3]
    if chunk.context_len == 0:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
    assert chunk.block_ids is not None
    kc = _gather_keys(k_cache, chunk.block_ids)  # [Hkv, L, D]
    vc = v_cache.index_select(0, chunk.block_ids).view(-1, num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        kc[:, : chunk.seq_len][None],
        vc[: chunk.seq_len].transpose(0, 1)[None],
        attn_mask=chunk.mask,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Attention of the flat batch. q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]."""
    if meta.native_kv_write:
        torch.ops.tokenloom_cpu.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    groups = meta.decode_groups
    if meta.num_decodes == num_tokens and len(groups) == 1:
        return _decode_attention(q, k_cache, v_cache, groups[0]).reshape(num_tokens, -1)

    out = torch.empty_like(q)
    native = meta.native
    if native is not None:
        native.op(
            out,
            q.contiguous(),
            k_cache,
            v_cache,
            native.block_table,
            native.table_rows,
            native.query_start,
            native.query_len,
            native.seq_lens,
            1.0 / math.sqrt(head_dim),
        )
    for group in groups:
        if group.token_slice is not None:
            a, b = group.token_slice
            out[a:b] = _decode_attention(q[a:b], k_cache, v_cache, group)
        else:
            assert group.token_idx is not None
            dq = q.index_select(0, group.token_idx)
            out.index_copy_(0, group.token_idx, _decode_attention(dq, k_cache, v_cache, group))
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.end
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk)
    return out.view(num_tokens, num_heads * head_dim)
