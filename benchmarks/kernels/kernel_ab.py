"""Two builds of the native kernels in one process, alternating: a git
revision's sources against the working tree's.

On a shared machine, runs of a whole workload a few minutes apart differ by
more than most kernel changes gain. Here both builds are loaded side by side
(each under its own op namespace) and every case times one, then the other,
round after round; the table gives medians over the rounds of each case's
best of 5 calls, and whether the two builds' outputs are bit for bit equal.

Each build compiles the ``csrc/`` tree of its revision (includes relative to
``csrc/``) with ``torch.utils.cpp_extension.load``, with the compiler flags of
the native library's variant for this CPU (``ops.cpu_variants``), so both run
as the installed library would; the revision must have its sources in
``csrc/`` at the repository root.

- ``attention`` (``csrc/attention/paged_attention.cpp``), the default model's
  heads (9 query heads, 3 KV heads of 64), blocks of 16 on huge pages, 80% of
  a request's blocks following its previous one as in a busy engine:
  decodes over ``--layers`` layers' caches (so that K/V come from DRAM),
  one layer's (from L3), a batch-1 decode whose caches are evicted before
  every layer as a step's weights evict them (with everything else the
  kernel touches, its scratch too: harsher than a step), a 2,048-token prompt step
  of fresh chunks (lengths log-uniform in 32-512). bfloat16 caches (what
  quantized weights serve with), the prompt step also float32.
- ``quant`` (``csrc/quantization/quant_linear.cpp``): the default model's
  matrices (layer 3's four and the LM head) at ``--rows`` rows (the head at
  up to 128), and the MLP's activation from gate_up (``quant_linear_silu``).
- ``dense`` (``csrc/dense/dense_linear.cpp``): the default model's and
  Llama-3.2-1B's matrices in ``--dtypes`` at ``--rows`` rows.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/kernels/kernel_ab.py --base HEAD~2 [--kernels attention quant] [--rounds 7]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tokenloom.model import huge_pages  # noqa: E402
from tokenloom.ops.cpu_variants import host_variant  # noqa: E402

# Per kernel: the translation unit compiled (under csrc/) and the op namespace
# its TORCH_LIBRARY blocks register.
KERNELS = {
    "attention": ("attention/paged_attention.cpp", "tokenloom_cpu"),
    "quant": ("quantization/quant_linear.cpp", "tokenloom_quant"),
    "dense": ("dense/dense_linear.cpp", "tokenloom_cpu"),
}
# The default model's attention: 9 query heads, 3 KV heads of 64, blocks of 16.
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
_REGISTRATIONS = ("TORCH_LIBRARY", "TORCH_LIBRARY_IMPL", "TORCH_LIBRARY_FRAGMENT")
# A case runs its kernel calls with one build's ops; it returns their output
# and the seconds the calls took (only the calls: not the evictions between).
Case = Callable[[Any], tuple[torch.Tensor, float]]


def csrc_files(rev: str | None) -> dict[str, str]:
    """Every file under ``csrc/`` at ``rev`` (None: the working tree), by path inside it."""
    if rev is None:
        base = ROOT / "csrc"
        return {
            str(path.relative_to(base)): path.read_text()
            for path in sorted(base.rglob("*"))
            if path.is_file()
        }
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "csrc/"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not listed:
        sys.exit(f"{rev} has no csrc/ at the repository root; pick a later revision")
    files = {}
    for path in listed:
        shown = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        files[path.removeprefix("csrc/")] = shown.stdout
    return files


def build(kernel: str, rev: str | None, tag: str) -> Any:
    """Compiles ``kernel``'s translation unit at ``rev`` (None: the working tree)
    with its ops registered as ``<namespace>_<tag>``; returns that namespace."""
    from torch.utils import cpp_extension

    source, namespace = KERNELS[kernel]
    files = csrc_files(rev)
    if source not in files:
        sys.exit(f"{rev or 'the working tree'} has no csrc/{source}")
    for path, text in files.items():
        for macro in _REGISTRATIONS:
            text = text.replace(f"{macro}({namespace},", f"{macro}({namespace}_{tag},")
        files[path] = text
    digest = hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:12]
    tree = Path.home() / ".cache" / "tokenloom" / "kernel_ab" / digest
    for path, text in files.items():
        (tree / "csrc" / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / "csrc" / path).write_text(text)
    variant = host_variant()
    if variant is None:
        sys.exit("this CPU has none of the native library's variants (AVX2 at least)")
    cpp_extension.load(
        name=f"{kernel}_ab_{digest}",
        sources=[str(tree / "csrc" / source)],
        # The flags the installed library's variant for this CPU is built with.
        extra_cflags=variant.compiler_flags(),
        extra_include_paths=[str(tree / "csrc")],
        build_directory=str(tree),
        is_python_module=False,
    )
    return getattr(torch.ops, f"{namespace}_{tag}")


def prompt_step(seed: int) -> tuple[list[int], torch.Tensor, int]:
    """A 2,048-token step of fresh prompt chunks, lengths log-uniform in 32-512:
    the lengths, their block table (each chunk's blocks in a row from block 1)
    and the number of blocks a cache for them needs."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < 2048:
        drawn = int(math.exp(rng.uniform(math.log(32), math.log(512))))
        lengths.append(min(drawn, 2048 - sum(lengths)))
    blocks = [-(-n // BLOCK) for n in lengths]
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    first = 1
    for row, n in enumerate(blocks):
        table[row, :n] = torch.arange(first, first + n)
        first += n
    return lengths, table, first


def adjacent_tables(
    requests: int, context: int, num_blocks: int, rng: random.Random
) -> torch.Tensor:
    """Block tables whose blocks mostly (80%) follow the previous one."""
    per = -(-context // BLOCK)
    rows = []
    for _ in range(requests):
        block, row = 0, []
        for i in range(per):
            block = (
                rng.randrange(1, num_blocks - per) if i == 0 or rng.random() > 0.8 else block + 1
            )
            row.append(block)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32)


def decode_case(requests: int, context: int, layers: int, evict: bool = False) -> Case:
    """``requests`` decodes of ``context`` tokens, one call per layer; with
    ``evict``, the caches leave the CPU's caches before each layer's call
    (only the calls are timed)."""
    rng = random.Random(0)
    num_blocks = 2 * requests * -(-context // BLOCK) + 1
    table = adjacent_tables(requests, context, num_blocks, rng)
    caches = []
    for _ in range(layers):
        k = huge_pages.zeros((num_blocks, KV_HEADS, HEAD_DIM, BLOCK), torch.bfloat16, "cpu")
        v = huge_pages.zeros((num_blocks, KV_HEADS, BLOCK, HEAD_DIM), torch.bfloat16, "cpu")
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
        caches.append((k, v))
    q = torch.randn(requests, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    rows, ones = torch.arange(requests, dtype=torch.int32), torch.ones(requests, dtype=torch.int32)
    seq_lens = torch.full((requests,), context, dtype=torch.int32)
    evictor = torch.ones(48 << 20) if evict else None

    def run(ops: Any) -> tuple[torch.Tensor, float]:
        elapsed = 0.0
        for k, v in caches:
            if evictor is not None:
                evictor.mul_(1.0)
            start = time.perf_counter()
            ops.paged_attention(out, q, k, v, table, rows, rows, ones, seq_lens, HEAD_DIM**-0.5)
            elapsed += time.perf_counter() - start
        return out, elapsed

    return run


def prefill_case(dtype: torch.dtype) -> Case:
    """One 2,048-token step of fresh prompt chunks in one call."""
    lengths, table, num_blocks = prompt_step(seed=0)
    k_cache = torch.randn(num_blocks, KV_HEADS, HEAD_DIM, BLOCK).to(dtype)
    v_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, HEAD_DIM).to(dtype)
    q = torch.randn(sum(lengths), HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    rows = torch.arange(len(lengths), dtype=torch.int32)

    def run(ops: Any) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        ops.paged_attention(
            out, q, k_cache, v_cache, table, rows, starts, lens, lens, HEAD_DIM**-0.5
        )
        return out, time.perf_counter() - start

    return run


def attention_cases(layers: int) -> dict[str, Case]:
    return {
        f"decode 128 x 200 tokens, {layers} layers": decode_case(128, 200, layers),
        "decode 128 x 200 tokens, 1 layer": decode_case(128, 200, 1),
        f"decode 22 x 550 tokens, {layers} layers": decode_case(22, 550, layers),
        "decode 1 x 200 tokens, evicted, 30 layers": decode_case(1, 200, 30, evict=True),
        "prompt step, bfloat16 cache": prefill_case(torch.bfloat16),
        "prompt step, float32 cache": prefill_case(torch.float32),
    }


def quant_cases(row_counts: list[int]) -> dict[str, Case]:
    from tokenloom.config import ModelConfig
    from tokenloom.model_loader.loader import load_model
    from tokenloom.quantization.linear import QuantLinear

    model = load_model(ModelConfig(model=None)).model
    weights = {
        name.rsplit(".", 1)[-1]: module.qweight
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear)
        and (name.startswith("layers.3.") or name == "logits_head")
    }
    generator = torch.Generator().manual_seed(0)
    cases: dict[str, Case] = {}
    for name, weight in weights.items():
        for rows in row_counts:
            if name == "logits_head" and rows > 128:
                continue
            x = torch.randn(rows, weight.in_features, generator=generator)
            cases[f"{name}, {rows} rows"] = matmul_case(x, weight.kernel_args())
            if name == "gate_up_proj":
                cases[f"{name} and SiLU, {rows} rows"] = matmul_case(
                    x, weight.kernel_args(), "quant_linear_silu"
                )
    return cases


# (out_features, in_features) of the four projections and the LM head: the
# default model's (SmolLM2-135M) and Llama-3.2-1B's.
DENSE_SHAPES = {
    "135M": {
        "qkv": (960, 576),
        "o": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
        "head": (49152, 576),
    },
    "1B": {
        "qkv": (3072, 2048),
        "o": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
        "head": (128256, 2048),
    },
}


def dense_cases(dtypes: list[str], row_counts: list[int]) -> dict[str, Case]:
    """Both models' matrices at 1 to 2,048 rows (the 1B's to 512, the heads to
    128: a step computes logits for its sampled rows only), random weights in
    panels (``model.panel_linear``), and the MLP's activation from gate_up."""
    from tokenloom.model.panel_linear import pack_panels

    generator = torch.Generator().manual_seed(0)
    cases: dict[str, Case] = {}
    for dtype in dtypes:
        for model, shapes in DENSE_SHAPES.items():
            for name, (n, k) in shapes.items():
                weight = (
                    torch.randn(n, k, generator=generator).div_(k**0.5).to(getattr(torch, dtype))
                )
                args = (pack_panels(weight), k, n)
                for rows in row_counts:
                    if rows > (128 if name == "head" else 512 if model == "1B" else 2048):
                        continue
                    x = torch.randn(rows, k, generator=generator)
                    label = f"{dtype} {model} {name}, {rows} rows"
                    cases[label] = matmul_case(x, args, "dense_linear")
                    if name == "gate_up" and rows in (128, 1):
                        cases[f"{label}, SiLU"] = matmul_case(x, args, "dense_linear_silu")
    return cases


def matmul_case(x: torch.Tensor, args: tuple[object, ...], op: str = "quant_linear") -> Case:
    """``op`` on ``x``: ``quant_linear``, or ``quant_linear_silu`` (the MLP's
    activation straight from its gate_up projection), or the dense ones."""

    def run(ops: Any) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        out = getattr(ops, op)(x, *args)
        return out, time.perf_counter() - start

    return run


def best_ms(case: Case, ops: Any) -> tuple[float, torch.Tensor]:
    case(ops)
    times = []
    for _ in range(5):
        out, seconds = case(ops)
        times.append(seconds)
    return min(times) * 1e3, out.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision to compare against")
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=["bfloat16", "float32"],
        default=["bfloat16", "float32"],
        help="the dense kernel's weight dtypes",
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        type=int,
        default=[2048, 512, 128, 16, 1],
        help="the matmuls' activation row counts",
    )
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}; base {args.base} against the working tree")
    print("| case | base ms | work ms | base / work | same outputs |\n|---|---:|---:|---:|---|")
    for kernel in args.kernels:
        builds = [build(kernel, args.base, "base"), build(kernel, None, "work")]
        if kernel == "attention":
            cases = attention_cases(args.layers)
        elif kernel == "dense":
            cases = dense_cases(args.dtypes, args.rows)
        else:
            cases = quant_cases(args.rows)
        times: dict[str, list[list[float]]] = {name: [[], []] for name in cases}
        same: dict[str, bool] = {}
        for _ in range(args.rounds):
            for name, case in cases.items():
                outs = []
                for i, ops in enumerate(builds):
                    ms, out = best_ms(case, ops)
                    times[name][i].append(ms)
                    outs.append(out)
                same[name] = same.get(name, True) and torch.equal(outs[0], outs[1])
        for name, (base, work) in times.items():
            b, w = statistics.median(base), statistics.median(work)
            print(
                f"| {kernel}: {name} | {b:.3f} | {w:.3f} | {b / w:.3f} | {'yes' if same[name] else 'no'} |"
            )


if __name__ == "__main__":
    main()
