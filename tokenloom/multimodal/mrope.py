"""Multimodal RoPE positions (Qwen2.5-VL), as the runner gives them to the model (numpy).

Every prompt token gets a (time, height, width) position. Text tokens count
up by one in all three; an image's tokens, laid out as its merged grid
``(t, h / merge, w / merge)`` in row-major order, get their frame, row and
column added to the position the image starts at, and the text after it
continues from that start plus the longer side of the grid. Generated tokens
continue past the prompt: token ``i`` is at ``i + delta`` in all three, where
``delta`` is the prompt's largest position + 1 - its length (vLLM's
``MRotaryEmbedding.get_input_positions``; transformers' ``get_rope_index``).
"""

from __future__ import annotations

import numpy as np


def mrope_positions(
    num_prompt_tokens: int,
    images: list[tuple[int, tuple[int, int, int]]],
    merge_size: int,
) -> tuple[np.ndarray, int]:
    """(positions [3, num_prompt_tokens] int64, delta) of a prompt whose images are
    (placeholder offset, grid (t, h, w) in patches), in prompt order."""
    positions = np.empty((3, num_prompt_tokens), dtype=np.int64)
    cursor = 0  # prompt index
    current = 0  # the next text position
    for offset, (t, h, w) in images:
        positions[:, cursor:offset] = np.arange(current, current + offset - cursor)
        current += offset - cursor
        gh, gw = h // merge_size, w // merge_size
        frames, rows, cols = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        end = offset + t * gh * gw
        positions[0, offset:end] = frames.reshape(-1) + current
        positions[1, offset:end] = rows.reshape(-1) + current
        positions[2, offset:end] = cols.reshape(-1) + current
        current += max(gh, gw)
        cursor = end
    positions[:, cursor:] = np.arange(current, current + num_prompt_tokens - cursor)
    delta = int(positions.max()) + 1 - num_prompt_tokens if num_prompt_tokens else 0
    return positions, delta
