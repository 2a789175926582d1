"""The data parallel router, driven by synthetic KV cache events."""

from __future__ import annotations

import pytest

from tokenloom.config import DPLoadBalanceConfig
from tokenloom.core.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from tokenloom.core.kv_cache.hashing import prompt_block_digests
from tokenloom.engine.data_parallel.router import Router

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_router(policy: str = "prefix", n: int = 3, margin: int = 2, ttl: float = 5.0) -> Router:
    config = DPLoadBalanceConfig(policy=policy, load_margin=margin, pending_ttl_s=ttl)  # type: ignore[arg-type]
    return Router(n, config, BS, clock=Clock())


def stored(rank: int, tokens: list[int], lora: int = 0) -> KVEventBatch:
    digests = prompt_block_digests(tokens, BS, lora)
    event = BlockStored(digests, None, tokens[: len(digests) * BS], BS, lora or None)
    return KVEventBatch(0.0, [event], rank)


PROMPT = list(range(100, 100 + 5 * BS))  # five full blocks


def test_round_robin_cycles_and_skips_excluded() -> None:
    router = make_router("round_robin")
    picks = [router.route(f"r{i}", PROMPT) for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    picks = [router.route(f"x{i}", PROMPT, exclude={1}) for i in range(4)]
    assert sorted(set(picks)) == [0, 2]
    assert router.loads == [2 + picks.count(0), 2, 2 + picks.count(2)]


def test_least_load_fills_the_emptiest_core() -> None:
    router = make_router("least_load")
    for i in range(3):
        router.route(f"r{i}", PROMPT)
    assert router.loads == [1, 1, 1]
    router.release("r1")
    assert router.route("new", PROMPT) == 1
    assert router.release("unknown") is None


def test_prefix_goes_to_the_core_holding_the_longest_prefix() -> None:
    router = make_router(margin=10)
    router.apply_events(stored(0, PROMPT[: 2 * BS]))
    router.apply_events(stored(2, PROMPT[: 4 * BS]))
    assert router.route("a", PROMPT + [1]) == 2
    # Another prompt sharing its first two of four blocks with both: a tie, and core 0
    # is less loaded.
    other = PROMPT[: 2 * BS] + [9] * (3 * BS)
    assert router.route("b", other) == 0


def test_only_blocks_before_the_last_prompt_token_count() -> None:
    router = make_router(margin=10)
    router.apply_events(stored(1, PROMPT))
    # The prompt is exactly the five blocks: the last block cannot hit in the core,
    # but the first four can, and only core 1 holds them.
    assert router.route("a", PROMPT) == 1


def test_load_margin_overrides_the_prefix() -> None:
    router = make_router(margin=2)
    router.apply_events(stored(1, PROMPT))
    for i in range(3):  # core 1 holds the prefix: everything goes there ...
        assert router.route(f"r{i}", PROMPT + [i]) == 1
    assert router.loads == [0, 3, 0]
    # ... until its load exceeds the least loaded core's by more than the margin.
    elsewhere = router.route("r3", PROMPT + [3])
    assert elsewhere != 1
    # The prompt now counts as held there too, and that core is less loaded.
    router.release("r0")
    assert router.route("r4", PROMPT + [4]) == elsewhere


def test_removed_and_cleared_blocks_no_longer_attract() -> None:
    router = make_router(margin=10, ttl=1.0)
    router.apply_events(stored(1, PROMPT))
    digests = prompt_block_digests(PROMPT, BS)
    router.apply_events(KVEventBatch(0.0, [BlockRemoved(digests[3:4])], 1))
    router.apply_events(stored(2, PROMPT[: 4 * BS]))
    # Core 1 now holds three blocks as a leading prefix; core 2 holds four.
    assert router.route("a", PROMPT + [0]) == 2
    router.release("a")
    router.apply_events(KVEventBatch(0.0, [AllBlocksCleared()], 2))
    router._clock.now = 2.0  # type: ignore[attr-defined]  # the routed prompt's hold expired
    assert router.route("b", PROMPT + [0]) == 1


def test_routed_prompts_count_as_held_until_they_expire() -> None:
    """Requests sharing a prompt that arrive before any event still land together."""
    router = make_router(margin=10, ttl=5.0)
    first = router.route("a", PROMPT + [0])
    assert all(router.route(f"r{i}", PROMPT + [i]) == first for i in range(1, 5))
    router._clock.now = 10.0  # type: ignore[attr-defined]
    # Expired and never confirmed: the least loaded core wins.
    assert router.route("late", PROMPT + [9]) != first


def test_new_prefixes_go_to_the_emptiest_cache() -> None:
    """A prompt nobody holds half of goes where the fewest blocks are held, not where the
    momentary load is lowest, so distinct prefixes arriving together spread over the cores."""
    router = make_router(n=2, margin=10)
    router.apply_events(stored(0, PROMPT))
    router.route("busy", [7] * BS, exclude={0})  # core 1 holds nothing but is busier
    assert router.loads == [0, 1]
    other = [5] * (5 * BS)
    assert router.route("new", other + [0]) == 1
    # Four distinct prompts interleaved, before any event: each stays on one core, two per core.
    router = make_router(n=2, margin=10)
    prompts = [[p] * (5 * BS) for p in (11, 12, 13, 14)]
    homes: dict[int, set[int]] = {p: set() for p in range(4)}
    for i in range(16):
        homes[i % 4].add(router.route(f"r{i}", prompts[i % 4] + [i]))
    assert all(len(cores) == 1 for cores in homes.values())
    assert sorted(next(iter(c)) for c in homes.values()) == [0, 0, 1, 1]


def test_lora_prefixes_do_not_match_the_base_model() -> None:
    router = make_router(margin=10)
    router.apply_events(stored(2, PROMPT, lora=5))
    assert router.route("base", PROMPT + [0]) == 0
    assert router.route("adapted", PROMPT + [0], lora_int_id=5) == 2


def test_events_of_unknown_ranks_are_ignored_and_forget_engine_resets() -> None:
    router = make_router(margin=10)
    router.apply_events(stored(7, PROMPT))
    router.apply_events(stored(1, PROMPT))
    router.forget_engine(1)
    assert router.route("a", PROMPT + [0]) == 0


def test_no_core_left_is_an_error_and_owner_is_tracked() -> None:
    router = make_router(n=2)
    with pytest.raises(RuntimeError, match="no engine core"):
        router.route("a", PROMPT, exclude={0, 1})
    engine = router.route("b", PROMPT)
    assert router.owner("b") == engine and router.release("b") == engine
    assert router.owner("b") is None and router.loads == [0, 0]


def test_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="^policy must be one of"):
        DPLoadBalanceConfig(policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^load_margin must be an integer >= 0"):
        DPLoadBalanceConfig(load_margin=-1)
