"""The CUDA backend's Triton layer ops (``ops.cuda.layer_ops``) against the torch
path of ``model.layers`` and ``model.llama.Attention``.

Without a GPU they run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``), on
widths that are not powers of two (hidden 576, heads of 80, an intermediate
size of 1,000), rows with strides, and partial rotary, in float32, bfloat16 and
float16. The interpreter rounds float32 to bfloat16 by truncation where a GPU
rounds to nearest, so 16-bit results are compared within a unit or two in the
last place.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.layers import GatedMLP, RMSNorm, apply_rope
from tokenloom.model.llama import Attention
from tokenloom.ops.cuda import layer_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float16: the activations on a GPU without bfloat16.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True, params=[2, 64], ids=["tiles of 2 rows", "tiles of 64 rows"])
def rows_per_program(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter the kernels take 64 rows a program; 2 checks tiles that
    split the rows over several programs, the last one part empty, as on a GPU."""
    monkeypatch.setattr(layer_ops, "_INTERPRETER_ROWS", request.param)


def _close(got: torch.Tensor, expected: torch.Tensor, atol: float = 1.6e-2) -> None:
    if expected.dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), expected, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(got.cpu(), expected, atol=atol, rtol=1.6e-2)


def _norm(width: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(width, 1e-6, dtype)
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = (1 + 0.2 * torch.randn(width, generator=gen)).to(dtype)
    return norm


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("width", [576, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm_match_torch(width: int, dtype: torch.dtype) -> None:
    norm = _norm(width, dtype, seed=width)
    x = _randn(7, width, dtype=dtype, seed=1) * 3
    residual = _randn(7, width, dtype=dtype, seed=2)
    weight = norm.weight.detach().to(DEVICE)

    out = torch.empty(7, width, dtype=dtype, device=DEVICE)
    layer_ops.rms_norm(out, x.to(DEVICE), weight, norm.eps)
    _close(out, norm(x).detach())

    expected_x, expected_residual = norm.add_and_norm(x, residual)
    got_x, got_residual = x.to(DEVICE), residual.to(DEVICE)
    layer_ops.add_rms_norm(got_x, got_residual, weight, norm.eps)
    _close(got_residual, expected_residual)
    _close(got_x, expected_x.detach())


def test_rms_norm_over_strided_rows_in_place() -> None:
    """Rows of a wider tensor (a stride past the width), normalized in place; the
    columns beside them are not touched."""
    norm = _norm(80, torch.float32, seed=3)
    wide = _randn(5, 100, dtype=torch.float32, seed=4).to(DEVICE)
    before = wide.clone()
    rows = wide[:, 10:90]
    layer_ops.rms_norm(rows, rows, norm.weight.detach().to(DEVICE), norm.eps)
    _close(rows, norm(before[:, 10:90].cpu()).detach())
    assert torch.equal(wide[:, :10], before[:, :10]) and torch.equal(wide[:, 90:], before[:, 90:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    mlp = GatedMLP(64, 1000, dtype)
    gate_up = _randn(3, 2000, dtype=dtype, seed=5) * 4
    gate, up = gate_up.split(1000, dim=-1)
    out = torch.empty(3, 1000, dtype=dtype, device=DEVICE)
    layer_ops.silu_and_mul(out, gate_up.to(DEVICE))
    _close(out, F.silu(gate) * up)
    assert mlp.intermediate_size == 1000


def _attention(dtype: torch.dtype, head_dim: int, partial: float, qk_norm: bool) -> Attention:
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=head_dim,
        vocab_size=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        partial_rotary_factor=partial,
        qk_norm=qk_norm,
    )
    attn = Attention(arch, dtype)
    if qk_norm:
        assert attn.q_norm is not None and attn.k_norm is not None
        attn.q_norm.weight.data = _norm(head_dim, dtype, seed=6).weight.data
        attn.k_norm.weight.data = _norm(head_dim, dtype, seed=7).weight.data
    return attn


@pytest.mark.parametrize(
    ("head_dim", "partial"), [(80, 1.0), (64, 1.0), (128, 1.0), (80, 0.75), (96, 0.5)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_qk_norm_match_the_attention_layer(
    head_dim: int, partial: float, dtype: torch.dtype
) -> None:
    """Q/K norms, then RoPE, in place on the fused QKV rows, against the layer's
    torch path; V and the columns past it are left alone."""
    attn = _attention(dtype, head_dim, partial, qk_norm=True)
    tokens = 9
    width = attn.q_size + 2 * attn.kv_size
    qkv = _randn(tokens, width + 3, dtype=dtype, seed=head_dim)[:, :width] * 2
    positions = torch.tensor([0, 1, 2, 17, 300, 5, 6, 1000, 4095])
    rotary_dim = attn.rotary_dim
    half = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    angles = positions[:, None].float() * (10000.0**-half)[None, :]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    reference = qkv.clone()
    attn.norm_qk(reference)
    q, k, v = attn.rope(reference, cos.unsqueeze(1), sin.unsqueeze(1))

    got = qkv.to(DEVICE)
    q_norm, k_norm = attn.q_norm, attn.k_norm
    assert q_norm is not None and k_norm is not None
    layer_ops.qk_rms_norm(
        got,
        q_norm.weight.detach().to(DEVICE),
        k_norm.weight.detach().to(DEVICE),
        attn.num_heads,
        attn.num_kv_heads,
        q_norm.eps,
    )
    layer_ops.rotary_qk(
        got, cos.to(DEVICE), sin.to(DEVICE), attn.num_heads, attn.num_kv_heads, head_dim
    )
    heads = got.view(tokens, -1, head_dim)
    # torch rounds each product of RoPE in bfloat16, the kernel their sum only:
    # where the two products cancel, that is a unit in the last place of the inputs.
    atol = 4e-2
    _close(heads[:, : attn.num_heads], q.detach(), atol)
    _close(heads[:, attn.num_heads : attn.num_heads + attn.num_kv_heads], k.detach(), atol)
    assert torch.equal(heads[:, attn.num_heads + attn.num_kv_heads :].cpu(), v)


def test_rope_reference_rotates_half() -> None:
    """The layout the kernel follows: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    cos, sin = torch.tensor([[[0.5, 1.0]]]), torch.tensor([[[2.0, 0.0]]])
    qkv = x.view(1, 4).clone().to(DEVICE)
    layer_ops.rotary_qk(qkv, cos.view(1, 2).to(DEVICE), sin.view(1, 2).to(DEVICE), 1, 0, 4)
    assert qkv.cpu().tolist() == [[0.5 - 6.0, 2.0, 3.0 * 0.5 + 2.0, 4.0]]
    assert torch.equal(apply_rope(x, cos, sin).view(1, 4), qkv.cpu())


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: layer_ops.add_rms_norm(
                torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6
            ),
            "add_rms_norm: x \\(2, 8\\), residual \\(3, 8\\)",
        ),
        (
            lambda: layer_ops.silu_and_mul(torch.zeros(2, 8), torch.zeros(2, 8)),
            "gate_up must be \\[T, 2 \\* I\\]",
        ),
        (
            lambda: layer_ops.rms_norm(
                torch.zeros(2, 8), torch.zeros(8, 2).t(), torch.ones(8), 1e-6
            ),
            "x must have 2 dims and a contiguous last one",
        ),
        (
            lambda: layer_ops.rotary_qk(
                torch.zeros(2, 16), torch.zeros(2, 5), torch.zeros(2, 5), 1, 1, 8
            ),
            "R <= head_dim 8",
        ),
    ],
)
def test_bad_shapes_are_refused(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
