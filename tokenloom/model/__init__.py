"""Llama-family models in PyTorch over a paged KV cache, and their loading.

Entry points used elsewhere:
- ``paths.resolve_model_path(model)`` (torch-free)
- ``loader.load_model(model_config) -> LoadedModel``
- ``arch_config.load_arch_config(path) -> ModelArchConfig`` (cheap: no tensors, no torch)
- ``tokenizer.load_tokenizer(path)`` (torch-free); ``dtype.resolve_dtype(name, device)``
- ``attention.AttentionMetadata.build(...)``: per-step batch description
- ``kv_cache.allocate_kv_caches(...)`` / ``kv_cache.kv_cache_bytes_per_block(...)``
- the model: ``model(input_ids, positions, kv_caches, attn_metadata) -> hidden`` and
  ``model.compute_logits(hidden) -> float32 logits`` (``llama.CausalLM``)
"""
