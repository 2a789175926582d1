"""The engine set-up ``LLM`` and ``AsyncLLM`` share, around starting the engine core.

``EngineSetup.from_engine_args`` finds the model (downloading a Hugging Face
id) and reads its architecture. The caller starts the core from
``core_configs`` (in this process, in its own, or one per data parallel
rank), then ``front_end`` gives the request side: tokenizer, input and output
processing, stat loggers. Imports no torch: with the core in its own process,
the front end's process never loads it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenloom.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from tokenloom.engine.args import EngineArgs, EngineConfig
from tokenloom.engine.input_processor import InputProcessor, eos_token_ids
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.metrics.stats import LoggingStatLogger, StatLogger
from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.multimodal.media import MediaLimits
from tokenloom.multimodal.processing import MultiModalProcessor
from tokenloom.pooling.config import resolve_pooler_config
from tokenloom.reasoning import get_reasoning_parser
from tokenloom.structured_output.reasoning_gate import ReasoningTokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from tokenloom.metrics.tracing import RequestTracer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontEnd:
    """The request side of an engine, in front of its core."""

    tokenizer: PreTrainedTokenizerFast
    input_processor: InputProcessor
    output_processor: OutputProcessor
    stat_loggers: list[StatLogger]


@dataclass(frozen=True)
class EngineSetup:
    """An engine's arguments, its configs with the model located, and the model's architecture.

    ``config.model_config.model`` is the model's local path; ``engine_args``
    keep the model as the user gave it (the served name defaults to it).
    """

    engine_args: EngineArgs
    config: EngineConfig
    arch: ModelArchConfig
    # Spans of finished requests to --otlp-traces-endpoint (None: tracing off).
    tracer: RequestTracer | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> EngineSetup:
        from tokenloom.model.arch_reader import load_arch_config
        from tokenloom.model.paths import resolve_model_path

        config = engine_args.config
        path = resolve_model_path(
            config.model_config.model,
            config.model_config.revision,
            config.model_config.load_format != "dummy",
        )
        arch = load_arch_config(path)
        model_config = dataclasses.replace(
            config.model_config,
            model=str(path),
            **_runner_settings(config.model_config, path, arch),
        )
        located = dataclasses.replace(config, model_config=model_config)
        tracer = None
        endpoint = config.frontend_config.otlp_traces_endpoint
        if endpoint is not None:  # before any core starts: a missing exporter fails here
            from tokenloom.metrics.tracing import RequestTracer

            tracer = RequestTracer.to_endpoint(engine_args.get_served_model_name(), endpoint)
        return cls(engine_args, located, arch, tracer)

    @property
    def core_configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig, LoRAConfig | None]:
        """What an engine core is built from (``EngineCore.from_config``, ``MPClient``)."""
        c = self.config
        return c.model_config, c.cache_config, c.scheduler_config, c.lora_config

    def load_tokenizer(self) -> PreTrainedTokenizerFast:
        """The model's tokenizer; ``ValueError`` naming ``reasoning_parser`` when the
        model lacks the parser's tags (found here, before the weights load)."""
        from tokenloom.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.config.model_config.model)  # type: ignore[arg-type]
        reasoning_parser = self.config.frontend_config.reasoning_parser
        if reasoning_parser is not None:
            parser = get_reasoning_parser(reasoning_parser)
            ReasoningTokens.resolve(parser, tokenizer, self.arch.vocab_size)
        return tokenizer

    def front_end(
        self,
        tokenizer: PreTrainedTokenizerFast,
        max_model_len: int,
        *,
        helpers_in_subprocess: bool = False,
    ) -> FrontEnd:
        """The request side for a core whose context is ``max_model_len`` tokens.

        ``helpers_in_subprocess``: check structured-output grammars and run image
        processors in helper processes (both import torch).
        """
        frontend = self.config.frontend_config
        limits = MediaLimits(
            allowed_local_media_path=frontend.allowed_local_media_path,
            allowed_media_domains=(
                None
                if frontend.allowed_media_domains is None
                else tuple(d.lower() for d in frontend.allowed_media_domains)
            ),
            fetch_timeout_s=frontend.media_fetch_timeout,
            max_bytes=frontend.max_media_bytes,
        )
        multimodal = None
        if self.arch.vision is not None:
            multimodal = MultiModalProcessor(
                self.arch.vision,
                self.config.model_config.model,  # type: ignore[arg-type]
                tokenizer,
                limits,
                frontend.max_images_per_prompt,
                in_subprocess=helpers_in_subprocess,
            )
        input_processor = InputProcessor(
            tokenizer,
            max_model_len,
            self.arch.vocab_size,
            eos_token_ids(self.arch.eos_token_ids, tokenizer),
            max_logprobs=frontend.max_logprobs,
            chat_template=self.config.chat_template,
            lora_config=self.config.lora_config,
            arch=self.arch,
            reasoning_parser=frontend.reasoning_parser,
            validate_constraints_in_subprocess=helpers_in_subprocess,
            multimodal=multimodal,
            media_limits=limits,
            pooler_config=self.config.model_config.pooler_config,
            served_model_name=self.engine_args.get_served_model_name(),
        )
        stat_loggers: list[StatLogger] = [LoggingStatLogger()] if frontend.log_stats else []
        if self.tracer is not None:
            stat_loggers.append(self.tracer)
        return FrontEnd(tokenizer, input_processor, OutputProcessor(tokenizer), stat_loggers)


def _runner_settings(
    model_config: ModelConfig, path: Path, arch: ModelArchConfig
) -> dict[str, Any]:
    """The runner ``auto`` stands for (generate: every supported architecture is a
    causal LM) and, for a pooling runner, its pooler config completed for the model."""
    if model_config.runner != "pooling":
        return {"runner": "generate"}
    pooler_config = resolve_pooler_config(model_config.pooler_config, path, arch.hidden_size)
    logger.info("pooling runner: %s", pooler_config.describe())
    return {"runner": "pooling", "pooler_config": pooler_config}
