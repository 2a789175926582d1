"""The O(1) doubly linked free queue: LRU order, removal from the middle, misuse errors."""

import pytest

from tokenloom.core.kv_cache.block import KVCacheBlock
from tokenloom.core.kv_cache.free_queue import FreeBlockQueue


def _ids(queue: FreeBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def test_popleft_takes_oldest_and_append_goes_to_tail() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 4
    first = queue.popleft()
    assert first.block_id == 0
    assert first.prev_free is None and first.next_free is None
    queue.append(first)
    assert _ids(queue) == [1, 2, 3, 0]
    assert len(queue) == 4


def test_remove_from_middle_relinks_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert _ids(queue) == [0, 1, 3, 4]
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert _ids(queue) == [1, 3]
    assert len(queue) == 2
    queue.append(blocks[2])
    assert _ids(queue) == [1, 3, 2]


def test_popleft_n_takes_in_order_and_keeps_rest_linked() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    taken = queue.popleft_n(4)
    assert [b.block_id for b in taken] == [0, 1, 2, 3]
    assert all(b.prev_free is None and b.next_free is None for b in taken)
    assert _ids(queue) == [4, 5]
    assert queue.popleft_n(0) == []
    assert [b.block_id for b in queue.popleft_n(2)] == [4, 5]
    assert len(queue) == 0 and _ids(queue) == []
    queue.append(blocks[1])
    assert _ids(queue) == [1]


def test_misuse_raises() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    with pytest.raises(RuntimeError, match="already in the free queue"):
        queue.append(blocks[0])
    with pytest.raises(RuntimeError, match="only 2 free"):
        queue.popleft_n(3)
    queue.popleft_n(2)
    with pytest.raises(RuntimeError, match="empty"):
        queue.popleft()
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[1])
    assert len(queue) == 0
