"""/v1/embeddings on the real server (``--runner pooling``), driven by the official
``openai`` client: a tiny random-weight Qwen3 with a Sentence-Transformers
pipeline (last-token pooling, normalised), compared with transformers' pooled hidden
states, one input and a batch, float and base64, chunked (8 tokens a step),
from the prefix cache, and a 400 naming the field for bad inputs; and a tiny
random-weight Llama in bfloat16, pooled as ``--pooler-config`` says."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.pooling.tiny_models import VOCAB, Reference, write_model, write_sentence_transformers

from .server_utils import RemoteServer, metric_values

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_MODEL_LEN = 96
MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = write_model("qwen3", tmp_path_factory.mktemp("qwen3_st"))
    return write_sentence_transformers(out, "lasttoken", normalize=True)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("embed_server") / "server.log"
    args = [
        str(model_dir),
        "--runner", "pooling",
        "--served-model-name", MODEL,
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-batched-tokens", "8",
        "--num-blocks", "64",
    ]  # fmt: skip
    server = RemoteServer(args, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with server.openai_client(timeout=120) as c:
        yield c


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _close(got: list[float], want: torch.Tensor) -> bool:
    return float((torch.tensor(got) - want).abs().max()) < 1e-4


def test_text_input_equals_transformers(client: openai.OpenAI, reference: Reference) -> None:
    text = "Embeddings map text to vectors."
    result = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
    ids = reference_ids(text)
    assert result.model == MODEL and result.object == "list"
    assert len(result.data) == 1 and result.data[0].index == 0
    assert _close(result.data[0].embedding, reference.embed(ids, "LAST"))
    assert result.usage.prompt_tokens == len(ids) == result.usage.total_tokens


def reference_ids(text: str) -> list[int]:
    from tokenloom.default_model import default_model_path
    from tokenloom.model.tokenizer import load_tokenizer

    return list(load_tokenizer(default_model_path())(text)["input_ids"])


def test_a_batch_in_both_encodings(client: openai.OpenAI, reference: Reference) -> None:
    prompts = _prompts(0, (3, 30, 17, 90, 1))  # chunked: 8 tokens a step
    expected = [reference.embed(p, "LAST") for p in prompts]
    as_float = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    # The client's default: base64, decoded by the client.
    as_base64 = client.embeddings.create(model=MODEL, input=prompts)
    for result in (as_float, as_base64):
        assert [d.index for d in result.data] == list(range(len(prompts)))
        for data, want in zip(result.data, expected, strict=True):
            assert _close(data.embedding, want)
        assert result.usage.prompt_tokens == sum(map(len, prompts))


def test_a_prefix_cache_hit_equals_transformers(
    server: RemoteServer, client: openai.OpenAI, reference: Reference
) -> None:
    (prompt,) = _prompts(1, (64,))
    first = client.embeddings.create(model=MODEL, input=[prompt], encoding_format="float")
    hits = _prefix_cache_hits(server)
    again = client.embeddings.create(model=MODEL, input=[prompt + [7, 8]], encoding_format="float")
    assert _prefix_cache_hits(server) - hits == 64  # the first prompt's four blocks
    assert _close(first.data[0].embedding, reference.embed(prompt, "LAST"))
    assert _close(again.data[0].embedding, reference.embed(prompt + [7, 8], "LAST"))


def _prefix_cache_hits(server: RemoteServer) -> float:
    values = metric_values(server.url)
    return sum(v for k, v in values.items() if k.startswith("tokenloom:prefix_cache_hits_total"))


def test_truncation_and_matryoshka_dimensions(client: openai.OpenAI, reference: Reference) -> None:
    (prompt,) = _prompts(2, (120,))
    result = client.embeddings.create(
        model=MODEL,
        input=[prompt],
        dimensions=16,
        encoding_format="float",
        extra_body={"truncate_prompt_tokens": 40},
    )
    full = reference.embed(prompt[-40:], "LAST", normalize=False)
    assert _close(result.data[0].embedding, torch.nn.functional.normalize(full[:16], dim=0))
    assert result.usage.prompt_tokens == 40


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"input": [[1] * (MAX_MODEL_LEN + 1)]}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[VOCAB + 5]]}, "input"),
        ({"input": "a", "dimensions": 65}, "dimensions"),
        (
            {"input": "a", "extra_body": {"truncate_prompt_tokens": MAX_MODEL_LEN + 1}},
            "truncate_prompt_tokens",
        ),
        ({"input": "a", "model": "nope"}, "model"),
    ],
)
def test_bad_inputs_are_a_400_naming_the_field(
    client: openai.OpenAI, kwargs: dict, param: str
) -> None:
    kwargs = {"model": MODEL, "encoding_format": "float", **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(**kwargs)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_llama_in_bfloat16_with_a_pooler_config(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Last-token pooling of a Llama in bfloat16, as ``--pooler-config`` says,
    chunked (16 tokens a step), against transformers in bfloat16: cosine >= 0.999,
    one input, a batch, and from a prefix-cache hit."""
    model_dir = write_model("llama", tmp_path_factory.mktemp("llama"))
    args = [
        str(model_dir),
        "--runner", "pooling",
        "--pooler-config", json.dumps({"pooling_type": "LAST", "normalize": True}),
        "--served-model-name", MODEL,
        "--dtype", "bfloat16",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-batched-tokens", "16",
        "--num-blocks", "64",
    ]  # fmt: skip
    prompts = _prompts(3, (40, 5, 64, 17, 1))
    server = RemoteServer(args, tmp_path_factory.mktemp("llama_server") / "server.log")
    try:
        with server.openai_client(timeout=120) as client:
            single = client.embeddings.create(model=MODEL, input=[prompts[0]])
            batch = client.embeddings.create(model=MODEL, input=prompts)
            hits = _prefix_cache_hits(server)
            again = client.embeddings.create(model=MODEL, input=[prompts[2] + [7, 8]])
            assert _prefix_cache_hits(server) - hits == 64  # prompts[2]'s four blocks
    finally:
        server.stop()
    reference = Reference(model_dir, torch.bfloat16)
    got = [single.data[0].embedding, *(d.embedding for d in batch.data), again.data[0].embedding]
    for vector, ids in zip(got, [prompts[0], *prompts, prompts[2] + [7, 8]], strict=True):
        cosine = torch.nn.functional.cosine_similarity(
            torch.tensor(vector), reference.embed(ids, "LAST"), dim=0
        )
        assert float(cosine) >= 0.999, (len(ids), float(cosine))


def test_generation_routes_are_refused(server: RemoteServer) -> None:
    r = httpx.post(
        server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=60
    )
    assert r.status_code == 400
    assert "pooling runner" in r.json()["error"]["message"]
