"""Scheduling a request's encoder inputs (images) beside its tokens.

An item's encoder output is needed in the step whose tokens first reach its
placeholder, and in each later step that computes more of it (chunked
prefill). ``schedule_encoder_inputs`` decides, for the tokens the scheduler
would give a request this step, which items the runner must encode: those
whose placeholder the tokens overlap, whose KV is not already computed
(a prefix-cache hit past the whole item), and whose output the encoder cache
does not hold. An item is encoded whole, within the step's encoder compute
budget and the cache's room; when either is short, the request's tokens this
step stop just before that item's placeholder (none at all when the
computed prefix already reaches into it).

The caller claims the items (``EncoderCacheManager.allocate``) only once the
request's KV slots are allocated, and ``release_passed_encoder_inputs``
releases an item once the request's computed tokens have passed it.
"""

from __future__ import annotations

from tokenloom.config import SchedulerConfig
from tokenloom.core.encoder_cache_manager import EncoderCacheManager
from tokenloom.request import Request


def encoder_budgets(config: SchedulerConfig, max_tokens_per_item: int) -> tuple[int, int]:
    """(encoder compute budget per step, encoder cache size), in encoder tokens.

    Unset, each is the step's token budget; either is raised to the largest
    single item the model can produce, so that every item can be encoded.
    """
    budget = config.max_num_encoder_input_tokens
    cache = config.encoder_cache_size
    if budget is None:
        budget = config.max_num_batched_tokens
    if cache is None:
        cache = config.max_num_batched_tokens
    return max(budget, max_tokens_per_item), max(cache, max_tokens_per_item)


def schedule_encoder_inputs(
    request: Request,
    num_computed_tokens: int,
    num_new_tokens: int,
    encoder_budget: int,
    cache: EncoderCacheManager,
) -> tuple[list[int], int, int]:
    """(items to encode this step, tokens the request may have, encoder tokens of the items).

    Items found in the cache are referenced by the request from here on (see
    ``EncoderCacheManager.check_and_update_cache``).
    """
    features = request.mm_features
    if not num_new_tokens or not features:
        return [], num_new_tokens, 0
    to_encode: list[int] = []
    # Rows this request claims this step, and identifiers already chosen (a prompt
    # may show the same image twice: it is encoded once).
    claimed = 0
    chosen: set[str] = set()
    end = num_computed_tokens + num_new_tokens
    for i, feature in enumerate(features):
        start = feature.mm_position.offset
        length = feature.mm_position.length
        if start >= end:
            break  # this step's tokens stop before the item, and before every later one
        if start + length <= num_computed_tokens:
            continue  # computed already: its KV is in the cache
        if feature.identifier in chosen or cache.check_and_update_cache(request, i):
            continue
        if not cache.can_allocate(request, i, encoder_budget, claimed):
            # The encoder attends over a whole item: it is encoded whole or not at
            # all, so the tokens stop before it.
            num_new_tokens = max(start - num_computed_tokens, 0)
            break
        claimed += length
        encoder_budget -= length
        chosen.add(feature.identifier)
        to_encode.append(i)
    return to_encode, num_new_tokens, claimed


def release_passed_encoder_inputs(request: Request, cache: EncoderCacheManager) -> None:
    """Release the items whose placeholder the request's computed tokens have passed."""
    features = request.mm_features
    assert features is not None
    computed = request.num_computed_tokens
    for i in cache.get_cached_input_ids(request):
        if features[i].mm_position.end <= computed:
            cache.free_encoder_input(request, i)
