"""The decoder's element-wise layers as Triton kernels, for the CUDA backend: RMSNorm
(alone, with the residual add folded in, and per q/k head), SiLU-and-mul, and
rotate-half RoPE of Q and K.

Each replaces a chain of small torch kernels with one launch. They compute in
float32 and round where the torch path (``model.layers``) rounds to the
activations' dtype, so in bfloat16 they give its results: RMSNorm rounds the
normalized row before the weight multiplies it, SiLU-and-mul rounds SiLU's
output before the product (as transformers and vLLM do). RoPE rounds once, where
torch rounds each product and sum.

The grids depend on the tensors' shapes only and nothing is read back to the
host, so a CUDA graph captures them. Every function writes in place or into a
tensor the caller gives, and takes rows with any stride but a contiguous last
dimension.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Widest row one program normalizes (hidden sizes and head dims are far below).
MAX_NORM_WIDTH = 65536
# Columns of SiLU-and-mul per program.
_ACT_BLOCK = 1024


@triton.jit
def _normalize(row, weight_ptr, cols, mask, n, eps, OUT_DTYPE: tl.constexpr):
    """row (float32, zeros past ``n``) / rms(row) * weight, rounded to OUT_DTYPE
    before the weight multiplies it, as the torch path does."""
    inv_rms = 1.0 / tl.sqrt(tl.sum(row * row, 0) / n + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return ((row * inv_rms).to(OUT_DTYPE).to(tl.float32) * weight).to(OUT_DTYPE)


@triton.jit
def _rms_norm_kernel(
    out,
    x,
    weight,
    stride_x,
    stride_o,
    n,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    values = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out.dtype.element_ty
    tl.store(
        out + row * stride_o + cols,
        _normalize(values, weight, cols, mask, n, eps, dtype),
        mask=mask,
    )


@triton.jit
def _add_rms_norm_kernel(
    x,
    residual,
    weight,
    stride_x,
    stride_r,
    n,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = x.dtype.element_ty
    a = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(residual + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    # The sum is rounded before it is normalized: the residual stream holds it so.
    total = (a + b).to(dtype)
    tl.store(residual + row * stride_r + cols, total, mask=mask)
    normed = _normalize(total.to(tl.float32), weight, cols, mask, n, eps, dtype)
    tl.store(x + row * stride_x + cols, normed, mask=mask)


@triton.jit
def _qk_rms_norm_kernel(
    qkv,
    q_weight,
    k_weight,
    stride_t,
    num_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HEAD_DIM
    ptr = qkv + token * stride_t + head * HEAD_DIM + cols
    values = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    dtype = qkv.dtype.element_ty
    if head < num_heads:
        normed = _normalize(values, q_weight, cols, mask, HEAD_DIM, eps, dtype)
    else:
        normed = _normalize(values, k_weight, cols, mask, HEAD_DIM, eps, dtype)
    tl.store(ptr, normed, mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    out,
    gate_up,
    stride_o,
    stride_g,
    n,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out.dtype.element_ty
    gate = tl.load(gate_up + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * stride_g + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    qkv,
    cos,
    sin,
    stride_t,
    stride_c,
    stride_s,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, HALF_PAD)
    mask = cols < HALF
    c = tl.load(cos + token * stride_c + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin + token * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
    first = qkv + token * stride_t + head * HEAD_DIM + cols
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = qkv.dtype.element_ty
    tl.store(first, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(first + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


def _check_rows(name: str, t: torch.Tensor, dims: int = 2) -> None:
    if t.dim() != dims or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have {dims} dims and a contiguous last one, "
            f"got shape {tuple(t.shape)} and strides {t.stride()}"
        )


def _norm_block(n: int) -> int:
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"rows of {n} are wider than the Triton RMSNorm's {MAX_NORM_WIDTH}")
    return triton.next_power_of_2(n)


def _norm_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out [T, n] = rms_norm(x [T, n]) * weight [n] (``out`` may be ``x``)."""
    _check_rows("x", x)
    _check_rows("out", out)
    rows, n = x.shape
    if out.shape != x.shape or weight.shape != (n,):
        raise ValueError(
            f"rms_norm: x {tuple(x.shape)}, out {tuple(out.shape)} and weight "
            f"{tuple(weight.shape)} differ"
        )
    if rows == 0:
        return
    block = _norm_block(n)
    _rms_norm_kernel[(rows,)](
        out,
        x,
        weight,
        x.stride(0),
        out.stride(0),
        n,
        eps,
        BLOCK=block,
        num_warps=_norm_warps(block),
    )


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, both [T, n]: residual += x, then x = rms_norm(residual) * weight
    (``tokenloom_cpu::add_rms_norm``'s contract)."""
    _check_rows("x", x)
    _check_rows("residual", residual)
    rows, n = x.shape
    if residual.shape != x.shape or weight.shape != (n,):
        raise ValueError(
            f"add_rms_norm: x {tuple(x.shape)}, residual {tuple(residual.shape)} and weight "
            f"{tuple(weight.shape)} differ"
        )
    if rows == 0:
        return
    block = _norm_block(n)
    _add_rms_norm_kernel[(rows,)](
        x,
        residual,
        weight,
        x.stride(0),
        residual.stride(0),
        n,
        eps,
        BLOCK=block,
        num_warps=_norm_warps(block),
    )


def qk_rms_norm(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> None:
    """Normalize each Q head (by ``q_weight`` [D]) and K head (by ``k_weight``) at
    the front of each ``qkv`` row [T, >= (H + Hkv) * D], in place (Qwen3's q/k norms)."""
    _check_rows("qkv", qkv)
    head_dim = q_weight.shape[0]
    if k_weight.shape != (head_dim,) or qkv.shape[1] < (num_heads + num_kv_heads) * head_dim:
        raise ValueError(
            f"qk_rms_norm: qkv {tuple(qkv.shape)} cannot hold {num_heads} + {num_kv_heads} "
            f"heads of q_weight {tuple(q_weight.shape)} / k_weight {tuple(k_weight.shape)}"
        )
    if qkv.shape[0] == 0:
        return
    _qk_rms_norm_kernel[(qkv.shape[0], num_heads + num_kv_heads)](
        qkv,
        q_weight,
        k_weight,
        qkv.stride(0),
        num_heads,
        eps,
        HEAD_DIM=head_dim,
        BLOCK=_norm_block(head_dim),
        num_warps=1,
    )


def silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]."""
    _check_rows("out", out)
    _check_rows("gate_up", gate_up)
    rows, n = out.shape
    if gate_up.shape != (rows, 2 * n):
        raise ValueError(
            f"silu_and_mul: gate_up must be [T, 2 * I] for out {tuple(out.shape)}, "
            f"got {tuple(gate_up.shape)}"
        )
    if rows == 0:
        return
    block = min(_ACT_BLOCK, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        out, gate_up, out.stride(0), gate_up.stride(0), n, BLOCK=block, num_warps=4
    )


def rotary_qk(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Rotate-half RoPE, in place, of the Q and K heads at the front of each ``qkv``
    row [T, >= (H + Hkv) * D], by ``cos``/``sin`` [T, R / 2] of each token's
    position: the first R = 2 * cos.shape[1] dims of each head turn (R < D:
    partial rotary), the rest stay as they are."""
    _check_rows("qkv", qkv)
    _check_rows("cos", cos)
    _check_rows("sin", sin)
    rows = qkv.shape[0]
    half = cos.shape[1]
    if cos.shape != (rows, half) or sin.shape != (rows, half) or 2 * half > head_dim:
        raise ValueError(
            f"rotary_qk: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be "
            f"[{rows}, R / 2] with R <= head_dim {head_dim}"
        )
    if qkv.shape[1] < (num_heads + num_kv_heads) * head_dim:
        raise ValueError(
            f"rotary_qk: qkv {tuple(qkv.shape)} cannot hold {num_heads} + {num_kv_heads} "
            f"heads of {head_dim}"
        )
    if rows == 0 or half == 0:
        return
    _rotary_kernel[(rows, num_heads + num_kv_heads)](
        qkv,
        cos,
        sin,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=1,
    )
