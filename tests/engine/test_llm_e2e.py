"""LLM end to end on the default model: batching, n, chat, stop strings, bad input."""

from __future__ import annotations

from typing import Any

import pytest

from tokenloom import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def assert_engine_idle(llm: Any) -> None:
    """No request left in the core and no KV block held (cached blocks are free)."""
    scheduler = llm.client.core.scheduler
    assert not scheduler.requests and not scheduler.running and len(scheduler.waiting) == 0
    assert scheduler.kv_cache_manager.usage == 0.0


def test_prompt_forms_in_order_and_batch_matches_single(llm: Any) -> None:
    tokenizer = llm.get_tokenizer()
    france_ids = tokenizer.encode("The capital of France is")
    prompts: list[Any] = ["Hello, my name is", france_ids, "1, 2, 3, 4,"]
    batch = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in batch] == ["Hello, my name is", None, "1, 2, 3, 4,"]
    assert batch[1].prompt_token_ids == france_ids
    assert batch[0].prompt_token_ids == tokenizer.encode("Hello, my name is")
    for output in batch:
        completion = output.outputs[0]
        assert len(completion.token_ids) == 6 or completion.finish_reason == "stop"
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    for prompt, output in zip(prompts[:2], batch[:2], strict=True):
        (single,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == single.outputs[0].token_ids
    # A list of token-id lists is a batch too.
    by_ids = llm.generate([france_ids, france_ids], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_ids] == [batch[1].outputs[0].token_ids] * 2
    assert_engine_idle(llm)


def test_n_completions_and_per_prompt_params(llm: Any) -> None:
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)
    (first,) = llm.generate("Once upon a time", params, use_tqdm=False)
    assert [c.index for c in first.outputs] == [0, 1]
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in first.outputs)
    (again,) = llm.generate("Once upon a time", params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]

    outs = llm.generate(
        ["a", "b"],
        [
            SamplingParams(max_tokens=1, ignore_eos=True),
            SamplingParams(max_tokens=3, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3]
    assert_engine_idle(llm)


def test_chat_applies_template(llm: Any) -> None:
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = llm.chat(conversation, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert out.prompt.startswith("<|im_start|>") and out.prompt.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?" in out.prompt
    assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)
    assert out.outputs[0].text.strip()
    two = llm.chat([conversation, conversation], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(two) == 2
    assert_engine_idle(llm)


def test_chat_options_as_vllm(llm: Any) -> None:
    conversation = [{"role": "user", "content": "Name a colour."}]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    template = "{{ prefix }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (out,) = llm.chat(
        conversation,
        params,
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"prefix": "Q: "},
    )
    assert out.prompt == "Q: <user>Name a colour."
    continued = [*conversation, {"role": "assistant", "content": "My favourite is"}]
    (out,) = llm.chat(
        continued, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert out.prompt.endswith("<|im_start|>assistant\nMy favourite is")
    (out,) = llm.chat(conversation, params, use_tqdm=False, add_generation_prompt=False)
    assert out.prompt.endswith("Name a colour.<|im_end|>\n")
    assert_engine_idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"chat_template": "{% for %}"}, "chat_template"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "\udc80"}]}, "messages"),
        ({"messages": [{"role": "user", "content": ["parts"]}]}, "messages"),
    ],
)
def test_chat_errors_name_the_field(llm: Any, kwargs: dict[str, Any], field: str) -> None:
    messages = kwargs.pop("messages", [{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, **kwargs)
    assert_engine_idle(llm)


def test_stop_string_ends_request_and_frees_blocks_at_once(llm: Any) -> None:
    prompt = "Write a long story about a dragon."
    free_run = llm.generate(
        prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    words = free_run.text.split()
    assert len(words) >= 3, free_run.text
    stop = words[2]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, stop=[stop])
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert free_run.text.startswith(completion.text) and stop not in completion.text
    assert len(completion.token_ids) < 200
    # The core aborted it before another step: nothing runs, no block is held.
    assert_engine_idle(llm)


def test_logprobs(llm: Any) -> None:
    (out,) = llm.generate("Hi", SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True))
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 3
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in entry and 2 <= len(entry) <= 3
        assert all(lp <= 0.0 for lp in entry.values())


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        (["fine", ""], None, "empty"),
        ([[1, 10**7]], None, "vocabulary"),
        ([[1] * 512], None, "context length"),
        ("Hi", SamplingParams(max_tokens=600), "max_tokens"),
        (["a", "b"], [SamplingParams()], "2 prompts"),
        ([3.5], None, "prompts must be"),
        (["fine", "bad \udcff"], None, "^prompt contains a lone surrogate"),
        ("Hi", SamplingParams(max_tokens=2, logprobs=21), r"^logprobs .*\b20\b"),
    ],
)
def test_invalid_input_raises_and_engine_keeps_working(
    llm: Any, prompts: Any, params: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_engine_idle(llm)
    (out,) = llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
