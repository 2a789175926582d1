"""``PoolerConfig``: how a pooling runner turns final hidden states into one vector.

Built from vLLM's ``--pooler-config`` keys (``PoolerConfig.parse``), completed
for a model by ``resolve_pooler_config``: what the user gave wins, then the
model directory's Sentence-Transformers files (``modules.json`` naming a
``Pooling`` module, whose ``config.json`` sets the pooling mode, and a
``Normalize`` module), then the defaults for a decoder (last token,
normalised). Matryoshka support (which ``dimensions`` a request may ask for)
comes from the model's ``config.json`` (``is_matryoshka``,
``matryoshka_dimensions``), as vLLM reads it. Torch-free: the front end
validates requests with it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from tokenloom.options import json_object
from tokenloom.pooling_params import PoolingParams

logger = logging.getLogger(__name__)

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[PoolingType, ...] = get_args(PoolingType)

# vLLM's keys that tokenloom accepts; any other key is refused at start-up.
# ``seq_pooling_type`` is newer vLLM's name for ``pooling_type``, ``use_activation``
# its name for ``normalize`` when the task is embed.
_KEYS = ("pooling_type", "seq_pooling_type", "normalize", "use_activation", "dimensions", "task")

# Sentence-Transformers' Pooling config: mode flag -> our pooling type.
_ST_MODES: dict[str, PoolingType] = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling_type``: ``LAST`` (the last prompt token's hidden state), ``MEAN``
    (the mean over the prompt) or ``CLS`` (the first token's); None until resolved.
    ``normalize``: L2-normalise by default (requests may override). ``dimensions``:
    the default output size for requests that name none (Matryoshka models).

    Set by ``resolve_pooler_config``, not by users: ``is_matryoshka`` (requests may
    truncate the vector) and ``matryoshka_dimensions`` (the sizes they may ask
    for; None: any up to ``hidden_size``), and ``source`` (where the settings
    came from, for the log)."""

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    hidden_size: int | None = None
    source: str = "defaults"

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}; "
                f"got {self.pooling_type!r}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be a boolean, got {self.normalize!r}")
        dims = self.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
            raise ValueError(f"pooler_config.dimensions must be an integer >= 1, got {dims!r}")

    @classmethod
    def parse(cls, value: object) -> PoolerConfig:
        """``--pooler-config``'s JSON text, vLLM's dict, or a PoolerConfig; errors name the key."""
        if isinstance(value, PoolerConfig):
            return value
        value = json_object(value, "pooler_config", _KEYS)
        task = value.get("task")
        if task not in (None, "embed"):
            raise ValueError(
                f"pooler_config.task must be 'embed' (the only task served), got {task!r}"
            )
        pooling_type = _one_of(value, "pooling_type", "seq_pooling_type")
        if isinstance(pooling_type, str):
            pooling_type = pooling_type.upper()
        return cls(
            pooling_type=pooling_type,
            normalize=_one_of(value, "normalize", "use_activation"),
            dimensions=value.get("dimensions"),
            source="--pooler-config",
        )

    @property
    def pools_every_token(self) -> bool:
        """Whether pooling reads hidden states before the last token, so a request
        must compute its whole prompt (no prefix-cache hit)."""
        return self.pooling_type != "LAST"

    def describe(self) -> str:
        dims = ""
        if self.is_matryoshka:
            allowed = self.matryoshka_dimensions
            dims = f", dimensions {list(allowed) if allowed else 'any'} (Matryoshka)"
        return f"{self.pooling_type} pooling, normalize={self.normalize}{dims} ({self.source})"

    def request_params(self, params: PoolingParams | None, served_name: str) -> PoolingParams:
        """A request's parameters completed with this config's defaults and checked
        against the model; ``ValueError`` naming ``dimensions`` when the model cannot
        give that size."""
        params = params if params is not None else PoolingParams()
        dimensions = params.dimensions if params.dimensions is not None else self.dimensions
        if dimensions is not None:
            self.check_dimensions(dimensions, served_name)
        normalize = params.normalize if params.normalize is not None else self.normalize
        return PoolingParams(
            dimensions=dimensions,
            normalize=True if normalize is None else normalize,
            truncate_prompt_tokens=params.truncate_prompt_tokens,
            skip_reading_prefix_cache=self.pools_every_token,
        )

    def check_dimensions(self, dimensions: int, served_name: str) -> None:
        if not self.is_matryoshka:
            raise ValueError(
                f"dimensions: model {served_name!r} does not support Matryoshka "
                "representations, so its embeddings cannot be shortened (its config.json "
                "sets neither is_matryoshka nor matryoshka_dimensions)"
            )
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise ValueError(
                f"dimensions: model {served_name!r} supports only {list(allowed)} dimensions, "
                f"got {dimensions}"
            )
        if self.hidden_size is not None and dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions ({dimensions}) exceeds the model's embedding size ({self.hidden_size})"
            )


def _one_of(value: dict[str, Any], name: str, alias: str) -> Any:
    if name in value and alias in value:
        raise ValueError(f"pooler_config: give {name} or {alias}, not both")
    return value.get(name, value.get(alias))


def resolve_pooler_config(
    user: PoolerConfig | None, model_path: Path, hidden_size: int
) -> PoolerConfig:
    """The complete pooler config for the model at ``model_path``; ``ValueError`` for a
    Sentence-Transformers pipeline tokenloom cannot run (modules beyond a transformer,
    a pooling and a normalisation; pooling modes other than last, mean and CLS)."""
    if user is not None and user.hidden_size is not None:
        return user  # resolved already (the engine set-up does it before the runner)
    user = user or PoolerConfig()
    found = _read_sentence_transformers(model_path) if model_path.is_dir() else None
    pooling_type = user.pooling_type
    normalize = user.normalize
    sources = [user.source] if user.source != "defaults" else []
    if found is not None:
        st_type, st_normalize = found
        if pooling_type is None or normalize is None:
            sources.append("Sentence-Transformers modules.json")
        pooling_type = pooling_type or st_type
        normalize = st_normalize if normalize is None else normalize
    is_matryoshka, allowed = _matryoshka(model_path)
    resolved = PoolerConfig(
        pooling_type=pooling_type or "LAST",
        normalize=True if normalize is None else normalize,
        dimensions=user.dimensions,
        is_matryoshka=is_matryoshka,
        matryoshka_dimensions=allowed,
        hidden_size=hidden_size,
        source=" and ".join(sources) or "defaults",
    )
    if resolved.dimensions is not None:
        try:
            resolved.check_dimensions(resolved.dimensions, model_path.name)
        except ValueError as exc:
            raise ValueError(f"pooler_config.{exc}") from None
    return resolved


def _read_sentence_transformers(model_dir: Path) -> tuple[PoolingType, bool] | None:
    """(pooling type, normalize) from ``modules.json``, or None when there is none."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must hold a list of modules")
    pooling_type: PoolingType | None = None
    normalize = False
    for module in modules:
        kind = module.get("type") if isinstance(module, dict) else None
        if kind == _ST_TRANSFORMER:
            continue
        if kind == _ST_NORMALIZE:
            normalize = True
        elif kind == _ST_POOLING:
            pooling_type = _st_pooling_type(model_dir / str(module.get("path", "")))
        else:
            raise ValueError(
                f"{modules_file}: the Sentence-Transformers module {kind!r} is not supported "
                "(tokenloom runs a Transformer, a Pooling and a Normalize module)"
            )
    if pooling_type is None:
        return None
    return pooling_type, normalize


def _st_pooling_type(pooling_dir: Path) -> PoolingType:
    config_file = pooling_dir / "config.json"
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object")
    unsupported = [mode for mode in _ST_UNSUPPORTED_MODES if config.get(mode)]
    chosen = [kind for mode, kind in _ST_MODES.items() if config.get(mode)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{config_file}: tokenloom pools with exactly one of "
            f"{', '.join(_ST_MODES)}; the file sets {', '.join(unsupported) or chosen or 'none'}"
        )
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{config_file}: include_prompt false is not supported")
    return chosen[0]


def _matryoshka(model_path: Path) -> tuple[bool, tuple[int, ...] | None]:
    config_file = model_path / "config.json"
    if not model_path.is_dir() or not config_file.is_file():
        return False, None
    config = _read_json(config_file)
    dims = config.get("matryoshka_dimensions") if isinstance(config, dict) else None
    if dims:
        return True, tuple(int(d) for d in dims)
    return bool(isinstance(config, dict) and config.get("is_matryoshka")), None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
