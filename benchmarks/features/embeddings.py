"""Embeddings per second: tokenloom's pooling runner beside sentence-transformers and
plain transformers, on the default model served as an embedding model.

The model is the default model's safetensors export (``benchmarks/peers/export_hf.py``,
made here under ``.bench/`` when missing) with a Sentence-Transformers pipeline
added beside it: last-token pooling, then normalisation (``modules.json``,
``1_Pooling``, ``2_Normalize``). Every engine reads that same pipeline;
tokenloom also runs the GGUF (its default, quantized weights) with the same
pooling. The workload is ``--num-inputs`` texts of ``--min-len`` to
``--max-len`` tokens (uniform, seeded), cut from the texts in
``benchmarks/kernels/agreement_text.md`` and the pinned torch's ``__init__.py``, given to every
engine as text (tokenizing is part of the work) and all at once: tokenloom
batches them through its scheduler, the others encode them in length-sorted
batches of ``--batch-size``, as sentence-transformers does.

Each engine runs in its own process per round (loading and a warm-up are not
timed), the engines in a rotated order each round, so a busy machine disturbs
them alike; the medians over ``--repeats`` rounds are reported, with the CPU
time other processes used during each run (the load). The first inputs'
vectors are compared across engines (cosine) to show they compute the same thing.

    python benchmarks/features/embeddings.py --repeats 3
    (sentence-transformers is used when importable: pip install sentence-transformers)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks._common import CpuMonitor, cpu_model, report, wait_for_idle  # noqa: E402

ENGINES = ("tokenloom", "tokenloom-gguf", "sentence-transformers", "transformers")
# Vectors kept from each run to compare engines.
NUM_COMPARED = 16
_ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]


# ------------------------------------------------------------------ set-up


def embedding_model(export_dir: Path, out: Path) -> Path:
    """``export_dir``'s files (linked) plus a last-token, normalised Sentence-Transformers
    pipeline."""
    if not (export_dir / "config.json").is_file():
        subprocess.run(
            [sys.executable, str(ROOT / "benchmarks/peers/export_hf.py"), "--out", str(export_dir)],
            check=True,
        )
    out.mkdir(parents=True, exist_ok=True)
    for item in export_dir.iterdir():
        link = out / item.name
        if not link.exists():
            link.symlink_to(item.resolve())
    hidden = json.loads((export_dir / "config.json").read_text())["hidden_size"]
    (out / "modules.json").write_text(json.dumps(_ST_MODULES, indent=1))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True})
    )
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 1024, "do_lower_case": False})
    )
    return out


def make_texts(model_dir: Path, count: int, low: int, high: int, seed: int) -> list[str]:
    """``count`` texts of ``low``..``high`` tokens of the model's tokenizer, cut at
    random places from a fixed corpus."""
    import torch
    from transformers import AutoTokenizer

    corpus = (ROOT / "benchmarks/kernels/agreement_text.md").read_text()
    corpus += Path(torch.__file__).read_text()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(corpus, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        length = rng.randint(low, high)
        start = rng.randrange(len(ids) - length)
        texts.append(tokenizer.decode(ids[start : start + length]))
    return texts


# ------------------------------------------------------------------ workers


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Load one engine, warm it up, embed every text once (timed)."""
    texts = json.loads(Path(args.texts).read_text())
    started = time.perf_counter()
    embed = _load(args)
    load_s = time.perf_counter() - started
    embed(texts[:8])  # warm-up
    waited = wait_for_idle(args.idle_wait)
    load_before = os.getloadavg()[0]
    with CpuMonitor() as cpu:
        started = time.perf_counter()
        vectors, num_tokens = embed(texts)
        wall = time.perf_counter() - started
    assert len(vectors) == len(texts)
    return {
        "engine": args.worker,
        "load_s": load_s,
        "wall_s": wall,
        "num_tokens": num_tokens,
        "own_cpu_s": cpu.own_cpu_s,
        "other_cpu_s": cpu.other_cpu_s,
        "loadavg_1m": load_before,
        "idle_wait_s": waited,
        "vectors": [list(map(float, v)) for v in vectors[:NUM_COMPARED]],
    }


def _load(args: argparse.Namespace) -> Any:
    if args.worker.startswith("tokenloom"):
        from tokenloom import LLM

        if args.worker == "tokenloom":
            llm = LLM(args.model, runner="pooling", dtype=args.dtype, **_engine_args(args))
        else:  # the default model's GGUF, quantized, with the same pooling
            llm = LLM(
                runner="pooling",
                pooler_config={"pooling_type": "LAST", "normalize": True},
                **_engine_args(args),
            )

        def embed_tokenloom(texts: list[str]) -> tuple[list[list[float]], int]:
            outputs = llm.embed(texts, use_tqdm=False)
            tokens = sum(len(o.prompt_token_ids) for o in outputs)
            return [o.outputs.embedding for o in outputs], tokens

        return embed_tokenloom

    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.worker == "sentence-transformers":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(args.model, device="cpu", model_kwargs={"dtype": dtype})
        model.max_seq_length = 1024
        tokenizer = model.tokenizer

        def embed_st(texts: list[str]) -> tuple[list[Any], int]:
            vectors = model.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
            return list(vectors), _count_tokens(tokenizer, texts)

        return embed_st

    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    model = AutoModel.from_pretrained(args.model, dtype=dtype).eval()

    def embed_hf(texts: list[str]) -> tuple[list[Any], int]:
        # Length-sorted batches, last-token pooling over right padding, normalised.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        vectors: list[Any] = [None] * len(texts)
        tokens = 0
        with torch.inference_mode():
            for start in range(0, len(order), args.batch_size):
                batch = order[start : start + args.batch_size]
                enc = tokenizer([texts[i] for i in batch], padding=True, return_tensors="pt")
                hidden = model(**enc).last_hidden_state
                last = enc["attention_mask"].sum(1) - 1
                tokens += int(enc["attention_mask"].sum())
                pooled = hidden[torch.arange(len(batch)), last].float()
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
                for i, vector in zip(batch, pooled, strict=True):
                    vectors[i] = vector.numpy()
        return vectors, tokens

    return embed_hf


def _engine_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "log_stats": False,
    }


def _count_tokens(tokenizer: Any, texts: list[str]) -> int:
    return sum(len(ids) for ids in tokenizer(texts)["input_ids"])


# ------------------------------------------------------------------ driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--export-dir", default=str(ROOT / ".bench/smollm2-hf"))
    ap.add_argument("--num-inputs", type=int, default=1000)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' and HF's")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--idle-wait", type=float, default=20.0)
    ap.add_argument("--json", default="", help="also write the result here")
    # A worker run (internal).
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--texts", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(run_worker(args)))
        return

    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")
    if "sentence-transformers" in engines and not _importable("sentence_transformers"):
        print("sentence-transformers is not installed: left out", file=sys.stderr)
        engines.remove("sentence-transformers")
    work = ROOT / ".bench/embeddings"
    work.mkdir(parents=True, exist_ok=True)
    model = embedding_model(Path(args.export_dir), work / "smollm2-embed")
    texts = make_texts(model, args.num_inputs, args.min_len, args.max_len, args.seed)
    texts_file = work / "texts.json"
    texts_file.write_text(json.dumps(texts))

    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for round_index in range(args.repeats):
        shift = round_index % len(engines)
        for engine in engines[shift:] + engines[:shift]:
            out = work / f"{engine}.json"
            command = [sys.executable, __file__, "--worker", engine, "--model", str(model)]
            command += ["--texts", str(texts_file), "--out", str(out)]
            command += _forwarded(args)
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT))
            subprocess.run(command, check=True, env=env, cwd=ROOT)
            run = json.loads(out.read_text())
            print(
                f"round {round_index + 1} {engine}: {args.num_inputs / run['wall_s']:.1f} "
                f"embeddings/s, {args.num_inputs / run['own_cpu_s']:.1f} per CPU s "
                f"(others used {run['other_cpu_s']:.1f} CPU s)",
                file=sys.stderr,
            )
            runs[engine].append(run)
    report(_summary(args, engines, runs), "benchmarks/features/embeddings.py", _json(args))


def _forwarded(args: argparse.Namespace) -> list[str]:
    names = ("batch_size", "dtype", "max_num_seqs", "max_num_batched_tokens", "threads")
    flags = [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in names]
    return [*flags, f"--idle-wait={args.idle_wait}"]


def _summary(
    args: argparse.Namespace, engines: list[str], runs: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    import numpy as np

    result: dict[str, Any] = {
        "workload": f"{args.num_inputs} texts of {args.min_len}-{args.max_len} tokens",
        "dtype": args.dtype,
        "threads": args.threads,
        "engines": {},
    }
    reference = runs[engines[0]][0]["vectors"]
    for engine in engines:
        walls = [r["wall_s"] for r in runs[engine]]
        wall = statistics.median(walls)
        own_cpu = statistics.median(r["own_cpu_s"] for r in runs[engine])
        vectors = runs[engine][0]["vectors"]
        cosines = [
            float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
            for a, b in zip(vectors, reference, strict=True)
        ]
        result["engines"][engine] = {
            "embeddings_per_s": round(args.num_inputs / wall, 2),
            "tokens_per_s": round(runs[engine][0]["num_tokens"] / wall),
            # Its own CPU time: what a busy machine disturbs least.
            "embeddings_per_cpu_s": round(args.num_inputs / own_cpu, 2),
            "wall_s": [round(w, 2) for w in walls],
            "others_cpu_s": [round(r["other_cpu_s"], 1) for r in runs[engine]],
            "loadavg_1m": [round(r["loadavg_1m"], 2) for r in runs[engine]],
            f"min_cosine_to_{engines[0]}": round(min(cosines), 5),
        }
    result["cpu"] = cpu_model()
    return result


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _json(args: argparse.Namespace) -> Path | None:
    return Path(args.json) if args.json else None


if __name__ == "__main__":
    main()
