"""A picture of the KV cache: the state of every block, one byte each.

The dashboard draws it; the engine core takes one a few times a second, so
walking every block here (a few hundred microseconds for thousands of
blocks) never shows in step times.
"""

from __future__ import annotations

from tokenloom.core.kv_cache.block_pool import BlockPool
from tokenloom.outputs import KV_BLOCK_CACHED, KV_BLOCK_FREE, KV_BLOCK_SHARED, KV_BLOCK_USED


def kv_block_map(pool: BlockPool) -> bytes:
    """``KV_BLOCK_*`` of each usable block, in block id order (the null block left out):
    free, free but still cached (a later prompt can hit it), held by one request,
    or shared by several."""
    return bytes(
        [
            (KV_BLOCK_SHARED if block.ref_cnt > 1 else KV_BLOCK_USED)
            if block.ref_cnt
            else (KV_BLOCK_FREE if block.block_hash is None else KV_BLOCK_CACHED)
            for block in pool.blocks[1:]
        ]
    )
