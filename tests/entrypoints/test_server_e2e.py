"""The real server over HTTP, driven by the official ``openai`` client and httpx.

One server (default model, small context) serves the whole module; requests
are short so the module stays quick on two CPU cores.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from .server_utils import RemoteServer, metric_values, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", "256", "--max-num-seqs", "8"]
    server = RemoteServer(args, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with server.openai_client(timeout=120) as c:
        yield c


def post(server: RemoteServer, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------ basics


def test_models_health_version(server: RemoteServer, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/version", timeout=10).json()["version"]


def test_completion(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert result.id.startswith("cmpl-")
    choice = result.choices[0]
    assert choice.text.strip()
    assert choice.finish_reason in ("stop", "length")
    assert result.usage is not None
    assert result.usage.prompt_tokens > 0
    assert 0 < result.usage.completion_tokens <= 5
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_chat(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=6, temperature=0
    )
    assert result.id.startswith("chatcmpl-")
    message = result.choices[0].message
    assert message.role == "assistant" and message.content
    assert result.usage is not None and result.usage.completion_tokens <= 6


def test_streamed_and_plain_greedy_completions_agree(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert plain.usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_chat_stream_role_first_then_content(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert not chunks[0].choices[0].delta.content
    text = "".join(c.choices[0].delta.content or "" for c in chunks[1:])
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_raw_sse_framing_ends_with_done(server: RemoteServer) -> None:
    body = {"messages": CHAT, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][len("data: ") :])["choices"][0]["delta"]["role"] == "assistant"


def test_n2_gives_two_indexed_choices(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, n=2, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert all(c.text for c in result.choices)
    assert result.usage is not None
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, n=2, temperature=1.0
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_string_cuts_the_output(client: openai.OpenAI) -> None:
    prompt = "Count: 1, 2, 3,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    text = full.choices[0].text
    assert len(text) > 4, text
    stop = text[2:4]  # a stop string somewhere inside the greedy output
    expected = text[: text.index(stop)]
    cut = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        result = client.completions.create(
            model=MODEL, prompt="My favourite word is", max_tokens=6, temperature=1.0, seed=seed
        )
        return result.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    )
    assert result.choices[0].text.startswith(PROMPT)
    assert len(result.choices[0].text) > len(PROMPT)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and result.usage is not None
    n = result.usage.completion_tokens
    assert len(logprobs.tokens or []) == len(logprobs.token_logprobs or []) == n
    assert len(logprobs.top_logprobs or []) == len(logprobs.text_offset or []) == n
    assert "".join(logprobs.tokens or []) == result.choices[0].text
    for token_logprob, top in zip(
        logprobs.token_logprobs or [], logprobs.top_logprobs or [], strict=True
    ):
        assert token_logprob is not None and token_logprob <= 0
        assert 1 <= len(top) <= 2
        # Greedy: the sampled token is the most likely one.
        assert token_logprob == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and result.usage is not None
    assert len(logprobs.content) == result.usage.completion_tokens
    for entry in logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"model": "no-such-model"}, "model"),
        ({"stop": 17}, "stop"),
        ({"prompt": "word " * (MAX_MODEL_LEN + 10)}, "prompt"),
        ({"max_tokens": MAX_MODEL_LEN}, "prompt"),
    ],
)
def test_bad_completion_requests_are_400(
    server: RemoteServer, patch: dict[str, object], param: str
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **patch}
    r = post(server, "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["message"]


def test_invalid_json_is_400(server: RemoteServer) -> None:
    r = post(server, "/v1/chat/completions", content=b'{"messages": [', headers={})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, top_p=2)
    assert "top_p" in str(info.value)
    # The server is unharmed by the bad request.
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert ok.choices[0].message.content is not None


# ------------------------------------------------------------------ metrics and disconnects


def test_metrics_parse_and_counters_move(server: RemoteServer, client: openai.OpenAI) -> None:
    before = metric_values(server.url)
    assert "tokenloom:num_requests_running{}" in before
    assert "tokenloom:kv_cache_usage_perc{}" in before
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.usage is not None and result.usage.completion_tokens == 3

    def moved() -> dict[str, float] | None:
        after = metric_values(server.url)
        done = after["tokenloom:request_success_total{finished_reason=length}"]
        return (
            after
            if done > before["tokenloom:request_success_total{finished_reason=length}"]
            else None
        )

    after = wait_until(moved, 10, "request_success_total to count the request")
    gen = "tokenloom:generation_tokens_total{}"
    assert after[gen] - before[gen] == 3
    assert after["tokenloom:prompt_tokens_total{}"] > before["tokenloom:prompt_tokens_total{}"]
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds"):
        key = f"tokenloom:{histogram}_count{{}}"
        assert after[key] == before[key] + 1
    prompt_tokens = "tokenloom:request_prompt_tokens_sum{}"
    assert after[prompt_tokens] - before[prompt_tokens] == result.usage.prompt_tokens


def _idle(url: str) -> bool:
    values = metric_values(url)
    return (
        values["tokenloom:num_requests_running{}"] == 0
        and values["tokenloom:num_requests_waiting{}"] == 0
        and values["tokenloom:kv_cache_usage_perc{}"] == 0
    )


def test_client_disconnect_mid_stream_aborts(server: RemoteServer) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in received), "no tokens streamed"
        busy = metric_values(server.url)
        assert busy["tokenloom:num_requests_running{}"] == 1
        assert busy["tokenloom:kv_cache_usage_perc{}"] > 0
    # Leaving the block closed the connection mid-generation.
    wait_until(lambda: _idle(server.url), 30, "running=0 and KV usage=0 after the disconnect")


def test_client_disconnect_without_streaming_aborts(server: RemoteServer) -> None:
    # The client must leave while the request still runs: 480 tokens take about
    # 3.5 s at the quantized default model's batch-1 speed (7 ms/token), so it
    # leaves after 1 s (with 400 tokens and 3 s, the request sometimes finished).
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(1.0))
    wait_until(lambda: _idle(server.url), 30, "running=0 and KV usage=0 after the disconnect")


# ------------------------------------------------------------------ hostile requests

_CHAT_BODY = '"messages": [{"role": "user", "content": "hi"}]'
_PROMPT_BODY = '"prompt": "hi"'


# ------------------------------------------------------------------ tokenization


def test_tokenize_counts_what_generation_counts(
    server: RemoteServer, client: openai.OpenAI, default_model_path: Path
) -> None:
    from tokenloom.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path)
    r = post(
        server, "/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(PROMPT)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert completion.usage is not None and completion.usage.prompt_tokens == body["count"]

    r = post(server, "/tokenize", json={"messages": CHAT})
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and r.json()["count"] == chat.usage.prompt_tokens

    r = post(server, "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT}
    r = post(server, "/detokenize", json={"tokens": [len(tokenizer)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(
    ("path", "raw", "status", "param"),
    [
        ("/v1/completions", f'{_PROMPT_BODY}, "seed": {2**64}', 400, "seed"),
        ("/v1/chat/completions", f'{_CHAT_BODY}, "temperature": NaN', 400, "temperature"),
        ("/v1/completions", f'{_PROMPT_BODY}, "top_p": Infinity', 400, "top_p"),
        ("/v1/completions", '"prompt": "a\\ud800"', 400, "prompt"),
        ("/v1/completions", f'{_PROMPT_BODY}, "stop": {"[" * 100 + "]" * 100}', 400, "stop"),
        ("/v1/completions", f'{_PROMPT_BODY}, "stop": {"[" * 5000 + "]" * 5000}', 400, None),
        ("/v1/completions", f'{_PROMPT_BODY}, "logprobs": 100', 400, "logprobs"),
        (
            "/v1/chat/completions",
            f'{_CHAT_BODY}, "logprobs": true, "top_logprobs": 1000',
            400,
            "top_logprobs",
        ),
        ("/v1/completions", f'{_PROMPT_BODY}, "n": 100000', 400, "n"),
        (
            "/v1/chat/completions",
            '"messages": [{"role": "wizard", "content": "x"}]',
            400,
            "messages[0].role",
        ),
        ("/v1/completions", '"prompt": [1, 1000000000000000000000000000000]', 400, "prompt"),
    ],
)
def test_hostile_requests_get_4xx_and_the_server_goes_on(
    server: RemoteServer, path: str, raw: str, status: int, param: str | None
) -> None:
    body = f'{{"model": "{MODEL}", "max_tokens": 2, {raw}}}'.encode()
    r = post(server, path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"]
    assert error["param"] == param, error
    ok = post(server, "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_oversized_body_is_413(server: RemoteServer) -> None:
    body = b'{"prompt": "' + b"x" * (16 * 2**20) + b'"}'  # just over the default 16 MiB
    r = post(server, "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == 413
    ok = post(server, "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_openapi_declares_the_request_bodies(server: RemoteServer) -> None:
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert model in schema["components"]["schemas"]


def test_server_log_has_no_traceback(server: RemoteServer) -> None:
    # The server wrote no traceback while serving everything above.
    assert "Traceback" not in server.log_tail(10**6)
