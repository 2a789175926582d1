"""The LoRA adapters a server serves, by name (vLLM's ``--lora-modules``,
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

A request selects an adapter by giving its name as ``model``. Each load gets a
fresh ``lora_int_id``, never reused, so an adapter unloaded and loaded again
(possibly with other weights) never meets the old one's prefix-cache blocks.
Unloading an adapter that requests are still using is refused (400) rather than
delayed: the caller learns at once and can retry, and no request loses its
adapter midway.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tokenloom.engine.protocol import EngineClient
from tokenloom.entrypoints.openai.errors import OpenAIError
from tokenloom.lora_request import LoRARequest


class LoRAAdapters:
    def __init__(self, engine: EngineClient, reserved_names: tuple[str, ...]) -> None:
        self.engine = engine
        self.reserved_names = reserved_names
        self._by_name: dict[str, LoRARequest] = {}
        self._pending: set[str] = set()
        self._in_flight: dict[int, int] = {}
        self._next_id = 1

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self._by_name.values()))

    def resolve(self, model: str) -> LoRARequest | None:
        return self._by_name.get(model)

    async def load(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the base model and serve it under ``name``."""
        if not name:
            raise OpenAIError("lora_name must be a non-empty string", param="lora_name")
        if not path:
            raise OpenAIError("lora_path must be a non-empty string", param="lora_path")
        if name in self._by_name or name in self._pending or name in self.reserved_names:
            raise OpenAIError(
                f"the name '{name}' is already served; unload it first or pick another",
                param="lora_name",
            )
        lora = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self._pending.add(name)
        try:
            await self.engine.add_lora(lora)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="lora_path") from exc
        finally:
            self._pending.discard(name)
        self._by_name[name] = lora
        return lora

    async def unload(self, name: str) -> None:
        lora = self._by_name.get(name)
        if lora is None:
            raise OpenAIError(
                f"no LoRA adapter named '{name}' is loaded", param="lora_name", status=404
            )
        busy = self._in_flight.get(lora.lora_int_id, 0)
        if busy:
            raise OpenAIError(
                f"LoRA adapter '{name}' is in use by {busy} request(s); unload it after they "
                "finish",
                param="lora_name",
            )
        del self._by_name[name]
        await self.engine.remove_lora(lora.lora_int_id)

    @contextmanager
    def in_use(self, lora: LoRARequest | None) -> Iterator[None]:
        """Count a request using ``lora`` while the block runs."""
        if lora is None:
            yield
            return
        key = lora.lora_int_id
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._in_flight[key] - 1
            if left:
                self._in_flight[key] = left
            else:
                del self._in_flight[key]
