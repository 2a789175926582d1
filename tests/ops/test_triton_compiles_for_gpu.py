"""Every Triton kernel of the CUDA backend compiles for an H100/H200 (sm_90) as
its wrappers launch it, on the CPU: the interpreter runs code the compiler may
refuse, and GPU time is rare.

Triton compiles ahead of time without a GPU (LLVM and ptxas ship with it). The
kernels must not be defined under ``TRITON_INTERPRET=1``, which the test
session sets, so the compilation runs in a subprocess: this file, as a script,
records the launches of the real wrappers on the shapes below and compiles each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    compiled = done.stdout.split()
    for kernel in (
        "_rms_norm_kernel",
        "_qk_rms_norm_kernel",
        "_silu_and_mul_kernel",
        "_rotary_kernel",
        "_paged_attention_kernel",
        "_write_kv_kernel",
    ):
        assert kernel in compiled, done.stdout


def _record_launches() -> list[tuple[Any, dict[str, Any]]]:
    """(kernel, keyword arguments) of each launch the wrappers make on the shapes
    of the 8B and 1B models (bf16), a SmolLM-sized hidden 576, Qwen3's q/k
    norms, partial rotary, and float32."""
    import torch

    from tokenloom.ops.cuda import layer_ops, paged_attention

    launches: list[tuple[Any, dict[str, Any]]] = []

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                named = dict(zip(self.kernel.arg_names, args, strict=False))
                launches.append((self.kernel, {**named, **kwargs}))

            return launch

    for module in (layer_ops, paged_attention):
        for name in dir(module):
            if name.endswith("_kernel"):
                setattr(module, name, Recorder(getattr(module, name)))

    def empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype)

    # (hidden, intermediate, heads, kv heads, head_dim, rotary dims, dtype)
    shapes = [
        (4096, 14336, 32, 8, 128, 128, torch.bfloat16),
        (2048, 8192, 32, 8, 64, 64, torch.bfloat16),
        (576, 1536, 9, 3, 64, 64, torch.float32),
        (3072, 8192, 24, 8, 128, 96, torch.bfloat16),
    ]
    tokens = 3
    for hidden, inter, heads, kv_heads, head_dim, rotary, dtype in shapes:
        x, w = empty(tokens, hidden, dtype=dtype), empty(hidden, dtype=dtype)
        layer_ops.rms_norm(x, x, w, 1e-6)
        layer_ops.add_rms_norm(x, x.clone(), w, 1e-6)
        layer_ops.silu_and_mul(
            empty(tokens, inter, dtype=dtype), empty(tokens, 2 * inter, dtype=dtype)
        )
        qkv = empty(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        norm_w = empty(head_dim, dtype=dtype)
        layer_ops.qk_rms_norm(qkv, norm_w, norm_w, heads, kv_heads, 1e-6)
        cos = empty(tokens, rotary // 2, dtype=dtype)
        layer_ops.rotary_qk(qkv, cos, cos, heads, kv_heads, head_dim)
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
        k = k.view(tokens, kv_heads, head_dim)
        k_cache = empty(4, kv_heads, head_dim, 16, dtype=dtype)
        v_cache = empty(4, kv_heads, 16, head_dim, dtype=dtype)
        paged_attention.write_kv(k, k, k_cache, v_cache, torch.zeros(tokens, dtype=torch.int64))
        paged_attention.paged_attention(
            torch.empty_like(q),
            q,
            k_cache,
            v_cache,
            torch.zeros(1, 4, dtype=torch.int32),
            torch.tensor([0, tokens], dtype=torch.int32),
            torch.tensor([tokens], dtype=torch.int32),
            head_dim**-0.5,
        )
    return launches


def _compile_all() -> None:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32"}
    pointer[torch.int64] = "*i64"
    for kernel, arguments in _record_launches():
        signature: dict[str, str] = {}
        constants: dict[str, Any] = {}
        options = {"num_warps": arguments.pop("num_warps", 4)}
        for param in kernel.params:
            name, value = param.name, arguments[param.name]
            if param.is_constexpr:
                signature[name], constants[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = pointer[value.dtype]
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                signature[name] = "i32"
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        print(kernel.fn.__name__)


if __name__ == "__main__":
    _compile_all()
