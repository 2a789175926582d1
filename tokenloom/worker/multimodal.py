"""The runner's side of images: the encoder cache, and images into the text model's inputs.

Each step, before the forward pass (``update``):

- requests that finished take their images along; encoder outputs the
  scheduler freed (``free_encoder_mm_hashes``) are dropped;
- the step's ``scheduled_encoder_inputs`` run through the vision tower
  (``model.embed_images``), each identifier once, and their outputs (one row
  per placeholder token) are kept by identifier until freed.

Then ``prepare`` gives the model its inputs: the token embeddings with each
image's rows written over the placeholder positions this step computes (a
chunk of a prompt may hold part of an image), and, for multimodal RoPE
(Qwen2.5-VL), [3, T] positions: a prompt's from ``multimodal.mrope``,
computed once per request, and ``position + delta`` past the prompt.

A request keeps its images until it finishes (a preempted one comes back as
a resumed request, without them).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.multimodal.families import max_tokens_per_image
from tokenloom.multimodal.inputs import MultiModalFeatureSpec
from tokenloom.multimodal.mrope import mrope_positions
from tokenloom.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


class MultiModalRunner:
    """Encoder outputs by identifier and each running request's images.

    ``encoder_time_s`` and ``num_encoded`` add up the vision tower's work;
    ``num_unscheduled_encodes`` counts images a step needed that the scheduler
    had not scheduled (encoded then, so the step stays correct; 0 unless the
    scheduler errs).

    ``share=False`` (the encoder cache disabled, for measuring it): each request
    scheduled to encode an image encodes it, even when another request in the
    same step shows the same image.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        arch: ModelArchConfig,
        model_path: Path,
        device: torch.device,
        *,
        share: bool = True,
    ) -> None:
        self.share = share
        assert arch.vision is not None
        self.model = model
        self.device = device
        self.max_tokens_per_item = max_tokens_per_image(arch.vision, model_path)
        self.uses_mrope = arch.mrope_section is not None
        self.merge_size = int(arch.vision.vision_config.get("spatial_merge_size", 1))
        self.features: dict[str, list[MultiModalFeatureSpec]] = {}
        self._mrope: dict[str, tuple[np.ndarray, int]] = {}
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.encoder_time_s = 0.0
        self.num_encoded = 0
        self.num_unscheduled_encodes = 0

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the step's image changes and run its scheduled encoder inputs."""
        for req_id in scheduler_output.finished_req_ids:
            self.features.pop(req_id, None)
            self._mrope.pop(req_id, None)
        for identifier in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(identifier, None)
        for new in scheduler_output.scheduled_new_reqs:
            if new.mm_features:
                self.features[new.req_id] = new.mm_features
                if self.uses_mrope:
                    self._mrope[new.req_id] = self._prompt_positions(
                        len(new.prompt_token_ids), new.mm_features
                    )
        todo: dict[str, MultiModalFeatureSpec] = {}
        repeats: list[MultiModalFeatureSpec] = []
        for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
            features = self.features[req_id]
            for i in input_ids:
                if features[i].identifier in todo and not self.share:
                    repeats.append(features[i])
                todo.setdefault(features[i].identifier, features[i])
        if todo:
            # Unshared, the repeats are encoded too (their outputs equal the first's).
            self._encode(list(todo.values()) + repeats)

    def prepare(self, step: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(input embeddings with images in place, or None when the step computes no
        image position; the positions the model rotates by)."""
        if not self.features:
            return None, step.positions
        embeds: torch.Tensor | None = None
        positions3: torch.Tensor | None = None
        query_lens = step.query_lens.tolist()
        starts = (step.seq_lens - step.query_lens).tolist()
        flat = 0
        for req_id, start, num in zip(step.req_ids, starts, query_lens, strict=True):
            features = self.features.get(req_id)
            if features is not None:
                end = start + num
                for feature in features:
                    first, last = feature.mm_position.offset, feature.mm_position.end
                    if first >= end:
                        break
                    a, b = max(start, first), min(end, last)
                    if a >= b:
                        continue
                    if embeds is None:
                        embeds = self.model.embed(step.input_ids)  # type: ignore[operator]
                    output = self._output(feature)
                    embeds[flat + a - start : flat + b - start] = output[a - first : b - first]
                if self.uses_mrope:
                    if positions3 is None:
                        positions3 = step.positions.unsqueeze(0).repeat(3, 1)
                    self._place_positions(positions3, req_id, start, num, flat)
            flat += num
        return embeds, step.positions if positions3 is None else positions3

    def _place_positions(
        self, positions3: torch.Tensor, req_id: str, start: int, num: int, flat: int
    ) -> None:
        prompt, delta = self._mrope[req_id]
        prompt_len = prompt.shape[1]
        end = start + num
        if start < prompt_len:
            stop = min(end, prompt_len)
            rows = torch.from_numpy(prompt[:, start:stop]).to(self.device)
            positions3[:, flat : flat + stop - start] = rows
        if end > prompt_len and delta:
            first = flat + max(prompt_len, start) - start
            positions3[:, first : flat + num] += delta

    def _prompt_positions(
        self, num_prompt_tokens: int, features: list[MultiModalFeatureSpec]
    ) -> tuple[np.ndarray, int]:
        images = []
        for feature in features:
            assert feature.data is not None
            grid = feature.data["image_grid_thw"].to_numpy().reshape(-1)
            images.append((feature.mm_position.offset, (int(grid[0]), int(grid[1]), int(grid[2]))))
        return mrope_positions(num_prompt_tokens, images, self.merge_size)

    def _output(self, feature: MultiModalFeatureSpec) -> torch.Tensor:
        output = self.encoder_cache.get(feature.identifier)
        if output is None:
            logger.warning(
                "image %s was needed but not scheduled for encoding; encoding it now",
                feature.identifier,
            )
            self.num_unscheduled_encodes += 1
            self._encode([feature])
            output = self.encoder_cache[feature.identifier]
        return output

    def _encode(self, features: list[MultiModalFeatureSpec]) -> None:
        started = time.perf_counter()
        items = []
        for feature in features:
            if feature.data is None:
                raise ValueError(f"image {feature.identifier} has no data to encode")
            items.append(
                {
                    name: torch.from_numpy(array.to_numpy().copy()).to(self.device)
                    for name, array in feature.data.items()
                }
            )
        with torch.inference_mode():
            outputs = self.model.embed_images(items)  # type: ignore[operator]
        for feature, output in zip(features, outputs, strict=True):
            if output.shape[0] != feature.mm_position.length:
                raise ValueError(
                    f"image {feature.identifier} encodes to {output.shape[0]} embeddings for "
                    f"{feature.mm_position.length} placeholder tokens"
                )
            self.encoder_cache[feature.identifier] = output
        self.num_encoded += len(features)
        self.encoder_time_s += time.perf_counter() - started
