"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's names).

``lora_int_id`` identifies the adapter everywhere past the front end: the
scheduler counts distinct ids per step (``LoRAConfig.max_loras``), the prefix
cache keys blocks by it, and the runner maps it to a weight slot. Two requests
naming the same id must mean the same weights. It is a msgspec Struct so that it
travels inside ``EngineCoreRequest`` unchanged.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, kw_only=False):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
