"""Per-request parameters of a pooling (embedding) request, vLLM's names.

A pooling request is prefilled like any prompt, never decodes, and finishes
with one pooled vector instead of a token. Defaults come from the engine's
pooler config (``tokenloom.pooling.config.PoolerConfig``); the front end fills
them in (``PoolerConfig.request_params``) before the request reaches the
core, so the runner reads complete parameters.
"""

from __future__ import annotations

import msgspec


class PoolingParams(msgspec.Struct, omit_defaults=True):
    """``dimensions``: keep the first N dimensions of the embedding (Matryoshka
    models only), renormalised when ``normalize``. ``normalize``: L2-normalise the
    vector (None: the pooler config's). ``truncate_prompt_tokens``: keep only the
    last N prompt tokens (-1: the last ``max_model_len``; None: no truncation, a
    prompt over the context is refused). ``skip_reading_prefix_cache``: recompute
    the prompt even where the prefix cache holds it, for pooling types that read
    every token's hidden state (set by the front end, not by users)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    skip_reading_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (not _is_int(truncate) or truncate < -1 or truncate == 0):
            raise ValueError(
                "truncate_prompt_tokens must be -1 (the model's context) or an integer >= 1, "
                f"got {truncate!r}"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
