"""What the sampler needs to know about each row of logits, as batched tensors.

One row is one sampled position: a request's last token, or one of the 1 + k
positions of a request verifying k draft tokens. Optional parts are None when
no row needs them, so the sampler skips that work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    # [R] float32; 0.0 marks a greedy row.
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    # [R] int64 in [1, vocab]; vocab (or more) means off. None: no row uses top-k.
    top_k: torch.Tensor | None = None
    # [R] float32 in (0, 1]. None: no row uses top-p.
    top_p: torch.Tensor | None = None
    # [R] float32 in [0, 1]. None: no row uses min-p.
    min_p: torch.Tensor | None = None
    # Row -> generator for seeded requests; the other rows share one batched draw.
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    # Penalties: all three [R] float32 tensors, or all None.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # [R, P] int64 padded with vocab_size; only needed for the repetition penalty.
    prompt_token_ids: torch.Tensor | None = None
    # [R, O] int64 padded with vocab_size: tokens generated before this row's position.
    output_token_ids: torch.Tensor | None = None

    # Token ids banned at a row (its request's stopping token ids while min_tokens is
    # not reached): parallel 1-D int64 tensors.
    banned_rows: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None

    # Per row: how many top logprobs to return (-1: none requested). None: no row asked.
    num_logprobs: list[int] | None = None

    @property
    def no_penalties(self) -> bool:
        return self.presence_penalties is None
