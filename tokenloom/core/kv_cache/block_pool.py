"""The pool of physical KV blocks: free queue, reference counts and the prefix cache map."""

from __future__ import annotations

from collections.abc import Iterable

from tokenloom.core.kv_cache.block import KVCacheBlock
from tokenloom.core.kv_cache.events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from tokenloom.core.kv_cache.free_queue import FreeBlockQueue
from tokenloom.core.kv_cache.hashing import BlockHash


class BlockPool:
    """Owns every block. Block 0 is the reserved null block and is never handed out.

    A block is *free* when its ref_cnt is 0; it then sits in the LRU free queue,
    possibly still carrying its hash so a later request can hit it. Popping a
    hashed block for reuse evicts it from ``cached``.

    ``events``: None (the default) records nothing; a list gets the
    ``BlockRemoved`` and ``AllBlocksCleared`` events (the manager adds ``BlockStored``).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        # Exact prefix identity -> the one block registered for it.
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.events: list[KVCacheEvent] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        usable = self.num_blocks - 1
        return (usable - len(self.free_queue)) / usable

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` free blocks (LRU first), evicting their hashes; each gets ref_cnt 1."""
        blocks = [self.free_queue.popleft()] if n == 1 else self.free_queue.popleft_n(n)
        cached = self.cached
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                if cached.get(block_hash) is block:
                    del cached[block_hash]
                    if self.events is not None:
                        self._record_removed(block_hash.digest)
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def _record_removed(self, digest: int) -> None:
        """One ``BlockRemoved`` per run of evictions."""
        events = self.events
        assert events is not None
        if events and isinstance(events[-1], BlockRemoved):
            events[-1].block_hashes.append(digest)
        else:
            events.append(BlockRemoved([digest]))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block, pulling free ones out of the queue."""
        queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the queue tail in order."""
        append = self.free_queue.append
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget these blocks' hashes (a ``BlockRemoved`` each); they stay where they are."""
        cached = self.cached
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                continue
            if cached.get(block_hash) is block:
                del cached[block_hash]
                if self.events is not None:
                    self._record_removed(block_hash.digest)
            block.block_hash = None

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full block under ``block_hash``; False if that prefix is already cached."""
        if self.cached.setdefault(block_hash, block) is not block:
            return False
        block.block_hash = block_hash
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False, nothing changed) while any block is in use.

        The free queue starts over in block order, as in a new pool. Left in LRU
        order, it would hand out next the blocks no request has used yet, whose
        pages the OS then zeroes on first write, while the pages of the blocks
        used before lie idle; and blocks in order lie side by side, which decode
        attention reads faster."""
        if len(self.free_queue) != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        queue = self.free_queue
        queue.popleft_n(len(queue))
        for block in self.blocks[1:]:
            queue.append(block)
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True
