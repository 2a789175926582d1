"""What a benchmark run is configured by; each flag declared once (``tokenloom.options``).

``tokenloom bench`` derives its flags from these dataclasses; ``bench offline``
adds the engine's (``EngineArgs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tokenloom.bench.datasets import LENGTH_DISTRIBUTIONS
from tokenloom.options import option, validate


@dataclass(frozen=True)
class DatasetArgs:
    """The workload: which prompts, how many, and how long prompts and outputs are."""

    dataset_name: Literal["random", "shared-prefix", "jsonl"] = option(
        "random", help="random token prompts, a shared system prompt, or a JSONL file"
    )
    dataset_path: str | None = option(None, help="JSONL file for --dataset-name jsonl")
    num_prompts: int = option(100, ge=1, help="requests in the workload")
    random_input_len: int = option(256, help="random: mean prompt tokens")
    random_output_len: int = option(128, help="random: mean output tokens")
    random_range_ratio: float = option(
        0.0, help="random: lengths drawn from [len*(1-r), len*(1+r)]; 0 means fixed"
    )
    input_len_dist: str = option(
        "uniform", choices=LENGTH_DISTRIBUTIONS, help="random: how prompt lengths spread"
    )
    output_len_dist: str = option(
        "uniform", choices=LENGTH_DISTRIBUTIONS, help="random: how output lengths spread"
    )
    min_input_len: int | None = option(None, help="random: explicit lower bound")
    max_input_len: int | None = option(None, help="random: explicit upper bound")
    min_output_len: int | None = option(None, help="random: explicit lower bound")
    max_output_len: int | None = option(None, help="random: explicit upper bound")
    prefix_len: int = option(400, help="shared-prefix: system prompt tokens")
    suffix_len: int = option(16, help="shared-prefix: unique tokens")
    output_len: int = option(64, help="shared-prefix / jsonl: output tokens")
    seed: int = option(0, help="seed of the random prompts")

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class ServeConfig:
    """How the load is sent to the server.

    ``base_url`` (from ``--base-url``, else ``--host``/``--port``), ``seed`` (the
    dataset's) and ``timeout_s`` are set by the caller, not by their own flags.
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = option(
        None, arg="served_model", help="model name to send (default: the first of /v1/models)"
    )
    endpoint: str = option("/v1/completions", help="the completions endpoint's path")
    request_rate: float = option(
        math.inf, gt=0, help="requests per second, Poisson arrivals; inf sends all at once"
    )
    max_concurrency: int | None = option(None, ge=1, help="most requests in flight")
    ignore_eos: bool = option(
        True, help="send ignore_eos (vLLM/tokenloom extension) so output lengths are fixed"
    )
    prompt_as_text: bool = option(False, help="send decoded text, not token ids")
    seed: int = 0
    timeout_s: float = 6 * 3600
    disable_tqdm: bool = option(False, help="no progress bar")

    def __post_init__(self) -> None:
        validate(self)
