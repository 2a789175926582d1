"""The scheduling decision for one step, as the model runner receives it.

The runner keeps a persistent batch and applies these as deltas: new requests
arrive whole, running ones carry only what changed since the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloom.lora_request import LoRARequest
from tokenloom.multimodal.inputs import MultiModalFeatureSpec
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen before (resumed requests come as cached ones)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    # Tokens already in the cache at the start of this step (prefix-cache hit).
    num_computed_tokens: int
    # Request.stopping_token_ids: banned while fewer than min_tokens outputs exist.
    # None (a hand-built record): the runner derives them with its own EOS id.
    stopping_token_ids: frozenset[int] | None = None
    lora_request: LoRARequest | None = None
    # Output a crashed engine core already produced (a resumed request), else empty.
    output_token_ids: list[int] = field(default_factory=list)
    # The prompt's images, with their arrays (the runner keeps them until the request
    # finishes, so a resumed request brings none).
    mm_features: list[MultiModalFeatureSpec] | None = None
    # A pooling request's parameters (it is pooled, never sampled); None: it generates.
    pooling_params: PoolingParams | None = None


@dataclass
class CachedRequestData:
    """Requests the runner already holds, column-wise.

    ``new_token_ids[i]`` is empty for running requests (the runner already
    holds what it sampled); for a resumed request it is every output token
    generated before the preemption, so the runner can rebuild its state.
    ``new_block_ids[i]`` is the blocks added this step (None if none), or the
    whole block list of a request resumed after preemption (listed in
    ``resumed_req_ids``).
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step: how many tokens each request gets, plus the deltas above."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    num_common_prefix_blocks: int
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    # Request id -> indices of its items the runner encodes this step (each identifier
    # at most once in a step), and identifiers whose encoder outputs it may drop.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # What the KV connector's worker side loads and saves this step (None: no connector).
    kv_connector_metadata: Any = None
