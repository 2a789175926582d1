"""``DPClient``: N engine cores behind the one-core client surface ``AsyncLLM`` uses.

Each core has its own client (``MPClient`` for local processes, a Ray
actor's client for ``--data-parallel-backend ray``). New requests go to the
core the ``Router`` picks; aborts go to the core that owns the request; a
LoRA removal goes to every core. ``get_output`` returns the next step output
of whichever core has one, tagged with that core's ``engine_index`` (for the
per-core ``engine`` label of the metrics), and feeds the cores' KV cache
events to the router on the way.

Failover: when core ``i`` dies, ``get_output`` raises ``CoreDeadError``
(naming ``i``) and routes nothing more there. The front end takes the ids
``release_core(i)`` returns, rebuilds them as resumed requests and
``resubmit(..., exclude_core=i)`` sends them to the live cores at once, while
``restart_core(i)`` replaces core ``i`` in the background, under its own
``CoreSupervisor`` (each core has its own restart budget). A new core rejoins
routing with an empty prefix index. Requests with no live core to go to wait
in the client until one rejoins. Both backends restart the same way: a local
core as a new process, a Ray core as a new actor in the dead one's
placement-group bundle (so on the same node).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Collection
from typing import Protocol

import zmq
import zmq.asyncio

from tokenloom.config import (
    CacheConfig,
    DPLoadBalanceConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RecoveryConfig,
    SchedulerConfig,
)
from tokenloom.core.kv_cache.events import decode_batch
from tokenloom.engine.data_parallel.router import Router
from tokenloom.engine.exceptions import CoreDeadError, EngineDeadError
from tokenloom.engine.kv_events import TOPIC
from tokenloom.engine.messages import CoreOutputs, EngineCoreRequest
from tokenloom.engine.supervisor import CoreSupervisor, client_starter

logger = logging.getLogger(__name__)


class CoreClient(Protocol):
    """One engine core's async client (``MPClient`` or ``RayCoreClient``)."""

    num_blocks: int
    max_model_len: int
    engine_core_pid: int | None

    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def remove_lora(self, lora_int_id: int) -> None: ...

    async def get_output(self) -> CoreOutputs: ...

    def wait_until_ready(self, timeout_s: float = 900.0) -> None: ...

    def is_alive(self) -> bool: ...

    def shutdown(self) -> None: ...


class KVEventSubscriber:
    """The SUB socket every core's KV event publisher connects to."""

    def __init__(self, address: str) -> None:
        """``address``: ``ipc://PATH``, or ``tcp://HOST:PORT`` (port 0: pick one)."""
        self._context = zmq.asyncio.Context()
        self.socket = self._context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 100_000)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
        if address.startswith("tcp://") and address.endswith(":0"):
            host = address[len("tcp://") : -len(":0")]
            port = self.socket.bind_to_random_port(f"tcp://{host}")
            address = f"tcp://{host}:{port}"
        else:
            self.socket.bind(address)
        self.address = address

    def close(self) -> None:
        self.socket.close(linger=0)
        self._context.term()


class DPClient:
    """Data parallel engine cores, presented as one core client."""

    def __init__(
        self,
        clients: list[CoreClient],
        router: Router,
        events: KVEventSubscriber | None = None,
        cleanup: Callable[[], None] | None = None,
        supervisors: list[CoreSupervisor[CoreClient]] | None = None,
    ) -> None:
        """``cleanup``: run by ``shutdown`` after the cores' (the backend's shared resources);
        ``supervisors``: one per core, restarting it when it dies (None: no restarts)."""
        self.clients = clients
        self.supervisors = supervisors
        self.router = router
        self._events = events
        self._cleanup = cleanup
        self.num_blocks = 0
        self.max_model_len = 0
        self._ready: deque[CoreOutputs] = deque()
        self._tasks: dict[int, asyncio.Task[CoreOutputs]] = {}
        self._events_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # Cores out of routing: dead, restarting, or out of restarts.
        self._down: set[int] = set()
        # Requests waiting for a core to rejoin, when none was live.
        self._held: dict[str, EngineCoreRequest] = {}
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self._rejoined: asyncio.Event | None = None
        self._rejoined_task: asyncio.Task[bool] | None = None

    @classmethod
    def launch(
        cls,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        lora_config: LoRAConfig | None,
        parallel_config: ParallelConfig,
        load_balance: DPLoadBalanceConfig,
        recovery: RecoveryConfig | None = None,
    ) -> DPClient:
        """Start the cores (they load in parallel); call ``wait_until_ready`` next.
        ``recovery``: each core's restart budget and back-off (None or 0: no restarts)."""
        size = parallel_config.data_parallel_size
        router = Router(size, load_balance, cache_config.block_size)
        configs = (model_config, cache_config, scheduler_config, lora_config)
        make: Callable[[int], CoreClient]
        if parallel_config.data_parallel_backend == "ray":
            from tokenloom.engine.data_parallel.ray_backend import RayCores, node_ip

            events = KVEventSubscriber(f"tcp://{node_ip()}:0") if router.uses_kv_events else None
            cores = RayCores(size, *configs, None if events is None else events.address)
            make, cleanup = cores.client, cores.remove
        else:
            from tokenloom.engine.core_client import MPClient

            tmpdir = tempfile.mkdtemp(prefix="tokenloom-dp-")
            cleanup = functools.partial(shutil.rmtree, tmpdir, ignore_errors=True)
            events = (
                KVEventSubscriber(f"ipc://{tmpdir}/kv-events") if router.uses_kv_events else None
            )
            address = None if events is None else events.address

            def make(index: int) -> CoreClient:
                return MPClient(*configs, engine_index=index, kv_events_address=address)

        clients: list[CoreClient] = []
        try:
            for index in range(size):
                clients.append(make(index))
        except BaseException:
            cls(clients, router, events, cleanup).shutdown()
            raise
        supervisors: list[CoreSupervisor[CoreClient]] | None = None
        if recovery is not None and recovery.max_engine_restarts:
            supervisors = [
                CoreSupervisor(recovery, client_starter(functools.partial(make, index)))
                for index in range(size)
            ]
        return cls(clients, router, events, cleanup, supervisors)

    # ------------------------------------------------------------------ state

    def wait_until_ready(self, timeout_s: float = 900.0) -> None:
        """Block until every core is ready; the usable context is the smallest core's."""
        for client in self.clients:
            client.wait_until_ready(timeout_s)
        self.num_blocks = min(client.num_blocks for client in self.clients)
        self.max_model_len = min(client.max_model_len for client in self.clients)

    @property
    def engine_core_pid(self) -> int | None:
        return self.clients[0].engine_core_pid

    @property
    def engine_core_pids(self) -> list[int | None]:
        return [client.engine_core_pid for client in self.clients]

    def is_alive(self) -> bool:
        """Some core is in routing and alive (a dead core's requests can fail over)."""
        return not self._closed and any(
            client.is_alive() for i, client in enumerate(self.clients) if i not in self._down
        )

    @property
    def restarting(self) -> bool:
        """Some dead core is being replaced: the engine is degraded."""
        return any(not task.done() for task in self._restarts.values())

    # ------------------------------------------------------------------ input

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._route_and_send(requests, ())

    def resubmit(self, requests: list[EngineCoreRequest], exclude_core: int) -> None:
        """Route requests again, to any core but ``exclude_core`` (failover of a dead core)."""
        for request in requests:
            self.router.release(request.request_id)
        self._route_and_send(requests, (exclude_core,))

    def _route_and_send(self, requests: list[EngineCoreRequest], exclude: Collection[int]) -> None:
        exclude = self._down.union(exclude)
        if len(exclude) >= len(self.clients):  # no live core: wait for one to rejoin
            self._held.update((request.request_id, request) for request in requests)
            return
        for request in requests:
            lora = request.lora_request
            engine = self.router.route(
                request.request_id,
                request.prompt_token_ids,
                0 if lora is None else lora.lora_int_id,
                exclude,
            )
            self.clients[engine].add_requests([request])

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            self._held.pop(request_id, None)
            engine = self.router.release(request_id)
            if engine is not None and engine not in self._down:
                by_engine.setdefault(engine, []).append(request_id)
        for engine, ids in by_engine.items():
            self.clients[engine].abort_requests(ids)

    def remove_lora(self, lora_int_id: int) -> None:
        for i, client in enumerate(self.clients):
            if i not in self._down:
                client.remove_lora(lora_int_id)

    # ------------------------------------------------------------------ failover

    def release_core(self, engine: int) -> list[str]:
        """Core ``engine`` is dead: the ids of the requests it held, no longer counted there."""
        return self.router.release_engine(engine)

    def restart_core(
        self, engine: int, reason: str, on_attempt: Callable[[], None] | None = None
    ) -> bool:
        """Replace dead core ``engine`` in the background; False: it stays down for good."""
        if self.supervisors is None or self._closed or engine in self._restarts:
            return False
        self._restarts[engine] = asyncio.get_running_loop().create_task(
            self._restart(engine, reason, on_attempt)
        )
        return True

    async def _restart(
        self, engine: int, reason: str, on_attempt: Callable[[], None] | None
    ) -> None:
        assert self.supervisors is not None
        old = self.clients[engine]
        old.shutdown()  # its process is gone; this frees its sockets
        try:
            client = await self.supervisors[engine].restart(reason, on_attempt)
            if client is None:
                logger.error("engine core %d stays down: its restart budget is spent", engine)
            elif self._closed:
                client.shutdown()
            else:
                self.clients[engine] = client
                self.router.forget_engine(engine)
                self._down.discard(engine)
                held, self._held = list(self._held.values()), {}
                logger.warning(
                    "engine core %d is back (pid %s); %d waiting requests go to the cores",
                    engine,
                    client.engine_core_pid,
                    len(held),
                )
                self._route_and_send(held, ())
        finally:
            del self._restarts[engine]
            if self._rejoined is not None:
                self._rejoined.set()  # get_output: read the new core, or see that none is left

    # ------------------------------------------------------------------ output

    async def get_output(self) -> CoreOutputs:
        """The next step output of any core; raises ``CoreDeadError`` when one dies (it
        leaves routing) and ``EngineDeadError`` once none is left nor restarting."""
        while not self._ready:
            loop = asyncio.get_running_loop()
            if self._loop is not loop:
                self._cancel_tasks()
                self._loop = loop
            if not self.is_alive() and not self.restarting:
                raise EngineDeadError("every engine core is dead and none can restart")
            for index, client in enumerate(self.clients):
                if index not in self._tasks and index not in self._down:
                    self._tasks[index] = loop.create_task(client.get_output())
            waiting: set[asyncio.Future[object]] = set(self._tasks.values())  # type: ignore[arg-type]
            rejoined = self._rejoined = self._rejoined or asyncio.Event()
            if self._rejoined_task is None:
                self._rejoined_task = loop.create_task(rejoined.wait())
            waiting.add(self._rejoined_task)  # type: ignore[arg-type]
            if self._events is not None:
                if self._events_task is None:
                    self._events_task = loop.create_task(self._apply_events(self._events))
                waiting.add(self._events_task)  # type: ignore[arg-type]
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if self._events_task is not None and self._events_task in done:
                self._events_task = None
            if self._rejoined_task in done:
                rejoined.clear()
                self._rejoined_task = None
            for index, output_task in list(self._tasks.items()):
                if output_task in done:
                    del self._tasks[index]
                    try:
                        result = output_task.result()
                    except EngineDeadError as exc:
                        self._down.add(index)
                        raise CoreDeadError(index, str(exc)) from exc
                    self._take(index, result)
        return self._ready.popleft()

    async def _apply_events(self, events: KVEventSubscriber) -> None:
        """Wait for event batches, then apply every one that has arrived."""
        frames = [await events.socket.recv_multipart()]
        while True:
            try:
                frames.append(await events.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        for _topic, frame in frames:
            self.router.apply_events(decode_batch(frame))

    def _take(self, engine: int, result: CoreOutputs) -> None:
        result.engine_index = engine
        finished = result.outputs.finished_requests
        if finished:
            for request_id in finished:
                self.router.release(request_id)
        self._ready.append(result)

    def _cancel_tasks(self) -> None:
        """Tasks of another (or a closed) event loop; a result they already hold is kept."""
        for index, task in self._tasks.items():
            if task.done() and not task.cancelled() and task.exception() is None:
                self._take(index, task.result())
            elif not task.get_loop().is_closed():
                task.get_loop().call_soon_threadsafe(task.cancel)
        self._tasks.clear()
        for other in (self._rejoined_task, self._events_task):
            if other is not None and not other.get_loop().is_closed():
                other.get_loop().call_soon_threadsafe(other.cancel)
        self._rejoined_task = self._rejoined = self._events_task = None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cancel_tasks()
        for task in self._restarts.values():
            if not task.get_loop().is_closed():
                task.get_loop().call_soon_threadsafe(task.cancel)
        for client in self.clients:
            client.shutdown()
        if self._events is not None:
            self._events.close()
        if self._cleanup is not None:
            self._cleanup()
