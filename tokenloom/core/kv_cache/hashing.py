"""Chained, collision-safe hashes of full KV cache blocks.

A block's :class:`BlockHash` covers its parent's hash, its own token ids and
optional extra keys (today the request's ``cache_salt``). The 64-bit
``digest`` only picks the dict bucket: equality compares the token ids and
extra keys of the whole chain, so two different prefixes can never be
confused even when their digests collide. Walking the chain stops at the first
shared ancestor object, and the manager reuses the cached object for a matching
prefix (see ``KVCacheManager``), so in practice equality is an identity check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenloom.request import Request

# Extra keys are a hashable tuple; None when there are none.
ExtraKeys = tuple[Any, ...] | None


def digest_block(
    parent_digest: int | None, token_ids: tuple[int, ...], extra_keys: ExtraKeys
) -> int:
    """Bucket key of a block. Collisions are harmless (see module doc); tests patch this."""
    return hash((parent_digest, token_ids, extra_keys))


class BlockHash:
    """Identity of a full block: the exact token prefix (and extras) it holds KV for."""

    __slots__ = ("digest", "token_ids", "extra_keys", "parent")
    digest: int
    token_ids: tuple[int, ...]
    extra_keys: ExtraKeys
    parent: BlockHash | None

    def __init__(
        self, parent: BlockHash | None, token_ids: tuple[int, ...], extra_keys: ExtraKeys = None
    ) -> None:
        self.parent = parent
        self.token_ids = token_ids
        self.extra_keys = extra_keys
        self.digest = digest_block(None if parent is None else parent.digest, token_ids, extra_keys)

    def __hash__(self) -> int:
        return self.digest

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockHash):
            return NotImplemented
        a: BlockHash | None = self
        b: BlockHash | None = other
        while a is not b:
            if a is None or b is None:
                return False
            if a.digest != b.digest or a.token_ids != b.token_ids or a.extra_keys != b.extra_keys:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        return f"BlockHash({self.digest:#x}, tokens={list(self.token_ids)})"


def request_extra_keys(request: Request) -> ExtraKeys:
    """Keys beyond token ids that separate prefix caches for a whole request.

    They go into the first block only: every later block chains to it, so the
    whole prefix inherits them. Add a LoRA id or similar here.
    """
    if request.cache_salt is None:
        return None
    return ("salt", request.cache_salt)


def extend_block_hashes(
    request: Request,
    block_size: int,
    canonical: dict[BlockHash, Any] | None = None,
) -> list[BlockHash]:
    """Append hashes for every newly full block of ``request.all_token_ids``.

    ``canonical`` maps cached hashes to blocks carrying them; when a new hash
    equals a cached one, the cached object is stored instead, so later
    comparisons against the cache short-cut on identity.
    """
    hashes: list[BlockHash] = request.block_hashes  # type: ignore[assignment]
    num_full = request.num_tokens // block_size
    start = len(hashes)
    if start >= num_full:
        return hashes
    tokens = request.all_token_ids
    parent = hashes[-1] if hashes else None
    for i in range(start, num_full):
        extras = request_extra_keys(request) if i == 0 else None
        block_hash = BlockHash(parent, tuple(tokens[i * block_size : (i + 1) * block_size]), extras)
        if canonical:
            cached = canonical.get(block_hash)
            if cached is not None and cached.block_hash is not None:
                block_hash = cached.block_hash
        hashes.append(block_hash)
        parent = block_hash
    return hashes
