"""Restarting a dead engine core, within a budget and with back-off.

``CoreSupervisor.restart`` waits (``RecoveryConfig.backoff_s``), starts a new
core and returns its client once it is ready; a start that fails counts
against ``max_engine_restarts`` like one that succeeds, and the next attempt
waits twice as long. Once the budget is spent it returns None and the engine
is dead for good. While it runs, ``restarting`` is true: the front end
reports itself degraded, not dead, and queues new requests for the new core.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from tokenloom.config import CacheConfig, LoRAConfig, ModelConfig, RecoveryConfig, SchedulerConfig
from tokenloom.engine.core_client import MPClient

logger = logging.getLogger(__name__)

ClientT = TypeVar("ClientT")


class CoreSupervisor(Generic[ClientT]):
    """Starts replacement cores through ``start`` (an async factory of ready clients)."""

    def __init__(self, config: RecoveryConfig, start: Callable[[], Awaitable[ClientT]]) -> None:
        self.config = config
        self._start = start
        # Start attempts made so far, failed ones included (the budget's count).
        self.num_restarts = 0
        self.restarting = False
        self.reason = ""

    @property
    def budget_left(self) -> int:
        return self.config.max_engine_restarts - self.num_restarts

    async def restart(
        self, reason: str, on_attempt: Callable[[], None] | None = None
    ) -> ClientT | None:
        """A ready client for a new core, or None once the restart budget is spent.

        ``restarting`` is set before the first await, so callers see the engine
        degraded from the moment its core is known dead. ``on_attempt`` is
        called for each start attempt (the restart counter).
        """
        self.restarting = True
        self.reason = reason
        try:
            while self.budget_left > 0:
                delay = self.config.backoff_s(self.num_restarts)
                self.num_restarts += 1
                logger.warning(
                    "engine core died (%s); restart %d of %d in %.1fs",
                    reason,
                    self.num_restarts,
                    self.config.max_engine_restarts,
                    delay,
                )
                await asyncio.sleep(delay)
                if on_attempt is not None:
                    on_attempt()
                try:
                    return await self._start()
                except Exception as exc:
                    self.reason = f"restart {self.num_restarts} failed: {exc}"
                    logger.error("engine core restart %d failed: %s", self.num_restarts, exc)
            logger.error("engine core restart budget (%d) spent", self.config.max_engine_restarts)
            return None
        finally:
            self.restarting = False


class StartingClient(Protocol):
    """A client whose core is starting: ready after ``wait_until_ready``."""

    def wait_until_ready(self, timeout_s: float = ...) -> None: ...

    def shutdown(self) -> None: ...


StartingT = TypeVar("StartingT", bound=StartingClient)


def client_starter(make: Callable[[], StartingT]) -> Callable[[], Awaitable[StartingT]]:
    """An async factory of ready clients: ``make()`` starts a core (a process or a Ray
    actor), whose model loads while a thread waits; a core that fails to start is shut down."""

    async def start() -> StartingT:
        client = make()
        try:
            await asyncio.to_thread(client.wait_until_ready)
        except BaseException:
            client.shutdown()
            raise
        return client

    return start


def mp_client_starter(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    lora_config: LoRAConfig | None,
) -> Callable[[], Awaitable[MPClient]]:
    """A starter of the one local core process over these configs (data parallel
    cores have theirs from ``DPClient.launch``)."""
    return client_starter(
        functools.partial(MPClient, model_config, cache_config, scheduler_config, lora_config)
    )
