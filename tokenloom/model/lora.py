"""LoRA adapters applied per token in a mixed batch.

``LoRAManager(model, lora_config)`` wraps the attention and MLP projections of a
loaded ``CausalLM`` in ``LoRALinear`` modules holding ``max_loras`` weight slots
of rank up to ``max_lora_rank``. Adapters are registered (``add_adapter``: PEFT
weights read onto the host) and, each step, ``prepare(token_adapter_ids)`` puts
the step's adapters in slots (evicting the least recently used ones the step
does not need) and builds one mask saying which slot each token uses.

Every wrapped projection then adds, for all tokens at once,
``((x @ A_all) * mask) @ B_all``: A_all [in, slots * rank] and B_all
[slots * rank, out] stack the slots' low-rank factors (zero-padded to the
maximal rank, the scaling folded into B), so a token's row only keeps its own
adapter's columns and base-model tokens none. Two matmuls per projection
whatever the mix of adapters: no loop over requests or adapters. A fused
projection (qkv, gate_up) has one B block per part (q, k, v), each writing its
own output columns. A step without adapter tokens skips the update entirely.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenloom.config import LoRAConfig
from tokenloom.lora_request import LoRARequest
from tokenloom.model.llama import CausalLM
from tokenloom.model.panel_linear import PanelProjection
from tokenloom.model.peft_config import read_peft_config, text_module_path


class _BatchMask:
    """The step's [T, slots * rank] mask, shared by every LoRALinear (None: no
    token uses an adapter)."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """``base(x)`` plus each token's own adapter update on the output columns of
    each part (``parts``: (offset, size) pairs covering the fused output)."""

    lora_a: torch.Tensor

    def __init__(
        self,
        base: nn.Module,
        parts: list[tuple[int, int]],
        num_slots: int,
        max_rank: int,
        batch: _BatchMask,
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.max_rank = max_rank
        self.width = num_slots * max_rank
        self._batch = batch
        weight = base.weight
        assert isinstance(weight, torch.Tensor)
        in_features = weight.shape[1]
        self.register_buffer(
            "lora_a",
            torch.zeros(in_features, len(parts) * self.width, dtype=weight.dtype),
            persistent=False,
        )
        self.lora_b = nn.ParameterList(
            nn.Parameter(torch.zeros(self.width, size, dtype=weight.dtype), requires_grad=False)
            for _, size in parts
        )

    @property
    def weight(self) -> torch.Tensor:
        weight = self.base.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        mask = self._batch.mask
        if mask is None:
            return out
        xa = torch.mm(x, self.lora_a).view(x.shape[0], len(self.parts), self.width)
        xa = xa * mask[:, None, :]
        for j, (offset, size) in enumerate(self.parts):
            out[:, offset : offset + size].addmm_(xa[:, j], self.lora_b[j])
        return out

    def set_slot(
        self, slot: int, rank: int, factors: list[tuple[torch.Tensor, torch.Tensor] | None]
    ) -> None:
        """Write (A [r, in], scaled B [size, r]) per part into ``slot`` (None: zeros)."""
        first = slot * self.max_rank
        for j, factor in enumerate(factors):
            col = j * self.width + first
            self.lora_a[:, col : col + self.max_rank] = 0
            self.lora_b[j].data[first : first + self.max_rank] = 0
            if factor is not None:
                a, b = factor
                self.lora_a[:, col : col + rank] = a.t()
                self.lora_b[j].data[first : first + rank] = b.t()


@dataclass
class LoRAWeights:
    """One adapter on the host: per target (wrapped module name, part index), A and
    scaled B."""

    lora_int_id: int
    name: str
    rank: int
    factors: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]


def _targets(model: CausalLM) -> dict[str, tuple[str, int]]:
    """Hugging Face module path -> (our wrapped module, part index)."""
    fused = model.arch.fused_checkpoint_projections
    targets: dict[str, tuple[str, int]] = {}
    for i in range(len(model.layers)):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        if fused:
            targets[hf + "self_attn.qkv_proj"] = (ours + "self_attn.qkv_proj", 0)
            targets[hf + "mlp.gate_up_proj"] = (ours + "mlp.gate_up_proj", 0)
        else:
            for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
                targets[hf + f"self_attn.{name}"] = (ours + "self_attn.qkv_proj", j)
            for j, name in enumerate(("gate_proj", "up_proj")):
                targets[hf + f"mlp.{name}"] = (ours + "mlp.gate_up_proj", j)
        targets[hf + "self_attn.o_proj"] = (ours + "self_attn.o_proj", 0)
        targets[hf + "mlp.down_proj"] = (ours + "mlp.down_proj", 0)
    return targets


class LoRAManager:
    """Owns the LoRA slots of one model; see the module docstring."""

    def __init__(self, model: CausalLM, lora_config: LoRAConfig) -> None:
        if any(getattr(m, "quantized", False) for m in model.modules()):
            raise ValueError(
                "enable_lora needs float base weights, and this model runs quantized: "
                "load it with dtype='float32' or 'bfloat16' (which dequantizes a GGUF)"
            )
        if model.decoder_stack is not None or any(
            isinstance(m, PanelProjection) for m in model.modules()
        ):
            # The native kernels would multiply past the wrapped modules.
            raise ValueError(
                "LoRA adds its updates to the projections' nn.Linear weights, and this "
                "model was loaded for the native kernels: load it with "
                "load_model(..., float_weights=True), as the engine does under enable_lora"
            )
        self.model = model
        self.max_loras = lora_config.max_loras
        self.max_rank = lora_config.max_lora_rank
        self._batch = _BatchMask()
        self.modules: dict[str, LoRALinear] = {}
        arch = model.arch
        q = arch.num_attention_heads * arch.head_dim
        kv = arch.num_key_value_heads * arch.head_dim
        fused = arch.fused_checkpoint_projections
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_parts = [(0, q + 2 * kv)] if fused else [(0, q), (q, kv), (q + kv, kv)]
            inter = arch.intermediate_size
            gate_up_parts = [(0, 2 * inter)] if fused else [(0, inter), (inter, inter)]
            for owner, attr, parts in (
                (attn, "qkv_proj", qkv_parts),
                (attn, "o_proj", [(0, arch.hidden_size)]),
                (mlp, "gate_up_proj", gate_up_parts),
                (mlp, "down_proj", [(0, arch.hidden_size)]),
            ):
                wrapped = LoRALinear(
                    getattr(owner, attr), parts, self.max_loras, self.max_rank, self._batch
                )
                setattr(owner, attr, wrapped)
                prefix = "self_attn" if owner is attn else "mlp"
                self.modules[f"layers.{i}.{prefix}.{attr}"] = wrapped
        self._targets = _targets(model)
        self.adapters: dict[int, LoRAWeights] = {}
        # adapter id -> slot, least recently used first
        self._slots: OrderedDict[int, int] = OrderedDict()

    # ------------------------------------------------------------ registration

    def add_adapter(self, request: LoRARequest) -> None:
        """Read the adapter's PEFT weights (no-op when its id is registered)."""
        if request.lora_int_id in self.adapters:
            return
        self.adapters[request.lora_int_id] = self._read(request)

    def remove_adapter(self, lora_int_id: int) -> bool:
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        slot = self._slots.pop(lora_int_id, None)
        if slot is not None:
            for module in self.modules.values():
                module.set_slot(slot, 0, [None] * len(module.parts))
        return True

    def _read(self, request: LoRARequest) -> LoRAWeights:
        from safetensors.torch import load_file

        config = read_peft_config(request.lora_path, self.max_rank)
        tensors = load_file(str(config.path / "adapter_model.safetensors"))
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            name = text_module_path(key.removeprefix("base_model.model."))
            for kind in ("lora_A", "lora_B"):
                suffix = f".{kind}.weight"
                if name.endswith(suffix):
                    pairs.setdefault(name[: -len(suffix)], {})[kind] = tensor
                    break
            else:
                raise ValueError(f"LoRA adapter {config.path}: unsupported tensor {key}")
        dtype = next(iter(self.modules.values())).lora_a.dtype
        factors: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for module_path, pair in pairs.items():
            target = self._targets.get(module_path)
            if target is None:
                raise ValueError(
                    f"LoRA adapter {config.path} targets {module_path}, which this "
                    f"{self.model.arch.architecture} model does not have"
                )
            if set(pair) != {"lora_A", "lora_B"}:
                raise ValueError(
                    f"LoRA adapter {config.path}: {module_path} lacks lora_A or lora_B"
                )
            module = self.modules[target[0]]
            _, size = module.parts[target[1]]
            a, b = pair["lora_A"], pair["lora_B"]
            expected_a = (config.rank, module.lora_a.shape[0])
            if tuple(a.shape) != expected_a or tuple(b.shape) != (size, config.rank):
                raise ValueError(
                    f"LoRA adapter {config.path}: {module_path} has A {tuple(a.shape)} and "
                    f"B {tuple(b.shape)}; the base model needs A {expected_a} and "
                    f"B {(size, config.rank)} (an adapter for another model?)"
                )
            factors[target] = (a.to(dtype), (b.float() * config.scaling).to(dtype))
        return LoRAWeights(request.lora_int_id, request.lora_name, config.rank, factors)

    # ------------------------------------------------------------------ a step

    def prepare(self, token_adapter_ids: np.ndarray | None) -> None:
        """Set the adapter of each token of the next forward (0: base model).

        The step may use at most ``max_loras`` distinct adapters, all registered."""
        if token_adapter_ids is None or not token_adapter_ids.any():
            self._batch.mask = None
            return
        needed = [int(i) for i in np.unique(token_adapter_ids) if i != 0]
        if len(needed) > self.max_loras:
            raise ValueError(f"{len(needed)} adapters in one step, max_loras={self.max_loras}")
        token_slots = np.full(len(token_adapter_ids), -1, dtype=np.int64)
        for lora_id in needed:
            token_slots[token_adapter_ids == lora_id] = self._slot_for(lora_id, needed)
        device = next(iter(self.modules.values())).lora_a.device
        column_slots = torch.arange(self.max_loras * self.max_rank, device=device) // self.max_rank
        slots = torch.from_numpy(token_slots).to(device)
        dtype = next(iter(self.modules.values())).lora_a.dtype
        self._batch.mask = (column_slots[None, :] == slots[:, None]).to(dtype)

    def clear(self) -> None:
        self._batch.mask = None

    def _slot_for(self, lora_id: int, needed: list[int]) -> int:
        if lora_id in self._slots:
            self._slots.move_to_end(lora_id)
            return self._slots[lora_id]
        weights = self.adapters.get(lora_id)
        if weights is None:
            raise KeyError(f"LoRA adapter id {lora_id} is not registered")
        used = set(self._slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self._slots if i not in needed)
            slot = self._slots.pop(victim)
        for name, module in self.modules.items():
            module.set_slot(
                slot,
                weights.rank,
                [weights.factors.get((name, j)) for j in range(len(module.parts))],
            )
        self._slots[lora_id] = slot
        return slot
