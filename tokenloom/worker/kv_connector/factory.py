"""The worker side of the KV connector a configuration names."""

from __future__ import annotations

import torch

from tokenloom.config import CacheConfig
from tokenloom.kv_transfer.base import KVCacheSpec
from tokenloom.worker.kv_connector.base import KVConnectorWorker


def create_worker_connector(
    cache_config: CacheConfig,
    spec: KVCacheSpec,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> KVConnectorWorker | None:
    config = cache_config.kv_transfer_config
    if config is None:
        return None
    if config.kv_connector == "OffloadingConnector":
        from tokenloom.worker.kv_connector.offloading import OffloadingWorker

        assert cache_config.kv_offload_dir is not None  # CacheConfig checks it
        return OffloadingWorker(spec, cache_config.kv_offload_dir, kv_caches)
    from tokenloom.worker.kv_connector.tcp import TcpWorker

    return TcpWorker(config, spec, kv_caches)
