"""A decoder layer's order of operations, written once, as a recipe of steps.

Each layer class lists its steps (``DecoderLayer.recipe``, ``GemmaDecoderLayer.recipe``)
and ``DecoderLayer.forward`` runs them with the layer's modules; the native decoder stack
(``csrc/decoder/decoder_stack.cpp``) is given the same steps by name and runs
them in C++, refusing a recipe with a step it does not implement. A new step or
another order is a change to a recipe, and both paths follow it.

The steps act on a few registers, alike in both languages:
- ``x``: the activations. A layer starts with the previous layer's output (not
  yet added to the residual stream) and ends with its own.
- ``residual``: the residual stream; None until the first layer's first
  ``ADD_NORM``, which takes ``x`` as the stream.
- ``q``, ``k``, ``v``: the attention's inputs, set by ``ROPE``.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class Op(str, Enum):
    """A step; its value is the name the native stack knows it by."""

    ADD_NORM = "add_norm"  # residual += x; x = norm(residual)
    NORM = "norm"  # x = norm(x)
    QKV_PROJ = "qkv_proj"  # x = qkv_proj(x): the q, k and v heads side by side
    QK_NORM = "qk_norm"  # x's q and k heads normalized per head, in place
    ROPE = "rope"  # q, k = x's q, k heads rotated; v = x's v heads
    ATTEND = "attend"  # this step's K/V into the cache; x = attention(q, k, v)
    O_PROJ = "o_proj"  # x = o_proj(x)
    GATE_UP = "gate_up"  # x = act(gate(x)) * up(x)
    DOWN_PROJ = "down_proj"  # x = down_proj(x)


class Step(NamedTuple):
    op: Op
    norm: str | None = None  # ADD_NORM, NORM: the layer's attribute holding the RMSNorm


Recipe = tuple[Step, ...]

# The module each projection step multiplies by, under the layer.
PROJECTIONS = {
    Op.QKV_PROJ: "self_attn.qkv_proj",
    Op.O_PROJ: "self_attn.o_proj",
    Op.GATE_UP: "mlp.gate_up_proj",
    Op.DOWN_PROJ: "mlp.down_proj",
}


def attention_steps(qk_norm: bool) -> Recipe:
    """From the normalized input to the attention's output projection."""
    return (
        Step(Op.QKV_PROJ),
        *((Step(Op.QK_NORM),) if qk_norm else ()),
        Step(Op.ROPE),
        Step(Op.ATTEND),
        Step(Op.O_PROJ),
    )
