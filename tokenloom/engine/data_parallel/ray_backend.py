"""Data parallel engine cores as Ray actors (``--data-parallel-backend ray``).

One placement group holds one bundle per core (one CPU, plus one GPU on
CUDA), spread over the cluster's nodes, so cores can sit on other machines
(``ray start --head`` on one, ``ray start --address=HEAD:6379`` on the others,
tokenloom installed on each). The front end joins the running cluster
(``RAY_ADDRESS`` or ``ray.init(address="auto")``), else starts a local one.
Everything between the front end and a core goes over ZMQ on ``tcp://``: each
actor binds its input on its node's IP, the front end binds the output and KV
event sockets on its own; Ray only places the actors and tells whether they live.
A dead core is replaced by a new actor in its bundle (``RayCores.client``), through
the same ``CoreSupervisor`` as a local core.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from tokenloom.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from tokenloom.engine.core_client import MPClient
from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.messages import CoreError, CoreOutputs, Shutdown, encode, output_decoder

if TYPE_CHECKING:
    from tokenloom.engine.core import EngineCore

logger = logging.getLogger(__name__)

# How often a waiting front end asks Ray whether a quiet core's actor still lives.
_LIVENESS_POLL_MS = 1000


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "data_parallel_backend: 'ray' needs Ray: pip install 'tokenloom[ray]'"
        ) from None
    return ray


def init_ray() -> None:
    """Join the running Ray cluster (RAY_ADDRESS, or one started here), else start a local one."""
    ray = _ray()
    if ray.is_initialized():
        return
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
    except ConnectionError:
        logger.info("no running Ray cluster found: starting a local one")
        ray.init(include_dashboard=False, log_to_driver=False)


def node_ip() -> str:
    """This node's IP, as the other nodes of the Ray cluster reach it."""
    init_ray()
    return str(_ray().util.get_node_ip_address())


class EngineCoreActor:
    """Runs one engine core in a Ray worker process: ``start`` builds it, ``serve`` runs it."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        lora_config: LoRAConfig | None,
        engine_index: int,
        kv_events_address: str | None,
    ) -> None:
        self._configs = (model_config, cache_config, scheduler_config, lora_config)
        self._engine_index = engine_index
        self._kv_events_address = kv_events_address
        self._core: EngineCore | None = None
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PULL)

    def start(self) -> tuple[str, int, int, int]:
        """Load the model, bind the input socket: (input address, blocks, context, pid)."""
        from tokenloom.engine.core import EngineCore

        self._core = EngineCore.from_config(*self._configs, engine_index=self._engine_index)
        ip = _ray().util.get_node_ip_address()
        port = self._input.bind_to_random_port(f"tcp://{ip}")
        return f"tcp://{ip}:{port}", self._core.num_blocks, self._core.max_model_len, os.getpid()

    def serve(self, output_address: str) -> None:
        """The core loop; returns on ``Shutdown`` (or after reporting an error)."""
        from tokenloom.engine.core_proc import serve_engine_core

        assert self._core is not None, "start() first"
        serve_engine_core(
            self._core,
            self._context,
            self._input,
            output_address,
            self._engine_index,
            self._kv_events_address,
        )


class RayCores:
    """The placement group of the core actors: one bundle per core, spread over the nodes.

    ``client(i)`` places a core actor in bundle ``i`` (it starts loading at
    once); a replacement for a dead core goes to the same bundle, so it lands on
    the same node. ``remove()`` frees the group once every core is shut down.
    """

    def __init__(
        self,
        size: int,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        lora_config: LoRAConfig | None,
        kv_events_address: str | None,
    ) -> None:
        ray = _ray()
        init_ray()
        from ray.util.placement_group import placement_group

        self._bundle = {"CPU": 1.0}
        if model_config.device.startswith("cuda"):
            self._bundle["GPU"] = 1.0
        self._group = placement_group([dict(self._bundle) for _ in range(size)], strategy="SPREAD")
        ray.get(self._group.ready(), timeout=300)
        self._actor_class = ray.remote(EngineCoreActor)
        self._configs = (model_config, cache_config, scheduler_config, lora_config)
        self._kv_events_address = kv_events_address

    def client(self, index: int) -> RayCoreClient:
        """A new core actor in bundle ``index``, and its client (``wait_until_ready`` next)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = self._actor_class.options(
            num_cpus=self._bundle["CPU"],
            num_gpus=self._bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=index
            ),
            name=f"tokenloom-engine-core-{index}-{os.getpid()}-{time.monotonic_ns()}",
        ).remote(*self._configs, index, self._kv_events_address)
        return RayCoreClient(actor)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self._group)


class RayCoreClient(MPClient):
    """The front end's side of one core actor: the async core client surface over tcp ZMQ.

    Its input side (requests, aborts, LoRA removals sent on ``_input``) is
    ``MPClient``'s; start-up, liveness, output and shutdown are the actor's, so
    ``MPClient.__init__`` (which spawns a process) is not called.
    """

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        self._start_ref = actor.start.remote()
        self._serve_ref: Any = None
        self._async_context = zmq.asyncio.Context()
        self._output = self._async_context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        port = self._output.bind_to_random_port(f"tcp://{node_ip()}")
        self._output_address = f"tcp://{node_ip()}:{port}"
        self._sync_context = zmq.Context()
        self._input = self._sync_context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self.engine_core_pid: int | None = None
        self.num_blocks = 0
        self.max_model_len = 0
        self._dead: EngineDeadError | None = None
        self._closed = False

    def wait_until_ready(self, timeout_s: float = 900.0) -> None:
        ray = _ray()
        try:
            address, self.num_blocks, self.max_model_len, self.engine_core_pid = ray.get(
                self._start_ref, timeout=timeout_s
            )
        except Exception as exc:
            self.shutdown()
            raise RuntimeError(f"engine core actor failed to start: {exc}") from exc
        self._input.connect(address)
        self._serve_ref = self._actor.serve.remote(self._output_address)

    def _actor_done(self) -> bool:
        if self._serve_ref is None:
            return False
        ready, _ = _ray().wait([self._serve_ref], timeout=0)
        return bool(ready)

    def is_alive(self) -> bool:
        return self._dead is None and not self._closed and not self._actor_done()

    async def get_output(self) -> CoreOutputs:
        """The next step's outputs; raises ``EngineDeadError`` once the actor is gone."""
        while True:
            if self._dead is not None:
                raise self._dead
            if self._closed:
                raise self._mark_dead("the engine was shut down")
            if await self._output.poll(_LIVENESS_POLL_MS):
                message = output_decoder.decode(await self._output.recv())
                if isinstance(message, CoreError):
                    raise self._mark_dead(message.message)
                return message
            if await asyncio.to_thread(self._actor_done):
                raise self._mark_dead("engine core actor died unexpectedly")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = _ray()
        if self._serve_ref is not None and not self._actor_done():
            try:
                self._input.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            ray.wait([self._serve_ref], timeout=5)
        ray.kill(self._actor)  # also when it reported an error and lives on, holding its bundle
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_context.term()
        self._async_context.term()
