"""Quantized matmul kernels per matrix shape and batch size, against PyTorch's own.

For each of the default model's matrix shapes (SmolLM2-135M: qkv 576->960,
o 576->576, gate_up 576->3072, down 1536->576, tied LM head 576->49152) and
each row count, the median time of:

- ``fp32``: ``F.linear`` on the dequantized float32 weight (the dtype=float32 path);
- ``fp32-mkl-packed``: the MKL-prepacked sgemm tokenloom used for float32 until now;
- ``ours-q4``: ``tokenloom_quant.quant_linear`` on the 4-bit layout (Q4_0/Q4_1/Q4_K);
- ``ours-q8``: the same on the 8-bit layout (Q8_0/Q5_K; Q6_K is group 16);
- ``int4pack-bf16``: ``aten._weight_int4pack_mm_for_cpu``, bf16 activations, group 32;
- ``int8pack``: ``aten._weight_int8pack_mm`` (per-channel int8), float32 activations;
- ``dyn-int8``: ``quantized.linear_dynamic`` (fbgemm/x86, per-channel int8).

PyTorch's kernels are timed for speed only: none reproduces the GGUF weights
(their scales are per channel or bf16).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/quant_kernels.py [--rows 1 8 32 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenloom.model.packed_linear import PackedLinear
from tokenloom.quantization.formats import quantize_float
from tokenloom.quantization.kernels import native_available, quant_matmul

SHAPES = {
    "qkv 576->960": (960, 576),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}


def median_ms(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def candidates(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    n, k = w.shape
    q4, q8 = quantize_float(w, "int4"), quantize_float(w, "int8")
    packed = PackedLinear(w)
    out: dict[str, Callable[[], object]] = {
        "fp32": lambda: F.linear(x, w),
        "fp32-mkl-packed": lambda: packed(x),
        "ours-q4": lambda: quant_matmul(x, q4),
        "ours-q8": lambda: quant_matmul(x, q8),
    }
    try:
        codes = q4.codes()[:, :k].to(torch.int32)
        w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        # int4pack computes (q - 8) * scale + zero per group.
        zeros = q4.mins + 8 * q4.scales
        sz = torch.stack((q4.scales, zeros), dim=-1).transpose(0, 1).contiguous().bfloat16()
        xb = x.bfloat16()
        out["int4pack-bf16"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w4, 32, sz)
    except (RuntimeError, AttributeError) as e:
        print(f"int4pack unavailable: {e}")
    scale = w.abs().amax(1) / 127
    w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    out["int8pack"] = lambda: torch.ops.aten._weight_int8pack_mm(x, w8, scale)
    qw = torch.quantize_per_channel(
        w, scale.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8
    )
    params = torch.ops.quantized.linear_prepack(qw, None)
    out["dyn-int8"] = lambda: torch.ops.quantized.linear_dynamic(x, params)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert native_available(), "the native kernel did not build"
    print(f"threads={args.threads} load={os.getloadavg()[0]:.2f} torch={torch.__version__}")
    names: list[str] = []
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for shape_name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            with torch.inference_mode():
                times = {name: median_ms(fn) for name, fn in candidates(w, x).items()}
            names = list(times)
            rows_out.append((shape_name, rows, times))
    print("| shape | rows | " + " | ".join(names) + " | fastest |")
    print("|---|---:|" + "---:|" * len(names) + "---|")
    for shape_name, rows, times in rows_out:
        best = min(times, key=lambda name: times[name])
        cells = " | ".join(f"{times[name]:.3f}" for name in names)
        print(f"| {shape_name} | {rows} | {cells} | {best} |")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
