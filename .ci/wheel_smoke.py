"""The installed wheel carries every native kernel, and runs the default model.

Run by `make wheel-smoke` in a fresh venv holding only torch, the wheel, its
dependencies and the default model, with no compiler reachable: any missing
variant, op or library fails here, not as a slow torch path in production.
Each variant this CPU runs is loaded in a process of its own (they register the
same op names) and checked there.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

# One variant's process: the library it loads, its ops, and a short generation.
CHILD = """
import torch
from tokenloom.ops import native_library
from tokenloom.ops.cpu_kernels import layer_ops_available
from tokenloom.quantization.kernels import native_available

variant = native_library.load_library()
assert variant is not None, "no native library loaded"
missing = native_library.missing_ops()
assert not missing, f"missing ops: {missing}"
assert native_available() and layer_ops_available(torch.device("cpu"), torch.float32)
from tokenloom import LLM, SamplingParams

llm = LLM(max_num_seqs=2)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
text = out[0].outputs[0].text
assert text.strip(), "empty generation"
print(f"{variant.name}: ops complete, generated {text!r}", flush=True)
"""


def check_variant(name: str) -> None:
    env = dict(os.environ, TOKENLOOM_CPU_VARIANT=name)
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=300)


def main() -> int:
    import tokenloom
    from tokenloom.ops import cpu_variants, native_library

    compilers = [c for c in ("c++", "g++", "gcc", "cc", "clang") if shutil.which(c)]
    assert not compilers, f"a compiler is reachable: {compilers}"
    package = Path(tokenloom.__file__).resolve().parent
    assert Path(sys.prefix).resolve() in package.parents, f"tokenloom from {package}, not the venv"
    static = package / "entrypoints" / "openai" / "dashboard_static"
    for name in ("index.html", "dashboard.js", "vendor/uPlot.iife.min.js", "vendor/uPlot.LICENSE"):
        assert (static / name).is_file(), f"the wheel lacks the dashboard's {name}"
    machine = platform.machine()
    expected = {v.name for v in cpu_variants.variants_for(machine)}
    built = set(native_library.built_variants())
    assert built == expected, f"the wheel carries {sorted(built)}, expected {sorted(expected)}"
    best = cpu_variants.host_variant()
    if expected:
        assert best is not None, "this CPU runs no variant: the smoke test needs one"
        loaded = native_library.load_library()
        assert loaded == best, f"loaded {loaded}, but this CPU runs {best.name}"
        print(f"{machine}: wheel carries {', '.join(sorted(built))}; loads {best.name}", flush=True)
    flags = cpu_variants.cpu_flags()
    runnable = [v.name for v in cpu_variants.variants_for(machine) if v.cpu_flags <= flags]
    for name in runnable:
        check_variant(name)
    print(f"wheel smoke: {len(runnable)} variants passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
