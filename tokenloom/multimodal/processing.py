"""A prompt's images through the model's image processor, into placeholders and features.

``MultiModalProcessor.process(token_ids, images)`` runs in the front end, off
the event loop, for a prompt holding one image placeholder token per image
(``<image>`` for LLaVA, ``<|image_pad|>`` for Qwen2.5-VL, as the chat
template writes them): it loads and checks each image (``media``), hashes its
pixels (the item's identifier, shared by every request showing the same
image), runs the model's own transformers image processor (its slow,
PIL/numpy variant), and expands each placeholder into as many tokens as the
vision tower will give embeddings. The result is the expanded token ids and
one ``MultiModalFeatureSpec`` per image, arrays included.

transformers' image processing imports torch: where the front end must stay
torch-free (the server with its core in another process) the processor runs
in a helper process (``tokenloom.helper_process``), else in place.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenloom.helper_process import HelperProcess
from tokenloom.multimodal.families import VisionArch, image_placeholder_text, num_image_tokens
from tokenloom.multimodal.inputs import MultiModalFeatureSpec, NDArray, PlaceholderRange
from tokenloom.multimodal.media import MediaLimits, load_image

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PreTrainedTokenizerBase


@functools.cache
def _image_processor(model_dir: str) -> Any:
    from transformers import AutoImageProcessor

    # The PIL/numpy variant: the fast one needs torchvision.
    return AutoImageProcessor.from_pretrained(model_dir, backend="pil")


def run_image_processor(model_dir: str, images: list[Image.Image]) -> list[dict[str, np.ndarray]]:
    """The model's image processor on each image: its arrays by name (``pixel_values``,
    and ``image_grid_thw`` for Qwen2.5-VL), one dict per image."""
    processor = _image_processor(model_dir)
    out = []
    for image in images:
        result = processor(images=[image], return_tensors="np")
        out.append({name: np.asarray(value) for name, value in result.items()})
    return out


def image_identifier(image: Image.Image) -> str:
    """The content hash of an RGB image: equal pixels, equal identifier."""
    digest = hashlib.sha256(f"{image.mode}:{image.size}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class MultiModalProcessor:
    """The front end's image handling for one vision-language model.

    ``max_images``: the most images one prompt may hold (``--limit-mm-per-prompt``).
    """

    def __init__(
        self,
        vision: VisionArch,
        model_dir: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        limits: MediaLimits,
        max_images: int,
        in_subprocess: bool,
    ) -> None:
        self.vision = vision
        self.model_dir = str(model_dir)
        self.limits = limits
        self.max_images = max_images
        self.image_token_id = vision.image_token_id
        self.image_token = str(tokenizer.convert_ids_to_tokens(self.image_token_id))
        added = {i: str(t) for i, t in tokenizer.added_tokens_decoder.items()}
        self.placeholder_text = image_placeholder_text(vision, self.image_token, added)
        self._helper = HelperProcess("tokenloom-images") if in_subprocess else None

    def check_count(self, num_images: int, param: str) -> None:
        if num_images > self.max_images:
            raise ValueError(
                f"{param}: at most {self.max_images} images per prompt "
                f"(--limit-mm-per-prompt), got {num_images}"
            )

    def process(
        self, token_ids: list[int], images: list[Any], param: str = "multi_modal_data"
    ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """(expanded token ids, one feature per image). ``ValueError`` (a ``MediaError``
        for a bad image) starts with ``param``."""
        self.check_count(len(images), param)
        loaded = [
            load_image(image, f"{param}.image[{i}]", self.limits) for i, image in enumerate(images)
        ]
        places = [i for i, token in enumerate(token_ids) if token == self.image_token_id]
        if len(places) != len(loaded):
            raise ValueError(
                f"{param}: the prompt has {len(places)} image placeholders "
                f"({self.image_token}) for {len(loaded)} images"
            )
        arrays = self._run(loaded)
        expanded: list[int] = []
        features = []
        cursor = 0
        for place, image, data in zip(places, loaded, arrays, strict=True):
            expanded.extend(token_ids[cursor:place])
            length = num_image_tokens(self.vision, data)
            features.append(
                MultiModalFeatureSpec(
                    image_identifier(image),
                    PlaceholderRange(len(expanded), length),
                    {name: NDArray.from_numpy(array) for name, array in data.items()},
                )
            )
            expanded.extend([self.image_token_id] * length)
            cursor = place + 1
        expanded.extend(token_ids[cursor:])
        return expanded, features

    def _run(self, images: list[Image.Image]) -> list[dict[str, np.ndarray]]:
        if self._helper is None:
            return run_image_processor(self.model_dir, images)
        return self._helper.call(run_image_processor, self.model_dir, images)

    def shutdown(self) -> None:
        if self._helper is not None:
            self._helper.shutdown()
