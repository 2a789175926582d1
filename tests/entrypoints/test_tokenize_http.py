"""/tokenize and /detokenize against the fake engine (one token per character)."""

from __future__ import annotations

import httpx
import pytest

from .fake_engine import FakeAsyncLLM
from .test_app_fake_engine import assert_error


async def test_tokenize_a_prompt(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "count": 5,
        "max_model_len": 64,
        "tokens": [ord(c) for c in "héllo"],
        "token_strs": list("héllo"),
    }
    r = await client.post("/tokenize", json={"prompt": "ab", "model": "fake-model"})
    assert r.json()["token_strs"] is None and r.json()["tokens"] == [97, 98]


async def test_tokenize_a_chat_as_the_chat_endpoint_renders_it(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = await client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    text = "user: hi\nassistant:"
    assert r.json()["tokens"] == [ord(c) for c in text] and r.json()["count"] == len(text)
    r = await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert r.json()["count"] == len("user: hi\n")
    tools = [{"type": "function", "function": {"name": "f"}}]
    await client.post("/tokenize", json={"messages": messages, "tools": tools})
    assert engine.chat_options[-1].tools == tools


async def test_detokenize(client: httpx.AsyncClient) -> None:
    r = await client.post("/detokenize", json={"tokens": [104, 105]})
    assert r.status_code == 200 and r.json() == {"prompt": "hi"}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                       "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                       "chat_template": "{{ 1 }}"}, "chat_template"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [2**70]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens[0]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)  # fmt: skip
async def test_bad_input_is_400_naming_the_field(
    client: httpx.AsyncClient, route: str, body: dict[str, object], param: str
) -> None:
    assert_error(await client.post(route, json=body), 400, param)


async def test_openapi_documents_both(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    body = spec["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]
    assert len(body["schema"]["anyOf"]) == 2
    assert "/detokenize" in spec["paths"]
    assert "return_token_strs" in spec["components"]["schemas"]["TokenizeChatRequest"]["properties"]
