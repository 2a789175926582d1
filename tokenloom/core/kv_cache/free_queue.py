"""An O(1) doubly linked free list of KV cache blocks, in LRU order.

Allocation pops from the head; freed blocks are appended at the tail. A cached
free block that is hit again is removed from the middle in O(1), so the queue
never scans (no ``list.remove``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenloom.core.kv_cache.block import KVCacheBlock


class FreeBlockQueue:
    """Free blocks between two sentinel nodes; ``len()`` is the number queued."""

    __slots__ = ("_head", "_tail", "_num_free")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._num_free

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block."""
        head = self._head
        block = head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("free block queue is empty")
        nxt = block.next_free
        assert nxt is not None
        head.next_free = nxt
        nxt.prev_free = head
        block.prev_free = block.next_free = None
        self._num_free -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the ``n`` least recently freed blocks, oldest first."""
        if n > self._num_free:
            raise RuntimeError(f"asked for {n} free blocks, only {self._num_free} free")
        out: list[KVCacheBlock] = []
        head, tail = self._head, self._tail
        block = head.next_free
        for _ in range(n):
            assert block is not None and block is not tail
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        head.next_free = block
        assert block is not None
        block.prev_free = head
        self._num_free -= n
        return out

    def append(self, block: KVCacheBlock) -> None:
        """Queue ``block`` as the most recently freed."""
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = tail
        tail.prev_free = block
        self._num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it sits in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._num_free -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks from head (next to be reused) to tail, for inspection and checks."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free
