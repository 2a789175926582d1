"""The model runner's CUDA side: decode steps replayed from captured graphs
(``graphs``) and the KV cache sized from ``--gpu-memory-utilization`` (``memory``)."""
