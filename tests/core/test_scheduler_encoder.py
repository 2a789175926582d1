"""Encoder inputs (images) scheduled beside tokens: budgets, sharing, prefix caching,
preemption. The fake runner checks every step that each image a request's tokens
reach is held (encoded that step or kept from an earlier one); every test ends
with the leak check, encoder cache included."""

from __future__ import annotations

import random

import pytest

from tests.core.utils import FakeRunner, Harness, assert_no_leaks, make_request, make_scheduler
from tokenloom.config import SchedulerConfig
from tokenloom.core.sched.encoder_inputs import encoder_budgets
from tokenloom.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from tokenloom.request import Request, RequestStatus

IMAGE_TOKEN = 7


def _image_request(
    req_id: str,
    images: list[tuple[str, int, int]],
    prompt_len: int,
    max_tokens: int = 3,
    text_seed: int = 0,
) -> Request:
    """A prompt of ``prompt_len`` tokens with images (identifier, offset, length)
    whose placeholders are IMAGE_TOKEN; the text tokens depend on ``text_seed`` only."""
    tokens = [100 + (text_seed * 31 + i) % 50 for i in range(prompt_len)]
    features = []
    for identifier, offset, length in images:
        tokens[offset : offset + length] = [IMAGE_TOKEN] * length
        features.append(MultiModalFeatureSpec(identifier, PlaceholderRange(offset, length)))
    return make_request(req_id, tokens, max_tokens=max_tokens, mm_features=features)


def test_an_image_is_encoded_in_the_step_whose_tokens_reach_it() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=8, block_size=4, max_tokens_per_mm_item=12))
    request = _image_request("a", [("x", 10, 12)], prompt_len=30)
    h.add(request)
    encoded_at = []
    for step in range(4):
        so = h.step()
        if so.scheduled_encoder_inputs:
            encoded_at.append(step)
            assert so.scheduled_encoder_inputs == {"a": [0]}
    # Tokens [0, 8) stop before the image; [8, 16) reach it; later chunks reuse it.
    assert encoded_at == [1]
    assert h.runner.encoded[1] == ["x"]
    # Computed past the image (32 > 22): the request no longer holds it.
    assert h.scheduler.encoder_cache_manager.get_cached_input_ids(request) == set()
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_an_exhausted_encoder_budget_cuts_the_tokens_before_the_image() -> None:
    h = Harness(
        make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=10, block_size=4)
    )
    a = _image_request("a", [("x", 4, 10)], prompt_len=20)
    b = _image_request("b", [("y", 4, 10)], prompt_len=20, text_seed=1)
    h.add(a, b)
    so = h.step()
    # a's image takes the whole encoder budget: b gets the 4 tokens before its image.
    assert so.scheduled_encoder_inputs == {"a": [0]}
    assert so.num_scheduled_tokens == {"a": 20, "b": 4}
    so = h.step()
    assert so.scheduled_encoder_inputs == {"b": [0]}
    assert so.num_scheduled_tokens == {"a": 1, "b": 16}
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_a_second_image_past_the_budget_waits_for_the_next_step() -> None:
    h = Harness(
        make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=12, block_size=4)
    )
    h.add(_image_request("a", [("x", 2, 8), ("y", 12, 8)], prompt_len=30))
    so = h.step()
    assert so.scheduled_encoder_inputs == {"a": [0]}
    assert so.num_scheduled_tokens == {"a": 12}
    so = h.step()
    assert so.scheduled_encoder_inputs == {"a": [1]}
    assert so.num_scheduled_tokens == {"a": 18}
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_a_full_encoder_cache_cuts_before_the_image_until_room_is_released() -> None:
    h = Harness(
        make_scheduler(
            max_num_batched_tokens=64, encoder_cache_size=10, block_size=4, max_num_seqs=8
        )
    )
    a = _image_request("a", [("x", 4, 10)], prompt_len=20)
    b = _image_request("b", [("y", 4, 10)], prompt_len=20, text_seed=1)
    h.add(a, b)
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 20, "b": 4}
    # a's prompt is past its image, so x is released (kept, unreferenced) and b's
    # image evicts it.
    so = h.step()
    assert so.scheduled_encoder_inputs == {"b": [0]}
    assert so.free_encoder_mm_hashes == ["x"]
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_an_image_shared_by_two_requests_is_encoded_once() -> None:
    h = Harness(make_scheduler(block_size=4, enable_prefix_caching=False))
    a = _image_request("a", [("x", 3, 10)], prompt_len=20)
    b = _image_request("b", [("x", 5, 10)], prompt_len=22, text_seed=1)
    h.add(a, b)
    so = h.step()
    assert so.scheduled_encoder_inputs == {"a": [0]}
    assert so.num_scheduled_tokens == {"a": 20, "b": 22}
    h.run_until_done()
    # Kept after both finished: a later request showing it encodes nothing.
    h.add(_image_request("c", [("x", 1, 10)], prompt_len=15, text_seed=2))
    so = h.step()
    assert so.scheduled_encoder_inputs == {}
    h.run_until_done()
    assert [ids for ids in h.runner.encoded if ids] == [["x"]]
    assert_no_leaks(h.scheduler)


def test_the_same_image_twice_in_one_prompt_is_encoded_once() -> None:
    h = Harness(make_scheduler(block_size=4))
    h.add(_image_request("a", [("x", 2, 6), ("x", 10, 6)], prompt_len=20))
    so = h.step()
    assert so.scheduled_encoder_inputs == {"a": [0]}
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_without_the_encoder_cache_each_request_encodes_its_own() -> None:
    h = Harness(
        make_scheduler(block_size=4, enable_prefix_caching=False, enable_encoder_cache=False)
    )
    h.add(
        _image_request("a", [("x", 3, 10)], prompt_len=20),
        _image_request("b", [("x", 5, 10)], prompt_len=22, text_seed=1),
    )
    so = h.step()
    assert so.scheduled_encoder_inputs == {"a": [0], "b": [0]}
    assert sorted(so.free_encoder_mm_hashes) == []
    so = h.step()
    assert so.free_encoder_mm_hashes == ["x"]  # released by both: dropped at once
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_an_image_whose_kv_is_cached_is_not_encoded() -> None:
    # The encoder cache keeps nothing, so only the prefix cache can spare the encoder.
    h = Harness(make_scheduler(block_size=4, enable_encoder_cache=False))
    h.add(_image_request("a", [("x", 4, 12)], prompt_len=24))
    h.run_until_done()
    h.add(_image_request("b", [("x", 4, 12)], prompt_len=24))
    so = h.step()
    assert h.scheduler.requests["b"].num_cached_tokens == 20
    assert so.scheduled_encoder_inputs == {}
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_a_prefix_hit_ending_inside_an_image_still_encodes_it() -> None:
    h = Harness(make_scheduler(block_size=4, enable_encoder_cache=False))
    h.add(_image_request("a", [("x", 4, 12)], prompt_len=24, max_tokens=1))
    h.run_until_done()
    # Same text and image for 12 tokens (3 blocks hit), then the prompt differs.
    b = _image_request("b", [("x", 4, 12)], prompt_len=24, max_tokens=1)
    b.prompt_token_ids[14:] = b.all_token_ids[14:] = [60] * 10
    h.add(b)
    so = h.step()
    assert b.num_cached_tokens == 12
    assert so.scheduled_encoder_inputs == {"b": [0]}
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_different_images_at_the_same_positions_never_share_blocks() -> None:
    h = Harness(make_scheduler(block_size=4))
    h.add(_image_request("a", [("x", 6, 8)], prompt_len=24))
    h.run_until_done()
    # Same tokens, another image: only the block before the image hits.
    b = _image_request("b", [("y", 6, 8)], prompt_len=24)
    h.add(b)
    h.step()
    assert b.num_cached_tokens == 4
    h.run_until_done()
    # The first image again: every block hits (the last token is recomputed).
    c = _image_request("c", [("x", 6, 8)], prompt_len=24)
    h.add(c)
    h.step()
    assert c.num_cached_tokens == 20
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_a_preempted_request_releases_its_encoder_outputs() -> None:
    # 6 usable blocks of 4 tokens: b's next chunk cannot get blocks while a decodes.
    h = Harness(
        make_scheduler(max_num_batched_tokens=12, block_size=4, num_blocks=7, max_num_seqs=4)
    )
    a = make_request("a", 8, max_tokens=6)
    b = _image_request("b", [("x", 2, 12)], prompt_len=16)
    h.add(a, b)
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 8, "b": 4}
    assert so.scheduled_encoder_inputs == {"b": [0]}
    cache = h.scheduler.encoder_cache_manager
    assert cache.get_cached_input_ids(b) == {0}
    so = h.step()
    assert so.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    assert cache.get_cached_input_ids(b) == set() and cache.num_referenced == 0
    h.run_until_done()
    assert "b" in h.finished
    assert_no_leaks(h.scheduler)


def test_an_image_larger_than_the_encoder_budget_is_unservable() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=8, block_size=4))
    h.add(_image_request("a", [("x", 2, 10)], prompt_len=16))
    h.step()
    assert h.finished["a"].finish_reason is not None
    assert_no_leaks(h.scheduler)


def test_budgets_default_to_the_step_budget_raised_to_the_largest_item() -> None:
    assert encoder_budgets(SchedulerConfig(max_num_batched_tokens=512), 0) == (512, 512)
    assert encoder_budgets(SchedulerConfig(max_num_batched_tokens=512), 576) == (576, 576)
    config = SchedulerConfig(max_num_encoder_input_tokens=1000, encoder_cache_size=3000)
    assert encoder_budgets(config, 576) == (1000, 3000)
    assert encoder_budgets(SchedulerConfig(encoder_cache_size=100), 576) == (2048, 576)
    with pytest.raises(ValueError, match="encoder_cache_size"):
        SchedulerConfig(encoder_cache_size=0)


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_keep_the_runner_supplied(seed: int) -> None:
    """Images from a small pool, short budgets and caches, prefix caching, chunking and
    preemption: the fake runner never misses an image, and nothing leaks."""
    rng = random.Random(seed)
    h = Harness(
        make_scheduler(
            max_num_batched_tokens=rng.choice([16, 24, 40]),
            max_num_encoder_input_tokens=rng.choice([12, 20]),
            encoder_cache_size=rng.choice([12, 24, 48]),
            enable_encoder_cache=rng.random() < 0.7,
            enable_prefix_caching=rng.random() < 0.7,
            policy=rng.choice(["fcfs", "priority"]),
            block_size=4,
            num_blocks=rng.choice([14, 30]),
            max_num_seqs=4,
        ),
        FakeRunner(seed=seed),
    )
    pool = {"p": 4, "q": 7, "r": 12}  # an image always has the same number of tokens
    for i in range(14):
        prompt_len = rng.randint(12, 36)
        images = []
        offset = rng.randint(0, 4)
        while len(images) < 3:
            identifier = rng.choice(list(pool))
            if offset + pool[identifier] > prompt_len:
                break
            images.append((identifier, offset, pool[identifier]))
            offset += pool[identifier] + rng.randint(0, 6)
        request = _image_request(
            f"r{i}", images, prompt_len, max_tokens=rng.randint(1, 6), text_seed=rng.randint(0, 2)
        )
        request.priority = rng.randint(0, 2)
        h.add(request)
        for _ in range(rng.randint(0, 2)):
            if h.scheduler.has_requests():
                h.step()
    h.run_until_done()
    assert len(h.finished) == 14
    assert_no_leaks(h.scheduler)


@pytest.mark.parametrize("sharer", [False, True], ids=["alone", "shared"])
def test_an_encoding_taken_back_by_preemption_in_the_same_step(sharer: bool) -> None:
    """Priority policy: v (lowest priority) is scheduled first and would encode x, then
    c's decode needs a block and v is preempted. x was never computed: it is forgotten,
    or, when r took it from the cache in the same step, r encodes it instead."""
    h = Harness(
        make_scheduler(
            max_num_batched_tokens=20,
            long_prefill_token_threshold=8,
            policy="priority",
            block_size=4,
            num_blocks=12 if sharer else 8,
            max_num_seqs=4,
            enable_prefix_caching=False,
        )
    )
    v = _image_request("v", [("x", 16, 4)], prompt_len=22, max_tokens=2)
    v.priority = 5
    h.add(v)
    h.step()
    c = make_request("c", 4, max_tokens=4, priority=2)
    if sharer:
        r = _image_request("r", [("x", 10, 4)], prompt_len=14, max_tokens=2, text_seed=1)
        r.priority = 1
        h.add(r)
    h.add(c)
    h.step()
    so = h.step()
    assert so.preempted_req_ids == {"v"}
    assert so.scheduled_encoder_inputs == ({"r": [0]} if sharer else {})
    assert ("x" in h.scheduler.encoder_cache_manager.cached) == sharer
    h.run_until_done()
    # v encodes x itself once it runs again (unless r's output is still kept).
    assert [ids for ids in h.runner.encoded if ids] == [["x"]]
    assert_no_leaks(h.scheduler)
