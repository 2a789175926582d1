"""Decoder models in PyTorch over a paged KV cache, and reading their weight files
(``model_loader.loader.load_model`` builds a loaded model from them).

Families: Llama, Mistral, Qwen2, Qwen3, Phi-3 (``llama``), Gemma 2 and 3
(``gemma``); ``registry.model_class(arch)`` picks the class. A layer's order of
operations is its ``recipe`` (``recipe.Op`` steps), which the modules and the
native decoder stack both run.

Entry points used elsewhere:
- ``paths.resolve_model_path(model, revision)`` (torch-free; Hugging Face ids via ``hub``)
- ``arch_reader.load_arch_config(path) -> ModelArchConfig`` (cheap: no tensors, no torch;
  family settings in ``arch_families``)
- ``tokenizer.load_tokenizer(path)`` (torch-free); ``dtype.resolve_dtype(name, device, checkpoint)``
- ``attention.AttentionMetadata.build(...)``: per-step batch description
- ``kv_cache.allocate_kv_caches(...)`` / ``kv_cache.kv_cache_bytes_per_block(...)``
- the model: ``model(input_ids, positions, kv_caches, attn_metadata, keep_rows=None)
  -> hidden`` (of rows ``keep_rows`` only, where given) and
  ``model.compute_logits(hidden) -> float32 logits`` (``llama.CausalLM``)
- LoRA: ``lora.LoRAManager`` (per-token adapters in a batch), ``peft_config`` (torch-free
  adapter validation)
"""
