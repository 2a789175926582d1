"""Quantized matmul kernels per matrix shape and batch size, against PyTorch's own.

For the default model's matrix shapes (SmolLM2-135M: qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576, tied LM head 576->49152), Llama-3.2-1B's
(2048->2048, 2048->8192, 8192->2048, LM head 2048->128256) and each row count,
the median time of:

- ``fp32``: ``F.linear`` on the dequantized float32 weight (the dtype=float32 path);
- ``fp32-mkl-packed``: the MKL-prepacked sgemm tokenloom uses for float32;
- ``bf16``: ``F.linear`` with bfloat16 weights and activations;
- ``ours-q4``: ``tokenloom_quant.quant_linear`` on the 4-bit layout with mins
  (Q4_0/Q4_1/Q4_K): int8 activations per 8 columns, VNNI integer dot products;
- ``ours-q8``: the same on the 8-bit layout without mins (Q8_0);
- ``ours-q6k``: the 6-bit layout with scales per 16 columns (Q6_K);
- ``int4pack-bf16``: ``aten._weight_int4pack_mm_for_cpu``, bf16 activations, group 32;
- ``int8pack``: ``aten._weight_int8pack_mm`` (per-channel int8), float32
  activations (scalar: slow, only with ``--columns``);
- ``dyn-int8``: ``quantized.linear_dynamic`` (fbgemm/x86, per-channel int8).

PyTorch's kernels are timed for speed only: none reproduces the GGUF weights
(their scales are per channel or bf16). ``--cpu-time`` times with the process's
CPU clock instead of the wall clock, which a loaded machine disturbs less (use
it with one thread only).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/kernels/quant_kernels.py [--rows 1 8 32 128]
        [--shapes default 1b] [--columns fp32 ours-q4 ...] [--threads 2] [--cpu-time]
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
from tokenloom.quantization.formats import (
    GroupFactors,
    QuantizedWeight,
    pack_codes,
    quantize_float,
)
from tokenloom.quantization.kernels import native_available, quant_matmul
from tokenloom.quantization.panels import PanelWeight

SHAPES = {
    "default": {
        "qkv 576->960": (960, 576),
        "o 576->576": (576, 576),
        "gate_up 576->3072": (3072, 576),
        "down 1536->576": (576, 1536),
        "lm_head 576->49152": (49152, 576),
    },
    "1b": {
        "1b q/o 2048->2048": (2048, 2048),
        "1b gate/up 2048->8192": (8192, 2048),
        "1b down 8192->2048": (2048, 8192),
        "1b lm_head 2048->128256": (128256, 2048),
    },
}
DEFAULT_COLUMNS = [
    "fp32",
    "fp32-mkl-packed",
    "bf16",
    "ours-q4",
    "ours-q8",
    "ours-q6k",
    "int4pack-bf16",
    "dyn-int8",
]


def median_ms(fn: Callable[[], object], cpu_time: bool = False, budget_s: float = 0.3) -> float:
    clock = time.process_time if cpu_time else time.perf_counter
    fn()
    times: list[float] = []
    start = clock()
    while len(times) < 5 or (clock() - start < budget_s and len(times) < 200):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def q6k_layout(w: torch.Tensor) -> QuantizedWeight:
    """Q6_K's codes (0..63, a scale per 16 columns, min -32 times it) from float
    weights, in the 6-bit layout."""
    n, k = w.shape
    groups = F.pad(w, (0, -k % 32)).view(n, -1, 16)
    scales = GroupFactors(groups.abs().amax(-1).clamp_min(1e-8) / 31)
    codes = (torch.round(groups / scales.base.unsqueeze(-1)).clamp(-32, 31) + 32).view(n, -1)
    qweight, qhigh = pack_codes(codes.numpy(), 6)
    mins = GroupFactors(scales.base, multiplier=-32.0)
    return QuantizedWeight(6, 16, k, qweight, scales, mins, qhigh)


def candidates(
    w: torch.Tensor, x: torch.Tensor, columns: list[str]
) -> dict[str, Callable[[], object]]:
    n, k = w.shape
    q4, q8 = quantize_float(w, "int4"), quantize_float(w, "int8")
    out: dict[str, Callable[[], object]] = {"fp32": lambda: F.linear(x, w)}
    if "fp32-mkl-packed" in columns:
        packed = PackedLinear(w)
        out["fp32-mkl-packed"] = lambda: packed(x)
    if "bf16" in columns:
        wb, xb = w.bfloat16(), x.bfloat16()
        out["bf16"] = lambda: F.linear(xb, wb)
    p4, p8, p6k = (PanelWeight.from_rows(q) for q in (q4, q8, q6k_layout(w)))
    out["ours-q4"] = lambda: quant_matmul(x, p4)
    out["ours-q8"] = lambda: quant_matmul(x, p8)
    out["ours-q6k"] = lambda: quant_matmul(x, p6k)
    if not {"int4pack-bf16", "int8pack", "dyn-int8"} & set(columns):
        return {name: fn for name, fn in out.items() if name in columns}
    try:
        codes = q4.codes()[:, :k].to(torch.int32)
        w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        # int4pack computes (q - 8) * scale + zero per group.
        assert q4.mins is not None
        scales = q4.scales.values()
        zeros = q4.mins.values() + 8 * scales
        sz = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().bfloat16()
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
    return {name: fn for name, fn in out.items() if name in columns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--columns", nargs="+", default=DEFAULT_COLUMNS)
    parser.add_argument("--cpu-time", action="store_true", help="time with the CPU clock")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert native_available(), "the native kernel did not build"
    print(f"threads={args.threads} load={os.getloadavg()[0]:.2f} torch={torch.__version__}")
    names: list[str] = []
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    shapes = {name: shape for group in args.shapes for name, shape in SHAPES[group].items()}
    for shape_name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            with torch.inference_mode():
                fns = candidates(w, x, args.columns)
                times = {name: median_ms(fns[name], args.cpu_time) for name in fns}
            names = list(times)
            rows_out.append((shape_name, rows, times))
            print(shape_name, rows, times, flush=True)
    print("| shape | rows | " + " | ".join(names) + " | fastest |")
    print("|---|---:|" + "---:|" * len(names) + "---|")
    for shape_name, rows, times in rows_out:
        best = min(times, key=lambda name: times[name])
        cells = " | ".join(f"{times[name]:.3f}" for name in names)
        print(f"| {shape_name} | {rows} | {cells} | {best} |")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
