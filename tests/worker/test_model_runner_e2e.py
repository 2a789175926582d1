"""Scheduler + ModelRunner on the real default model (GGUF, fp32) against Hugging Face
transformers (fp32, the same weights dequantized by transformers' own GGUF loader).

One runner (one model load) serves every configuration; each gets a fresh
Scheduler. Greedy outputs must be token-for-token identical, and the logits the
runner computes at every sampled position must match transformers' within
LOGITS_ATOL.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig
from tokenloom.core.sched.scheduler import Scheduler
from tokenloom.model.decoder_stack import DecoderStack
from tokenloom.model.panel_linear import PanelLinear
from tokenloom.request import Request, RequestStatus
from tokenloom.sampling_params import SamplingParams
from tokenloom.worker.model_runner import ModelRunner

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
BLOCK_SIZE = 16
RUNNER_BLOCKS = 512
LOGITS_ATOL = 1e-3

SYSTEM = (
    "You are a careful assistant for a small bakery. You answer questions about opening "
    "hours, ingredients, allergens and prices. Keep answers short and friendly, never "
    "invent products, and always mention that the shop is closed on Mondays. Our breads "
    "are sourdough, rye and spelt; pastries include croissants and cinnamon rolls.\n"
)
SHARED = [
    "Customer: Do you sell gluten-free bread?\nAssistant:",
    "Customer: When do you open on Saturday?\nAssistant:",
    "Customer: How much is a croissant?\nAssistant:",
    "Customer: Is the rye bread vegan?\nAssistant:",
    "Customer: Can I order a birthday cake for Friday afternoon, with strawberries?\nAssistant:",
    "Customer: hi\nAssistant:",
    "Customer: What nuts are in the cinnamon rolls, if any?\nAssistant:",
    "Customer: Are you open on Monday?\nAssistant:",
]
PLAIN = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a village at the edge of a dark forest, there lived an old "
    "woodcutter who had three sons. The eldest was strong, the second was clever, and "
    "the youngest",
    "Translate to French: I would like a cup of coffee, please.",
    "List three colours:",
    "Q: What is 12 times 7?\nA:",
    "The mitochondria is",
    "import numpy as np\nx = np.arange(10)\nprint(",
]


@dataclass
class Reference:
    tokens: list[int]
    logits: torch.Tensor  # [MAX_TOKENS, vocab], at each generated position


@dataclass
class RunResult:
    requests: dict[str, Request]
    outputs: dict[str, list[int]]
    logits: dict[str, list[torch.Tensor]]
    steps: int
    most_tokens_in_a_step: dict[str, int]


@pytest.fixture(scope="session")
def runner() -> ModelRunner:
    torch.manual_seed(0)
    return ModelRunner(
        ModelConfig(dtype="float32", max_model_len=1024),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=RUNNER_BLOCKS),
        SchedulerConfig(max_num_seqs=32),
    )


@pytest.fixture(scope="session")
def prompts(default_hf_model_dir: Path) -> list[list[int]]:
    from tokenloom.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_hf_model_dir)
    texts = [SYSTEM + s for s in SHARED] + PLAIN
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="session")
def references(default_hf_model_dir: Path, prompts: list[list[int]]) -> list[Reference]:
    """Greedy continuations and per-step logits from transformers, with its own KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_hf_model_dir, dtype=torch.float32)
    model.eval()
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            step_logits = [out.logits[0, -1].float()]
            tokens = [int(step_logits[-1].argmax())]
            for _ in range(MAX_TOKENS - 1):
                out = model(
                    torch.tensor([[tokens[-1]]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
                step_logits.append(out.logits[0, -1].float())
                tokens.append(int(step_logits[-1].argmax()))
            refs.append(Reference(tokens, torch.stack(step_logits)))
    return refs


def drive(
    runner: ModelRunner,
    prompts: list[list[int]],
    tag: str,
    scheduler_config: SchedulerConfig,
    num_blocks: int = RUNNER_BLOCKS,
    first_alone: bool = False,
    propose: Callable[[Request], list[int]] | None = None,
    num_speculative_tokens: int = 0,
) -> RunResult:
    """schedule -> execute_model -> update_from_output until every request is done.

    ``first_alone``: the first request runs its prefill before the others arrive.
    ``propose``: draft tokens for each running request, fed before each step.
    """
    cache_config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks)
    scheduler = Scheduler(
        scheduler_config,
        cache_config,
        runner.max_model_len,
        num_speculative_tokens=num_speculative_tokens,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = {
        f"{tag}-{i}": Request(f"{tag}-{i}", p, params, eos_token_id=runner.eos_token_ids[0])
        for i, p in enumerate(prompts)
    }
    queue = list(requests.values())
    scheduler.add_request(queue.pop(0))
    if not first_alone:
        for request in queue:
            scheduler.add_request(request)
        queue = []

    outputs: dict[str, list[int]] = defaultdict(list)
    most: dict[str, int] = defaultdict(int)
    logits: dict[str, list[torch.Tensor]] = defaultdict(list)
    captured: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        result = compute_logits(hidden)
        captured.append(result.clone())  # the sampler edits logits in place
        return result

    runner.model.compute_logits = capture  # type: ignore[method-assign]
    steps = 0
    try:
        while scheduler.has_unfinished_requests() or queue:
            if queue and not scheduler.has_unfinished_requests():
                raise AssertionError("first request finished before the others were added")
            if propose is not None:
                scheduler.update_draft_token_ids(
                    {r.request_id: propose(r) for r in scheduler.running}
                )
            scheduler_output = scheduler.schedule()
            runner_output = runner.execute_model(scheduler_output)
            steps += 1
            sampling = [
                r
                for r, t in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
                if t
            ]
            if sampling:
                step_logits = captured.pop()
                row = 0
                for req_id in sampling:
                    n = 1 + len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, []))
                    kept = len(
                        runner_output.sampled_token_ids[runner_output.req_id_to_index[req_id]]
                    )
                    most[req_id] = max(most[req_id], kept)
                    logits[req_id].extend(step_logits[row : row + kept])
                    row += n
            assert not captured
            for engine_outputs in scheduler.update_from_output(
                scheduler_output, runner_output
            ).values():
                for out in engine_outputs.outputs:
                    outputs[out.request_id].extend(out.new_token_ids)
            first = requests[f"{tag}-0"]
            if queue and first.num_output_tokens > 0:
                for request in queue:
                    scheduler.add_request(request)
                queue = []
        # One more step hands the last finished ids to the runner.
        runner.execute_model(scheduler.schedule())
    finally:
        del runner.model.compute_logits
    assert runner.input_batch.num_reqs == 0
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == num_blocks - 1, "leaked KV blocks"
    return RunResult(requests, dict(outputs), dict(logits), steps, dict(most))


def check_against_reference(result: RunResult, references: list[Reference], tag: str) -> float:
    """Identical greedy tokens; returns the largest logits difference seen."""
    worst = 0.0
    for i, ref in enumerate(references):
        req_id = f"{tag}-{i}"
        assert result.outputs[req_id] == ref.tokens, f"{req_id} diverged from transformers"
        # A verification step may sample past max_tokens; the scheduler drops the excess.
        got = torch.stack(result.logits[req_id][:MAX_TOKENS])
        assert got.shape == ref.logits.shape
        diff = float((got - ref.logits).abs().max())
        assert diff < LOGITS_ATOL, f"{req_id}: logits differ by {diff}"
        worst = max(worst, diff)
    return worst


def test_the_runner_says_which_forward_path_runs(runner: ModelRunner) -> None:
    """float32 weights run in panels through the native kernel and the decoder stack
    (the tests below hold that path to transformers' logits)."""
    plan = runner.forward_plan
    assert (plan.weights, plan.matmul, plan.decoder) == ("float32", "native", "stack")
    assert isinstance(runner.model.decoder_stack, DecoderStack)
    assert isinstance(runner.model.layers[0].mlp.down_proj, PanelLinear)
    assert (runner.native_attention is not None) == (plan.attention == "native")


def test_chunked_prefill_matches_transformers(
    runner: ModelRunner, prompts: list[list[int]], references: list[Reference]
) -> None:
    budget = 64
    assert len(prompts) >= 16 and max(len(p) for p in prompts) > budget
    result = drive(
        runner, prompts, "chunk", SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=budget)
    )
    worst = check_against_reference(result, references, "chunk")
    print(f"chunked prefill: {result.steps} steps, max |logits diff| {worst:.2e}")


def test_prefix_cache_hits_match_transformers(
    runner: ModelRunner, prompts: list[list[int]], references: list[Reference]
) -> None:
    result = drive(runner, prompts, "prefix", SchedulerConfig(max_num_seqs=32), first_alone=True)
    check_against_reference(result, references, "prefix")
    shared_len = len(prompts[0]) - 20  # the system prompt covers at least this many tokens
    for i in range(1, len(SHARED)):
        cached = result.requests[f"prefix-{i}"].num_cached_tokens
        assert cached >= (shared_len // BLOCK_SIZE) * BLOCK_SIZE - BLOCK_SIZE and cached > 0


def test_preemption_matches_transformers(
    runner: ModelRunner, prompts: list[list[int]], references: list[Reference]
) -> None:
    need = [-(-(len(p) + MAX_TOKENS) // BLOCK_SIZE) for p in prompts]
    num_blocks = max(need) + sum(need) // 4  # far fewer than running everything at once needs
    result = drive(
        runner, prompts, "preempt", SchedulerConfig(max_num_seqs=32), num_blocks=num_blocks
    )
    check_against_reference(result, references, "preempt")
    assert sum(r.num_preemptions for r in result.requests.values()) > 0


def test_draft_verification_keeps_greedy_output(
    runner: ModelRunner, prompts: list[list[int]], references: list[Reference]
) -> None:
    """Right drafts (transformers' own continuation) for even requests, wrong ones for odd."""
    k = 3
    count = 8  # multi-token verification steps are the slow path: keep this lean

    def propose(request: Request) -> list[int]:
        i = int(request.request_id.rsplit("-", 1)[1])
        done = request.num_output_tokens
        if i % 2 == 0:
            return references[i].tokens[done : done + k]
        return [(t + 1) % runner.arch.vocab_size for t in references[i].tokens[done : done + k]]

    result = drive(
        runner,
        prompts[:count],
        "spec",
        SchedulerConfig(max_num_seqs=32),
        propose=propose,
        num_speculative_tokens=k,
    )
    check_against_reference(result, references[:count], "spec")
    for i in range(count):
        most = result.most_tokens_in_a_step[f"spec-{i}"]
        assert most == (k + 1 if i % 2 == 0 else 1), (i, most)


def run_requests(
    runner: ModelRunner, requests: list[Request]
) -> tuple[dict[str, list[int]], dict[str, list]]:
    """A minimal driver that also collects logprobs."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=32),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=RUNNER_BLOCKS),
        runner.max_model_len,
    )
    for request in requests:
        scheduler.add_request(request)
    tokens: dict[str, list[int]] = defaultdict(list)
    logprobs: dict[str, list] = defaultdict(list)
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        runner_output = runner.execute_model(scheduler_output)
        asked = any(r.sampling_params.logprobs is not None for r in scheduler.running)
        assert (runner_output.logprobs is not None) == asked
        for engine_outputs in scheduler.update_from_output(
            scheduler_output, runner_output
        ).values():
            for out in engine_outputs.outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    logprobs[out.request_id].extend(out.new_logprobs)
    runner.execute_model(scheduler.schedule())
    assert runner.input_batch.num_reqs == 0
    return dict(tokens), dict(logprobs)


def test_seeded_sampling_ignores_batch_and_logprobs_are_reported(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, logprobs=2)
    alone, logprobs = run_requests(runner, [Request("alone", prompts[3], seeded)])
    others = [
        Request(f"other-{i}", prompts[i], SamplingParams(temperature=1.0, max_tokens=6))
        for i in (0, 9, 12)
    ]
    together, _ = run_requests(runner, [*others, Request("together", prompts[3], seeded)])
    assert together["together"] == alone["alone"]
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=10)
    changed, _ = run_requests(runner, [Request("changed", prompts[3], other_seed)])
    assert changed["changed"] != alone["alone"]

    entries = logprobs["alone"]
    assert len(entries) == len(alone["alone"]) == 10
    for token, entry in zip(alone["alone"], entries, strict=True):
        assert entry.token_ids[0] == token and len(entry.token_ids) == 3
        assert all(lp <= 0.0 for lp in entry.logprobs)
        assert entry.logprobs[1] >= entry.logprobs[2]
        assert entry.logprobs[0] <= entry.logprobs[1] + 1e-5  # the top-1 is the most likely
        if token == entry.token_ids[1]:
            assert entry.logprobs[0] == pytest.approx(entry.logprobs[1], abs=1e-5)


def test_min_tokens_ban_and_stop_check_agree_on_the_model(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    """The model's first greedy token, made a stop id with min_tokens=3, is banned for
    three outputs (the runner) and finishes the request when it comes later (the
    scheduler): both sides use the request's one stop set."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    free, _ = run_requests(runner, [Request("free", prompts[1], greedy)])
    first = free["free"][0]
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[first], min_tokens=3
    )
    request = Request("min", prompts[1], params)
    out, _ = run_requests(runner, [request])
    tokens = out["min"]
    assert first not in tokens[:3]
    if first in tokens:
        assert tokens.index(first) == len(tokens) - 1
        assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == first
    else:
        assert len(tokens) == 8 and request.status == RequestStatus.FINISHED_LENGTH_CAPPED
