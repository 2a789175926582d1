"""Loading model weights.

- ``load_model(model_config: ModelConfig) -> LoadedModel``: builds the model on
  ``model_config.device`` in the dtype from ``resolve_dtype`` and fills every
  parameter, raising if the checkpoint leaves one empty. Quantized models
  (``quantization.loading.resolve_quantization``) keep their matrices quantized
  and compute in float32.

The model is built on the meta device first so that no time goes into random
initialisation of weights that are overwritten anyway. Finding the files
(``paths.resolve_model_path``) is torch-free and lives apart, for the front end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from tokenloom.config import ModelConfig
from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.arch_reader import load_arch_config
from tokenloom.model.dtype import resolve_dtype
from tokenloom.model.gguf_loader import iter_gguf_weights
from tokenloom.model.llama import CausalLM
from tokenloom.model.packed_linear import prepacking_available
from tokenloom.model.paths import resolve_model_path
from tokenloom.model.registry import model_class
from tokenloom.model.safetensors_loader import iter_safetensors
from tokenloom.ops.cpu_kernels import layer_ops_available
from tokenloom.quantization.decoder_stack import DecoderStack
from tokenloom.quantization.loading import load_quantized, resolve_quantization

if TYPE_CHECKING:
    from tokenloom.distributed.shard import TPShard


@dataclass
class LoadedModel:
    model: nn.Module
    arch: ModelArchConfig
    dtype: torch.dtype
    device: torch.device
    path: Path
    quantized: bool = False  # matrices kept quantized (dtype is then what they compute in)


def load_model(
    model_config: ModelConfig, shard: TPShard | None = None, float_weights: bool = False
) -> LoadedModel:
    """Load the weights named by ``model_config`` onto its device, ready for inference.

    ``float_weights`` (LoRA needs them) keeps a GGUF from running quantized unless
    ``model_config.quantization`` asks for it.

    With ``shard`` (a tensor-parallel rank) the model holds only the rank's share
    (``model.arch`` is the local one, ``LoadedModel.arch`` the whole model's) and
    talks to the other ranks where it must (``distributed.parallel_layers``).
    """
    path = resolve_model_path(model_config.model, model_config.revision)
    arch = load_arch_config(path)
    device = torch.device(model_config.device)
    quantization = resolve_quantization(model_config, path, float_weights)
    dtype = (
        torch.float32 if quantization else resolve_dtype(model_config.dtype, model_config.device)
    )

    local_arch = arch if shard is None else shard.local_arch(arch)
    with torch.device("meta"):
        model = model_class(arch)(local_arch, dtype)
    if quantization:
        filled = load_quantized(cast(CausalLM, model), path, arch, quantization, device)
    else:
        model.to_empty(device=device)
        weights = (
            iter_gguf_weights(path, arch) if path.suffix == ".gguf" else iter_safetensors(path)
        )
        if shard is not None:
            weights = shard.slice_weights(weights, arch)
        filled = model.load_weights(weights)
    missing = sorted(set(dict(model.named_parameters())) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {path} lacks weights for {len(missing)} parameters: {shown}")
    model.init_buffers(device, dtype, model_config.max_model_len)
    model.eval()
    model.requires_grad_(False)
    if prepacking_available(device, dtype) and not quantization:
        model.prepack_weights()
    if layer_ops_available(device, dtype):
        model.use_fused_layer_ops()
    if (
        quantization
        and shard is None
        and isinstance(model, CausalLM)
        and layer_ops_available(device, dtype)
        and DecoderStack.refusal(model) is None
    ):
        model.decoder_stack = DecoderStack(model)
    if shard is not None:
        from tokenloom.distributed.parallel_layers import parallelize

        parallelize(model, shard, arch.vocab_size)
    return LoadedModel(
        model=model, arch=arch, dtype=dtype, device=device, path=path, quantized=bool(quantization)
    )
