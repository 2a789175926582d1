"""EngineArgs: validation names the field; CLI flags round-trip."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tokenloom.default_model import DEFAULT_MODEL_NAME
from tokenloom.engine.args import EngineArgs


def test_defaults_build_configs() -> None:
    model_config, cache_config, scheduler_config = EngineArgs().create_configs()
    assert model_config.model is None and model_config.device == "cpu"
    assert cache_config.block_size == 16 and cache_config.num_blocks is None
    assert cache_config.memory_fraction == 0.1
    assert scheduler_config.max_num_seqs == 256 and scheduler_config.policy == "fcfs"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -5}, "max_num_batched_tokens"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"policy": "lifo"}, "policy"),
        ({"dtype": "int3"}, "dtype"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"kv_cache_memory_fraction": 0.0}, "kv_cache_memory_fraction"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"kv_cache_memory_bytes": 1.5e9}, "kv_cache_memory_bytes"),
        ({"device": "tpu"}, "device"),
        ({"max_num_seqs": "8"}, "max_num_seqs"),
        ({"seed": 1.5}, "seed"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
        ({"served_model_name": ""}, "served_model_name"),
        ({"max_logprobs": -1}, "max_logprobs"),
        ({"max_logprobs": 2.5}, "max_logprobs"),
        ({"chat_template": "/no/such/template.jinja"}, "chat_template"),
        ({"chat_template": "{% for m in messages %}"}, "chat_template"),
        ({"chat_template": ""}, "chat_template"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        EngineArgs(**kwargs)


def test_cli_round_trip() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(
        [
            "--model",
            "/m.gguf",
            "--max-model-len",
            "512",
            "--num-blocks",
            "64",
            "--no-enable-prefix-caching",
            "--policy",
            "priority",
            "--max-num-seqs",
            "4",
            "--kv-cache-memory-fraction",
            "0.5",
            "--no-log-stats",
            "--served-model-name",
            "x",
            "--chat-template",
            "{{ messages[0].content }}",
            "--max-logprobs",
            "5",
        ]
    )
    args = EngineArgs.from_cli_args(ns)
    assert args == EngineArgs(
        model="/m.gguf",
        max_model_len=512,
        num_blocks=64,
        enable_prefix_caching=False,
        policy="priority",
        max_num_seqs=4,
        kv_cache_memory_fraction=0.5,
        log_stats=False,
        served_model_name="x",
        chat_template="{{ messages[0].content }}",
        max_logprobs=5,
    )
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()
    sized = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-memory-bytes", "1048576"]))
    assert sized.create_configs()[1].memory_bytes == 1 << 20


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert EngineArgs().load_chat_template() is None
    assert EngineArgs(chat_template=inline).load_chat_template() == inline
    path = tmp_path / "chat.jinja"
    path.write_text(inline, encoding="utf-8")
    assert EngineArgs(chat_template=str(path)).load_chat_template() == inline
    assert EngineArgs().max_logprobs == 20


def test_served_model_name() -> None:
    assert EngineArgs().get_served_model_name() == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert EngineArgs(model="/a/b.gguf").get_served_model_name() == "/a/b.gguf"
    assert EngineArgs(model="/a/b.gguf", served_model_name="m").get_served_model_name() == "m"
