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

The cache may hold K/V in a narrower dtype than the model computes in
(``CacheConfig.cache_dtype``, e.g. bfloat16 under a float32 model): they are
rounded when written and widened when read, which halves what a decode reads.

Where the forward plan chose the native CPU kernel (``cpu_kernels``; the runner
passes it as ``native_op``), every request with at most ``NATIVE_MAX_QUERY`` new
tokens is attended by it in one call that reads K/V in place through the block
table, and only longer chunks take the SDPA path above.

On CUDA the forward plan chooses the Triton kernels (``ops.cuda.paged_attention``):
``AttentionMetadata.for_kernel`` describes the batch by int32 tensors alone
(query start offsets, context lengths, block table), and one launch per layer
attends every request, windows and soft caps included, reading K/V in place.
Nothing is computed on the host, so a captured CUDA graph replays it.

Sliding-window layers (Mistral, Gemma, Phi-3) attend to the last ``window``
positions only: ``meta.for_layer(window, native)`` gives a variant of the
metadata, built once per step and shared by the layers with that window, whose
masks also exclude older keys. Those variants (and layers with soft-capped
scores, which SDPA cannot express) take the torch path. No block is freed when
it falls out of a window: the KV cache manager keeps every block of a request,
as the global layers interleaved with the sliding ones (Gemma) still read them
and prefix caching can reuse them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

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


# Longest chunk the native kernel takes. It scores each query token against its
# context separately and takes a step's chunks in one call, not one each: up to
# this length that beats SDPA, even on a fresh prompt SDPA takes without a
# gather; on longer chunks SDPA's tiles win.
NATIVE_MAX_QUERY = 512


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
class KernelBatch:
    """The batch as the Triton kernel reads it: int32 tensors on the model's device."""

    block_table: torch.Tensor  # [>= R, max_blocks]
    query_start: torch.Tensor  # [R + 1] first token of each request, then the total
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
    kernel: KernelBatch | None = None  # set: the Triton kernel attends the whole batch
    # The native kernels are loaded (a native_op was given): K/V are written by
    # ``tokenloom_cpu.write_kv`` too.
    native_kv_write: bool = False
    window: int | None = None
    # What ``for_layer`` needs to build the other variants, and those built so far.
    build_args: tuple | None = None
    variants: dict[tuple[int | None, bool], AttentionMetadata] | None = None

    def for_layer(self, window: int | None, native: bool = True) -> AttentionMetadata:
        """This step's metadata for a layer attending to the last ``window`` positions
        (None: all), through the native kernel only if ``native`` and no window."""
        # The Triton kernel takes every layer's window itself.
        use_kernel = self.kernel is not None
        use_native = not use_kernel and native and window is None and self.native is not None
        if window == self.window and (use_kernel or use_native or self.native is None):
            return self
        key = (window, use_native)
        if self.variants is None:
            self.variants = {}
        variant = self.variants.get(key)
        if variant is None:
            if use_kernel:
                variant = replace(self, window=window, variants=None)
            else:
                assert self.build_args is not None
                query_lens, seq_lens, block_table, slot_mapping, native_op = self.build_args
                variant = AttentionMetadata.build(
                    query_lens,
                    seq_lens,
                    block_table,
                    slot_mapping,
                    self.block_size,
                    native_op=native_op if use_native else None,
                    window=window,
                )
                variant.native_kv_write = self.native_kv_write
            self.variants[key] = variant
        return variant

    @classmethod
    def for_kernel(
        cls,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
    ) -> AttentionMetadata:
        """The batch for the Triton kernel, from tensors already on the device:
        ``query_start`` int32 [R + 1], ``seq_lens`` int32 [R], ``block_table``
        int32, ``slot_mapping`` int64 [T] (negative: a padded row, not written)."""
        return cls(
            num_tokens=slot_mapping.numel(),
            block_size=block_size,
            slot_mapping=slot_mapping,
            num_decodes=0,
            decode_groups=[],
            prefills=[],
            kernel=KernelBatch(block_table, query_start, seq_lens),
        )

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        native_op: Callable[..., None] | None = None,
        window: int | None = None,
    ) -> AttentionMetadata:
        """``window``: attend only to keys within the last ``window`` positions of
        each query (the native kernel is then not used)."""
        if window is not None:
            native_op_for_build = None
            if window < 1:
                raise ValueError(f"window must be >= 1, got {window}")
        else:
            native_op_for_build = native_op
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
        native_max_query = NATIVE_MAX_QUERY if native_op_for_build is not None else 0
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
                if ctx > 0 or (window is not None and q > window):
                    key_pos = torch.arange(s, device=device)
                    query_pos = torch.arange(ctx, s, device=device)
                    mask = key_pos[None, :] <= query_pos[:, None]
                    if window is not None:
                        mask &= key_pos[None, :] > query_pos[:, None] - window
                prefills.append(PrefillChunk(start, start + q, ctx, s, block_ids, mask))
            start += q

        groups = [
            _decode_group(
                members, dec_rows, dec_tokens, dec_seq_lens, block_table, block_size, window
            )
            for members in _bucket_by_length(
                dec_rows,
                dec_seq_lens if window is None else [min(n, window) for n in dec_seq_lens],
                block_size,
            )
        ]
        native = None
        if native_op_for_build is not None and native_reqs:
            columns = torch.tensor(native_reqs, dtype=torch.int32).t().contiguous()
            native = NativeBatch(
                op=native_op_for_build,
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
            window=window,
            build_args=(query_lens, seq_lens, block_table, slot_mapping, native_op),
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
    window: int | None = None,
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
    if window is not None and max(lens) > window:
        return _windowed_decode_group(
            token_slice, token_idx, rows, lens, block_table, block_size, window
        )
    n_blocks = -(-max(lens) // block_size)
    if rows == list(range(rows[0], rows[0] + count)):
        table = block_table[rows[0] : rows[0] + count, :n_blocks]
    else:
        table = block_table[torch.tensor(rows, device=device), :n_blocks]
    key_pos = torch.arange(n_blocks * block_size, device=device)
    lens_t = torch.tensor(lens, device=device)[:, None]
    mask = key_pos[None, :] < lens_t
    if window is not None:
        mask &= key_pos[None, :] >= lens_t - window
    return DecodeGroup(token_slice, token_idx, table.to(torch.long), mask.view(count, 1, 1, -1))


def _windowed_decode_group(
    token_slice: tuple[int, int] | None,
    token_idx: torch.Tensor | None,
    rows: list[int],
    lens: list[int],
    block_table: torch.Tensor,
    block_size: int,
    window: int,
) -> DecodeGroup:
    """Decodes of a sliding-window layer gather only the blocks their window
    touches: row i's table starts at the block holding position len_i - window."""
    device = block_table.device
    lens_t = torch.tensor(lens, device=device)
    first = torch.clamp(lens_t - window, min=0) // block_size  # [b]
    n_blocks = int((-(-lens_t // block_size) - first).max())
    cols = torch.clamp(
        first[:, None] + torch.arange(n_blocks, device=device)[None, :],
        max=block_table.shape[1] - 1,
    )
    table = torch.gather(block_table[torch.tensor(rows, device=device)].to(torch.long), 1, cols)
    key_pos = first[:, None] * block_size + torch.arange(n_blocks * block_size, device=device)
    mask = (key_pos < lens_t[:, None]) & (key_pos >= lens_t[:, None] - window)
    return DecodeGroup(token_slice, token_idx, table, mask.view(len(rows), 1, 1, -1))


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V ([T, Hkv, D]) at their slots (layouts: ``kv_cache``),
    converted to the cache's dtype."""
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    block_size = v_cache.shape[2]
    at = (slot_mapping // block_size, slot_mapping % block_size)
    # K blocks are [Hkv, D, block_size]: slot (block, offset) is column `offset`;
    # V blocks are [Hkv, block_size, D]: it is row `offset` of each head.
    k_cache.permute(0, 3, 1, 2).index_put_(at, k)
    v_cache.transpose(1, 2).index_put_(at, v)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, keys: bool) -> torch.Tensor:
    """Blocks ``block_ids`` [..., n] of K (``keys``: [Hkv, D, bs] blocks) or V
    ([Hkv, bs, D] blocks) as token-major [..., Hkv, n * block_size, D]."""
    blocks = cache.index_select(0, block_ids.reshape(-1)).view(*block_ids.shape, *cache.shape[1:])
    if keys:
        blocks = blocks.transpose(-1, -2)
    lead = block_ids.dim() - 1
    blocks = blocks.movedim(lead, lead + 1)  # [..., Hkv, n, bs, D]
    return blocks.reshape(*block_ids.shape[:-1], blocks.shape[lead], -1, blocks.shape[-1])


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA over q [B, Hq, Lq, D] and k, v [B, Hk, L, D] (Hq a multiple of Hk), or
    the same in plain torch with soft-capped scores ``cap * tanh(s / cap)``."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    if q.shape[1] != k.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        q_len, k_len = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [b, H, D] -> [b, H, D], one masked SDPA over the group's gathered blocks."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = v_cache.shape[1]
    # A 16-bit cache is widened to the compute dtype after the gather.
    k = _gather_blocks(k_cache, group.block_ids, keys=True).to(q.dtype)  # [b, Hkv, L, D]
    v = _gather_blocks(v_cache, group.block_ids, keys=False).to(q.dtype)
    # The query heads sharing a KV head become that head's query rows.
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = _attend(qg, k, v, group.mask, False, scale, softcap)
    return out.reshape(batch, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [q, H, D]; k, v: this chunk's fresh [q, Hkv, D] -> [q, H, D].

    SDPA gets 4-D [1, heads, tokens, D] inputs: on CPU only those reach the fused
    flash kernel (3-D ones take the slower unfused path)."""
    if chunk.context_len == 0:
        out = _attend(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            chunk.mask,
            chunk.mask is None,
            scale,
            softcap,
        )
        return out[0].transpose(0, 1)
    assert chunk.block_ids is not None
    kc = _gather_blocks(k_cache, chunk.block_ids, keys=True).to(q.dtype)  # [Hkv, L, D]
    vc = _gather_blocks(v_cache, chunk.block_ids, keys=False).to(q.dtype)
    out = _attend(
        q.transpose(0, 1)[None],
        kc[:, : chunk.seq_len][None],
        vc[:, : chunk.seq_len][None],
        chunk.mask,
        False,
        scale,
        softcap,
    )
    return out[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the flat batch. q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D].

    ``scale`` defaults to head_dim ** -0.5; ``softcap`` needs a metadata variant
    without the native kernel (``meta.for_layer(window, native=False)``)."""
    if meta.kernel is not None:
        return _kernel_attention(q, k, v, k_cache, v_cache, meta, meta.kernel, scale, softcap)
    if meta.native_kv_write:
        torch.ops.tokenloom_cpu.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    groups = meta.decode_groups
    if meta.num_decodes == num_tokens and len(groups) == 1:
        out = _decode_attention(q, k_cache, v_cache, groups[0], scale, softcap)
        return out.reshape(num_tokens, -1)

    out = torch.empty_like(q)
    native = meta.native
    if native is not None:
        if softcap is not None:
            raise ValueError("soft-capped attention cannot use the native kernel")
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
            scale if scale is not None else 1.0 / math.sqrt(head_dim),
        )
    for group in groups:
        if group.token_slice is not None:
            a, b = group.token_slice
            out[a:b] = _decode_attention(q[a:b], k_cache, v_cache, group, scale, softcap)
        else:
            assert group.token_idx is not None
            dq = q.index_select(0, group.token_idx)
            attended = _decode_attention(dq, k_cache, v_cache, group, scale, softcap)
            out.index_copy_(0, group.token_idx, attended)
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.end
        out[s:e] = _prefill_attention(
            q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, scale, softcap
        )
    return out.view(num_tokens, num_heads * head_dim)


def _kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    batch: KernelBatch,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """The whole batch through the Triton kernels: the K/V write, then one launch."""
    from tokenloom.ops.cuda import paged_attention as kernels

    kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    kernels.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        batch.block_table,
        batch.query_start,
        batch.seq_lens,
        scale if scale is not None else 1.0 / math.sqrt(head_dim),
        softcap=softcap,
        window=meta.window,
    )
    return out.view(num_tokens, num_heads * head_dim)
