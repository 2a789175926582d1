"""The forward plan's decisions, from what the model, device and build allow: no
model, no kernels, only ``decide_plan``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tokenloom.model_loader.forward_plan import ENV, PlanInputs, decide_plan

QUANTIZED = PlanInputs(
    device="cpu", weights_dtype=torch.float32, weights="gguf", quantized=True, num_layers=30
)
FLOAT32 = replace(QUANTIZED, weights="float32", quantized=False)
BFLOAT16 = replace(
    FLOAT32,
    weights_dtype=torch.bfloat16,
    weights="bfloat16",
    unavailable={"matmul=mkl": "MKL's packed sgemm serves float32 on a CPU build with MKL"},
)
NO_NATIVE = {
    "matmul=native": "the native kernels run on the CPU",
    "layer_ops=native": "the native kernels run on the CPU",
    "attention=native": "the native kernels run on the CPU",
    "matmul=mkl": "MKL's packed sgemm serves float32 on a CPU build with MKL",
}


def parts(inputs: PlanInputs, override: str | None = None) -> tuple[str, str, str, str]:
    plan = decide_plan(inputs, override)
    return plan.matmul, plan.layer_ops, plan.attention, plan.decoder


def test_quantized_weights_take_every_native_path() -> None:
    plan = decide_plan(QUANTIZED)
    assert parts(QUANTIZED) == ("native", "native", "native", "stack")
    assert plan.fallbacks == () and plan.overridden == ()
    assert plan.describe() == (
        "cpu, weights=gguf, activations=float32, matmul=native, layer_ops=native, "
        "decoder=stack (steps of chunks up to 512 tokens; longer: modules), "
        "attention=native (torch SDPA for chunks over 512 tokens), tensor_parallel=1"
    )


@pytest.mark.parametrize("inputs", [FLOAT32, BFLOAT16])
def test_float_weights_take_every_native_path_with_float32_activations(
    inputs: PlanInputs,
) -> None:
    plan = decide_plan(inputs)
    assert parts(inputs) == ("native", "native", "native", "stack")
    assert plan.dtype == torch.float32 and plan.fallbacks == ()
    assert plan.describe().startswith(f"cpu, weights={inputs.weights}, activations=float32, ")


@pytest.mark.parametrize(
    ("inputs", "expected", "activations"),
    [
        (replace(BFLOAT16, unavailable=NO_NATIVE), ("torch",) * 3 + ("modules",), torch.bfloat16),
        (
            replace(FLOAT32, unavailable={"matmul=native": "the native kernels failed to load"}),
            ("mkl", "native", "native", "modules"),
            torch.float32,
        ),
        (
            replace(
                BFLOAT16,
                tensor_parallel=2,
                unavailable={
                    **BFLOAT16.unavailable,
                    "matmul=native": "tensor-parallel ranks shard nn.Linear weights",
                },
            ),
            ("torch",) * 3 + ("modules",),
            torch.bfloat16,
        ),
    ],
)
def test_other_devices_and_dtypes_take_the_torch_paths(
    inputs: PlanInputs, expected: tuple[str, ...], activations: torch.dtype
) -> None:
    plan = decide_plan(inputs)
    assert parts(inputs) == expected
    assert plan.dtype == activations
    assert plan.tensor_parallel == inputs.tensor_parallel


def test_torch_matmul_on_16_bit_weights_computes_in_their_dtype() -> None:
    plan = decide_plan(BFLOAT16, "matmul=torch")
    assert parts(BFLOAT16, "matmul=torch") == ("torch", "torch", "torch", "modules")
    assert plan.dtype == torch.bfloat16
    assert (
        "layer_ops=native: the native kernels take float32 activations; "
        "matmul=torch computes in bfloat16"
    ) in plan.fallbacks


CUDA = replace(BFLOAT16, device="cuda", unavailable={})


@pytest.mark.parametrize(
    ("change", "expected", "fallback"),
    [
        ({}, ("torch", "triton", "triton", "graphs"), None),
        (
            {"enforce_eager": True},
            ("torch", "triton", "triton", "modules"),
            "decoder=graphs: --enforce-eager runs every step eagerly",
        ),
        (
            {"lora": True},
            ("torch", "triton", "triton", "modules"),
            "decoder=graphs: LoRA sets each token's adapter per step",
        ),
        (
            {"tensor_parallel": 2},
            ("torch", "triton", "triton", "modules"),
            "decoder=graphs: tensor-parallel ranks exchange partial sums between captured kernels",
        ),
        (
            {
                "unavailable": {
                    "attention=triton": "Triton is not installed",
                    "layer_ops=triton": "Triton is not installed",
                }
            },
            ("torch", "torch", "torch", "modules"),
            "layer_ops=triton: Triton is not installed",
        ),
    ],
)
def test_cuda_takes_the_triton_kernel_and_captured_graphs(
    change: dict, expected: tuple[str, ...], fallback: str | None
) -> None:
    inputs = replace(CUDA, **change)
    plan = decide_plan(inputs)
    assert parts(inputs) == expected
    assert plan.dtype == torch.bfloat16  # nn.Linear weights, computing in their dtype
    assert fallback is None or fallback in plan.fallbacks, plan.fallbacks


def test_triton_on_the_cpu_only_when_asked_under_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bf16 = replace(BFLOAT16, unavailable=NO_NATIVE)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert parts(bf16)[1:3] == ("torch", "torch")  # never chosen unasked
    assert parts(bf16, "attention=triton")[1:3] == ("torch", "triton")
    assert parts(bf16, "layer_ops=triton,attention=triton")[1:3] == ("triton", "triton")
    # Over the native matmul's float32 activations too (the engine test's plan).
    assert parts(FLOAT32, "layer_ops=triton") == ("native", "triton", "native", "modules")
    monkeypatch.delenv("TRITON_INTERPRET")
    for part in ("attention", "layer_ops"):
        with pytest.raises(ValueError, match="the Triton kernels run on CUDA"):
            decide_plan(bf16, f"{part}=triton")


def test_triton_layer_ops_refused_without_triton() -> None:
    cuda = replace(CUDA, unavailable={"layer_ops=triton": "Triton is not installed"})
    with pytest.raises(ValueError, match="layer_ops=triton cannot run here: Triton is not"):
        decide_plan(cuda, "layer_ops=triton")
    assert parts(cuda, "layer_ops=torch")[1:] == ("torch", "triton", "graphs")


@pytest.mark.parametrize(
    ("change", "expected", "reason"),
    [
        (
            {
                "unavailable": {
                    "matmul=native": "TOKENLOOM_CPU_KERNELS=0 turns the native kernels off"
                }
            },
            ("torch", "native", "native", "modules"),
            "decoder=stack: the decoder stack needs matmul=native",
        ),
        (
            {"unavailable": {"attention=native": "the native attention kernel has no head_dim 48"}},
            ("native", "native", "torch", "modules"),
            "attention=native: the native attention kernel has no head_dim 48",
        ),
        (
            {
                "unavailable": {
                    "decoder=stack": "layer 0 has a sliding window or soft-capped scores"
                }
            },
            ("native", "native", "native", "modules"),
            "decoder=stack: layer 0 has a sliding window or soft-capped scores",
        ),
        (
            {"tensor_parallel": 2},
            ("native", "native", "native", "modules"),
            "decoder=stack: tensor-parallel ranks exchange partial sums inside each layer",
        ),
        (
            {"lora": True},
            ("native", "native", "native", "modules"),
            "decoder=stack: LoRA adds its updates to the modules' projections",
        ),
    ],
)
def test_a_part_that_cannot_run_falls_back_and_says_why(
    change: dict, expected: tuple[str, ...], reason: str
) -> None:
    inputs = replace(QUANTIZED, **change)
    assert parts(inputs) == expected
    assert reason in decide_plan(inputs).fallbacks


def test_the_override_picks_the_paths_it_names() -> None:
    plan = decide_plan(QUANTIZED, " decoder=modules , attention=torch ")
    assert parts(QUANTIZED, "decoder=modules,attention=torch") == (
        "native",
        "native",
        "torch",
        "modules",
    )
    assert plan.overridden == ("decoder=modules", "attention=torch")
    assert plan.fallbacks == ()
    assert f"set by {ENV}: decoder=modules, attention=torch" in plan.describe()
    # A part the stack needs, turned off: the stack falls back, saying why.
    plan = decide_plan(QUANTIZED, "layer_ops=torch")
    assert parts(QUANTIZED, "layer_ops=torch") == ("native", "torch", "native", "modules")
    assert plan.fallbacks == ("decoder=stack: the decoder stack needs layer_ops=native",)
    assert parts(FLOAT32, "matmul=torch") == ("torch", "native", "native", "modules")
    assert parts(FLOAT32, "matmul=mkl") == ("mkl", "native", "native", "modules")
    assert parts(QUANTIZED, "") == parts(QUANTIZED)


@pytest.mark.parametrize(
    ("inputs", "override", "message"),
    [
        (
            FLOAT32,
            "matmul=mkl,decoder=stack",
            "decoder=stack cannot run here: the decoder stack needs matmul=native",
        ),
        (
            BFLOAT16,
            "matmul=mkl",
            "matmul=mkl cannot run here: MKL's packed sgemm serves float32",
        ),
        (
            QUANTIZED,
            "layer_ops=torch,decoder=stack",
            "decoder=stack cannot run here: the decoder stack needs layer_ops=native",
        ),
        (
            replace(FLOAT32, unavailable=NO_NATIVE),
            "attention=native",
            "attention=native cannot run here: the native kernels run on the CPU",
        ),
        (
            QUANTIZED,
            "matmul=mkl",
            "matmul must be one of native, torch for gguf weights; got 'mkl'",
        ),
        (FLOAT32, "decoder=graphs", "decoder must be one of stack, modules for float32 weights"),
        (
            QUANTIZED,
            "kernels=fast",
            "unknown part 'kernels'; the parts are matmul, layer_ops, attention, decoder",
        ),
        (QUANTIZED, "decoder", "expected part=choice, got 'decoder'"),
        (QUANTIZED, "decoder=", "expected part=choice, got 'decoder='"),
        (QUANTIZED, "decoder=modules,decoder=stack", "decoder is given twice"),
    ],
)
def test_an_override_that_cannot_be_followed_is_refused(
    inputs: PlanInputs, override: str, message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{ENV}: ") as error:
        decide_plan(inputs, override)
    assert message in str(error.value)


def test_the_layers_the_attention_kernel_cannot_compute_are_named() -> None:
    sliding = replace(QUANTIZED, num_layers=8, torch_attention_layers=(0, 1, 2, 5, 7))
    assert (
        "torch SDPA for chunks over 512 tokens and layers 0-2, 5, 7)"
        in decide_plan(sliding).describe()
    )
    capped = replace(sliding, torch_attention_layers=tuple(range(8)))
    assert "and every layer)" in decide_plan(capped).describe()
    assert "torch SDPA" not in decide_plan(capped, "attention=torch").describe()
