"""Chained, collision-safe hashes of full KV cache blocks.

A block's :class:`BlockHash` covers its parent's hash and its own token ids,
and the chain carries an extra key: the request's LoRA adapter id (0 for the
base model), so that blocks computed with different adapters never match.
The 64-bit ``digest`` only picks the dict bucket: equality compares the token
ids of the whole chain, so two different prefixes can never be confused even
when their digests collide. Walking the chain stops at the first
shared ancestor object, and the manager reuses the cached object for a matching
prefix (see ``KVCacheManager``), so in practice equality is an identity check.

Digests hash only integers, so they are the same in every process (no string
hash randomisation, no ``hash(None)``): KV cache events carry them, and a
front end computes them from a prompt's token ids (:func:`prompt_block_digests`)
to tell which engine core already holds a prompt's prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenloom.request import Request


# Seeds of a chain's first block: the base model's, and a LoRA adapter's (with its id).
_ROOT_SEED = 0x746F6B656E6C6F6F
_LORA_SEED = 0x6C6F7261


def digest_block(parent_digest: int, token_ids: tuple[int, ...]) -> int:
    """Bucket key of a block. Collisions are harmless (see module doc); tests patch this."""
    return hash((parent_digest, token_ids))


class BlockHash:
    """Identity of a full block: the exact token prefix it holds KV for."""

    __slots__ = ("digest", "token_ids", "parent", "extra_key")
    digest: int
    token_ids: tuple[int, ...]
    parent: BlockHash | None
    extra_key: int

    def __init__(
        self, parent: BlockHash | None, token_ids: tuple[int, ...], extra_key: int = 0
    ) -> None:
        """``extra_key`` counts for the first block of a chain; later ones inherit it."""
        self.parent = parent
        self.token_ids = token_ids
        if parent is not None:
            self.extra_key = parent.extra_key
            seed = parent.digest
        else:
            self.extra_key = extra_key
            seed = _ROOT_SEED if extra_key == 0 else hash((_LORA_SEED, extra_key))
        self.digest = digest_block(seed, token_ids)

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
            if a.digest != b.digest or a.token_ids != b.token_ids or a.extra_key != b.extra_key:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        return f"BlockHash({self.digest:#x}, tokens={list(self.token_ids)})"


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
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    start = len(hashes)
    if start >= num_full:
        return hashes
    parent = hashes[-1] if hashes else None
    for i in range(start, num_full):
        block_hash = BlockHash(
            parent, tuple(tokens[i * block_size : (i + 1) * block_size]), request.lora_int_id
        )
        if canonical:
            cached = canonical.get(block_hash)
            if cached is not None and cached.block_hash is not None:
                block_hash = cached.block_hash
        hashes.append(block_hash)
        parent = block_hash
    return hashes


def prompt_block_digests(token_ids: list[int], block_size: int, lora_int_id: int = 0) -> list[int]:
    """Digests of the full blocks of ``token_ids``, as an engine core caching them reports."""
    digests: list[int] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = BlockHash(parent, tuple(token_ids[start : start + block_size]), lora_int_id)
        digests.append(parent.digest)
    return digests
