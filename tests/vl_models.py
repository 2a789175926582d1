"""Tiny random-weight vision-language checkpoints, built by transformers from each
family's own config classes, saved as complete model directories: weights, a real
tokenizer (the default model's, with the family's image tokens added), the image
processor's settings and a chat template that places images.

Shared by the model, worker, engine and server tests. Images are generated here
too (seeded noise), so nothing is downloaded.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image

LLAVA_IMAGE_TOKEN = "<image>"
QWEN_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")

LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
)


@functools.cache
def _base_tokenizer_dir() -> Path:
    """The default model's tokenizer as a directory (converted once, torch-free to load)."""
    from tokenloom.default_model import default_model_path
    from tokenloom.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    out = Path(tokenizer.name_or_path)
    assert (out / "tokenizer.json").is_file(), out
    return out


def _tokenizer(added: tuple[str, ...], template: str):  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(_base_tokenizer_dir()))
    tokenizer.add_special_tokens({"additional_special_tokens": list(added)})
    tokenizer.chat_template = template
    return tokenizer


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight") and ("norm" in name or "ln_q" in name):
                param.uniform_(0.7, 1.3)
            else:
                param.normal_(0.0, 0.1)
    return model.eval()


def make_llava(
    out: Path,
    tower: str = "clip",
    seed: int = 0,
    *,
    vision_sizes: dict | None = None,
    text_sizes: dict | None = None,
) -> torch.nn.Module:
    """A LLaVA with a CLIP (or SigLIP) tower of 28x28-pixel images in 7-pixel patches:
    16 placeholder tokens per image. Returns the transformers model (fp32, eager).

    ``vision_sizes`` and ``text_sizes`` override the tower's and the text model's
    config (``image_size`` and ``patch_size`` included; the benchmarks' larger models)."""
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    tokenizer = _tokenizer((LLAVA_IMAGE_TOKEN,), LLAVA_TEMPLATE)
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=28,
        patch_size=7,
    )
    vision.update(vision_sizes or {})
    side = vision["image_size"]
    if tower == "clip":
        vision_config = CLIPVisionConfig(**vision, projection_dim=32)
        processor = CLIPImageProcessorPil(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        )
    else:
        vision_config = SiglipVisionConfig(**vision)
        processor = SiglipImageProcessorPil(size={"height": side, "width": side})
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=LlamaConfig(
            **{**TEXT, **(text_sizes or {})},
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        vision_feature_select_strategy="default" if tower == "clip" else "full",
    )
    config._attn_implementation = "eager"
    model = _randomize(LlavaForConditionalGeneration(config), seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    return model


def make_qwen2_5_vl(out: Path, seed: int = 0) -> torch.nn.Module:
    """A Qwen2.5-VL whose processor sizes images to 56..448 pixels a side (4 to 256
    patches of 14 pixels, 1 to 64 placeholder tokens), windows of 2x2 merge units."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    tokenizer = _tokenizer(QWEN_TOKENS, QWEN_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    config = Qwen2_5_VLConfig(
        text_config=dict(
            **TEXT,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        vision_start_token_id=ids[0],
        image_token_id=ids[1],
        vision_end_token_id=ids[2],
        video_token_id=ids[3],
    )
    config._attn_implementation = "eager"
    model = _randomize(Qwen2_5_VLForConditionalGeneration(config), seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(out)
    return model


def random_image(seed: int, width: int = 40, height: int = 32) -> Image.Image:
    """Seeded RGB noise with some structure (a gradient), so resizing matters."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    pixels = (0.5 * noise + 0.5 * ramp).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def image_identifier(image: Image.Image) -> str:
    return hashlib.sha256(image.tobytes()).hexdigest()


def reference_logits(
    hf_model: torch.nn.Module, path: Path, token_ids: list[int], images: list
) -> torch.Tensor:
    """transformers' logits [len(token_ids), vocab] for a prompt whose placeholders are
    expanded (as the engine reports ``prompt_token_ids``), its images given in order."""
    from transformers import AutoImageProcessor

    ids = torch.tensor([token_ids])
    kwargs: dict = {}
    if images:
        processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
        inputs = processor(images=images, return_tensors="pt")
        kwargs["pixel_values"] = inputs["pixel_values"]
        if "image_grid_thw" in inputs:
            kwargs["image_grid_thw"] = inputs["image_grid_thw"]
            kwargs["mm_token_type_ids"] = (ids == hf_model.config.image_token_id).int()
    with torch.inference_mode():
        return hf_model(input_ids=ids, **kwargs).logits[0].float()


def reference_greedy(
    hf_model: torch.nn.Module, path: Path, token_ids: list[int], images: list, max_tokens: int
) -> list[int]:
    """transformers' greedy continuation, one full forward per token."""
    sequence = list(token_ids)
    for _ in range(max_tokens):
        sequence.append(int(reference_logits(hf_model, path, sequence, images)[-1].argmax()))
    return sequence[len(token_ids) :]
