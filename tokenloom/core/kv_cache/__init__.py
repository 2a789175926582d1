"""Paged KV cache bookkeeping with prefix caching (pure Python, no torch)."""

from tokenloom.core.kv_cache.block import EMPTY_BLOCKS, KVCacheBlock, KVCacheBlocks
from tokenloom.core.kv_cache.manager import KVCacheManager

__all__ = ["EMPTY_BLOCKS", "KVCacheBlock", "KVCacheBlocks", "KVCacheManager"]
