"""Loading a model whose matrices stay quantized.

``resolve_quantization(model_config, path)`` decides whether (and how) a model
runs quantized; ``load_quantized(model, path, method, device)`` fills a model
built on the meta device: every projection of ``model.layers``, the LM head and
the embedding become ``QuantLinear``/``QuantEmbedding`` before anything is
allocated, so the float weights never exist in full; norms and biases load as
usual through ``model.load_weights``. The rest of the model computes in float32.

Memory: a GGUF matrix is repacked a slice of rows at a time into its final
buffers (``_repack``), so the load's temporaries stay at one slice's, not a whole
unpacked matrix's (gigabytes for a large model's head); fused projections are
concatenated as soon as their parts are in (not all at the end, which would hold
every fused matrix twice), and the reader hands each tensor's pages back once it
is repacked (``gguf_loader.iter_gguf_tensors``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenloom.config import ModelConfig
from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.gguf_loader import GGUFTensor, iter_gguf_tensors
from tokenloom.model.huge_pages import WeightArena
from tokenloom.model.llama import CausalLM
from tokenloom.model.safetensors_loader import iter_safetensors
from tokenloom.quantization.formats import (
    FLOAT_METHODS,
    GGUF_TYPES,
    QuantizedWeight,
    concat_rows,
    from_gguf,
    quantize_float,
)
from tokenloom.quantization.linear import QuantEmbedding, QuantLinear
from tokenloom.quantization.panels import PanelWeight, act_group_for

_EMBED = "embed_tokens.weight"
_HEAD = "lm_head.weight"
_SLICE_WEIGHTS = 1 << 24  # weights repacked at a time (~100 MB of temporaries)


def resolve_quantization(
    model_config: ModelConfig, path: Path, float_weights: bool = False
) -> str | None:
    """The quantization method to load ``path`` with, or None for float weights.
    Raises ValueError naming the field for combinations that cannot work. Tensor
    parallel ranks load float weights (their shards are sliced from the dequantized
    tensors), and LoRA (``float_weights``) adds to float weights, so in both cases a
    GGUF runs dequantized unless quantization is asked for."""
    method = model_config.quantization
    is_gguf = path.suffix == ".gguf"
    on_cpu = torch.device(model_config.device).type == "cpu"
    single_rank = model_config.parallel_config.tensor_parallel_size == 1
    if method is None:
        auto = is_gguf and model_config.dtype == "auto" and on_cpu and single_rank
        auto = auto and not float_weights
        return "gguf" if auto else None
    if not single_rank:
        raise ValueError(
            f"quantization {method!r} cannot be combined with tensor_parallel_size "
            f"{model_config.parallel_config.tensor_parallel_size}"
        )
    if method == "gguf" and not is_gguf:
        raise ValueError(f"quantization 'gguf' needs a .gguf model file; got {path}")
    if method in FLOAT_METHODS and is_gguf:
        raise ValueError(
            f"quantization {method!r} quantizes float checkpoints; {path.name} is already "
            "quantized (leave quantization unset, or use 'gguf')"
        )
    if model_config.dtype not in ("auto", "float32"):
        raise ValueError(
            f"dtype {model_config.dtype!r} cannot be combined with quantization {method!r}: "
            "quantized models compute in float32 (use dtype 'auto' or 'float32')"
        )
    if not on_cpu:
        raise ValueError(
            f"quantization {method!r} runs on the CPU only; device is {model_config.device!r}"
        )
    return method


class _Pending(nn.Module):
    """Stands in for a projection until its quantized weight arrives; keeps the
    bias, which loads as a normal parameter under the same name."""

    def __init__(self, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.bias = bias


def _owners(model: CausalLM) -> dict[str, tuple[nn.Module, str]]:
    """Weight name -> (parent module, attribute) of every matrix to quantize."""
    owners: dict[str, tuple[nn.Module, str]] = {_EMBED: (model, "embed_tokens")}
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        owners[_HEAD] = (model, "lm_head")
    for prefix, module in model.layers.named_modules(prefix="layers"):
        for attr, child in module.named_children():
            if isinstance(child, nn.Linear):
                owners[f"{prefix}.{attr}.weight"] = (module, attr)
    return owners


def _repack(tensor: GGUFTensor) -> QuantizedWeight:
    """``from_gguf`` over slices of rows (rows are independent blocks), each copied
    into the whole matrix's preallocated buffers."""
    raw, qtype = tensor.raw_rows(), tensor.ggml_type
    rows, cols = tensor.shape
    step = max(1, _SLICE_WEIGHTS // cols)
    first = from_gguf(raw[:step], qtype, (min(step, rows), cols))
    if step >= rows:
        return first

    out = first.map_tensors(lambda part: part.new_empty((rows, *part.shape[1:])))
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        part = first if start == 0 else from_gguf(raw[start:stop], qtype, (stop - start, cols))
        for whole, piece in zip(out.tensors(), part.tensors(), strict=True):
            whole[start:stop] = piece
    return out


def _quantized_stream(
    path: Path,
    arch: ModelArchConfig,
    method: str,
    wanted: set[str],
    map_name: Callable[[str], tuple[str, int | None, int] | None],
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(hf_name, float tensor or quantized weight): matrices named in ``wanted``
    come quantized, from the file's blocks or quantized from floats."""
    if method == "gguf":
        for hf_name, tensor in iter_gguf_tensors(path, arch):
            target = map_name(hf_name)
            if target is None or target[0] not in wanted:
                yield hf_name, tensor.dequantize()
            elif tensor.ggml_type in GGUF_TYPES:
                yield hf_name, _repack(tensor)
            else:  # an F16/F32 matrix in a quantized file: 8 bits per weight
                yield hf_name, quantize_float(tensor.dequantize(), "int8")
        return
    for hf_name, weight in iter_safetensors(path):
        target = map_name(hf_name)
        if target is not None and target[0] in wanted:
            yield hf_name, quantize_float(weight, method)
        else:
            yield hf_name, weight


def load_quantized(
    model: CausalLM, path: Path, arch: ModelArchConfig, method: str, device: torch.device
) -> set[str]:
    """Fill ``model`` (on the meta device) with quantized matrices; returns the
    names of the float parameters filled, like ``load_weights``."""
    owners = _owners(model)
    for parent, attr in owners.values():
        setattr(parent, attr, _Pending(getattr(getattr(parent, attr), "bias", None)))
    model.to_empty(device=device)

    map_name = model._map_name  # HF name -> (our parameter, row offset, parts)
    pending: dict[str, list[tuple[int, QuantizedWeight]]] = {}
    weights: dict[str, PanelWeight] = {}
    arena = WeightArena()  # every matrix on huge pages, which a batch-1 step streams faster

    def floats(stream: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, value in stream:
            target = map_name(hf_name)
            if isinstance(value, QuantizedWeight) and target is not None:
                name, offset, count = target
                got = pending.setdefault(name, [])
                got.append((offset or 0, value))
                if len(got) == count:  # fused now, so its parts are gone before the next
                    del pending[name]
                    weights[name] = PanelWeight.from_rows(
                        concat_rows([w for _, w in sorted(got, key=lambda p: p[0])]),
                        act_group_for(name),
                        arena,
                    )
            else:
                yield hf_name, value

    filled = model.load_weights(
        floats(_quantized_stream(path, arch, method, set(owners), map_name))
    )
    missing = sorted(name for name in owners if name not in weights or name in pending)
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for {', '.join(missing[:5])}")
    for name, (parent, attr) in owners.items():
        bias = getattr(parent, attr).bias
        module = (
            QuantEmbedding(weights[name]) if name == _EMBED else QuantLinear(weights[name], bias)
        )
        setattr(parent, attr, module)
    # Tied models read their logits through the embedding's quantized copy.
    setattr(model, "logits_head", QuantLinear(weights.get(_HEAD, weights[_EMBED])))  # noqa: B010
    return filled
