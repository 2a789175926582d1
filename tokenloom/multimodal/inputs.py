"""What a multimodal item carries into the engine core: torch-free, msgspec-serialisable.

A prompt with images holds, for each image, a run of placeholder tokens whose
input embeddings the model's vision encoder fills. The scheduler sees each
item as a ``MultiModalFeatureSpec``: its content hash (``identifier``, which
keys the encoder cache and goes into the prefix cache's block hashes) and the
prompt positions it fills (``mm_position``). The runner also reads ``data``:
the image processor's arrays (pixel values, grid sizes), carried as raw bytes
so that they cross the process boundary without pickling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import numpy as np


class PlaceholderRange(msgspec.Struct, frozen=True):
    """The prompt positions ``[offset, offset + length)`` an item's embeddings fill."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class NDArray(msgspec.Struct, frozen=True):
    """A numpy array as dtype name, shape and C-order bytes (msgpack carries bytes as is)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> NDArray:
        import numpy as np

        array = np.ascontiguousarray(array)
        return cls(str(array.dtype), tuple(int(n) for n in array.shape), array.tobytes())

    def to_numpy(self) -> np.ndarray:
        """A read-only view of the bytes (copy it before writing)."""
        import numpy as np

        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)


class MultiModalFeatureSpec(msgspec.Struct):
    """One item of a prompt: ``identifier`` (its content hash), where it sits in the
    prompt (``mm_position``), and the processor's arrays (``data``, by name, e.g.
    ``pixel_values`` and ``image_grid_thw``; None where only scheduling matters)."""

    identifier: str
    mm_position: PlaceholderRange
    data: dict[str, NDArray] | None = None
    modality: str = "image"

    def __repr__(self) -> str:
        arrays = ", ".join(f"{k}{list(v.shape)}" for k, v in (self.data or {}).items())
        return (
            f"MultiModalFeatureSpec({self.identifier[:12]!r}, {self.mm_position.offset}"
            f"+{self.mm_position.length}{', ' + arrays if arrays else ''})"
        )


def check_features(features: Any, num_prompt_tokens: int) -> list[MultiModalFeatureSpec]:
    """``features`` as a list, or ``ValueError`` (naming ``mm_features``) unless they are
    ``MultiModalFeatureSpec``s in prompt order, non-empty, non-overlapping, within the prompt."""
    if not isinstance(features, (list, tuple)):
        raise ValueError(f"mm_features must be a list, got {type(features).__name__}")
    end = 0
    for i, feature in enumerate(features):
        if not isinstance(feature, MultiModalFeatureSpec):
            raise ValueError(
                f"mm_features[{i}] must be a MultiModalFeatureSpec, got {type(feature).__name__}"
            )
        position = feature.mm_position
        if position.length < 1 or position.offset < end:
            raise ValueError(
                f"mm_features[{i}] covers [{position.offset}, {position.end}): items must be "
                "non-empty, in prompt order and must not overlap"
            )
        end = position.end
    if end > num_prompt_tokens:
        raise ValueError(
            f"mm_features end at position {end}, past the prompt's {num_prompt_tokens} tokens"
        )
    return list(features)
