"""Export the default model (the bundled Q4_1 GGUF) as a plain HF directory.

vLLM and transformers need config.json + safetensors + tokenizer files.
transformers dequantizes the GGUF when loading it with ``gguf_file=...`` but
refuses ``save_pretrained`` on such a model, so we build a fresh
``LlamaForCausalLM`` from the same config, copy the dequantized state dict
into it and save that. All peers then run identical (dequantized) weights.

Usage: .venv/bin/python benchmarks/peers/export_hf.py [--out .bench/smollm2-hf] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# compare_peers.py finds the GGUF through this name.
from tokenloom.default_model import default_model_path


def export(gguf: Path, out: Path, dtype: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    torch_dtype = getattr(torch, dtype)
    src = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    dst = LlamaForCausalLM(src.config).to(torch_dtype)  # type: ignore[arg-type]
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    # lm_head is tied to the embeddings in SmolLM2; anything else missing is a bug.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    out.mkdir(parents=True, exist_ok=True)
    dst.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    if getattr(src, "generation_config", None) is not None:
        src.generation_config.save_pretrained(str(out))
    _clean_config(out / "config.json")
    return out


def _clean_config(path: Path) -> None:
    """Drop the GGUF quantization note: the saved weights are plain tensors, and
    vLLM would otherwise try to load the directory as a GGUF-quantized model."""
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])  # for older readers
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path(".bench/smollm2-hf"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    out = export(args.gguf or default_model_path(), args.out, args.dtype)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
