"""The scheduler side of the KV connector a configuration names."""

from __future__ import annotations

from typing import Any

from tokenloom.config import CacheConfig
from tokenloom.kv_transfer.base import KVCacheSpec, KVConnectorBase


def create_connector(
    cache_config: CacheConfig, spec: KVCacheSpec, worker_info: dict[str, Any] | None = None
) -> KVConnectorBase | None:
    """None without ``kv_transfer_config``. ``worker_info``: what the worker side
    reported when it started (a producer's bound port)."""
    config = cache_config.kv_transfer_config
    if config is None:
        return None
    if config.kv_connector == "OffloadingConnector":
        from tokenloom.kv_transfer.offloading import OffloadingConnector

        assert cache_config.kv_offload_dir is not None  # CacheConfig checks it
        return OffloadingConnector(spec, cache_config.kv_offload_dir, cache_config.kv_offload_bytes)
    from tokenloom.kv_transfer.tcp import TcpConnector

    return TcpConnector(config, spec, worker_info or {})
