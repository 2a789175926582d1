"""Vision-language models through the whole engine (``LLM``: image processing, encoder
scheduling, the encoder cache, the runner writing image rows into the text model's
inputs) give transformers' logits and greedy tokens, in fp32, for tiny random models
of each family built from transformers' own configs: LLaVA with a CLIP tower, LLaVA
with a SigLIP tower, Qwen2.5-VL (windowed attention, multimodal RoPE).

Scenarios: one image; several images of different sizes; images split over chunks
of a chunked prefill; a batch mixing image and text-only requests, where two
requests show the same image (encoded once). Every logits row the engine samples
from is compared with transformers' full forward over the final sequence.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vl_models import make_llava, make_qwen2_5_vl, random_image, reference_logits
from tokenloom import LLM, SamplingParams

FAMILIES = ("llava_clip", "llava_siglip", "qwen2_5_vl")
MAX_TOKENS = 6
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    path = tmp_path_factory.mktemp(name)
    if name == "qwen2_5_vl":
        hf_model = make_qwen2_5_vl(path, seed=3)
    else:
        hf_model = make_llava(path, tower=name.removeprefix("llava_"), seed=1)
    return name, hf_model, path


def _placeholder(name: str) -> str:
    return "<|vision_start|><|image_pad|><|vision_end|>" if name == "qwen2_5_vl" else "<image>\n"


def _capture_logits(llm: LLM) -> dict[str, list[torch.Tensor]]:
    """Every logits row the runner samples from, by request id."""
    runner = llm.client.core.runner
    captured: dict[str, list[torch.Tensor]] = defaultdict(list)
    sample = runner._sample

    def capturing(step: Any, logits: torch.Tensor, metadata: Any) -> Any:
        for row, i in enumerate(step.sample_idx.tolist()):
            captured[step.req_ids[i]].append(logits[row].clone())
        return sample(step, logits, metadata)

    runner._sample = capturing
    return captured


def _run_and_compare(
    name: str, hf_model: Any, path: Path, prompts: list[tuple[str, list]], **engine: Any
) -> LLM:
    llm = LLM(
        str(path), dtype="float32", num_blocks=256, max_model_len=1024, log_stats=False, **engine
    )
    captured = _capture_logits(llm)
    batch = [
        {"prompt": text, "multi_modal_data": {"image": images}} if images else text
        for text, images in prompts
    ]
    outputs = llm.generate(
        batch, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    for (_, images), output in zip(prompts, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        sequence = list(output.prompt_token_ids) + list(tokens)
        reference = reference_logits(hf_model, path, sequence, images)
        prompt_len = len(output.prompt_token_ids)
        expected = reference[prompt_len - 1 : prompt_len - 1 + len(tokens)]
        ours = torch.stack(captured[output.request_id])
        assert ours.shape == expected.shape
        diff = (ours - expected).abs().max().item()
        assert diff < TOLERANCE, f"{name}: max |logit diff| {diff:.2e}"
        assert tokens == expected.argmax(-1).tolist(), f"{name}: greedy tokens differ"
    runner = llm.client.core.runner
    assert runner.multimodal.num_unscheduled_encodes == 0
    return llm


def test_one_image(family) -> None:
    name, hf_model, path = family
    prompt = f"USER: {_placeholder(name)}What is in the picture? ASSISTANT:"
    _run_and_compare(name, hf_model, path, [(prompt, [random_image(0, 60, 44)])])


def test_several_images(family) -> None:
    name, hf_model, path = family
    ph = _placeholder(name)
    images = [random_image(1, 40, 32), random_image(2, 90, 60), random_image(3, 56, 120)]
    prompt = f"First {ph} then {ph}, and last {ph} compare them."
    _run_and_compare(name, hf_model, path, [(prompt, images)])


def test_images_inside_a_chunked_prefill(family) -> None:
    """Steps of 8 tokens: each image (16 to 40 placeholders) spans several chunks, and
    is encoded whole in the first step that reaches it."""
    name, hf_model, path = family
    ph = _placeholder(name)
    images = [random_image(4, 112, 84), random_image(5, 84, 112)]
    llm = _run_and_compare(
        name,
        hf_model,
        path,
        [(f"Look {ph} at these two {ph} images.", images)],
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    assert llm.client.core.runner.multimodal.num_encoded == 2


def test_a_batch_mixing_image_and_text_requests(family) -> None:
    name, hf_model, path = family
    ph = _placeholder(name)
    shared, other = random_image(6, 70, 50), random_image(7, 50, 70)
    llm = _run_and_compare(
        name,
        hf_model,
        path,
        [
            (f"USER: {ph}Describe it. ASSISTANT:", [shared]),
            ("USER: Just text, no picture here. ASSISTANT:", []),
            (f"USER: Compare {ph} with {ph} please. ASSISTANT:", [other, shared]),
        ],
        enable_prefix_caching=False,
    )
    # The image two requests show is encoded once.
    assert llm.client.core.runner.multimodal.num_encoded == 2
