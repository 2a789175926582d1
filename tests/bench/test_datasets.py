"""Workload generators: reproducible for a seed, lengths in range, token ids valid."""

from __future__ import annotations

import json

import pytest

from tokenloom.bench.datasets import (
    BenchRequest,
    LengthSpec,
    jsonl_requests,
    load_workload,
    random_requests,
    save_workload,
    shared_prefix_requests,
    usable_token_ids,
)

SPECIAL = [0, 1, 2]
VOCAB = usable_token_ids(1000, SPECIAL)


def test_usable_token_ids_excludes_specials():
    assert len(VOCAB) == 997
    assert not set(SPECIAL) & set(VOCAB)
    assert min(VOCAB) == 3 and max(VOCAB) == 999


def test_random_requests_are_reproducible_and_valid():
    spec_in, spec_out = LengthSpec("log-uniform", 32, 512), LengthSpec("uniform", 16, 256)
    a = random_requests(200, spec_in, spec_out, VOCAB, seed=7)
    b = random_requests(200, spec_in, spec_out, VOCAB, seed=7)
    c = random_requests(200, spec_in, spec_out, VOCAB, seed=8)
    assert a == b
    assert a != c
    for r in a:
        assert 32 <= r.prompt_len <= 512
        assert 16 <= r.max_tokens <= 256
        assert all(3 <= t < 1000 for t in r.prompt_token_ids)


def test_log_uniform_favours_short_lengths():
    spec = LengthSpec("log-uniform", 32, 512)
    reqs = random_requests(2000, spec, LengthSpec("fixed", 1, 1), VOCAB, seed=0)
    lens = sorted(r.prompt_len for r in reqs)
    median = lens[len(lens) // 2]
    # Geometric midpoint of [32, 513) is ~128; uniform would give ~272.
    assert 100 < median < 160
    assert lens[0] < 40 and lens[-1] > 450


def test_fixed_and_ratio_specs():
    assert LengthSpec.from_ratio(100, 0.0) == LengthSpec("fixed", 100, 100)
    spec = LengthSpec.from_ratio(100, 0.5)
    assert (spec.low, spec.high) == (50, 150)
    reqs = random_requests(50, LengthSpec("fixed", 64, 64), spec, VOCAB, seed=1)
    assert all(r.prompt_len == 64 and 50 <= r.max_tokens <= 150 for r in reqs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dist="normal", low=1, high=2),
        dict(dist="uniform", low=0, high=2),
        dict(dist="uniform", low=5, high=2),
    ],
)
def test_bad_length_spec_names_the_field(kwargs):
    with pytest.raises(ValueError, match="dist|low|high"):
        LengthSpec(**kwargs)


def test_shared_prefix_requests():
    reqs = shared_prefix_requests(16, 400, 8, 64, VOCAB, seed=3)
    assert len(reqs) == 16
    prefix = reqs[0].prompt_token_ids[:400]
    suffixes = {tuple(r.prompt_token_ids[400:]) for r in reqs}
    assert all(r.prompt_token_ids[:400] == prefix and r.prompt_len == 408 for r in reqs)
    assert len(suffixes) == 16  # unique suffixes
    assert all(r.max_tokens == 64 for r in reqs)
    assert reqs == shared_prefix_requests(16, 400, 8, 64, VOCAB, seed=3)


def test_jsonl_requests(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "hello world", "max_tokens": 5}, {"prompt": [5, 6, 7]}, {"prompt": "x"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = jsonl_requests(path, lambda s: [ord(c) for c in s], default_max_tokens=9)
    assert reqs[0] == BenchRequest([ord(c) for c in "hello world"], 5, prompt="hello world")
    assert reqs[1] == BenchRequest([5, 6, 7], 9)
    assert len(jsonl_requests(path, lambda s: [1], num_requests=2)) == 2


def test_jsonl_rejects_rows_without_prompt(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        jsonl_requests(path, lambda s: [1])


def test_workload_round_trip(tmp_path):
    reqs = random_requests(5, LengthSpec("uniform", 3, 9), LengthSpec("fixed", 4, 4), VOCAB, seed=2)
    save_workload(reqs, tmp_path / "w.json")
    assert load_workload(tmp_path / "w.json") == reqs


def test_token_ids_valid_for_real_tokenizer_vocab():
    # A vocabulary built from a tokenizer-like object: specials and added tokens excluded.
    from tokenloom.bench.datasets import tokenizer_vocab

    class Tok:
        all_special_ids = [0, 1]
        added_tokens_decoder = {5: "<|x|>"}

        def __len__(self) -> int:
            return 10

    assert tokenizer_vocab(Tok()) == [2, 3, 4, 6, 7, 8, 9]


def test_load_tokenizer_is_the_engines(default_model_path):
    # The default model's tokenizer with the engine's GGUF fix-ups (EOS <|im_end|>).
    from tokenloom.bench.datasets import load_tokenizer
    from tokenloom.model.tokenizer import load_tokenizer as engine_tokenizer

    tokenizer = load_tokenizer(None)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert (
        load_tokenizer(str(default_model_path)).vocab == engine_tokenizer(default_model_path).vocab
    )
