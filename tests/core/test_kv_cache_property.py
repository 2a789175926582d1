"""Random allocate/free/cache sequences against a simulated KV cache.

The test plays model runner: every scheduled token writes, into its slot, the
exact token prefix it ends. A prefix hit must hand out blocks whose slots hold
exactly the request's own prefix, so a wrong hit (hash collision, stale
eviction) fails here. ``check_integrity()`` runs after every operation.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tokenloom.core.kv_cache import KVCacheManager, hashing
from tokenloom.request import Request
from tokenloom.sampling_params import SamplingParams

BS = 2
BASES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 1, 2, 3, 4]]

# One op: (kind, index, amount, lookahead, tail tokens); fields a kind does
# not use are ignored. Kinds are listed with weights so requests share prefixes.
KINDS = ["add"] * 3 + ["step"] * 4 + ["decode"] * 2 + ["preempt", "finish", "cache", "reset"]
op = st.tuples(
    st.sampled_from(KINDS),
    st.integers(0, 7),
    st.integers(1, 8),
    st.integers(0, 3),
    st.lists(st.integers(0, 2), max_size=3),
)


class Runner:
    """Scheduler + model runner stand-in that records what each KV slot holds."""

    def __init__(self, num_blocks: int) -> None:
        self.m = KVCacheManager(num_blocks, BS, max_model_len=24)
        self.kv: dict[int, list[tuple[int, ...] | None]] = {}
        self.live: list[Request] = []
        self.next_id = 0
        self.num_hit_blocks = 0
        self.num_refused = 0

    def pick(self, index: int) -> Request | None:
        return self.live[index % len(self.live)] if self.live else None

    def run(self, request: Request, chunk: int, lookahead: int) -> None:
        m = self.m
        computed, num_hit = None, 0
        if not m.get_block_ids(request.request_id):
            computed, num_hit = m.get_computed_blocks(request)
            assert num_hit <= request.num_tokens - 1
            for i, block_id in enumerate(computed.get_block_ids()):
                for slot in range(BS):
                    expected = tuple(request.all_token_ids[: i * BS + slot + 1])
                    assert self.kv[block_id][slot] == expected, "prefix hit on wrong KV"
        remaining = request.num_tokens - request.num_computed_tokens - num_hit
        num_new = min(chunk, remaining)
        if num_new <= 0:
            return
        free_before = m.num_free_blocks
        new = m.allocate_slots(request, num_new, num_hit, computed, lookahead)
        if new is None:
            # Oracle: the blocks still missing plus the free hit blocks it must
            # take out of the free queue exceed what is free.
            held = len(m.get_block_ids(request.request_id))
            hits = computed.blocks if computed is not None else ()
            slots = min(request.num_computed_tokens + num_hit + num_new + lookahead, 24)
            missing = max(-(-slots // BS) - held - len(hits), 0)
            assert missing + sum(b.ref_cnt == 0 for b in hits) > free_before
            self.num_refused += 1
            return
        self.num_hit_blocks += num_hit // BS
        ids = m.get_block_ids(request.request_id)
        start = request.num_computed_tokens + num_hit
        for pos in range(start, start + num_new):
            slots = self.kv.setdefault(ids[pos // BS], [None] * BS)
            slots[pos % BS] = tuple(request.all_token_ids[: pos + 1])
        request.num_computed_tokens = start + num_new

    def apply(self, operation: tuple) -> None:
        kind, index, amount, lookahead, tail = operation
        if kind == "add":
            base = BASES[index % len(BASES)]
            tokens = base[: 2 + amount % (len(base) - 1)] + tail
            request = Request(f"r{self.next_id}", tokens, SamplingParams(max_tokens=None))
            self.next_id += 1
            self.live.append(request)
            return
        if kind == "reset":
            in_use = self.m.num_free_blocks < self.m.num_usable_blocks
            assert self.m.reset_prefix_cache() is (not in_use)
            return
        request = self.pick(index)
        if request is None:
            return
        if kind == "step":
            self.run(request, amount, lookahead)
        elif kind == "decode" and request.num_computed_tokens == request.num_tokens:
            if request.num_tokens < 20:
                request.append_output_token_ids([amount % 3], self.m.max_model_len)
                self.run(request, 1, 0)
        elif kind == "preempt":
            self.m.free(request)
            request.num_computed_tokens = 0
        elif kind == "finish":
            self.m.free(request)
            self.live.remove(request)
        elif kind == "cache":
            self.m.cache_blocks(request, request.num_computed_tokens)

    def finish_all(self) -> None:
        for request in self.live:
            self.m.free(request)
        m = self.m
        m.check_integrity()
        assert m.num_free_blocks == m.num_blocks - 1 and m.usage == 0.0
        assert all(block.ref_cnt == 0 for block in m.block_pool.blocks)
        assert m.reset_prefix_cache()
        m.check_integrity()


def _play(num_blocks: int, ops: list[tuple]) -> Runner:
    runner = Runner(num_blocks)
    for operation in ops:
        runner.apply(operation)
        runner.m.check_integrity()
    runner.finish_all()
    return runner


def test_fixed_sequence_exercises_hits_evictions_and_refusals() -> None:
    # (kind, index, amount, lookahead, tail); indices pick from live requests.
    ops = [
        ("add", 0, 6, 0, []),  # r0 = 1..8
        ("step", 0, 8, 0, []),
        ("add", 0, 6, 0, [2]),  # r1 = 1..8, 2: hits r0's 4 blocks
        ("step", 1, 8, 0, []),
        ("finish", 0, 0, 0, []),  # live: r1
        ("add", 2, 6, 0, []),  # r2 = 5..8, 1..4: no hit; fills the pool
        ("step", 1, 8, 0, []),
        ("add", 0, 2, 0, [0, 1]),  # r3 = 1..4, 0, 1: hits 2 held blocks
        ("step", 2, 8, 3, []),  # 3 new blocks wanted, none free: refused
        ("finish", 0, 0, 0, []),  # live: r2, r3; r1's blocks become free
        ("step", 1, 8, 3, []),  # r3 hits the 2 now-free blocks again
    ]
    runner = _play(10, ops)
    assert runner.num_hit_blocks == 4 + 2
    assert runner.num_refused == 1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(2, 12), ops=st.lists(op, min_size=10, max_size=80))
def test_random_operations_keep_integrity_and_exact_hits(num_blocks: int, ops: list) -> None:
    runner = _play(num_blocks, ops)
    event(f"hit blocks > 0: {runner.num_hit_blocks > 0}")
    event(f"refused allocations > 0: {runner.num_refused > 0}")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(2, 12), ops=st.lists(op, min_size=10, max_size=80))
def test_random_operations_with_every_digest_colliding(num_blocks: int, ops: list) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hashing, "digest_block", lambda parent, tokens: 0)
        runner = _play(num_blocks, ops)
    event(f"hit blocks > 0: {runner.num_hit_blocks > 0}")
    event(f"refused allocations > 0: {runner.num_refused > 0}")
