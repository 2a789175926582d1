"""How closely the default model on its quantized weights follows the float32
model, on three local texts, as the numerics test measures it on one.

Teacher-forced over the first 4,096 tokens of each text (numpy's LICENSE.txt,
the numerics test's; the pinned torch's ``__init__.py``; ``agreement_text.md``
beside this script, a fixed English and Markdown text kept for this and never
edited), 4 tokens a forward pass as the test runs it (the
decoder stack and the int8 kernel serving uses), over the KV cache ``auto``
gives each model: the argmax agreement with the dequantized float32 model and
the perplexity ratio. ``--per-16`` names the matrices whose activations are
rounded per 16 columns instead of 8 (default: what ``panels.act_group_for``
picks), to see what a coarser rounding would cost before building it.

    .venv/bin/python benchmarks/kernels/quant_agreement.py [--per-16 gate_up_proj,o_proj]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tokenloom.quantization.panels as panels  # noqa: E402
from tests.quantization.test_quantized_model import DECODE_ROWS, teacher_forced  # noqa: E402
from tokenloom.config import ModelConfig  # noqa: E402
from tokenloom.default_model import default_model_path  # noqa: E402
from tokenloom.model.tokenizer import load_tokenizer  # noqa: E402
from tokenloom.model_loader.loader import load_model  # noqa: E402

TOKENS = 4096


def texts() -> dict[str, str]:
    numpy_files = importlib.metadata.distribution("numpy").files or []
    license_file = next(f for f in numpy_files if f.name == "LICENSE.txt")
    return {
        "numpy LICENSE.txt": Path(str(license_file.locate())).read_text(),
        "torch __init__.py": Path(torch.__file__).read_text(),
        "agreement_text.md": (Path(__file__).parent / "agreement_text.md").read_text(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--per-16", default=None, help="comma-separated matrix names (gate_up_proj, ...)"
    )
    args = ap.parse_args()
    if args.per_16 is not None:
        panels._MATRICES_PER_16 = tuple(args.per_16.split(","))
    torch.set_num_threads(2)
    tokenizer = load_tokenizer(default_model_path())
    reference = load_model(ModelConfig(model=None, dtype="float32"))
    quantized = load_model(ModelConfig(model=None))
    print(f"activations per 16 columns: {', '.join(panels._MATRICES_PER_16)}")
    print("| text | argmax agreement | perplexity ratio |\n|---|---:|---:|")
    for name, text in texts().items():
        ids = list(tokenizer.encode(text)[:TOKENS])
        ref_ppl, ref_top = teacher_forced(reference, ids)
        ppl, top = teacher_forced(quantized, ids, DECODE_ROWS)
        agreement = float((top == ref_top).float().mean())
        print(f"| {name} | {agreement:.2%} | {ppl / ref_ppl:.4f} |")


if __name__ == "__main__":
    main()
