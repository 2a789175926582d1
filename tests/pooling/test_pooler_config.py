"""``--pooler-config`` (vLLM's keys) and the Sentence-Transformers files of a model
directory, completed into one ``PoolerConfig``; requests' parameters completed
and checked against it. No model, no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.pooling.tiny_models import HIDDEN, write_sentence_transformers
from tokenloom.engine.args import EngineArgs
from tokenloom.pooling.config import PoolerConfig, resolve_pooler_config
from tokenloom.pooling_params import PoolingParams


def st_model(root: Path, mode: str | None, *, normalize: bool, extra: dict | None = None) -> Path:
    """A model directory (a config.json only) with Sentence-Transformers files."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(extra or {}))
    return write_sentence_transformers(root, mode, normalize=normalize)


@pytest.mark.parametrize(
    ("mode", "normalize", "expected"),
    [("lasttoken", True, "LAST"), ("mean_tokens", False, "MEAN"), ("cls_token", True, "CLS")],
)
def test_sentence_transformers_files_set_pooling(
    tmp_path: Path, mode: str, normalize: bool, expected: str
) -> None:
    config = resolve_pooler_config(None, st_model(tmp_path, mode, normalize=normalize), HIDDEN)
    assert (config.pooling_type, config.normalize) == (expected, normalize)
    assert "Sentence-Transformers" in config.source
    assert config.pools_every_token == (expected != "LAST")


def test_user_keys_win_over_the_model_files(tmp_path: Path) -> None:
    model = st_model(tmp_path, "mean_tokens", normalize=True)
    user = PoolerConfig.parse('{"pooling_type": "last", "normalize": false}')
    config = resolve_pooler_config(user, model, HIDDEN)
    assert (config.pooling_type, config.normalize) == ("LAST", False)
    # Newer vLLM's names for the same keys.
    user = PoolerConfig.parse({"seq_pooling_type": "CLS", "use_activation": False, "task": "embed"})
    assert (user.pooling_type, user.normalize) == ("CLS", False)


def test_defaults_without_model_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = resolve_pooler_config(None, tmp_path, HIDDEN)
    assert (config.pooling_type, config.normalize, config.source) == ("LAST", True, "defaults")
    assert not config.is_matryoshka


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"pooling_type": "MAX"}', "pooler_config.pooling_type must be one of LAST, MEAN, CLS"),
        ('{"normalise": true}', "pooler_config.normalise is not a supported key"),
        ('{"normalize": "yes"}', "pooler_config.normalize must be a boolean"),
        ('{"dimensions": 0}', "pooler_config.dimensions must be an integer >= 1"),
        ('{"task": "classify"}', "pooler_config.task must be 'embed'"),
        ('{"pooling_type": "LAST", "seq_pooling_type": "MEAN"}', "not both"),
        ("[1]", "pooler_config must be a dict"),
        ("{oops", "pooler_config is not valid JSON"),
    ],
)
def test_bad_pooler_config_names_the_key(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PoolerConfig.parse(value)


def test_pooler_config_flag_needs_the_pooling_runner() -> None:
    with pytest.raises(ValueError, match="pooler_config needs runner='pooling'"):
        EngineArgs(pooler_config='{"pooling_type": "MEAN"}')
    with pytest.raises(ValueError, match="speculative_config: the pooling runner never decodes"):
        EngineArgs(
            runner="pooling",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineArgs(runner="embed")
    args = EngineArgs(runner="pooling", pooler_config='{"pooling_type": "MEAN"}')
    assert args.config.model_config.pooler_config == PoolerConfig(
        pooling_type="MEAN", source="--pooler-config"
    )


@pytest.mark.parametrize(
    "modules",
    [
        [{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}],
    ],
)
def test_unsupported_sentence_transformers_modules_are_refused(
    tmp_path: Path, modules: list[dict]
) -> None:
    model = st_model(tmp_path, "lasttoken", normalize=False)
    listed = json.loads((model / "modules.json").read_text()) + modules
    (model / "modules.json").write_text(json.dumps(listed))
    with pytest.raises(ValueError, match="sentence_transformers.models.Dense' is not supported"):
        resolve_pooler_config(None, model, HIDDEN)


def test_unsupported_pooling_modes_are_refused(tmp_path: Path) -> None:
    model = st_model(tmp_path, "max_tokens", normalize=False)
    with pytest.raises(ValueError, match="sets pooling_mode_max_tokens"):
        resolve_pooler_config(None, model, HIDDEN)


def test_request_params_take_the_config_defaults_and_check_dimensions(tmp_path: Path) -> None:
    plain = resolve_pooler_config(
        None, st_model(tmp_path / "a", "mean_tokens", normalize=False), HIDDEN
    )
    params = plain.request_params(None, "m")
    assert params == PoolingParams(normalize=False, skip_reading_prefix_cache=True)
    assert plain.request_params(PoolingParams(normalize=True), "m").normalize is True
    with pytest.raises(ValueError, match="^dimensions: model 'm' does not support Matryoshka"):
        plain.request_params(PoolingParams(dimensions=8), "m")

    any_size = resolve_pooler_config(
        None,
        st_model(tmp_path / "b", "lasttoken", normalize=True, extra={"is_matryoshka": True}),
        HIDDEN,
    )
    assert any_size.request_params(PoolingParams(dimensions=8), "m").dimensions == 8
    with pytest.raises(ValueError, match=r"^dimensions \(65\) exceeds the model's embedding size"):
        any_size.request_params(PoolingParams(dimensions=65), "m")

    listed = resolve_pooler_config(
        PoolerConfig(dimensions=16),
        st_model(
            tmp_path / "c", "lasttoken", normalize=True, extra={"matryoshka_dimensions": [16, 32]}
        ),
        HIDDEN,
    )
    assert listed.request_params(None, "m").dimensions == 16  # the config's default
    assert listed.request_params(PoolingParams(dimensions=32), "m").dimensions == 32
    with pytest.raises(ValueError, match=r"supports only \[16, 32\] dimensions, got 8"):
        listed.request_params(PoolingParams(dimensions=8), "m")
    with pytest.raises(ValueError, match="^pooler_config.dimensions: model"):
        resolve_pooler_config(PoolerConfig(dimensions=16), tmp_path / "a", HIDDEN)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dimensions": 0}, "dimensions must be an integer >= 1"),
        ({"dimensions": True}, "dimensions must be an integer >= 1"),
        ({"normalize": 1}, "normalize must be a boolean"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be -1"),
    ],
)
def test_bad_pooling_params_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        PoolingParams(**kwargs)
