"""The decoder's element-wise layers as Triton kernels, for the CUDA backend: RMSNorm
(alone, with the residual add folded in, and per q/k head), SiLU-and-mul, and
rotate-half RoPE of Q and K.

Each replaces a chain of small torch kernels with one launch. They compute in
float32 and round where the torch path (``model.layers``) rounds to the
activations' dtype, so in bfloat16 they differ from it only by the order of a
row's sum: RMSNorm rounds the normalized row before the weight multiplies it,
SiLU-and-mul rounds SiLU's output before the product (as transformers and vLLM
do). RoPE rounds once, where torch rounds each product and sum.

The grids depend on the tensors' shapes only and nothing is read back to the
host, so a CUDA graph captures them. Every function writes in place or into a
tensor the caller gives, and takes rows with any stride but a contiguous last
dimension.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

# Widest row one program normalizes (hidden sizes and head dims are far below).
MAX_NORM_WIDTH = 65536
# Columns of SiLU-and-mul per program.
_ACT_BLOCK = 1024
# Elements of one program's tile on a GPU: a row each where rows are wide (the
# hidden size), several where they are narrow (heads).
_TILE = 2048
# Under the interpreter a program costs the same whatever its tile: many rows each.
_INTERPRETER_ROWS = 64


@triton.jit
def _normalize(values, weight, n, eps, out):
    """Each row of ``values`` [ROWS, BLOCK] (float32, zeros past ``n``) divided by
    its rms and rounded to the dtype ``out`` points to, then times ``weight``
    (float32, broadcast over the rows) and rounded again, as the torch path does."""
    dtype = out.dtype.element_ty
    inv_rms = 1.0 / tl.sqrt(tl.sum(values * values, 1) / n + eps)
    return ((values * inv_rms[:, None]).to(dtype).to(tl.float32) * weight).to(dtype)


@triton.jit
def _rms_norm_kernel(
    x,
    y,
    weight,
    num_rows,
    stride_x,
    stride_y,
    n,
    eps,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    """Without ADD_RESIDUAL y = rms_norm(x); with it, y is the residual stream:
    y += x, then x = rms_norm(y)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < n)
    x_ptr = x + rows * stride_x + cols
    y_ptr = y + rows * stride_y + cols
    values = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight + cols, mask=cols < n, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(y_ptr, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded before it is normalized: the residual stream holds it so.
        total = (values + residual).to(y.dtype.element_ty)
        tl.store(y_ptr, total, mask=mask)
        tl.store(x_ptr, _normalize(total.to(tl.float32), w, n, eps, x), mask=mask)
    else:
        tl.store(y_ptr, _normalize(values, w, n, eps, y), mask=mask)


@triton.jit
def _qk_rms_norm_kernel(
    qkv,
    q_weight,
    k_weight,
    stride_t,
    num_rows,
    num_heads,
    num_qk_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    # Row r is head r % num_qk_heads of token r // num_qk_heads (Q heads first).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    head = rows % num_qk_heads
    cols = tl.arange(0, BLOCK)[None, :]
    col_mask = cols < HEAD_DIM
    mask = (rows < num_rows) & col_mask
    ptr = qkv + (rows // num_qk_heads) * stride_t + head * HEAD_DIM + cols
    values = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    qw = tl.load(q_weight + cols, mask=col_mask, other=0.0).to(tl.float32)
    kw = tl.load(k_weight + cols, mask=col_mask, other=0.0).to(tl.float32)
    w = tl.where(head < num_heads, qw, kw)
    tl.store(ptr, _normalize(values, w, HEAD_DIM, eps, qkv), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    out,
    gate_up,
    num_rows,
    stride_o,
    stride_g,
    n,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < n)
    dtype = out.dtype.element_ty
    gate = tl.load(gate_up + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + rows * stride_g + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out + rows * stride_o + cols, (silu * up).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    qkv,
    cos,
    sin,
    stride_t,
    stride_c,
    stride_s,
    num_rows,
    num_qk_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    # Row r is head r % num_qk_heads of token r // num_qk_heads.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    token = rows // num_qk_heads
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < HALF)
    c = tl.load(cos + token * stride_c + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin + token * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
    first = qkv + token * stride_t + (rows % num_qk_heads) * HEAD_DIM + cols
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


def _rows_per_program(block: int) -> int:
    """Rows of ``block`` elements one program takes: a fixed number for each width,
    never the batch's, so a new batch size never compiles a kernel again."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _INTERPRETER_ROWS
    return max(1, _TILE // block)


def _launch(kernel: Any, num_rows: int, block: int, *args: Any, **constants: Any) -> None:
    """``kernel`` over ``num_rows`` rows of ``block`` elements, in row tiles."""
    rows = _rows_per_program(block)
    warps = min(max(rows * block // 256, 1), 8)
    kernel[(triton.cdiv(num_rows, rows),)](
        *args, BLOCK=block, ROWS=rows, num_warps=warps, **constants
    )


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out [T, n] = rms_norm(x [T, n]) * weight [n] (``out`` may be ``x``)."""
    _norm_rows("rms_norm", x, ("out", out), weight, eps, add_residual=False)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, both [T, n]: residual += x, then x = rms_norm(residual) * weight
    (``tokenloom_cpu::add_rms_norm``'s contract)."""
    _norm_rows("add_rms_norm", x, ("residual", residual), weight, eps, add_residual=True)


def _norm_rows(
    op: str,
    x: torch.Tensor,
    other: tuple[str, torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    add_residual: bool,
) -> None:
    """The norm kernel over the rows of ``x`` [T, n] and the other tensor of its shape."""
    name, y = other
    _check_rows("x", x)
    _check_rows(name, y)
    rows, n = x.shape
    if y.shape != x.shape or weight.shape != (n,):
        raise ValueError(
            f"{op}: x {tuple(x.shape)}, {name} {tuple(y.shape)} and weight "
            f"{tuple(weight.shape)} differ"
        )
    if rows == 0:
        return
    _launch(
        _rms_norm_kernel,
        rows,
        _norm_block(n),
        x,
        y,
        weight,
        rows,
        x.stride(0),
        y.stride(0),
        n,
        eps,
        ADD_RESIDUAL=add_residual,
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
    heads = num_heads + num_kv_heads
    rows = qkv.shape[0] * heads
    _launch(
        _qk_rms_norm_kernel,
        rows,
        _norm_block(head_dim),
        qkv,
        q_weight,
        k_weight,
        qkv.stride(0),
        rows,
        num_heads,
        heads,
        eps,
        HEAD_DIM=head_dim,
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
    per_program = _rows_per_program(block)
    _silu_and_mul_kernel[(triton.cdiv(rows, per_program), triton.cdiv(n, block))](
        out,
        gate_up,
        rows,
        out.stride(0),
        gate_up.stride(0),
        n,
        BLOCK=block,
        ROWS=per_program,
        num_warps=4,
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
    heads = num_heads + num_kv_heads
    _launch(
        _rotary_kernel,
        rows * heads,
        triton.next_power_of_2(half),
        qkv,
        cos,
        sin,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        rows * heads,
        heads,
        HEAD_DIM=head_dim,
        HALF=half,
    )
