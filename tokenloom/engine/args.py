"""Engine arguments: every engine option as one keyword (``LLM``, ``AsyncLLM``) or flag (CLI).

The options are declared once, as ``option`` fields of the config dataclasses
in ``CONFIG_CLASSES`` (``tokenloom.config``). ``EngineArgs(**kwargs)`` takes
them by argument name, builds each config once, validating it, and keeps the
result in ``EngineArgs.config``; ``add_cli_args`` derives the flags from the
same declarations.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from tokenloom.config import (
    CacheConfig,
    DPLoadBalanceConfig,
    FrontendConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RecoveryConfig,
    SchedulerConfig,
)
from tokenloom.default_model import DEFAULT_MODEL_NAME
from tokenloom.options import OptionSpec, add_cli_args, build, option_specs

# The configs whose options are engine arguments, in the order ``--help`` lists them.
CONFIG_CLASSES: tuple[type, ...] = (
    ModelConfig,
    ParallelConfig,
    CacheConfig,
    SchedulerConfig,
    LoRAConfig,
    DPLoadBalanceConfig,
    RecoveryConfig,
    FrontendConfig,
)


def _engine_options() -> dict[str, OptionSpec]:
    options: dict[str, OptionSpec] = {}
    for cls in CONFIG_CLASSES:
        for spec in option_specs(cls):
            if spec.arg in options:
                raise TypeError(f"engine argument {spec.arg} is declared twice")
            options[spec.arg] = spec
    return options


# Argument name -> its declaration, over all of CONFIG_CLASSES.
ENGINE_OPTIONS = _engine_options()


@dataclass(frozen=True)
class EngineConfig:
    """Every config of one engine, each built once from ``EngineArgs``.

    ``lora_config`` is None unless ``enable_lora``; ``chat_template`` is the
    default template's text (read from the file ``--chat-template`` named).
    """

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    lora_config: LoRAConfig | None
    load_balance_config: DPLoadBalanceConfig
    recovery_config: RecoveryConfig
    frontend_config: FrontendConfig
    chat_template: str | None

    @property
    def parallel_config(self) -> ParallelConfig:
        return self.model_config.parallel_config


class EngineArgs:
    """Engine options by argument name; invalid values raise ``ValueError`` naming the argument.

    ``EngineArgs(model, max_num_seqs=8, ...)`` takes any argument in
    ``ENGINE_OPTIONS`` (the others keep their defaults) and reads each back as
    an attribute (``args.max_num_seqs``); ``config`` holds the configs built
    from them.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - ENGINE_OPTIONS.keys())
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        values = {arg: spec.default for arg, spec in ENGINE_OPTIONS.items()}
        values.update(kwargs, model=model)
        self._values = values
        self.config = self._build()

    def _build(self) -> EngineConfig:
        from tokenloom.engine.chat_template import load_chat_template

        values = self._values
        model_config = build(ModelConfig, values, parallel_config=build(ParallelConfig, values))
        scheduler_config = build(SchedulerConfig, values)
        _check_draft_model(scheduler_config)
        _check_runner(model_config, scheduler_config)
        lora_config = build(LoRAConfig, values)
        frontend_config = build(FrontendConfig, values)
        cache_config = build(CacheConfig, values)
        _check_kv_transfer(cache_config, model_config.parallel_config)
        _check_async_scheduling(model_config, scheduler_config, cache_config)
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            lora_config=lora_config if frontend_config.enable_lora else None,
            load_balance_config=build(DPLoadBalanceConfig, values),
            recovery_config=build(RecoveryConfig, values),
            frontend_config=frontend_config,
            chat_template=load_chat_template(frontend_config.chat_template),
        )

    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not attributes: the arguments.
        values = self.__dict__.get("_values")
        if values is None or name not in values:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return values[name]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EngineArgs):
            return NotImplemented
        return self._values == other._values

    def __repr__(self) -> str:
        changed = ", ".join(
            f"{arg}={value!r}"
            for arg, value in self._values.items()
            if value != ENGINE_OPTIONS[arg].default
        )
        return f"EngineArgs({changed})"

    def as_kwargs(self) -> dict[str, Any]:
        """Every argument by name, as ``EngineArgs(**args.as_kwargs())`` takes them."""
        return dict(self._values)

    def get_served_model_name(self) -> str:
        """The name clients use: ``served_model_name``, else the model as given."""
        name = self.config.frontend_config.served_model_name
        if name:
            return name
        model = self.config.model_config.model
        return model if model is not None else DEFAULT_MODEL_NAME

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per engine argument, a group per config (``--model`` for the model)."""
        for cls in CONFIG_CLASSES:
            add_cli_args(parser, cls)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from a namespace; arguments it lacks keep their defaults."""
        given = {arg: value for arg, value in vars(args).items() if arg in ENGINE_OPTIONS}
        model = given.pop("model", None)
        return cls(model, **given)


def _check_runner(model_config: ModelConfig, scheduler_config: SchedulerConfig) -> None:
    """A pooler config needs the pooling runner, which never decodes (nothing to speculate)."""
    if model_config.runner == "pooling":
        if scheduler_config.speculative_config is not None:
            raise ValueError(
                "speculative_config: the pooling runner never decodes, so it has nothing "
                "to speculate"
            )
    elif model_config.pooler_config is not None:
        raise ValueError("pooler_config needs runner='pooling' (--runner pooling)")


def _check_async_scheduling(
    model_config: ModelConfig, scheduler_config: SchedulerConfig, cache_config: CacheConfig
) -> None:
    """Async scheduling overlaps steps whose only link is one sampled token each:
    nothing that needs a step's outcome before the next is built."""
    if not scheduler_config.async_scheduling:
        return
    conflicts = {
        "speculative_config": scheduler_config.speculative_config is not None,
        "kv_transfer_config": cache_config.kv_transfer_config is not None,
        "runner='pooling'": model_config.runner == "pooling",
        "tensor_parallel_size > 1": model_config.parallel_config.tensor_parallel_size > 1,
    }
    for name, present in conflicts.items():
        if present:
            raise ValueError(f"async_scheduling cannot be combined with {name}")


def _check_draft_model(scheduler_config: SchedulerConfig) -> None:
    """A draft model must exist at start-up, not when the first request speculates."""
    spec = scheduler_config.speculative_config
    if spec is None or spec.model is None:
        return
    from tokenloom.model.paths import resolve_model_path

    try:
        resolve_model_path(spec.model)
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config.model: {exc}") from None


def _check_kv_transfer(cache_config: CacheConfig, parallel_config: ParallelConfig) -> None:
    """A KV connector serves one engine core of one process (its tier or its port)."""
    connector = cache_config.kv_transfer_config
    if connector is None:
        return
    for name in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(parallel_config, name) > 1:
            raise ValueError(
                f"kv_transfer_config: the {connector.kv_connector} serves one engine core; "
                f"{name} must be 1"
            )
    if connector.kv_connector == "TcpConnector":
        from tokenloom.kv_transfer.tcp import extra_config

        extra_config(connector)  # its settings, checked before the weights load
    elif connector.kv_connector_extra_config:
        key = sorted(connector.kv_connector_extra_config)[0]
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config.{key}: the {connector.kv_connector} "
            "has no settings there (see --kv-offload-dir, --kv-offload-bytes)"
        )
