"""``LLM.embed`` on tiny random-weight Qwen3 and Llama models equals transformers'
pooled final hidden states: last-token, mean and CLS pooling, alone and batched,
chunked over several steps, and from a prefix-cache hit; float32 within 1e-4,
bfloat16 with cosine >= 0.999. The models are built from transformers configs
and carry the default model's tokenizer."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.pooling.tiny_models import (
    CONFIGS,
    VOCAB,
    Reference,
    write_model,
    write_sentence_transformers,
)
from tokenloom import LLM
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.core_client import AsyncInprocClient
from tokenloom.pooling_params import PoolingParams
from tokenloom.request import Request

BLOCK = 16
LENGTHS = (5, 17, 40, 33, 64, 1)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: write_model(name, tmp_path_factory.mktemp(name)) for name in CONFIGS}


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path]) -> dict[str, Reference]:
    return {name: Reference(path, torch.float32) for name, path in model_dirs.items()}


def _llm(path: Path, pooling: str, budget: int, **kwargs: object) -> LLM:
    return LLM(
        str(path),
        runner="pooling",
        pooler_config={"pooling_type": pooling},
        dtype=kwargs.pop("dtype", "float32"),
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        block_size=BLOCK,
        num_blocks=64,
        log_stats=False,
        **kwargs,
    )


@pytest.fixture(scope="module", params=[(n, p) for n in CONFIGS for p in ("LAST", "MEAN", "CLS")])
def case(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Iterator[tuple]:
    """(model name, pooling, chunked engine with 16 tokens a step, unchunked engine)."""
    name, pooling = request.param
    chunked = _llm(model_dirs[name], pooling, budget=16)
    whole = _llm(model_dirs[name], pooling, budget=2048)
    yield name, pooling, chunked, whole


def _vectors(outputs: list) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outputs]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_embeddings_equal_transformers_alone_batched_and_chunked(
    case: tuple, references: dict[str, Reference]
) -> None:
    name, pooling, chunked, whole = case
    prompts = _prompts(1)
    expected = [references[name].embed(p, pooling) for p in prompts]
    for llm in (chunked, whole):
        batched = _vectors(llm.embed(prompts, use_tqdm=False))
        for got, want in zip(batched, expected, strict=True):
            assert got.shape == (64,)
            assert _max_diff(got, want) < 1e-4
        alone = _vectors(llm.embed(prompts[2], use_tqdm=False))[0]
        assert _max_diff(alone, expected[2]) < 1e-4


def test_a_prefix_cache_hit_gives_the_same_embedding(
    case: tuple, references: dict[str, Reference]
) -> None:
    name, pooling, chunked, _ = case
    base = _prompts(2)[4]  # 64 tokens: four full blocks
    longer = base + [7, 8, 9]
    first = chunked.embed([base], use_tqdm=False)[0]
    again, extended = chunked.embed([base, longer], use_tqdm=False)
    if pooling == "LAST":
        # The whole prompt is cached but for its last token, which is recomputed.
        assert again.num_cached_tokens == 48 and extended.num_cached_tokens == 64
    else:  # pooling reads every token: the cache is written, never read
        assert again.num_cached_tokens == 0 and extended.num_cached_tokens == 0
    reference = references[name]
    for output, ids in ((first, base), (again, base), (extended, longer)):
        vector = torch.tensor(output.outputs.embedding)
        assert _max_diff(vector, reference.embed(ids, pooling)) < 1e-4


def test_text_prompts_and_unnormalised_vectors(
    model_dirs: dict[str, Path], references: dict[str, Reference]
) -> None:
    llm = _llm(model_dirs["llama"], "MEAN", budget=8)
    ids = llm.get_tokenizer()("The capital of France is Paris.")["input_ids"]
    (output,) = llm.embed("The capital of France is Paris.", use_tqdm=False)
    assert output.prompt_token_ids == ids
    want = references["llama"].embed(ids, "MEAN")
    assert _max_diff(torch.tensor(output.outputs.embedding), want) < 1e-4
    (raw,) = llm.embed([ids], PoolingParams(normalize=False), use_tqdm=False)
    raw_want = references["llama"].embed(ids, "MEAN", normalize=False)
    assert _max_diff(torch.tensor(raw.outputs.embedding), raw_want) < 1e-4
    assert abs(float(raw_want.norm()) - 1.0) > 0.01  # so normalisation was really skipped


def test_matryoshka_dimensions_and_truncation(
    model_dirs: dict[str, Path], references: dict[str, Reference]
) -> None:
    llm = _llm(model_dirs["qwen3"], "LAST", budget=32, max_model_len=48)
    prompt = _prompts(3)[4]  # 64 tokens, over the 48-token context
    reference = references["qwen3"]
    (short,) = llm.embed([prompt[:20]], PoolingParams(dimensions=16), use_tqdm=False)
    full = reference.embed(prompt[:20], "LAST", normalize=False)
    want = torch.nn.functional.normalize(full[:16], dim=0)
    assert _max_diff(torch.tensor(short.outputs.embedding), want) < 1e-4
    with pytest.raises(ValueError, match="^prompt is 64 tokens, more than the maximum context"):
        llm.embed([prompt], use_tqdm=False)
    (cut,) = llm.embed([prompt], truncate_prompt_tokens=20, use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-20:]
    assert (
        _max_diff(torch.tensor(cut.outputs.embedding), reference.embed(prompt[-20:], "LAST")) < 1e-4
    )
    (context,) = llm.embed([prompt], truncate_prompt_tokens=-1, use_tqdm=False)
    assert context.prompt_token_ids == prompt[-48:]
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens \(49\) exceeds"):
        llm.embed([prompt], truncate_prompt_tokens=49, use_tqdm=False)
    # The engine stays usable after the refusals, and it does not generate.
    with pytest.raises(ValueError, match="^model: this engine runs the pooling runner"):
        llm.generate([prompt[:5]], use_tqdm=False)
    assert len(llm.embed([prompt[:3]], use_tqdm=False)[0].outputs.embedding) == 64


def test_dimensions_are_refused_where_the_model_is_not_matryoshka(
    model_dirs: dict[str, Path],
) -> None:
    llm = _llm(model_dirs["llama"], "LAST", budget=64)
    with pytest.raises(ValueError, match="^dimensions: model .* does not support Matryoshka"):
        llm.embed([[5, 6, 7]], PoolingParams(dimensions=8), use_tqdm=False)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_bfloat16_embeddings_match_transformers_in_bfloat16(
    model_dirs: dict[str, Path], pooling: str
) -> None:
    reference = Reference(model_dirs["qwen3"], torch.bfloat16)
    llm = _llm(model_dirs["qwen3"], pooling, budget=16, dtype="bfloat16")
    prompts = _prompts(4)
    for output, ids in zip(llm.embed(prompts, use_tqdm=False), prompts, strict=True):
        got = torch.tensor(output.outputs.embedding)
        cosine = torch.nn.functional.cosine_similarity(got, reference.embed(ids, pooling), dim=0)
        assert float(cosine) >= 0.999, (len(ids), float(cosine))


def test_sentence_transformers_files_choose_the_pooling(
    model_dirs: dict[str, Path], references: dict[str, Reference], tmp_path: Path
) -> None:
    """A copy of the Llama model with a Sentence-Transformers pipeline pooling by CLS,
    without normalisation: served as it says, with no --pooler-config."""
    st_dir = tmp_path / "st"
    st_dir.mkdir()
    for item in model_dirs["llama"].iterdir():
        (st_dir / item.name).symlink_to(item)
    write_sentence_transformers(st_dir, "cls_token", normalize=False)
    llm = LLM(str(st_dir), runner="pooling", dtype="float32", num_blocks=32, log_stats=False)
    prompt = _prompts(5)[3]
    (output,) = llm.embed([prompt], use_tqdm=False)
    want = references["llama"].embed(prompt, "CLS", normalize=False)
    assert _max_diff(torch.tensor(output.outputs.embedding), want) < 1e-4


async def test_async_encode_is_scheduled_under_its_tenant(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = EngineArgs(
        model=str(model_dirs["qwen3"]),
        runner="pooling",
        pooler_config={"pooling_type": "LAST"},
        dtype="float32",
        policy="fair",
        block_size=BLOCK,
        num_blocks=64,
        max_num_seqs=8,
        log_stats=False,
    )
    engine = AsyncLLM.from_engine_args(args, multiprocess=False)
    try:
        client = engine.client
        assert isinstance(client, AsyncInprocClient)
        scheduler = client._client.core.scheduler
        seen: list[tuple[str, str, float]] = []
        add = scheduler.add_request

        def record(request: Request) -> None:
            seen.append((request.request_id, request.tenant, request.tenant_weight))
            add(request)

        monkeypatch.setattr(scheduler, "add_request", record)
        stream = engine.encode([5, 6, 7], None, "e", tenant="team-a", tenant_weight=2.0)
        outputs = [output async for output in stream]
        assert outputs[-1].finished and len(outputs[-1].outputs.data) > 0
        assert seen == [("e", "team-a", 2.0)]
        with pytest.raises(ValueError, match="^tenant_weight must be a finite number > 0"):
            async for _ in engine.encode([5], None, "w", tenant_weight=-1.0):
                pass
    finally:
        engine.shutdown()
