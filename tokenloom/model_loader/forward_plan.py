"""The forward plan: which implementation runs each part of the forward pass,
decided once when the model loads, logged, and exposed as ``ModelRunner.forward_plan``.

The weights' format is an input: quantized (``gguf``, ``int8``, ``int4``) or a float
dtype (``bfloat16``, ``float32``, ``float16``), kept as it is in memory. What the
activations compute in follows from the matmul: float32 around every native
kernel and MKL, the weights' own dtype where torch multiplies float weights.

The parts, each with its choices best first (``torch`` and ``modules`` always run):

- ``matmul``, the projections: ``native`` (quantized weights through the int8
  kernels of ``quantization``; bfloat16 and float32 weights in panels through
  the dense kernel, ``model.panel_linear``), ``mkl`` (float32 weights
  prepacked for MKL's sgemm, ``model.packed_linear``), ``torch`` (``F.linear``;
  quantized weights dequantized per call);
- ``layer_ops``, RMSNorm with its residual add (and per q/k head), SiLU-and-mul
  and RoPE: on CUDA ``triton`` (one launch each, ``ops.cuda.layer_ops``) or
  ``torch``; on the CPU ``native`` (``csrc/layer_ops.cpp``) or ``torch``, and
  ``triton`` only when asked for, under ``TRITON_INTERPRET=1``;
- ``attention``: on CUDA ``triton`` (one launch per layer for the whole batch,
  ``ops.cuda.paged_attention``) or ``torch``; on the CPU ``native`` (the CPU
  kernel reads K/V in place for every request of at most ``NATIVE_MAX_QUERY``
  new tokens; longer chunks, and the
  layers it cannot compute, take torch SDPA) or ``torch`` (SDPA over gathered
  blocks), and ``triton`` only when asked for, under ``TRITON_INTERPRET=1`` (the
  CUDA kernels in Triton's interpreter, for tests);
- ``decoder``: ``stack`` (every layer as one native call, for the steps the
  native attention takes whole, ``model.decoder_stack``, over any weights the
  native matmul runs), on CUDA ``graphs`` (decode steps replayed from CUDA
  graphs captured per batch size, ``worker.cuda.graphs``; off with
  ``--enforce-eager``), or ``modules`` (each layer's recipe run by its modules);
- tensor parallelism, which is the model configuration's, not a choice.

``decide_plan`` is pure: it takes what the model, device, dtype and build allow
(``PlanInputs``) and picks, for each part, the best choice available or the one
``TOKENLOOM_FORWARD_PLAN`` asks for (for debugging, e.g.
``decoder=modules,attention=torch``; it applies to every model the process
loads, a draft model too), refusing a choice that cannot run here.
A new weight format adds the choices that serve it (its native matmul, which
the stack then runs too); a new device adds its own (an attention kernel per backend, a decoder that
replays captured graphs for the steps it serves, as the stack serves its own).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tokenloom.model.attention import NATIVE_MAX_QUERY

ENV = "TOKENLOOM_FORWARD_PLAN"

PARTS = ("matmul", "layer_ops", "attention", "decoder")


@dataclass(frozen=True)
class PlanInputs:
    """What the model (built, not yet loaded), its device and weights and this build
    allow."""

    device: str  # the torch device type
    weights_dtype: torch.dtype  # the weights' float dtype (float32 for quantized ones)
    weights: str  # the quantization method ("gguf", "int8", "int4") or the float dtype
    quantized: bool
    num_layers: int
    tensor_parallel: int = 1
    lora: bool = False
    enforce_eager: bool = False
    # "part=choice" -> why it cannot run here, for the kernels this process lacks
    # and the models a kernel cannot compute (absent: it can).
    unavailable: Mapping[str, str] = field(default_factory=dict)
    # Layers the native attention kernel cannot compute (sliding windows, soft-capped scores).
    torch_attention_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ForwardPlan:
    device: str
    dtype: torch.dtype  # what the activations compute in
    weights: str
    quantized: bool
    matmul: str
    layer_ops: str
    attention: str
    decoder: str
    tensor_parallel: int
    num_layers: int
    torch_attention_layers: tuple[int, ...] = ()
    # Why a part runs other than its best choice, one "part=choice: reason" each.
    fallbacks: tuple[str, ...] = ()
    overridden: tuple[str, ...] = ()  # the parts TOKENLOOM_FORWARD_PLAN set

    def describe(self) -> str:
        """One line saying what runs."""
        attention = self.attention
        if self.attention == "native":
            torch_sdpa = [f"chunks over {NATIVE_MAX_QUERY} tokens"]
            layers = self.torch_attention_layers
            if len(layers) == self.num_layers:
                torch_sdpa.append("every layer")
            elif layers:
                torch_sdpa.append(f"layers {_ranges(layers)}")
            attention += f" (torch SDPA for {' and '.join(torch_sdpa)})"
        decoder = self.decoder
        if self.decoder == "stack":
            decoder += f" (steps of chunks up to {NATIVE_MAX_QUERY} tokens; longer: modules)"
        dtype = str(self.dtype).removeprefix("torch.")
        text = (
            f"{self.device}, weights={self.weights}, activations={dtype}, matmul={self.matmul}, "
            f"layer_ops={self.layer_ops}, decoder={decoder}, attention={attention}, "
            f"tensor_parallel={self.tensor_parallel}"
        )
        if self.overridden:
            text += f"; set by {ENV}: {', '.join(self.overridden)}"
        if self.fallbacks:
            text += f"; not {'; not '.join(self.fallbacks)}"
        return text


def parse_override(text: str | None) -> dict[str, str]:
    """``"part=choice,..."`` -> {part: choice}; the choices are checked by ``decide_plan``."""
    wanted: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        part, sep, choice = (s.strip() for s in item.partition("="))
        if not sep or not choice:
            raise ValueError(f"{ENV}: expected part=choice, got {item.strip()!r}")
        if part not in PARTS:
            raise ValueError(f"{ENV}: unknown part {part!r}; the parts are {', '.join(PARTS)}")
        if part in wanted:
            raise ValueError(f"{ENV}: {part} is given twice")
        wanted[part] = choice
    return wanted


def choices(part: str, inputs: PlanInputs) -> tuple[str, ...]:
    """The choices of ``part`` for these weights, best first."""
    if inputs.device == "cuda" and not inputs.quantized:
        return {
            "layer_ops": ("triton", "torch"),
            "attention": ("triton", "torch"),
            "decoder": ("graphs", "modules"),
        }.get(part, ("torch",))
    if part == "matmul":
        return ("native", "torch") if inputs.quantized else ("native", "mkl", "torch")
    if part == "decoder":
        return ("stack", "modules")
    if part in ("layer_ops", "attention") and not inputs.quantized:
        # Asked for only: the CUDA kernels on the CPU, in Triton's interpreter, for tests.
        return ("native", "torch", "triton")
    return ("native", "torch")


def activations_dtype(inputs: PlanInputs, matmul: str) -> torch.dtype:
    """What the activations compute in with this matmul: float32 around the native
    kernels and MKL, else the weights' dtype (torch multiplying float weights)."""
    if inputs.quantized or matmul in ("native", "mkl"):
        return torch.float32
    return inputs.weights_dtype


def decide_plan(inputs: PlanInputs, override: str | None = None) -> ForwardPlan:
    """The plan for ``inputs``; ``override`` is ``TOKENLOOM_FORWARD_PLAN``'s text.
    Raises ValueError naming the variable for a choice that does not exist or
    cannot run here."""
    wanted = parse_override(override)
    chosen: dict[str, str] = {}
    fallbacks: list[str] = []
    for part in PARTS:
        options = choices(part, inputs)
        why_not = {choice: _why_not(part, choice, inputs, chosen) for choice in options}
        want = wanted.get(part)
        if want is None:
            chosen[part] = next(choice for choice in options if why_not[choice] is None)
            if chosen[part] != options[0]:
                fallbacks.append(f"{part}={options[0]}: {why_not[options[0]]}")
        elif want not in options:
            raise ValueError(
                f"{ENV}: {part} must be one of {', '.join(options)} for {inputs.weights} "
                f"weights; got {want!r}"
            )
        elif why_not[want] is not None:
            raise ValueError(f"{ENV}: {part}={want} cannot run here: {why_not[want]}")
        else:
            chosen[part] = want
    return ForwardPlan(
        device=inputs.device,
        dtype=activations_dtype(inputs, chosen["matmul"]),
        weights=inputs.weights,
        quantized=inputs.quantized,
        matmul=chosen["matmul"],
        layer_ops=chosen["layer_ops"],
        attention=chosen["attention"],
        decoder=chosen["decoder"],
        tensor_parallel=inputs.tensor_parallel,
        num_layers=inputs.num_layers,
        torch_attention_layers=inputs.torch_attention_layers,
        fallbacks=tuple(fallbacks),
        overridden=tuple(f"{part}={choice}" for part, choice in wanted.items()),
    )


def _why_not(part: str, choice: str, inputs: PlanInputs, chosen: Mapping[str, str]) -> str | None:
    """Why ``part=choice`` cannot run given the inputs and the parts chosen before it
    (None: it can)."""
    if part in ("layer_ops", "attention") and choice == "native":
        dtype = activations_dtype(inputs, chosen["matmul"])
        if dtype != torch.float32:
            name = str(dtype).removeprefix("torch.")
            return f"the native kernels take float32 activations; matmul={chosen['matmul']} computes in {name}"
    if part == "decoder" and choice == "stack":
        for needed in ("matmul", "layer_ops", "attention"):
            if chosen[needed] != "native":
                return f"the decoder stack needs {needed}=native"
        if inputs.tensor_parallel > 1:
            return "tensor-parallel ranks exchange partial sums inside each layer"
        if inputs.lora:
            return "LoRA adds its updates to the modules' projections"
    if choice == "triton" and inputs.device != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "the Triton kernels run on CUDA (on the CPU under TRITON_INTERPRET=1 only)"
    if part == "decoder" and choice == "graphs":
        if inputs.enforce_eager:
            return "--enforce-eager runs every step eagerly"
        if chosen["attention"] != "triton":
            return "captured graphs need attention=triton"
        if inputs.lora:
            return "LoRA sets each token's adapter per step"
        if inputs.tensor_parallel > 1:
            return "tensor-parallel ranks exchange partial sums between captured kernels"
    return inputs.unavailable.get(f"{part}={choice}")


def _ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2, 5"."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
