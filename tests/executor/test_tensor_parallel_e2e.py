"""Tensor parallelism on the real default model: two worker processes (gloo, one
thread each) must produce exactly TP=1's greedy tokens through a workload that
mixes chunked prefills with decodes, hits the prefix cache and preempts; the
workers must exit on shutdown and when the engine process dies."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tokenloom.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.engine.core import EngineCore
from tokenloom.engine.messages import EngineCoreRequest
from tokenloom.model.tokenizer import load_tokenizer
from tokenloom.outputs import ModelRunnerOutput
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output.manager import GrammarOutput

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SYSTEM = (
    "You are a careful assistant. Answer in one short paragraph, plainly, and do not "
    "repeat the question. Here is the user's question: "
)
QUESTIONS = [
    "Why is the sky blue?",
    "What is a prime number?",
    "How do bees make honey?",
    "Name three rivers in Europe.",
    "What does a compiler do?",
    "Why do cats purr?",
]
# 16-token blocks, and fewer of them than the requests need at once: preemption.
CACHE = CacheConfig(block_size=16, num_blocks=20)
# Prefill chunks of at most 48 tokens share steps with the running decodes.
SCHEDULER = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48)


def model_config(default_model_path: Path, tp: int) -> ModelConfig:
    return ModelConfig(
        model=str(default_model_path),
        dtype="float32",
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )


class StepLog:
    """Wraps the core's runner to see each step's schedule."""

    def __init__(self, core: EngineCore) -> None:
        self.mixed_steps = 0  # a prefill chunk beside decodes
        self.chunked_prefills = 0  # a prompt cut short by the token budget
        self._execute = core.runner.execute_model
        self._prompt_lens: dict[str, int] = {}
        core.runner.execute_model = self  # type: ignore[method-assign]

    def __call__(
        self, output: SchedulerOutput, grammar: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        for new in output.scheduled_new_reqs:
            self._prompt_lens[new.req_id] = len(new.prompt_token_ids)
            remaining = len(new.prompt_token_ids) - new.num_computed_tokens
            if output.num_scheduled_tokens.get(new.req_id, 0) < remaining:
                self.chunked_prefills += 1
        counts = list(output.num_scheduled_tokens.values())
        if 1 in counts and any(c > 1 for c in counts):
            self.mixed_steps += 1
        return self._execute(output, grammar)


@dataclass
class Run:
    log: StepLog
    tokens: dict[str, list[int]] = field(default_factory=dict)
    stats: dict[str, int] = field(
        default_factory=lambda: {"prefix_cache_hits": 0, "num_preemptions": 0}
    )
    worker_exit_codes: list[int | None] = field(default_factory=list)


def run_workload(config: ModelConfig, prompts: list[list[int]]) -> Run:
    """Half the requests at once, the rest while those decode, then shut down."""
    core = EngineCore.from_config(config, CACHE, SCHEDULER)
    run = Run(StepLog(core))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    pending = list(enumerate(prompts))
    try:
        step = 0
        while pending or core.has_work():
            if pending and (step == 0 or step >= 6):
                count = len(prompts) // 2 if step == 0 else 1
                for i, prompt in pending[:count]:
                    core.add_request(
                        EngineCoreRequest(f"req-{i}", prompt, params, None, time.time())
                    )
                pending = pending[count:]
            result = core.step()
            step += 1
            if result is None:
                continue
            for out in result.outputs.outputs:
                run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            snapshot = result.outputs.scheduler_stats
            assert snapshot is not None
            run.stats["prefix_cache_hits"] += snapshot.prefix_cache_hits
            run.stats["num_preemptions"] += snapshot.num_preemptions
    finally:
        core.shutdown()
    if core.executor is not None:
        run.worker_exit_codes = core.executor.exit_codes()
    return run


@pytest.fixture(scope="module")
def prompts(default_model_path: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(default_model_path)
    return [tokenizer.encode(SYSTEM + question) for question in QUESTIONS]


def test_tp2_greedy_tokens_equal_tp1(default_model_path: Path, prompts: list[list[int]]) -> None:
    expected = run_workload(model_config(default_model_path, 1), prompts)
    got = run_workload(model_config(default_model_path, 2), prompts)
    assert len(got.tokens) == len(prompts)
    assert all(len(t) == 40 for t in got.tokens.values())
    for req_id, tokens in expected.tokens.items():
        assert got.tokens[req_id] == tokens, req_id
    # The workload exercised what it claims to.
    stats = got.stats
    assert stats == expected.stats
    assert stats["prefix_cache_hits"] > 0, stats
    assert stats["num_preemptions"] > 0, stats
    assert got.log.chunked_prefills > 0 and got.log.mixed_steps > 0
    # Shutting the core down stopped both workers cleanly.
    assert got.worker_exit_codes == [0, 0]


def _live(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_dead_worker_fails_the_step_with_its_rank(default_model_path: Path) -> None:
    # The cache sized from memory this time: the ranks agree on one block count.
    config = dataclasses.replace(model_config(default_model_path, 2), max_model_len=256)
    core = EngineCore.from_config(config, CacheConfig(memory_fraction=0.01), SchedulerConfig())
    executor = core.executor
    assert executor is not None
    try:
        assert core.num_blocks == executor.num_blocks >= 2
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        params = SamplingParams(temperature=0.0, max_tokens=4)
        core.add_request(EngineCoreRequest("r", [1, 2, 3], params, None, time.time()))
        with pytest.raises(RuntimeError, match="tensor-parallel worker 1 exited"):
            core.step()
    finally:
        core.shutdown()
    assert _live(executor.worker_pids) == []


@pytest.fixture
def engine_process(default_model_path: Path) -> Iterator[object]:
    from tokenloom.engine.core_client import MPClient

    client = MPClient(model_config(default_model_path, 2), CacheConfig(num_blocks=16), SCHEDULER)
    try:
        client.wait_until_ready()
        yield client
    finally:
        client.shutdown()


def test_workers_die_with_the_engine_process(engine_process: object) -> None:
    """The serving path: the engine core is a daemon process; SIGKILL it."""
    proc = engine_process.proc  # type: ignore[attr-defined]
    workers = [
        p.pid
        for p in psutil.Process(proc.pid).children()
        if "tokenloom.executor.worker_proc" in " ".join(p.cmdline())
    ]
    assert len(workers) == 2
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while _live(workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _live(workers) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lora_config": LoRAConfig()}, "enable_lora"),
        (
            {"scheduler_config": SchedulerConfig(speculative_config=SpeculativeConfig("ngram", 2))},
            "speculative_config",
        ),
        ({"tp": 4}, r"tensor_parallel_size \(4\)"),
    ],
)
def test_unsupported_combinations_are_refused_at_start(
    default_model_path: Path, kwargs: dict, field: str
) -> None:
    tp = kwargs.pop("tp", 2)
    scheduler = kwargs.pop("scheduler_config", SchedulerConfig())
    with pytest.raises(ValueError, match=field):
        EngineCore.from_config(
            model_config(default_model_path, tp), CacheConfig(num_blocks=16), scheduler, **kwargs
        )


def test_tp2_loads_hf_safetensors_shards(default_hf_model_dir: Path) -> None:
    """The same model as a Hugging Face directory: safetensors tensors sliced per rank."""
    from tokenloom.engine.llm import LLM

    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = {}
    for tp in (1, 2):
        llm = LLM(
            str(default_hf_model_dir),
            dtype="float32",
            num_blocks=32,
            tensor_parallel_size=tp,
            log_stats=False,
        )
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.client.shutdown()
        texts[tp] = [o.outputs[0].token_ids for o in outputs]
    assert texts[2] == texts[1]
