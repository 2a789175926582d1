"""Images with the engine's other features, on tiny random LLaVA and Qwen2.5-VL models:
prefix caching (the same image in a repeated prompt hits; another image at the same
positions does not), preemption, n-gram speculative decoding, structured outputs and
LoRA on the text model. Outputs are greedy and checked against a plain run or
transformers."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vl_models import make_llava, make_qwen2_5_vl, random_image, reference_greedy
from tokenloom import LLM, SamplingParams
from tokenloom.lora_request import LoRARequest
from tokenloom.structured_output.params import StructuredOutputsParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE: dict[str, Any] = dict(dtype="float32", max_model_len=512, log_stats=False)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("llava")
    return make_llava(path, seed=5), path


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("qwen")
    return make_qwen2_5_vl(path, seed=6), path


def _prompt(kind: str, image: Any, text: str = "What do you see in this picture, exactly?"):
    placeholder = "<image>\n" if kind == "llava" else "<|vision_start|><|image_pad|><|vision_end|>"
    return {"prompt": f"USER: {placeholder}{text} ASSISTANT:", "multi_modal_data": {"image": image}}


def _count_calls(obj: Any, name: str) -> list[int]:
    """Count calls to ``obj.name`` (a list holding the count, so it can be read later)."""
    count = [0]
    method = getattr(obj, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return method(*args, **kwargs)

    setattr(obj, name, counting)
    return count


@pytest.mark.parametrize("kind", ["llava", "qwen"])
def test_the_same_image_in_a_repeated_prompt_hits_the_prefix_cache(
    kind: str, request: pytest.FixtureRequest
) -> None:
    _, path = request.getfixturevalue(kind)
    llm = LLM(str(path), block_size=4, num_blocks=128, **ENGINE)
    image, other = random_image(10, 64, 48), random_image(11, 64, 48)
    first = llm.generate(_prompt(kind, image), GREEDY)[0]
    multimodal = llm.client.core.runner.multimodal
    assert multimodal.num_encoded == 1
    again = llm.generate(_prompt(kind, image), GREEDY)[0]
    # Every full block but the one holding the last prompt token hits, image included,
    # so the image is not encoded again.
    prompt_len = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (prompt_len - 1) // 4 * 4
    assert multimodal.num_encoded == 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Another image at the same positions: only the blocks before it hit.
    different = llm.generate(_prompt(kind, other), GREEDY)[0]
    image_start = different.prompt_token_ids.index(llm.input_processor.multimodal.image_token_id)
    assert different.num_cached_tokens == image_start // 4 * 4
    assert multimodal.num_encoded == 2


def test_without_the_encoder_cache_each_request_encodes_its_image(
    llava: tuple[Any, Path],
) -> None:
    """(What the encoder-cache benchmark compares against.) Two requests showing one
    image in one step: encoded once with the cache, twice without; the same tokens."""
    _, path = llava
    image = random_image(12, 48, 40)
    prompts = [_prompt("llava", image, f"Question {i}?") for i in range(2)]
    outputs = {}
    for share in (True, False):
        llm = LLM(str(path), enable_prefix_caching=False, enable_encoder_cache=share, **ENGINE)
        outputs[share] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.client.core.runner.multimodal.num_encoded == (1 if share else 2)
    assert outputs[True] == outputs[False]


def test_llm_chat_takes_image_parts_as_generate_takes_images(llava: tuple[Any, Path]) -> None:
    """vLLM's offline chat: ``image_pil`` and ``image_url`` (a data URL) parts give the
    prompt and tokens that ``generate`` gives for the template's text and the image;
    a bad image is a ValueError naming its part, before anything is queued."""
    _, path = llava
    llm = LLM(str(path), **ENGINE)
    image = random_image(13, 48, 40)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    question = {"type": "text", "text": "What is it?"}
    by_generate = llm.generate(
        {"prompt": "USER: <image>\nWhat is it?ASSISTANT:", "multi_modal_data": {"image": image}},
        GREEDY,
    )[0]
    for part in (
        {"type": "image_pil", "image_pil": image},
        {"type": "image_url", "image_url": {"url": url}},
    ):
        [by_chat] = llm.chat([{"role": "user", "content": [part, question]}], GREEDY)
        assert by_chat.prompt_token_ids == by_generate.prompt_token_ids
        assert by_chat.outputs[0].token_ids == by_generate.outputs[0].token_ids
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]\.image_url: "):
        llm.chat([{"role": "user", "content": [question, bad]}], GREEDY)
    assert llm.client.core.scheduler.get_num_unfinished_requests() == 0
    # A placeholder written as text, without its image, is refused too.
    with pytest.raises(
        ValueError, match="^prompt holds the image placeholder <image> but no image"
    ):
        llm.generate("USER: <image>\nWhat is it?ASSISTANT:", GREEDY)
    with pytest.raises(ValueError, match="^prompt holds the image placeholder"):
        llm.chat([{"role": "user", "content": "Look: <image>"}], GREEDY)


def test_preempted_image_requests_finish_as_if_alone(llava: tuple[Any, Path]) -> None:
    _, path = llava
    prompts = [_prompt("llava", random_image(20 + i, 48, 40), f"Tell me {i}.") for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(path), num_blocks=128, **ENGINE)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    # 8 blocks of 16 tokens cannot hold four requests of ~55 tokens at once.
    tight = LLM(str(path), num_blocks=9, enable_prefix_caching=False, **ENGINE)
    preemptions = _count_calls(tight.client.core.scheduler, "_preempt")
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert preemptions[0] > 0
    assert got == expected
    assert tight.client.core.scheduler.encoder_cache_manager.num_referenced == 0


def test_ngram_speculative_decoding_with_images(llava: tuple[Any, Path]) -> None:
    _, path = llava
    prompts = [_prompt("llava", random_image(30 + i), "a b a b a b a b") for i in range(3)]
    plain = LLM(str(path), num_blocks=128, **ENGINE)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    spec = LLM(
        str(path),
        num_blocks=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        **ENGINE,
    )
    drafts = _count_calls(spec.client.core.scheduler, "update_draft_token_ids")
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == expected
    assert drafts[0] > 0


def test_structured_output_with_an_image(qwen: tuple[Any, Path]) -> None:
    _, path = qwen
    llm = LLM(str(path), num_blocks=128, **ENGINE)
    params = SamplingParams(
        max_tokens=10,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(choice=["a cat", "a dog", "nothing"]),
    )
    out = llm.generate(_prompt("qwen", random_image(40)), params)[0]
    assert out.outputs[0].text in ("a cat", "a dog", "nothing")


def test_lora_on_the_text_model(llava: tuple[Any, Path], tmp_path: Path) -> None:
    """A PEFT adapter on the text model's projections (the vision tower excluded): the
    engine's output equals transformers' with the adapter merged; the base model's in
    the same batch is untouched."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    _, path = llava
    hf_base = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    peft_model = get_peft_model(
        LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32),
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            exclude_modules=r".*vision_tower.*",
            init_lora_weights=False,
        ),
    )
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    merged = peft_model.merge_and_unload().eval()

    llm = LLM(str(path), num_blocks=128, enable_lora=True, max_lora_rank=8, **ENGINE)
    image = random_image(50)
    lora = LoRARequest("text-adapter", 1, str(adapter))
    with_lora, without = llm.generate(
        [_prompt("llava", image), _prompt("llava", image)], GREEDY, lora_request=[lora, None]
    )
    ids = with_lora.prompt_token_ids
    assert with_lora.outputs[0].token_ids == reference_greedy(merged, path, ids, [image], 8)
    assert without.outputs[0].token_ids == reference_greedy(hf_base, path, ids, [image], 8)
    assert with_lora.outputs[0].token_ids != without.outputs[0].token_ids
