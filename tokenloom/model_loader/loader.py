"""Loading model weights, and deciding how the forward pass runs over them.

- ``load_model(model_config) -> LoadedModel``: builds the model on the meta
  device with its weights in the dtype from ``resolve_dtype`` (or quantized:
  ``quantization.loading.resolve_quantization``), decides the forward plan
  (``forward_plan``) from what the model and this process allow and logs it,
  fills every parameter on ``model_config.device`` (raising if the checkpoint
  leaves one empty), and sets the model up for the plan: matrices in panels
  for the native matmul, MKL-prepacked, or as they are.

The plan comes before the weights because it says what the activations
compute in: float32 around the native kernels (the model's norms and biases
are then float32, its matrices in their own dtype), else the weights' dtype.
Building on the meta device first also spares the random initialisation of
weights that are overwritten anyway. Finding the files
(``paths.resolve_model_path``) is torch-free and lives apart, for the front end.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenloom.config import ModelConfig
from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.arch_reader import load_arch_config
from tokenloom.model.decoder_stack import DecoderStack
from tokenloom.model.dtype import resolve_dtype
from tokenloom.model.gguf_loader import iter_gguf_weights
from tokenloom.model.llama import CausalLM, DecoderLayer
from tokenloom.model.packed_linear import prepacking_available
from tokenloom.model.panel_linear import PANEL_DTYPES, use_native_matmul
from tokenloom.model.paths import resolve_model_path
from tokenloom.model.registry import model_class
from tokenloom.model.safetensors_loader import iter_safetensors
from tokenloom.model_loader.forward_plan import (
    ENV,
    ForwardPlan,
    PlanInputs,
    decide_plan,
    parse_override,
)
from tokenloom.ops.cpu_kernels import (
    NATIVE_HEAD_DIMS,
    kernels_enabled,
    layer_ops_available,
    paged_attention_op,
)
from tokenloom.quantization.loading import load_quantized, resolve_quantization

if TYPE_CHECKING:
    from tokenloom.distributed.shard import TPShard

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    arch: ModelArchConfig
    dtype: torch.dtype
    device: torch.device
    path: Path
    plan: ForwardPlan
    # The native attention kernel where the plan chose it, for ``AttentionMetadata.build``.
    attention_op: Callable[..., None] | None = None
    quantized: bool = False  # matrices kept quantized
    # The weights' float dtype (float32 for quantized ones); ``dtype`` is what the
    # activations compute in.
    weights_dtype: torch.dtype = torch.float32


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
    path = resolve_model_path(
        model_config.model, model_config.revision, model_config.load_format != "dummy"
    )
    arch = load_arch_config(path)
    device = torch.device(model_config.device)
    quantization = resolve_quantization(model_config, path, float_weights)
    if arch.vision is not None and (shard is not None or quantization):
        raise ValueError(
            f"{arch.architecture} (a vision-language model) runs unquantized on one device: "
            "tensor_parallel_size must be 1 and quantization unset"
        )
    tensor_parallel = 1 if shard is None else shard.world_size
    if quantization:
        weights_dtype, why = torch.float32, f"quantized ({quantization})"
    else:
        widens_bf16 = _native_matmul_keeps_bf16(device, arch, tensor_parallel, float_weights)
        weights_dtype, why = resolve_dtype(
            model_config.dtype, model_config.device, arch.checkpoint_dtype, widens_bf16
        )

    local_arch = arch if shard is None else shard.local_arch(arch)
    with torch.device("meta"):
        model = model_class(arch)(local_arch, weights_dtype)
    inputs = plan_inputs(
        model,
        device,
        weights_dtype,
        weights=quantization or str(weights_dtype).removeprefix("torch."),
        quantized=bool(quantization),
        tensor_parallel=tensor_parallel,
        lora=float_weights,
        enforce_eager=model_config.enforce_eager,
    )
    plan = decide_plan(inputs, os.environ.get(ENV))
    dtype = plan.dtype
    logger.info("dtype %s: weights in %s (%s)", model_config.dtype, inputs.weights, why)
    logger.info("forward plan for %s: %s", path.name, plan.describe())
    if quantization:
        filled = load_quantized(model, path, arch, quantization, device)
    else:
        if dtype != weights_dtype:  # norms and biases in the activations' dtype
            model.cast_outside_matrices(dtype)
        model.to_empty(device=device)
        if model_config.load_format == "dummy":
            filled = fill_random(model, model_config.seed)
        else:
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
    apply_plan(model, plan)
    if shard is not None:
        from tokenloom.distributed.parallel_layers import parallelize

        parallelize(model, shard, arch.vocab_size)
    attention_op = None
    if plan.attention == "native":
        attention_op = paged_attention_op(device, dtype, local_arch.head_dim)
    return LoadedModel(
        model=model,
        arch=arch,
        dtype=dtype,
        device=device,
        path=path,
        plan=plan,
        attention_op=attention_op,
        quantized=bool(quantization),
        weights_dtype=weights_dtype,
    )


def fill_random(model: CausalLM, seed: int) -> set[str]:
    """vLLM's ``--load-format dummy``: every parameter drawn uniformly from a small
    range (norm weights around 1, so activations keep their scale); returns the
    names filled."""
    generator = torch.Generator(device=next(model.parameters()).device)
    generator.manual_seed(seed)
    names = set()
    for name, param in model.named_parameters():
        param.data.uniform_(-0.02, 0.02, generator=generator)
        if "norm" in name:
            param.data.add_(1.0)
        names.add(name)
    return names


def plan_inputs(
    model: CausalLM,
    device: torch.device,
    weights_dtype: torch.dtype,
    weights: str,
    quantized: bool,
    tensor_parallel: int = 1,
    lora: bool = False,
    enforce_eager: bool = False,
) -> PlanInputs:
    """What ``model`` (built, on any device: only its structure is read) on ``device``
    with these weights and this process's kernels allow."""
    unavailable: dict[str, str] = {}
    native = _native_refusal(device)
    matmul = _native_matmul_refusal(
        device, model.arch, weights_dtype, quantized, tensor_parallel, lora
    )
    if matmul is not None:
        unavailable["matmul=native"] = matmul
    if not quantized and not prepacking_available(device, weights_dtype):
        unavailable["matmul=mkl"] = "MKL's packed sgemm serves float32 on a CPU build with MKL"
    if importlib.util.find_spec("triton") is None:
        unavailable["attention=triton"] = unavailable["layer_ops=triton"] = (
            "Triton is not installed"
        )
    refusal = DecoderStack.refusal(model)
    if refusal is not None:
        unavailable["decoder=stack"] = refusal
    if native is not None:
        unavailable["layer_ops=native"] = unavailable["attention=native"] = native
    elif model.arch.head_dim not in NATIVE_HEAD_DIMS:
        unavailable["attention=native"] = (
            f"the native attention kernel has no head_dim {model.arch.head_dim} "
            f"(it has {', '.join(map(str, NATIVE_HEAD_DIMS))})"
        )
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    return PlanInputs(
        device=device.type,
        weights_dtype=weights_dtype,
        weights=weights,
        quantized=quantized,
        num_layers=len(layers),
        tensor_parallel=tensor_parallel,
        lora=lora,
        enforce_eager=enforce_eager,
        unavailable=unavailable,
        torch_attention_layers=tuple(
            i for i, layer in enumerate(layers) if not layer.self_attn.takes_native_kernel
        ),
    )


def _native_matmul_keeps_bf16(
    device: torch.device, arch: ModelArchConfig, tensor_parallel: int, lora: bool
) -> bool:
    """Whether bfloat16 weights would run through the native dense kernel, which
    widens them to float32 per tile where the CPU has no bfloat16 dot products
    (unless ``TOKENLOOM_FORWARD_PLAN`` asks for another matmul)."""
    if parse_override(os.environ.get(ENV)).get("matmul", "native") != "native":
        return False
    refusal = _native_matmul_refusal(device, arch, torch.bfloat16, False, tensor_parallel, lora)
    return refusal is None


def _native_matmul_refusal(
    device: torch.device,
    arch: ModelArchConfig,
    weights_dtype: torch.dtype,
    quantized: bool,
    tensor_parallel: int,
    lora: bool,
) -> str | None:
    """Why the native matmul cannot multiply these weights (None: it can)."""
    native = _native_refusal(device)
    if native is not None or quantized:
        return native
    if weights_dtype not in PANEL_DTYPES:
        return "the native matmul keeps bfloat16 or float32 weights"
    if tensor_parallel > 1:
        return "tensor-parallel ranks shard nn.Linear weights"
    if lora:
        return "LoRA adds its updates to nn.Linear weights"
    if arch.vision is not None:
        return "a vision-language model's vision tower computes in the weights' dtype"
    return None


def _native_refusal(device: torch.device) -> str | None:
    """Why the native CPU kernels cannot serve ``device`` (None: they can)."""
    if device.type != "cpu":
        return "the native kernels run on the CPU"
    if not kernels_enabled():
        return "TOKENLOOM_CPU_KERNELS=0 turns the native kernels off"
    if not layer_ops_available(device, torch.float32):
        return "the native kernels failed to build or load"
    return None


def apply_plan(model: CausalLM, plan: ForwardPlan) -> None:
    """Set a loaded model up to run ``plan`` (tensor parallelism aside, which wraps
    the result: ``distributed.parallel_layers.parallelize``)."""
    if plan.matmul == "mkl":
        model.prepack_weights()
    elif plan.matmul == "native" and not plan.quantized:
        model.pack_weights()
    use_native_matmul(model, plan.matmul == "native")
    model.use_layer_ops(plan.layer_ops)
    if plan.decoder == "stack":
        model.decoder_stack = DecoderStack(model)
