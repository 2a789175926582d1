"""KV cache blocks: the unit of allocation, and the list type handed to the scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenloom.core.kv_cache.hashing import BlockHash


class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's KV cache.

    ``ref_cnt`` counts the requests holding the block. ``block_hash`` is set while
    the block is registered in the prefix cache (it survives the block being
    freed, until the block is reused). ``prev_free``/``next_free`` link the block
    into the free queue; both are None while it is not queued.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class KVCacheBlocks:
    """Blocks returned by the manager to the scheduler (computed hits or new ones).

    ``blocks`` is an immutable tuple, so the shared empty instance
    (:data:`EMPTY_BLOCKS`) can be returned on the hot path without copying.
    Instances are always truthy; test for ``None`` to detect a failed allocation.
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: Sequence[KVCacheBlock] = ()) -> None:
        self.blocks: tuple[KVCacheBlock, ...] = tuple(blocks)

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        if not other.blocks:
            return self
        if not self.blocks:
            return other
        return KVCacheBlocks(self.blocks + other.blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


EMPTY_BLOCKS = KVCacheBlocks()
