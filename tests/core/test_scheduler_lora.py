"""The scheduler's LoRA rules: at most ``max_loras`` adapters among running
requests (a request whose adapter would exceed it waits while others behind it
go first), and prefix-cache blocks keyed by the adapter."""

from __future__ import annotations

from tests.core.utils import Harness, assert_no_leaks, make_request, make_scheduler
from tokenloom.config import LoRAConfig
from tokenloom.lora_request import LoRARequest

A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")
C = LoRARequest("c", 3, "/adapters/c")


def test_max_loras_limits_adapters_per_step() -> None:
    h = Harness(make_scheduler(lora_config=LoRAConfig(max_loras=2)))
    h.add(
        make_request("a1", 8, lora_request=A, max_tokens=3),
        make_request("b1", 8, lora_request=B, max_tokens=3),
        make_request("c1", 8, lora_request=C, max_tokens=3),  # a third adapter: waits
        make_request("a2", 8, lora_request=A, max_tokens=3),  # same adapter as a1: runs
        make_request("base", 8, max_tokens=3),  # base model: no adapter slot needed
    )
    so = h.step()
    assert set(so.num_scheduled_tokens) == {"a1", "b1", "a2", "base"}
    assert [r.request_id for r in h.scheduler.waiting] == ["c1"]
    new = {n.req_id: n.lora_request for n in so.scheduled_new_reqs}
    assert new == {"a1": A, "b1": B, "a2": A, "base": None}
    seen_together: list[set[int]] = []
    while h.scheduler.has_requests():
        so = h.step()
        ids = {
            h.scheduler.requests[r].lora_int_id
            for r in so.num_scheduled_tokens
            if r in h.scheduler.requests
        }
        seen_together.append(ids - {0})
    assert all(len(ids) <= 2 for ids in seen_together)
    assert set(h.finished) == {"a1", "b1", "c1", "a2", "base"}
    assert_no_leaks(h.scheduler)


def test_without_lora_config_adapters_are_not_limited() -> None:
    h = Harness(make_scheduler())
    h.add(
        *(make_request(f"r{i}", 4, lora_request=r, max_tokens=1) for i, r in enumerate((A, B, C)))
    )
    assert len(h.step().num_scheduled_tokens) == 3
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_prefix_cache_is_keyed_by_adapter() -> None:
    """Same prompt: a hit for the same adapter, none across adapters or with the base."""
    h = Harness(make_scheduler(block_size=4, lora_config=LoRAConfig(max_loras=4)))
    prompt = list(range(100, 117))  # 4 full blocks + 1
    h.add(make_request("first", prompt, lora_request=A, max_tokens=1))
    h.run_until_done()
    cached = {}
    for name, lora in (("same", A), ("other", B), ("base", None), ("again", A)):
        h.add(make_request(name, prompt, lora_request=lora, max_tokens=1))
        h.run_until_done()
        cached[name] = h.finished[name].num_cached_tokens
    assert cached == {"same": 16, "other": 0, "base": 0, "again": 16}
    assert_no_leaks(h.scheduler)
