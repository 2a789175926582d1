"""Pooling: serving a decoder as an embedding model (``--runner pooling``).

``config`` (torch-free) holds ``PoolerConfig``, vLLM's ``--pooler-config``,
read from a Sentence-Transformers model directory where it has one, and the
per-request parameters it completes. ``methods`` holds the pooling math over
final hidden states (last token, mean, CLS; normalisation, Matryoshka
truncation) that the model runner's ``worker.pooling_runner`` applies.
"""
