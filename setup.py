"""Builds tokenloom's native CPU library, once per instruction-set variant.

Every source of ``csrc/`` is compiled into one library per variant of
``tokenloom/ops/cpu_variants.py`` (``tokenloom/_C_<variant>.so``); at run time
``tokenloom/ops/native_library.py`` loads the best one the CPU has, so a wheel
runs on any x86-64 CPU with AVX2 and needs no compiler. The libraries are
torch operator libraries, not Python modules: they are loaded with
``torch.ops.load_library`` and register ``torch.ops.tokenloom_cpu`` and
``torch.ops.tokenloom_quant``.

Build without build isolation, against the torch that will run the code
(``pip install --no-build-isolation -e .`` or ``pip wheel --no-build-isolation
.``): the library links against that torch's C++ ABI, so the project requires
exactly that torch version. ``TOKENLOOM_BUILD_VARIANTS`` chooses the variants:
``all`` (the default, what a wheel for other machines needs), ``host`` (the one
this CPU runs best: ``make setup``), names (``avx2,avx512_bf16``), or ``none``
(a pure-Python wheel for CUDA machines, which run the Triton kernels instead).
"""

from __future__ import annotations

import os
import platform
import runpy
import warnings
from pathlib import Path

# torch warns when numpy is missing, as it is while a fresh venv builds this.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / CSRC).rglob("*.cpp"))

variants = runpy.run_path(str(ROOT / "tokenloom" / "ops" / "cpu_variants.py"))


def selected_variants() -> list:
    """The variants TOKENLOOM_BUILD_VARIANTS asks for: ``all`` (the default) of
    this architecture's, ``host`` the one this CPU runs best, names, or ``none``."""
    machine = platform.machine()
    names = os.environ.get("TOKENLOOM_BUILD_VARIANTS", "").strip() or "all"
    if names == "none":
        return []
    if names == "all":
        return list(variants["variants_for"](machine))
    if names == "host":
        host = variants["host_variant"]()
        return [] if host is None else [host]
    return [variants["variant_named"](name.strip(), machine) for name in names.split(",")]


def extension(variant) -> CppExtension:
    return CppExtension(
        name=f"tokenloom._C_{variant.name}",
        sources=SOURCES,
        include_dirs=[str(ROOT / CSRC)],
        extra_compile_args=variant.compiler_flags(),
    )


class BuildNative(BuildExtension.with_options(no_python_abi_suffix=True)):  # type: ignore[misc]
    """torch's builder (ninja, MAX_JOBS parallel jobs), with each variant's objects
    in build/native/<variant>, which outlives the build: an editable install and a
    wheel built from the same tree, and a rebuild after an edit, recompile only
    what changed."""

    def build_extensions(self) -> None:
        # Not the interpreter's compiler flags (-g, -Wall, -fwrapv, -DNDEBUG, made
        # for CPython's C): only the position-independent code a library needs,
        # then each variant's own.
        self.compiler.compiler_so = [*self.compiler.compiler_so[:1], "-fPIC"]
        super().build_extensions()

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        self.build_temp = str(ROOT / "build" / "native" / ext.name.rsplit("._C_", 1)[1])
        super().build_extension(ext)


# torch's version without its local label (2.13.0 for 2.13.0+cpu): the CPU and
# CUDA builds of one release share the C++ ABI the library is compiled against.
TORCH_REQUIREMENT = f"torch=={torch.__version__.split('+')[0]}"

setup(
    ext_modules=[extension(variant) for variant in selected_variants()],
    cmdclass={"build_ext": BuildNative},
    install_requires=[
        TORCH_REQUIREMENT,
        "numpy>=1.26",
        "safetensors>=0.4",
        "gguf>=0.10",
        "tokenizers>=0.21",
        "transformers>=4.45",
        "huggingface_hub>=0.24",
        "jinja2>=3.1",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "pydantic>=2.6",
        "prometheus-client>=0.20",
        "pyzmq>=25",
        "msgspec>=0.18",
        "tqdm>=4.66",
        "httpx>=0.27",
        "psutil>=5.9",
        "xgrammar>=0.2.8",
        # Tool calls are validated against their function's schema before a client sees them.
        "jsonschema>=4.20",
        "pyyaml>=6.0",  # --tenants files in YAML
        "pillow>=10.0",  # images in prompts (chat image parts, multi_modal_data)
        "xxhash>=3.0",  # the disk KV tier's block checksums
    ],
)
