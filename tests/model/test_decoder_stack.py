"""The native decoder stack against the modules it stands in for: it runs the same
kernels in the same order, so logits and KV caches must match bit for bit, on
the real default model in each weight format the stack runs (the GGUF's
quantized panels, and its weights as bfloat16 and float32 panels) and at every
batch shape the stack serves."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from tests.model.harness import BlockAllocator, Seq, run_step
from tests.quantization.blocks import write_tiny_gguf
from tests.torch_threads import intra_op_threads
from tokenloom.config import ModelConfig
from tokenloom.model import decoder_stack
from tokenloom.model.attention import NATIVE_MAX_QUERY, AttentionMetadata
from tokenloom.model.decoder_stack import DecoderStack, implemented_steps
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model.layers import RMSNorm
from tokenloom.model.recipe import Op, Step, attention_steps
from tokenloom.model_loader.loader import LoadedModel, load_model
from tokenloom.ops.cpu_kernels import paged_attention_op

BLOCK = 16


@pytest.fixture(scope="module")
def default_quantized() -> LoadedModel:
    return load_model(ModelConfig(model=None))


@pytest.fixture(scope="module", params=["gguf", "bfloat16", "float32"])
def default_any(request: pytest.FixtureRequest, default_quantized: LoadedModel) -> LoadedModel:
    """The default model in each weight format the stack runs."""
    if request.param == "gguf":
        return default_quantized
    loaded = load_model(ModelConfig(model=None, dtype=request.param))
    assert loaded.plan.weights == request.param
    return loaded


@pytest.fixture
def tiny_quantized(tmp_path: Path) -> LoadedModel:
    """A random two-layer Llama GGUF, loaded quantized with its stack (fresh per test:
    tests change its layers)."""
    path = tmp_path / "tiny.gguf"
    matrices = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    write_tiny_gguf(path, {"token_embd": T.Q8_0, **dict.fromkeys(matrices, T.Q4_K)})
    return load_model(ModelConfig(model=str(path)))


class CountingStack:
    """Stands in for the native object, counting the steps it runs."""

    def __init__(self, native: Any) -> None:
        self.native = native
        self.calls = 0

    def forward(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.native.forward(*args)
        return out


# A fixed mix: a long prefill (modules), then steps of decodes, short chunks and
# the longest chunk the native attention kernel takes, side by side. Each step
# lists (sequence, new tokens).
MIXED_STEPS = [
    [(0, NATIVE_MAX_QUERY + 1), (1, 40)],  # a chunk longer than the kernel takes: modules
    [(0, 1), (1, 1), (2, 5)],
    [(0, 1), (1, 3), (2, NATIVE_MAX_QUERY)],
    [(0, 1)],
    [(0, 1), (1, 1), (2, 1)],
]


def run_schedule(
    loaded: LoadedModel,
    cache_dtype: torch.dtype,
    use_stack: bool,
    steps: list[list[tuple[int, int]]] = MIXED_STEPS,
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]], int]:
    """(logits of every step, the caches after, steps the stack ran) for ``steps``
    over random sequences."""
    model: Any = loaded.model
    stack = model.decoder_stack
    counter = CountingStack(stack.stack)
    stack.stack = counter
    model.decoder_stack = stack if use_stack else None
    count = 1 + max(seq for step in steps for seq, _ in step)
    seq_len = max(sum(n for step in steps for seq, n in step if seq == i) for i in range(count))
    caches = allocate_kv_caches(
        loaded.arch, count * -(-seq_len // BLOCK) + 1, BLOCK, cache_dtype, loaded.device
    )
    native_op = paged_attention_op(loaded.device, loaded.dtype, loaded.arch.head_dim)
    gen = torch.Generator().manual_seed(0)
    top = min(40000, loaded.arch.vocab_size)
    seqs = [Seq(torch.randint(100, top, (seq_len,), generator=gen).tolist()) for _ in range(count)]
    allocator = BlockAllocator(BLOCK)
    try:
        logits = [
            torch.cat(
                run_step(model, caches, allocator, [(seqs[i], n) for i, n in step], native_op)
            )
            for step in steps
        ]
    finally:
        stack.stack = counter.native
        model.decoder_stack = stack
    return logits, caches, counter.calls


def assert_stack_equals_modules(loaded: LoadedModel, cache_dtype: torch.dtype) -> None:
    """MIXED_STEPS through the stack and through the modules: every step but the
    first through the stack, and the same logits and caches bit for bit."""
    stacked, stacked_caches, calls = run_schedule(loaded, cache_dtype, True)
    modules, module_caches, unused = run_schedule(loaded, cache_dtype, False)
    assert (calls, unused) == (4, 0)
    for a, b in zip(stacked, modules, strict=True):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(stacked_caches, module_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


# Both cache dtypes on the quantized weights; the float weights with the cache
# their dtype gets under kv_cache_dtype=auto.
@pytest.mark.parametrize(
    ("default_any", "cache_dtype"),
    [
        ("gguf", torch.float32),
        ("gguf", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("float32", torch.float32),
    ],
    indirect=["default_any"],
)
def test_stack_equals_the_modules_bit_for_bit(
    default_any: LoadedModel, cache_dtype: torch.dtype
) -> None:
    assert isinstance(default_any.model.decoder_stack, DecoderStack)
    assert_stack_equals_modules(default_any, cache_dtype)


# Steps of 20 and 3 decodes (after their prompts), which a stack told to
# overlap from 2 decodes runs as two micro-batches: 8 + 12 rows, 1 + 2.
OVERLAPPED_STEPS = [
    [(i, 20 + i) for i in range(20)],
    [(i, 1) for i in range(20)],
    [(i, 1) for i in range(3)],
]


@pytest.mark.parametrize(
    ("default_any", "cache_dtype"),
    [("gguf", torch.float32), ("bfloat16", torch.bfloat16), ("float32", torch.float32)],
    indirect=["default_any"],
)
def test_decodes_in_two_micro_batches_equal_the_modules_bit_for_bit(
    default_any: LoadedModel, cache_dtype: torch.dtype
) -> None:
    model: Any = default_any.model
    whole = model.decoder_stack
    model.decoder_stack = DecoderStack(model, overlap_decodes_from=2)
    try:
        with intra_op_threads(2):  # a team of two, whose second thread attends
            stacked, stacked_caches, calls = run_schedule(
                default_any, cache_dtype, True, OVERLAPPED_STEPS
            )
            modules, module_caches, unused = run_schedule(
                default_any, cache_dtype, False, OVERLAPPED_STEPS
            )
        assert model.decoder_stack.stack.micro_batched_steps() == 2
    finally:
        model.decoder_stack = whole
    assert (calls, unused) == (len(OVERLAPPED_STEPS), 0)
    for a, b in zip(stacked, modules, strict=True):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(stacked_caches, module_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize(("max_layer_bytes", "overlapped"), [(16 << 20, 1), (1 << 20, 0)])
def test_steps_of_32_decodes_overlap_where_the_layers_are_small(
    default_quantized: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
    max_layer_bytes: int,
    overlapped: int,
) -> None:
    """The default GGUF's layers are 2.1 MiB: a step of 31 decodes runs whole, one
    of 32 in two micro-batches, unless layers that small count as too large."""
    monkeypatch.setattr(decoder_stack, "OVERLAP_MAX_LAYER_BYTES", max_layer_bytes)
    model: Any = default_quantized.model
    whole = model.decoder_stack
    model.decoder_stack = DecoderStack(model)
    steps = [[(i, 4) for i in range(32)], [(i, 1) for i in range(31)], [(i, 1) for i in range(32)]]
    try:
        with intra_op_threads(2):
            run_schedule(default_quantized, torch.float32, True, steps)
        assert model.decoder_stack.stack.micro_batched_steps() == overlapped
    finally:
        model.decoder_stack = whole


@pytest.mark.parametrize("use_stack", [True, False])
def test_kept_rows_are_those_of_the_whole_batch(default_any: LoadedModel, use_stack: bool) -> None:
    # The stack computes its last layer for the kept rows alone; the modules select
    # them at the end. Either way: those rows' logits, and every row's K/V.
    model: Any = default_any.model
    stack = model.decoder_stack
    model.decoder_stack = stack if use_stack else None
    native_op = paged_attention_op(default_any.device, torch.float32, 64)
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(100, 40000, (90,), generator=gen).tolist() for _ in range(3)]
    # A chunk's last row, rows inside chunks (as prompt logprobs or drafts keep
    # them), a decode, and rows out of order.
    keep = [80, 3, 49, 50, 78, 79]
    results = []
    try:
        for keep_rows in (None, keep):
            seqs = [Seq(list(t)) for t in tokens]
            caches = allocate_kv_caches(default_any.arch, 20, BLOCK, torch.bfloat16, "cpu")
            allocator = BlockAllocator(BLOCK)
            run_step(model, caches, allocator, [(seqs[0], 30), (seqs[2], 60)], native_op)
            schedule = [(seqs[0], 50), (seqs[1], 30), (seqs[2], 1)]  # rows 0-49, 50-79, 80
            step = run_step(model, caches, allocator, schedule, native_op, keep_rows)
            results.append((torch.cat(step), caches))
    finally:
        model.decoder_stack = stack
    (every, every_caches), (kept, kept_caches) = results
    torch.testing.assert_close(kept, every[keep], rtol=1e-5, atol=1e-4)
    for (k1, v1), (k2, v2) in zip(every_caches, kept_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_serves_only_steps_the_native_kernel_takes_whole() -> None:
    seq_len = NATIVE_MAX_QUERY + 8
    table = torch.arange(1, -(-seq_len // BLOCK) + 1, dtype=torch.int32)[None]
    op = paged_attention_op(torch.device("cpu"), torch.float32, 64)

    def meta(query_len: int, native_op: Callable[..., None] | None = op) -> AttentionMetadata:
        slots = torch.arange(seq_len - query_len, seq_len)
        return AttentionMetadata.build([query_len], [seq_len], table, slots, BLOCK, native_op)

    assert DecoderStack.serves(meta(1))
    assert DecoderStack.serves(meta(NATIVE_MAX_QUERY))
    assert not DecoderStack.serves(meta(NATIVE_MAX_QUERY + 1))
    assert not DecoderStack.serves(meta(1, native_op=None))


def _with_bias(model: Any) -> None:
    proj = model.layers[1].self_attn.qkv_proj
    proj.bias = torch.zeros(proj.out_features)


def _with_q_norm(model: Any) -> None:
    for layer in model.layers:
        attn = layer.self_attn
        attn.q_norm = attn.k_norm = RMSNorm(attn.head_dim, 1e-5)
        layer.recipe = (*layer.recipe[:2], Step(Op.QK_NORM), *layer.recipe[2:])


def _with_window(model: Any) -> None:
    model.layers[1].self_attn.window = 64


def _with_softcap(model: Any) -> None:
    model.layers[0].self_attn.softcap = 50.0


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (_with_bias, "layer 1's self_attn.qkv_proj has a bias"),
        (_with_q_norm, "'qk_norm' step, which the stack does not implement"),
        (_with_window, "layer 1 has a sliding window"),
        (_with_softcap, "layer 0 has a sliding window or soft-capped scores"),
    ],
)
def test_layers_it_does_not_compute_keep_the_modules(
    change: Callable[[Any], None], refusal: str, tiny_quantized: LoadedModel
) -> None:
    model: Any = tiny_quantized.model
    assert DecoderStack.refusal(model) is None
    change(model)
    assert refusal in str(DecoderStack.refusal(model))
    with pytest.raises(ValueError, match="cannot compute this model"):
        DecoderStack(model)


def test_the_stack_refuses_recipes_with_steps_it_lacks(tiny_quantized: LoadedModel) -> None:
    # What the native stack lacks, by name: Qwen3's and Gemma 3's per-head q/k norms.
    assert implemented_steps() == {op.value for op in Op} - {"qk_norm"}
    model: Any = tiny_quantized.model
    attn = model.layers[0].self_attn
    llama = [step.op.value for step in model.layers[0].recipe]

    def build(recipe: list[str]) -> Any:
        return torch.classes.tokenloom_cpu.DecoderStack(
            recipe, attn.num_heads, attn.num_kv_heads, attn.head_dim, 1e-5, 0.125, model.norm.weight
        )

    build(llama)
    with pytest.raises(RuntimeError, match="the decoder stack has no step 'qk_norm'"):
        build([*llama[:2], "qk_norm", *llama[2:]])
    with pytest.raises(RuntimeError, match="has no step 'swap'"):
        build([*llama, "swap"])
    with pytest.raises(RuntimeError, match="attend needs an earlier rope"):
        build(["add_norm", "qkv_proj", "attend", "rope"])
    with pytest.raises(RuntimeError, match="starts with add_norm"):
        build(["norm", *llama])


# Llama's weights in Gemma's order: a norm after each sublayer too (reusing the
# layer's two norms, so that no weight is missing).
SANDWICH = (
    Step(Op.ADD_NORM, "input_layernorm"),
    *attention_steps(qk_norm=False),
    Step(Op.NORM, "post_attention_layernorm"),
    Step(Op.ADD_NORM, "input_layernorm"),
    Step(Op.GATE_UP),
    Step(Op.DOWN_PROJ),
    Step(Op.NORM, "post_attention_layernorm"),
)
SHORT_STEPS = [[(0, 20), (1, 7)], [(0, 1), (1, 3), (2, 12)], [(0, 1), (1, 1), (2, 1)]]


def test_a_new_recipe_runs_alike_in_the_modules_and_the_stack(
    tiny_quantized: LoadedModel,
) -> None:
    model: Any = tiny_quantized.model
    llama, _, _ = run_schedule(tiny_quantized, torch.float32, False, SHORT_STEPS)
    for layer in model.layers:
        layer.recipe = SANDWICH
    model.decoder_stack = DecoderStack(model)
    stacked, stacked_caches, calls = run_schedule(tiny_quantized, torch.float32, True, SHORT_STEPS)
    modules, module_caches, _ = run_schedule(tiny_quantized, torch.float32, False, SHORT_STEPS)
    assert calls == len(SHORT_STEPS)
    for a, b, before in zip(stacked, modules, llama, strict=True):
        assert torch.equal(a, b)
        assert not torch.allclose(a, before, atol=1e-2)  # the recipe changed both paths
    for (k1, v1), (k2, v2) in zip(stacked_caches, module_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


class SlotsPastTheCache(CountingStack):
    """Stands in for the native object, giving it slots past the caches: write_kv
    refuses them inside the step, where the threads are held as a team."""

    def forward(self, *args: Any) -> torch.Tensor:
        slot_mapping = args[5]
        return super().forward(*args[:5], torch.full_like(slot_mapping, 1 << 40), *args[6:])


# A team thread left waiting would hang the process in native code, out of
# reach of a signal: the thread method ends the run instead.
@pytest.mark.timeout(300, method="thread")
def test_an_error_inside_a_step_reaches_the_caller_and_the_stack_serves_on(
    default_quantized: LoadedModel,
) -> None:
    model: Any = default_quantized.model
    stack = model.decoder_stack
    native = stack.stack
    native_op = paged_attention_op(default_quantized.device, torch.float32, 64)
    seq = Seq(list(range(100, 140)))
    caches = allocate_kv_caches(default_quantized.arch, 8, BLOCK, torch.float32, "cpu")
    allocator = BlockAllocator(BLOCK)
    with intra_op_threads(2):  # a team of two (common/team.h), on any machine
        try:
            run_step(model, caches, allocator, [(seq, 39)], native_op)
            stack.stack = SlotsPastTheCache(native)
            with pytest.raises(RuntimeError, match="slot 1099511627776 out of range"):
                run_step(model, caches, allocator, [(seq, 1)], native_op)
        finally:
            stack.stack = native
        # The team's other threads were let go: the stack and every parallel
        # region after it run, and give the modules' results.
        assert_stack_equals_modules(default_quantized, torch.float32)


class LastSlotPastTheCache(CountingStack):
    """As SlotsPastTheCache for the step's last row only: in two micro-batches,
    the second's K/V write fails while the first attends beside it."""

    def forward(self, *args: Any) -> torch.Tensor:
        slot_mapping = args[5].clone()
        slot_mapping[-1] = 1 << 40
        return super().forward(*args[:5], slot_mapping, *args[6:])


@pytest.mark.timeout(300, method="thread")
def test_an_error_beside_a_micro_batchs_attention_reaches_the_caller(
    default_quantized: LoadedModel,
) -> None:
    model: Any = default_quantized.model
    whole = model.decoder_stack
    stack = DecoderStack(model, overlap_decodes_from=2)
    native = stack.stack
    native_op = paged_attention_op(default_quantized.device, torch.float32, 64)
    seqs = [Seq(list(range(100 + 7 * i, 120 + 7 * i))) for i in range(3)]
    caches = allocate_kv_caches(default_quantized.arch, 8, BLOCK, torch.float32, "cpu")
    allocator = BlockAllocator(BLOCK)
    model.decoder_stack = stack
    with intra_op_threads(2):
        try:
            run_step(model, caches, allocator, [(seq, 19) for seq in seqs], native_op)
            stack.stack = LastSlotPastTheCache(native)
            with pytest.raises(RuntimeError, match="slot 1099511627776 out of range"):
                run_step(model, caches, allocator, [(seq, 1) for seq in seqs], native_op)
            assert native.micro_batched_steps() == 1
        finally:
            stack.stack = native
            model.decoder_stack = whole
        # The side task ended with the step: the team serves on.
        assert_stack_equals_modules(default_quantized, torch.float32)


# More threads than cores: a team of more than two, whose waiting threads
# yield their cores (common/team.h), and a hang caught as in the test above.
@pytest.mark.timeout(300, method="thread")
def test_a_team_larger_than_the_cores_gives_the_same_bits(
    default_quantized: LoadedModel,
) -> None:
    with intra_op_threads(len(os.sched_getaffinity(0)) + 2):
        assert_stack_equals_modules(default_quantized, torch.float32)


def test_torch_matmuls_and_disabled_kernels_get_no_stack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENLOOM_FORWARD_PLAN", "matmul=mkl")
    assert load_model(ModelConfig(model=None, dtype="float32")).model.decoder_stack is None
    monkeypatch.delenv("TOKENLOOM_FORWARD_PLAN")
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "0")
    assert load_model(ModelConfig(model=None)).model.decoder_stack is None
    assert load_model(ModelConfig(model=None, dtype="bfloat16")).model.decoder_stack is None


def test_mismatched_caches_are_refused(default_quantized: LoadedModel) -> None:
    stack: Any = default_quantized.model.decoder_stack
    layers = default_quantized.arch.num_hidden_layers
    hidden = torch.zeros(1, default_quantized.arch.hidden_size)
    meta = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=f"for {layers} layers"):
        stack.stack.forward(
            hidden, hidden, hidden, [], [], meta.long(), meta[None], meta, meta, meta, meta, None
        )


def test_a_qkv_projection_that_does_not_fit_the_heads_is_refused_at_load(
    default_quantized: LoadedModel,
) -> None:
    model: Any = default_quantized.model
    attn = model.layers[0].self_attn
    stack = torch.classes.tokenloom_cpu.DecoderStack(
        [step.op.value for step in model.layers[0].recipe],
        attn.num_heads + attn.num_kv_heads,
        attn.num_kv_heads,
        attn.head_dim,
        1e-5,
        0.125,
        model.norm.weight,
    )
    stack.add_layer([model.layers[0].input_layernorm.weight, model.norm.weight])
    with pytest.raises(RuntimeError, match="qkv width 960"):
        stack.add_projection(attn.qkv_proj.native_projection())
    with pytest.raises(RuntimeError, match="expected a projection object"):
        stack.add_projection(model.norm.weight)
