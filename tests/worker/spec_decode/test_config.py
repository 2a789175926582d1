"""SpeculativeConfig: vLLM's keys, validated at construction, errors naming the key."""

import pytest

from tokenloom.config import SpeculativeConfig


def test_ngram_from_vllm_dict() -> None:
    config = SpeculativeConfig.from_dict(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 5,
        }
    )
    assert (config.method, config.num_speculative_tokens) == ("ngram", 4)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 5)
    assert config.model is None and config.disable_by_batch_size is None


def test_method_inferred_and_bounds_defaulted() -> None:
    draft = SpeculativeConfig.from_json('{"model": "/models/draft", "num_speculative_tokens": 3}')
    assert draft.method == "draft_model" and draft.model == "/models/draft"
    assert (
        SpeculativeConfig.from_dict({"model": "ngram", "num_speculative_tokens": 2}).method
        == "ngram"
    )
    only_max = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1}
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (1, 1)
    only_min = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 7}
    )
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (7, 7)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 1}, "lookahead"),
        ({"method": "eagle", "num_speculative_tokens": 4}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
            "prompt_lookup_max",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "model"),
        ({"num_speculative_tokens": 2}, "method"),
    ],
)
def test_invalid_configs_name_the_key(config: dict, key: str) -> None:
    with pytest.raises(ValueError, match=rf"speculative_config\.{key}\b"):
        SpeculativeConfig.from_dict(config)


def test_not_a_dict_or_bad_json() -> None:
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_dict(["ngram"])
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_json("{method: ngram}")


def test_engine_args_and_cli_flag_reach_the_scheduler_config() -> None:
    import argparse
    import json

    from tokenloom.engine.args import EngineArgs

    config = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--speculative-config", json.dumps(config)]))
    spec = args.config.scheduler_config.speculative_config
    assert spec == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, disable_by_batch_size=8
    )
    assert EngineArgs(speculative_config=config).config.scheduler_config.speculative_config == spec
    assert EngineArgs().config.scheduler_config.speculative_config is None


def test_engine_args_refuse_bad_configs_at_start_up(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tokenloom.engine.args import EngineArgs

    with pytest.raises(ValueError, match=r"speculative_config\.model: .*does not exist"):
        EngineArgs(
            speculative_config={
                "method": "draft_model",
                "model": str(tmp_path / "missing"),
                "num_speculative_tokens": 2,
            }
        )
    with pytest.raises(ValueError, match=r"speculative_config\.prompt_lookup_max"):
        EngineArgs(
            speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}'
        )
