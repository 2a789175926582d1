"""Chained, collision-safe hashes of full KV cache blocks.

A block's :class:`BlockHash` covers its parent's hash and its own token ids,
and the chain carries an extra key: the request's LoRA adapter id (0 for the
base model), so that blocks computed with different adapters never match. A
block that overlaps images also carries their identifiers (``mm_keys``): an
image's placeholder tokens are the same whatever the image, so two different
images at the same positions never share blocks.
The 64-bit ``digest`` only picks the dict bucket: equality compares the token
ids of the whole chain, so two different prefixes can never be confused even
when their digests collide. Walking the chain stops at the first
shared ancestor object, and the manager reuses the cached object for a matching
prefix (see ``KVCacheManager``), so in practice equality is an identity check.

Digests hash only integers, so they are the same in every process (no string
hash randomisation, no ``hash(None)``; image identifiers enter through a fixed
digest of their bytes): KV cache events carry them, and a front end computes
them from a prompt's token ids (:func:`prompt_block_digests`) to tell which
engine core already holds a prompt's prefix.
"""

from __future__ import annotations

import hashlib
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

    __slots__ = ("digest", "token_ids", "parent", "extra_key", "mm_keys")
    digest: int
    token_ids: tuple[int, ...]
    parent: BlockHash | None
    extra_key: int
    mm_keys: tuple[str, ...]

    def __init__(
        self,
        parent: BlockHash | None,
        token_ids: tuple[int, ...],
        extra_key: int = 0,
        mm_keys: tuple[str, ...] = (),
    ) -> None:
        """``extra_key`` counts for the first block of a chain; later ones inherit it.
        ``mm_keys``: identifiers of the images this block's positions overlap."""
        self.parent = parent
        self.token_ids = token_ids
        self.mm_keys = mm_keys
        if parent is not None:
            self.extra_key = parent.extra_key
            seed = parent.digest
        else:
            self.extra_key = extra_key
            seed = _ROOT_SEED if extra_key == 0 else hash((_LORA_SEED, extra_key))
        if mm_keys:
            seed = hash((seed, *map(_key_digest, mm_keys)))
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
            if (
                a.digest != b.digest
                or a.token_ids != b.token_ids
                or a.extra_key != b.extra_key
                or a.mm_keys != b.mm_keys
            ):
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
    mm_spans = _mm_spans(request, start * block_size) if request.mm_features else None
    for i in range(start, num_full):
        mm_keys: tuple[str, ...] = ()
        if mm_spans:
            mm_keys = _overlapping(mm_spans, i * block_size, (i + 1) * block_size)
        block_hash = BlockHash(
            parent,
            tuple(tokens[i * block_size : (i + 1) * block_size]),
            request.lora_int_id,
            mm_keys,
        )
        if canonical:
            cached = canonical.get(block_hash)
            if cached is not None and cached.block_hash is not None:
                block_hash = cached.block_hash
        hashes.append(block_hash)
        parent = block_hash
    return hashes


def _key_digest(identifier: str) -> int:
    """A process-independent integer for an image identifier (str hashes are salted)."""
    return int.from_bytes(hashlib.blake2b(identifier.encode(), digest_size=8).digest(), "little")


def _mm_spans(request: Request, first_position: int) -> list[tuple[int, int, str]]:
    """(start, end, identifier) of the request's images ending after ``first_position``."""
    return [
        (f.mm_position.offset, f.mm_position.end, f.identifier)
        for f in request.mm_features or ()
        if f.mm_position.end > first_position
    ]


def _overlapping(spans: list[tuple[int, int, str]], start: int, end: int) -> tuple[str, ...]:
    """Identifiers of the spans overlapping ``[start, end)``, dropping those that end
    before it from the front of ``spans`` (blocks are visited in order)."""
    while spans and spans[0][1] <= start:
        spans.pop(0)
    keys = []
    for span_start, _, identifier in spans:
        if span_start >= end:
            break
        keys.append(identifier)
    return tuple(keys)


def prompt_block_digests(token_ids: list[int], block_size: int, lora_int_id: int = 0) -> list[int]:
    """Digests of the full blocks of ``token_ids``, as an engine core caching them reports."""
    digests: list[int] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = BlockHash(parent, tuple(token_ids[start : start + block_size]), lora_int_id)
        digests.append(parent.digest)
    return digests
