"""Every GPU check of the CUDA backend, one section per invocation.

    python benchmarks/gpu/check.py SECTION --out DIR [--device cuda] [--small]

Sections (``check.sh`` runs them in this order, each in its own process):

- ``env``: the device, the copy bandwidth and the bf16 matrix roofline measured
  now; the floors and shares below divide by these.
- ``correctness``: random-weight Llama and Qwen3 models saved as Hugging Face
  checkpoints; in float32 tokenloom's greedy tokens must equal transformers'
  on the same device, over a mixed batch that takes chunked prefill, prefix
  hits and preemption; in bfloat16 the log-probabilities of the chosen tokens
  must match transformers' within bf16 tolerance.
- ``kernels``: one layer's attention by the Triton kernel, the torch path and
  PyTorch's FlexAttention, on decodes, a mixed batch and long prefills; one
  layer's norms, RoPE and SiLU-and-mul by the Triton layer ops and the torch path.
- ``decode``: batch-1 decode ms/token of the Llama-3.2-1B and Llama-3.1-8B
  shapes (``--load-format dummy``) in bf16, beside the floor of weight bytes
  read per token over the measured bandwidth: graphs with async scheduling (as
  vLLM users run it), graphs without it, eager with it; for each, where a
  step's time goes on the host (``step_clock.py``), and the device's own time
  per step (graph replay, LM head, kernels per step).
- ``workload``: 1,000 seeded requests (prompts 128-2,048, outputs 64-512 tokens)
  on both shapes, with ``--async-scheduling`` (``--no-async-scheduling``: without):
  output and total tok/s, the total as a share of the matrix roofline, and the
  GPU's idle share between kernels (torch profiler).
- ``hf``: transformers' static batches over a sample of the same workload, at a
  few batch sizes, for the best of them.

Results are appended to ``DIR/results.jsonl`` (one JSON object per measure).
With ``--small`` the models are tiny and the workload short: the CI runs the
``correctness``, ``kernels`` and ``decode`` sections on the CPU that way, in
Triton's interpreter.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Llama-3.2-1B and Llama-3.1-8B, from their config.json (max_position_embeddings
# trimmed: only the served context is tabled).
LLAMA_1B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    max_position_embeddings=8192,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
)
LLAMA_8B = dict(
    LLAMA_1B,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    head_dim=128,
    tie_word_embeddings=False,
)
SHAPES = {"llama-3.2-1b": LLAMA_1B, "llama-3.1-8b": LLAMA_8B}
# Model directories (config, tokenizer, the correctness checks' weights): not results.
MODELS = Path(tempfile.gettempdir()) / "tokenloom-gpu-check"
# --small: the same code over shapes the CPU runs in seconds.
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=32, vocab_size=49152
)


def shape_config(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    return dict(SHAPES[shape], **TINY) if args.small else SHAPES[shape]


def small_config(family: str, vocab_size: int, small: bool) -> dict[str, Any]:
    """A random-weight model of ``family`` (llama or qwen3) for the correctness checks."""
    size = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=32)
        if small
        else dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, head_dim=64)
    )
    common = dict(
        vocab_size=vocab_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
        **size,
    )
    if family == "qwen3":
        head_dim = 128 if not small else 32
        return dict(
            common,
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            head_dim=head_dim,
            tie_word_embeddings=False,
        )
    return dict(
        common, architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=True
    )


def write_model_dir(out: Path, config: dict[str, Any], tokenizer_dir: Path) -> Path:
    """config.json and the tokenizer's files (for ``--load-format dummy``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def random_hf_checkpoint(out: Path, config: dict[str, Any], tokenizer_dir: Path, seed: int):
    """Random weights of ``config`` saved by transformers (its own layout and names)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    write_model_dir(out, config, tokenizer_dir)
    torch.manual_seed(seed)
    hf_config = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return model.eval()


class Results:
    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "results.jsonl"

    def add(self, **record: Any) -> None:
        record["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        line = json.dumps(record)
        print("RESULT", line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------- env


def measure_bandwidth(device: str) -> float:
    """Bytes read plus written per second by a device-to-device copy of 2 GiB."""
    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - start)


def measure_matmul_flops(device: str) -> float:
    """FLOP/s of an 8192^3 bf16 matrix product on random data."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 10
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def section_env(args: argparse.Namespace, results: Results) -> None:
    import transformers
    import triton

    props = torch.cuda.get_device_properties(0)
    results.add(
        section="env",
        device=props.name,
        memory_gib=round(props.total_memory / 2**30, 1),
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        transformers=transformers.__version__,
        copy_bytes_per_s=measure_bandwidth(args.device),
        bf16_matmul_flops=measure_matmul_flops(args.device),
    )


def env_record(out: Path) -> dict[str, Any]:
    path = out / "results.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("section") == "env":
                return record
    return {}


# -------------------------------------------------------------- correctness


def mixed_prompts(vocab: int, seed: int, small: bool) -> list[list[int]]:
    """Prompts of many lengths, some sharing long prefixes (prefix-cache hits),
    enough of them to overflow a small cache (preemption)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40 if small else 300)]
    prompts = []
    for i in range(6 if small else 24):
        n = rng.choice([5, 17, 33, 64] if small else [7, 60, 250, 700])
        own = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(shared[: rng.randrange(16, len(shared))] + own if i % 2 else own)
    return prompts


def count_preemptions(llm) -> list[int]:
    """A counter of the engine's preemptions (the scheduler's own is reset by
    every stats report)."""
    scheduler = llm.client.core.scheduler
    preempt = scheduler._preempt
    count = [0]

    def counted(index: int) -> None:
        count[0] += 1
        preempt(index)

    scheduler._preempt = counted
    return count


def hf_greedy(model, prompts: list[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


def top2_gap(model, ids: list[int], device: str) -> float:
    """transformers' margin between its two best next-token logits after ``ids``."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def hf_token_logprobs(model, prompt: list[int], tokens: list[int], device: str) -> list[float]:
    """transformers' log-probability of each of ``tokens`` following ``prompt``."""
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0].tolist()


def section_correctness(args: argparse.Namespace, results: Results) -> None:
    from transformers import AutoModelForCausalLM

    from tokenloom import LLM, SamplingParams

    work = MODELS
    max_tokens = 20 if args.small else 24
    vocab = 256 if args.small else 49152
    failures = []
    for family in ("llama", "qwen3"):
        path = work / family
        config = small_config(family, vocab, args.small)
        random_hf_checkpoint(path, config, args.tokenizer, seed=len(family))
        prompts = mixed_prompts(vocab, seed=7, small=args.small)
        for dtype in ("float32", "bfloat16"):
            torch_dtype = getattr(torch, dtype)
            hf = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, attn_implementation="eager"
            ).to(args.device)
            llm = LLM(
                str(path),
                device=args.device,
                dtype=dtype,
                block_size=16,
                # Few blocks and a small token budget: chunked prefill, prefix
                # hits on blocks written by earlier requests, and preemption.
                num_blocks=12 if args.small else 160,
                max_num_batched_tokens=32 if args.small else 256,
                max_num_seqs=8,
                max_model_len=1024,
                log_stats=False,
                seed=0,
            )
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0
            )
            preemptions = count_preemptions(llm)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            ours = [list(o.outputs[0].token_ids) for o in outputs]
            record: dict[str, Any] = dict(
                section="correctness",
                model=family,
                dtype=dtype,
                prompts=len(prompts),
                plan=llm.client.core.runner.forward_plan.describe(),
                preemptions=preemptions[0],
                cached_tokens=sum(o.num_cached_tokens for o in outputs),
            )
            if dtype == "float32":
                reference = hf_greedy(hf, prompts, max_tokens, args.device)
                equal = sum(a == b for a, b in zip(ours, reference, strict=True))
                # A differing sequence passes only where it first differs at a tie:
                # transformers' two best logits there within float32 noise.
                gaps = [
                    top2_gap(hf, prompt + theirs[: first_difference(mine, theirs)], args.device)
                    for prompt, mine, theirs in zip(prompts, ours, reference, strict=True)
                    if mine != theirs
                ]
                record.update(greedy_equal=equal, tie_gaps=gaps, ok=all(gap < 1e-4 for gap in gaps))
            else:
                worst = 0.0
                for prompt, out in zip(prompts, outputs, strict=True):
                    completion = out.outputs[0]
                    mine = [
                        entry[token]
                        for token, entry in zip(
                            completion.token_ids, completion.logprobs or [], strict=True
                        )
                    ]
                    theirs = hf_token_logprobs(hf, prompt, list(completion.token_ids), args.device)
                    worst = max(worst, max(abs(a - b) for a, b in zip(mine, theirs, strict=True)))
                record.update(max_logprob_diff=worst, ok=worst < 0.15)
            results.add(**record)
            if not record["ok"]:
                failures.append(f"{family}/{dtype}")
            del llm, hf
            free_memory(args.device)
    if failures:
        raise SystemExit(f"correctness failed: {', '.join(failures)}")


# ------------------------------------------------------------------ kernels


def attention_batch(query_lens, seq_lens, heads, kv_heads, head_dim, device, block_size=16):
    """Inputs of one layer's attention: random q/k/v, a cache with every request's
    blocks shuffled over it, and the slots of the new tokens."""
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 1
    order = torch.randperm(num_blocks - 1) + 1
    table = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    slots, used = [], 0
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        table[i, : needed[i]] = order[used : used + needed[i]].to(torch.int32)
        used += needed[i]
        blocks = table[i].long()
        pos = torch.arange(s - q, s)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    t = sum(query_lens)
    dt = torch.bfloat16
    return dict(
        q=torch.randn(t, heads, head_dim, device=device, dtype=dt),
        k=torch.randn(t, kv_heads, head_dim, device=device, dtype=dt),
        v=torch.randn(t, kv_heads, head_dim, device=device, dtype=dt),
        k_cache=torch.randn(num_blocks, kv_heads, head_dim, block_size, device=device, dtype=dt),
        v_cache=torch.randn(num_blocks, kv_heads, block_size, head_dim, device=device, dtype=dt),
        table=table.to(device),
        slots=torch.cat(slots).to(device),
    )


def time_call(fn, device: str, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


def flex_attention_step(b, query_lens, seq_lens, device: str, block_size: int = 16):
    """PyTorch's FlexAttention over the batch of ``attention_batch`` ``b``: returns
    (one layer's attention, [T, H * D] as ``paged_attention``; the block mask's
    build time, s). Like the torch path it writes the step's K/V into the cache
    and gathers each request's blocks (here into one padded [B, Hkv, S, D]);
    queries are padded to [B, H, Q, D]. The block mask keeps each query's
    causal prefix and skips the padding; an engine builds it once per step for
    every layer, so its build is timed apart. Compiled on CUDA, as it is meant to
    run; eager (the reference implementation) elsewhere."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from tokenloom.model.attention import _gather_blocks, write_kv

    num, max_q = len(query_lens), max(query_lens)
    q_len = torch.tensor(query_lens, device=device)
    before = torch.tensor(seq_lens, device=device) - q_len  # cached keys before the chunk

    def causal_prefix(batch, head, q_idx, kv_idx):
        return (q_idx < q_len[batch]) & (kv_idx <= q_idx + before[batch])

    width = b["table"].shape[1] * block_size
    start = time.perf_counter()
    mask = create_block_mask(causal_prefix, num, None, max_q, width, device=device)
    sync(device)
    mask_s = time.perf_counter() - start
    # Each query's row in the padded [B * Q] (found once: a boolean mask would sync).
    rows = (torch.arange(max_q, device=device) < q_len[:, None]).flatten().nonzero()[:, 0]
    attend = torch.compile(flex_attention, dynamic=False) if device.startswith("cuda") else None
    q = b["q"]

    def run() -> torch.Tensor:
        write_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slots"])
        keys = _gather_blocks(b["k_cache"], b["table"], keys=True)
        values = _gather_blocks(b["v_cache"], b["table"], keys=False)
        padded = q.new_zeros(num * max_q, *q.shape[1:]).index_copy_(0, rows, q)
        padded = padded.view(num, max_q, *q.shape[1:]).transpose(1, 2)
        call = attend or flex_attention
        out = call(padded, keys, values, block_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(num * max_q, -1).index_select(0, rows)

    return run, mask_s


def section_kernels(args: argparse.Namespace, results: Results) -> None:
    """One layer's attention (1B shape: 32 query heads, 8 KV heads, head_dim 64)
    through the Triton kernel, the torch path (gathered blocks, SDPA) and PyTorch's
    FlexAttention (gathered blocks, a block mask)."""
    from tokenloom.model.attention import AttentionMetadata, paged_attention

    cases = {
        "decode 64 x 2048": ([1] * 64, [2048] * 64),
        "mixed: 4 chunks of 512 after 1024 cached + 64 decodes": (
            [512] * 4 + [1] * 64,
            [1536] * 4 + [1024] * 64,
        ),
        "prefill 2 x 2048": ([2048] * 2, [2048] * 2),
    }
    if args.small:
        cases = {"decode 4 x 40": ([1] * 4, [40] * 4), "mixed": ([20, 1], [40, 17])}
    for name, (query_lens, seq_lens) in cases.items():
        b = attention_batch(query_lens, seq_lens, 32, 8, 64, args.device)
        start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        kernel_meta = AttentionMetadata.for_kernel(
            start.to(args.device),
            torch.tensor(seq_lens, dtype=torch.int32, device=args.device),
            b["table"],
            b["slots"],
            16,
        )
        torch_meta = AttentionMetadata.build(query_lens, seq_lens, b["table"], b["slots"], 16)
        inputs = (b["q"], b["k"], b["v"], b["k_cache"], b["v_cache"])
        flex, mask_s = flex_attention_step(b, query_lens, seq_lens, args.device)
        run = {
            "triton": functools.partial(paged_attention, *inputs, kernel_meta),
            "torch": functools.partial(paged_attention, *inputs, torch_meta),
            "flex": flex,
        }
        reference = run["triton"]()
        diff = {k: (run[k]() - reference).abs().max().item() for k in ("torch", "flex")}
        # --small (the CPU, the kernel interpreted): only that every path runs.
        reps, warmup = (1, 0) if args.small else (20, 3)
        timings = {k: time_call(fn, args.device, reps, warmup) * 1e3 for k, fn in run.items()}
        kv_bytes = sum(seq_lens) * 8 * 64 * 2 * 2
        results.add(
            section="kernels",
            case=name,
            triton_ms=timings["triton"],
            torch_ms=timings["torch"],
            flex_ms=timings["flex"],
            flex_block_mask_ms=mask_s * 1e3,
            max_abs_diff=diff["torch"],
            flex_max_abs_diff=diff["flex"],
            triton_kv_read_bytes_per_s=kv_bytes / (timings["triton"] / 1e3),
        )
    layer_ops_timings(args, results)


def layer_ops_timings(args: argparse.Namespace, results: Results) -> None:
    """One layer's element-wise ops of the 8B shape in bf16 (hidden 4096, 32 + 8
    heads of 128, intermediate 14336) by the Triton kernels (``layer_ops=triton``)
    and the torch path (``layer_ops=torch``): each norm with its residual add,
    RoPE of Q and K, SiLU-and-mul."""
    shape = (64, 128, 4, 2, 32) if args.small else (4096, 14336, 32, 8, 128)
    reps, warmup = (1, 0) if args.small else (50, 5)
    for tokens in (1, 3) if args.small else (1, 64, 2048):
        with torch.inference_mode():
            timings = {
                op: [time_call(fn, args.device, reps, warmup) * 1e3 for fn in pair]
                for op, pair in layer_ops_calls(tokens, *shape, args.device).items()
            }
        # A layer runs two norms, one RoPE, one SiLU-and-mul.
        per_layer = [
            sum(t[i] * (2 if op == "add_rms_norm" else 1) for op, t in timings.items())
            for i in (0, 1)
        ]
        results.add(
            section="layer_ops",
            tokens=tokens,
            triton_ms={op: t[0] for op, t in timings.items()},
            torch_ms={op: t[1] for op, t in timings.items()},
            triton_layer_ms=per_layer[0],
            torch_layer_ms=per_layer[1],
        )


def layer_ops_calls(tokens, hidden, inter, heads, kv_heads, head_dim, device):
    """{op: (the Triton call, the torch path's)} over random bf16 inputs."""
    import torch.nn.functional as F

    from tokenloom.model.layers import RMSNorm, apply_rope
    from tokenloom.ops.cuda import layer_ops

    dt = torch.bfloat16
    norm = RMSNorm(hidden, 1e-5, dt).to(device)
    x = torch.randn(tokens, hidden, device=device, dtype=dt)
    residual = torch.randn(tokens, hidden, device=device, dtype=dt)
    qk_width = (heads + kv_heads) * head_dim
    qkv = torch.randn(tokens, qk_width + kv_heads * head_dim, device=device, dtype=dt)
    cos = torch.rand(tokens, head_dim // 2, device=device, dtype=dt)
    sin = torch.rand(tokens, head_dim // 2, device=device, dtype=dt)
    gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=dt)
    act = torch.empty(tokens, inter, device=device, dtype=dt)

    def torch_rope() -> torch.Tensor:
        qk = qkv[:, :qk_width].reshape(tokens, -1, head_dim)
        return apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1))

    def torch_silu() -> torch.Tensor:
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up

    return {
        "add_rms_norm": (
            lambda: layer_ops.add_rms_norm(x, residual, norm.weight, norm.eps),
            lambda: norm.add_and_norm(x, residual),
        ),
        "rotary_qk": (
            lambda: layer_ops.rotary_qk(qkv, cos, sin, heads, kv_heads, head_dim),
            torch_rope,
        ),
        "silu_and_mul": (lambda: layer_ops.silu_and_mul(act, gate_up), torch_silu),
    }


# ------------------------------------------------------------------- decode


def weight_bytes_per_token(config: dict[str, Any]) -> int:
    """bf16 bytes a decode step reads: every matrix but the embedding table
    (one row of it), which a tied model reads whole as its LM head."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv, d = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * i
    return 2 * (config["num_hidden_layers"] * layer + v * h)


def params(config: dict[str, Any]) -> int:
    untied = 0 if config["tie_word_embeddings"] else config["vocab_size"] * config["hidden_size"]
    return weight_bytes_per_token(config) // 2 + untied


def dummy_llm(args: argparse.Namespace, shape: str, **engine: Any):
    from tokenloom import LLM

    path = write_model_dir(MODELS / shape, shape_config(args, shape), args.tokenizer)
    return LLM(
        str(path),
        device=args.device,
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=4096,
        log_stats=False,
        **engine,
    )


def decode_ms_per_token(llm, prompt: list[int], steps: int) -> float:
    """Median of 3: (time of 1 + steps tokens - time of 1 token) / steps."""
    from tokenloom import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    run(8)  # warm-up
    times = sorted((run(steps + 1) - run(1)) / steps for _ in range(3))
    return times[1] * 1e3


def decode_phases(llm, prompt: list[int], steps: int) -> dict[str, float]:
    """Where a decode step's wall time goes on the host (``step_clock``): ms per
    step of each phase over a run of ``steps`` tokens."""
    from step_clock import clock_engine, per_step_ms

    from tokenloom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    with clock_engine(llm) as timer:
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - start
    return {name: round(ms, 4) for name, ms in per_step_ms(timer, wall).items()}


def decode_device_ms(llm, prompt: list[int], device: str) -> dict[str, float]:
    """The device's own time of a batch-1 decode step: the captured graph's replay
    alone, the LM head and argmax after it, and (torch profiler, over 32 tokens)
    kernels per step and the device's busy time per step."""
    from tokenloom import SamplingParams

    runner = llm.client.core.runner
    graphs = runner.decode_graphs
    hidden = graphs.outputs[1][:1]
    timings = {
        "replay_ms": time_call(graphs.replays[1], device, reps=50) * 1e3,
        "head_and_argmax_ms": time_call(
            lambda: runner.model.compute_logits(hidden).argmax(-1), device, reps=50
        )
        * 1e3,
    }
    tokens = 32
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    kernels, busy, span = gpu_timeline(lambda: llm.generate([prompt], params, use_tqdm=False))
    timings.update(
        kernels_per_step=kernels / tokens,
        busy_ms_per_step=busy / tokens / 1e3,
        span_ms_per_step=span / tokens / 1e3,
    )
    return timings


def section_decode(args: argparse.Namespace, results: Results) -> None:
    """Batch-1 decode of both shapes: CUDA graphs with and without async
    scheduling, and eager with it; the host's phases per step; and on CUDA the
    device's own time per step (``decode_device_ms``)."""
    env = env_record(args.out)
    bandwidth = env.get("copy_bytes_per_s")
    prompt = list(range(100, 228))
    steps = 8 if args.small else 256
    runs = ((False, True), (False, False), (True, True))  # (eager, async scheduling)
    for shape in args.shapes.split(","):
        weight_bytes = weight_bytes_per_token(shape_config(args, shape))
        floor_ms = weight_bytes / bandwidth * 1e3 if bandwidth else None
        for eager, async_scheduling in runs:
            llm = dummy_llm(
                args,
                shape,
                enforce_eager=eager,
                max_num_seqs=8,
                async_scheduling=async_scheduling,
            )
            ms = decode_ms_per_token(llm, prompt, steps)
            record: dict[str, Any] = dict(
                section="decode",
                model=shape,
                graphs=not eager,
                async_scheduling=async_scheduling,
                ms_per_token=ms,
                floor_ms=floor_ms,
                over_floor=ms / floor_ms if floor_ms else None,
                weight_bytes=weight_bytes,
                host_phases_ms=decode_phases(llm, prompt, steps),
            )
            if not eager and args.device.startswith("cuda"):
                record["device"] = decode_device_ms(llm, prompt, args.device)
            results.add(**record)
            del llm
            free_memory(args.device)


# ----------------------------------------------------------------- workload


def workload(num: int, seed: int, small: bool) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs, seeded."""
    rng = random.Random(seed)
    lo, hi, out_lo, out_hi = (16, 64, 4, 16) if small else (128, 2048, 64, 512)
    return [
        (
            [rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))],
            rng.randint(out_lo, out_hi),
        )
        for _ in range(num)
    ]


def gpu_timeline(run) -> tuple[int, float, float]:
    """(kernels, busy µs, span µs) of the device while ``run()`` runs under the
    torch profiler: busy is the union of the kernels' intervals, span the time
    from the first kernel's start to the last one's end."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA"
    )
    if not spans:
        return 0, 0.0, 0.0
    busy, cur_start, cur_end = 0.0, spans[0][0], spans[0][1]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return len(spans), busy, spans[-1][1] - spans[0][0]


def gpu_idle_share(llm, requests, sampling) -> float:
    """Share of wall time, between the first and last kernel of the profiled run,
    in which no kernel ran (the union of kernel intervals against the span)."""
    _, busy, span = gpu_timeline(
        lambda: llm.generate([p for p, _ in requests], sampling, use_tqdm=False)
    )
    return 1.0 - busy / span if span else float("nan")


def section_workload(args: argparse.Namespace, results: Results) -> None:
    from tokenloom import SamplingParams

    env = env_record(args.out)
    roofline = env.get("bf16_matmul_flops")
    requests = workload(args.num_requests, seed=0, small=args.small)
    sampling = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(n for _, n in requests)
    for shape in args.shapes.split(","):
        llm = dummy_llm(
            args,
            shape,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            gpu_memory_utilization=0.9,
            async_scheduling=args.async_scheduling,
        )
        start = time.perf_counter()
        llm.generate([p for p, _ in requests], sampling, use_tqdm=False)
        wall = time.perf_counter() - start
        total_tps = (prompt_tokens + output_tokens) / wall
        flops = 2 * params(shape_config(args, shape)) * total_tps
        idle = None
        if args.device.startswith("cuda"):
            idle = gpu_idle_share(llm, requests[:64], sampling[:64])
        results.add(
            section="workload",
            model=shape,
            async_scheduling=args.async_scheduling,
            requests=len(requests),
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            wall_s=wall,
            output_tok_s=output_tokens / wall,
            total_tok_s=total_tps,
            roofline_share=flops / roofline if roofline else None,
            gpu_idle_share_64_requests=idle,
        )
        del llm
        free_memory(args.device)


def section_hf(args: argparse.Namespace, results: Results) -> None:
    """transformers' generate over static batches (left-padded, every request
    run to the batch's longest output) of the workload's first requests."""
    from transformers import AutoConfig, AutoModelForCausalLM

    requests = workload(args.num_requests, seed=0, small=args.small)
    for shape in args.shapes.split(","):
        path = write_model_dir(MODELS / shape, shape_config(args, shape), args.tokenizer)
        config = AutoConfig.from_pretrained(path)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        best = None
        for batch in (2, 4) if args.small else args.hf_batches:
            chosen = requests[:batch]
            width = max(len(p) for p, _ in chosen)
            ids = torch.zeros(batch, width, dtype=torch.long)
            mask = torch.zeros(batch, width, dtype=torch.long)
            for row, (prompt, _) in enumerate(chosen):
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            new = max(n for _, n in chosen)
            sync(args.device)
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(
                    ids.to(args.device),
                    attention_mask=mask.to(args.device),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
            sync(args.device)
            wall = time.perf_counter() - start
            useful = sum(n for _, n in chosen)
            record = dict(
                section="hf",
                model=shape,
                batch=batch,
                wall_s=wall,
                output_tok_s=useful / wall,
                total_tok_s=(useful + sum(len(p) for p, _ in chosen)) / wall,
            )
            results.add(**record)
            if best is None or record["output_tok_s"] > best:
                best = record["output_tok_s"]
        results.add(section="hf_best", model=shape, output_tok_s=best)
        del model
        free_memory(args.device)


SECTIONS = {
    "env": section_env,
    "correctness": section_correctness,
    "kernels": section_kernels,
    "decode": section_decode,
    "workload": section_workload,
    "hf": section_hf,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("section", choices=list(SECTIONS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=Path(__file__).resolve().parents[2] / ".gpu" / "tokenizer",
        help="a directory with the default model's tokenizer files",
    )
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument(
        "--hf-batches",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[32, 128],
        help="the hf section's static batch sizes",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the workload section's engine schedules each step while the GPU runs the last",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    SECTIONS[args.section](args, Results(args.out))
    print(f"{args.section}: {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
