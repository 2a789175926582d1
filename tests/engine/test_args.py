"""EngineArgs: validation names the field; CLI flags round-trip."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tokenloom.config import DTYPES, CacheConfig, LoRAConfig, SchedulerConfig
from tokenloom.default_model import DEFAULT_MODEL_NAME
from tokenloom.engine.args import ENGINE_OPTIONS, EngineArgs


def test_defaults_build_configs() -> None:
    config = EngineArgs().config
    assert config.model_config.model is None and config.model_config.device == "cpu"
    assert config.cache_config.block_size == 16 and config.cache_config.num_blocks is None
    assert config.cache_config.memory_fraction == 0.1
    assert config.scheduler_config == SchedulerConfig()  # the contract's defaults
    assert config.cache_config == CacheConfig()
    assert config.lora_config is None and config.chat_template is None


def test_arguments_reach_their_configs() -> None:
    args = EngineArgs(
        "/m.gguf",
        max_num_seqs=8,
        kv_cache_dtype="bfloat16",
        kv_cache_memory_bytes=1 << 20,
        tensor_parallel_size=2,
        enable_lora=True,
        max_lora_rank=8,
        dp_load_balance="least_load",
    )
    config = args.config
    assert config.model_config.model == "/m.gguf" and args.model == "/m.gguf"
    assert config.scheduler_config.max_num_seqs == 8 == args.max_num_seqs
    assert config.cache_config.cache_dtype == "bfloat16"
    assert config.cache_config.memory_bytes == 1 << 20
    assert config.parallel_config.tensor_parallel_size == 2
    assert config.lora_config == LoRAConfig(max_lora_rank=8)
    assert config.load_balance_config.policy == "least_load"
    assert EngineArgs(**args.as_kwargs()) == args


def test_unknown_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown engine argument.*max_num_seq"):
        EngineArgs(max_num_seq=8)


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
        ({"model": 3}, "model"),
        ({"max_lora_rank": 600}, "max_lora_rank"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"speculative_config": "{not json"}, "speculative_config"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        EngineArgs(**kwargs)


def test_messages_say_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"^max_num_seqs must be an integer >= 1, got 0$"):
        EngineArgs(max_num_seqs=0)
    with pytest.raises(ValueError, match=r"^kv_cache_memory_fraction must be a number in \(0, 1\]"):
        EngineArgs(kv_cache_memory_fraction=2)
    with pytest.raises(ValueError, match=r"^num_blocks must be an integer >= 1 or None, got 0$"):
        EngineArgs(num_blocks=0)
    with pytest.raises(
        ValueError, match=r"^policy must be one of \{fcfs, priority, fair\}, got 'lifo'"
    ):
        EngineArgs(policy="lifo")
    # Built directly, a config names its own field.
    with pytest.raises(ValueError, match=r"^memory_fraction must be a number in \(0, 1\]"):
        CacheConfig(memory_fraction=2)


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
    assert sized.config.cache_config.memory_bytes == 1 << 20
    aliased = parser.parse_args(["-tp", "2", "-dp", "3", "--no-enable-chunked-prefill"])
    assert (aliased.tensor_parallel_size, aliased.data_parallel_size) == (2, 3)
    assert aliased.enable_chunked_prefill is False


def test_every_engine_argument_is_a_flag_with_help() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert flags.keys() == ENGINE_OPTIONS.keys()
    for dest, action in flags.items():
        assert action.help, dest
        assert action.default == ENGINE_OPTIONS[dest].default
    assert flags["dtype"].choices == list(DTYPES) == flags["kv_cache_dtype"].choices
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int3"])


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert EngineArgs().config.chat_template is None
    assert EngineArgs(chat_template=inline).config.chat_template == inline
    path = tmp_path / "chat.jinja"
    path.write_text(inline, encoding="utf-8")
    from_file = EngineArgs(chat_template=str(path))
    path.unlink()  # read once, at construction
    assert from_file.config.chat_template == inline
    assert from_file.chat_template == str(path)
    assert EngineArgs().max_logprobs == 20


def test_served_model_name() -> None:
    assert EngineArgs().get_served_model_name() == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert EngineArgs(model="/a/b.gguf").get_served_model_name() == "/a/b.gguf"
    assert EngineArgs(model="/a/b.gguf", served_model_name="m").get_served_model_name() == "m"


def test_kv_transfer_config_flags() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(
        [
            "--kv-transfer-config",
            '{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": 0,'
            ' "kv_connector_extra_config": {"send_timeout_s": 5}}',
        ]
    )
    connector = EngineArgs.from_cli_args(ns).config.cache_config.kv_transfer_config
    assert connector is not None and connector.kv_connector == "TcpConnector"
    assert connector.is_producer and not connector.is_consumer and connector.kv_port == 0
    assert connector.kv_connector_extra_config == {"send_timeout_s": 5}
    # --kv-offload-dir alone means the disk tier.
    ns = parser.parse_args(["--kv-offload-dir", "/tmp/t", "--kv-offload-bytes", "4096"])
    cache = EngineArgs.from_cli_args(ns).config.cache_config
    assert cache.kv_transfer_config is not None
    assert cache.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert (cache.kv_offload_dir, cache.kv_offload_bytes) == ("/tmp/t", 4096)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_transfer_config": "{"}, "kv_transfer_config is not valid JSON"),
        ({"kv_transfer_config": "[1]"}, "kv_transfer_config must be a dict"),
        ({"kv_transfer_config": {}}, "kv_transfer_config.kv_connector is required"),
        ({"kv_transfer_config": {"kv_connector": "X"}}, "kv_transfer_config.kv_connector"),
        (
            {"kv_transfer_config": {"kv_connector": "TcpConnector", "kv_role": "both"}},
            "kv_transfer_config.kv_role",
        ),
        (
            {"kv_transfer_config": {"kv_connector": "TcpConnector", "kv_port": 70000}},
            "kv_transfer_config.kv_port",
        ),
        (
            {"kv_transfer_config": {"kv_connector": "TcpConnector", "kv_buffer": 1}},
            "kv_transfer_config.kv_buffer is not a supported key",
        ),
        (
            {"kv_transfer_config": {"kv_connector": "OffloadingConnector"}},
            "kv_offload_dir must name",
        ),
        (
            {"kv_transfer_config": {"kv_connector": "TcpConnector"}, "kv_offload_dir": "/t"},
            "kv_offload_dir is only used by the OffloadingConnector",
        ),
        (
            {
                "kv_transfer_config": {
                    "kv_connector": "TcpConnector",
                    "kv_connector_extra_config": {"transfer_timeout_s": 0},
                }
            },
            "kv_connector_extra_config.transfer_timeout_s must be a number > 0",
        ),
        (
            {
                "kv_offload_dir": "/t",
                "kv_transfer_config": {
                    "kv_connector": "OffloadingConnector",
                    "kv_connector_extra_config": {"size": 1},
                },
            },
            "kv_connector_extra_config.size: the OffloadingConnector has no settings",
        ),
        ({"kv_offload_dir": "/t", "kv_offload_bytes": 0}, "kv_offload_bytes"),
        ({"kv_offload_dir": "/t", "tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
    ],
)
def test_kv_transfer_config_errors_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)
