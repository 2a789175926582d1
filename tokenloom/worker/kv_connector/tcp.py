"""``TcpConnector``, worker side: serves and pulls KV blocks over ZMQ/TCP.

Producer: a thread owns a ROUTER socket on ``kv_ip:kv_port``. Each finished
request's blocks are a hold in the ``HoldTable`` the scheduler side fills; a
pull for it (``PullRequest``) is answered with a ``PullReply`` and one frame
of the blocks' bytes (``block_io`` layout), after which the blocks are
released (``finished_sending``). A pull that comes before its hold waits for
it a moment; holds nobody pulls within ``send_timeout_s`` are released too.

Consumer: each pull runs on a small thread pool: a TCP connect within
``connect_timeout_s`` (a dead peer fails at once), then the request and the
reply within ``transfer_timeout_s``; the bytes go straight into the
request's blocks. Any failure reports the blocks invalid, so the scheduler
computes them: nothing waits forever on a peer.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import zmq

from tokenloom.config import KVTransferConfig
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.kv_transfer.base import KVCacheSpec
from tokenloom.kv_transfer.tcp import (
    HoldTable,
    PullJob,
    PullReply,
    PullRequest,
    TcpMeta,
    extra_config,
)
from tokenloom.outputs import KVConnectorOutput, KVTransferStats
from tokenloom.worker.kv_connector.base import KVConnectorWorker
from tokenloom.worker.kv_connector.block_io import KVBlockIO

logger = logging.getLogger(__name__)

_POLL_MS = 50
# A pull that arrives before its hold waits this long for it.
_HOLD_WAIT_S = 10.0

_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(PullRequest).decode
_decode_reply = msgspec.msgpack.Decoder(PullReply).decode


class TcpWorker(KVConnectorWorker):
    def __init__(
        self,
        config: KVTransferConfig,
        spec: KVCacheSpec,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.config = config
        self.spec = spec
        self.extra = extra_config(config)
        self.io = KVBlockIO(kv_caches)
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._recving: set[str] = set()
        self._invalid: set[int] = set()
        self._stats = KVTransferStats()
        self._context = zmq.Context()
        self._stop = threading.Event()
        self.port = config.kv_port
        self._server: threading.Thread | None = None
        self.holds: HoldTable | None = None
        if config.is_producer:
            router = self._context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            address = f"tcp://{config.kv_ip}"
            try:
                if config.kv_port == 0:
                    self.port = router.bind_to_random_port(address)
                else:
                    router.bind(f"{address}:{config.kv_port}")
            except zmq.ZMQError as exc:
                router.close()
                raise ValueError(
                    f"kv_transfer_config: cannot listen on {config.kv_ip}:{config.kv_port} "
                    f"for KV pulls: {exc}"
                ) from None
            self.holds = HoldTable()
            self._server = threading.Thread(
                target=self._serve, args=(router,), name="kv-send", daemon=True
            )
            self._server.start()
            logger.info("KV producer: serving KV pulls on %s:%d", config.kv_ip, self.port)
        self._pool = ThreadPoolExecutor(self.extra["max_concurrent_pulls"], "kv-recv")

    @property
    def info(self) -> dict[str, Any]:
        return {"port": self.port, "holds": self.holds}

    # ------------------------------------------------------------------ the step

    def start_load_kv(self, scheduler_output: SchedulerOutput, metadata: Any) -> None:
        if not isinstance(metadata, TcpMeta):
            return
        for req_id, job in metadata.pulls.items():
            self._pool.submit(self._pull, req_id, job)

    def save_kv(self, scheduler_output: SchedulerOutput, metadata: Any) -> None:
        return

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            output = KVConnectorOutput(
                finished_sending=self._sent,
                finished_recving=self._recving,
                invalid_block_ids=self._invalid,
                kv_connector_stats=self._stats,
            )
            self._sent, self._recving, self._invalid = set(), set(), set()
            self._stats = KVTransferStats()
        return output

    def shutdown(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._context.term()

    def _record(self, op: str, num_bytes: int, seconds: float, error: str | None = None) -> None:
        stats = self._stats
        stats.num_bytes[op] = stats.num_bytes.get(op, 0) + num_bytes
        stats.seconds.setdefault(op, []).append(seconds)
        if error is not None:
            stats.errors[error] = stats.errors.get(error, 0) + 1

    # ------------------------------------------------------------------ producer

    def _serve(self, router: zmq.Socket) -> None:
        holds = self.holds
        assert holds is not None
        # Pulls that came before their request finished, with how long they may wait.
        early: list[tuple[bytes, PullRequest, float]] = []
        try:
            while not self._stop.is_set():
                if router.poll(_POLL_MS):
                    identity, frame = router.recv_multipart()
                    try:
                        pull = _decode_request(frame)
                    except msgspec.DecodeError:
                        router.send_multipart([identity, _encode(PullReply(False, "bad request"))])
                        continue
                    early.append((identity, pull, time.monotonic() + _HOLD_WAIT_S))
                now = time.monotonic()
                waiting = []
                for identity, pull, deadline in early:
                    block_ids = holds.take(pull.request_id)
                    if block_ids is not None:
                        self._send(router, identity, pull, block_ids)
                    elif deadline < now:
                        reply = PullReply(False, f"no KV held for request {pull.request_id}")
                        router.send_multipart([identity, _encode(reply)])
                    else:
                        waiting.append((identity, pull, deadline))
                early = waiting
                for req_id in holds.take_expired():
                    logger.warning("request %s: nobody pulled its KV; releasing it", req_id)
                    with self._lock:
                        self._sent.add(req_id)
                        self._stats.errors["expired"] = self._stats.errors.get("expired", 0) + 1
        finally:
            router.close(linger=0)

    def _send(
        self, router: zmq.Socket, identity: bytes, pull: PullRequest, block_ids: list[int]
    ) -> None:
        started = time.perf_counter()
        error = None
        if pull.fingerprint != self.spec.fingerprint:
            error = "the engines' KV caches differ (model, dtype or block size)"
        elif not set(pull.block_ids) <= set(block_ids):
            error = "pulled blocks the request does not hold"
        if error is not None:
            router.send_multipart([identity, _encode(PullReply(False, error))])
        else:
            data = self.io.gather(pull.block_ids) if pull.block_ids else torch.empty(0)
            reply = PullReply(True, num_blocks=len(pull.block_ids), block_bytes=self.io.block_bytes)
            payload = zmq.Frame(data.numpy(), copy=False)  # zmq keeps it until sent
            router.send_multipart([identity, _encode(reply), payload], copy=False)
        # The bytes are copied out: the blocks may go.
        with self._lock:
            self._sent.add(pull.request_id)
            num_bytes = 0 if error else len(pull.block_ids) * self.io.block_bytes
            self._record("send", num_bytes, time.perf_counter() - started, error and "send_refused")

    # ------------------------------------------------------------------ consumer

    def _pull(self, req_id: str, job: PullJob) -> None:
        started = time.perf_counter()
        error = None
        try:
            error = self._fetch(job)
        except Exception as exc:  # any failure means: compute these blocks here
            error = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - started
        with self._lock:
            self._recving.add(req_id)
            if error is None:
                self._record("recv", len(job.block_ids) * self.io.block_bytes, seconds)
            else:
                self._invalid.update(job.block_ids)
                reason = error.split(":")[0]
                self._record("recv", 0, seconds, reason)
        if error is not None:
            logger.warning(
                "request %s: pulling its KV from %s:%d failed (%s); computing it here",
                req_id,
                job.host,
                job.port,
                error,
            )

    def _fetch(self, job: PullJob) -> str | None:
        """Pull ``job``'s blocks into the KV cache; None on success, else what failed."""
        try:
            socket.create_connection((job.host, job.port), self.extra["connect_timeout_s"]).close()
        except OSError as exc:
            return f"peer_unreachable: {exc}"
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(f"tcp://{job.host}:{job.port}")
            request = PullRequest(
                job.remote_request_id, job.remote_block_ids, self.spec.fingerprint
            )
            dealer.send(_encode(request))
            if not dealer.poll(int(self.extra["transfer_timeout_s"] * 1000)):
                return f"timeout: no reply within {self.extra['transfer_timeout_s']} s"
            frames = dealer.recv_multipart(copy=False)
        finally:
            dealer.close()
        reply = _decode_reply(frames[0].bytes)
        if not reply.ok:
            return f"refused: {reply.error}"
        n = len(job.block_ids)
        if reply.num_blocks != n or reply.block_bytes != self.io.block_bytes or len(frames) != 2:
            return "bad_reply: block count or size differs"
        buffer = frames[1].buffer
        if len(buffer) != n * self.io.block_bytes:
            return "bad_reply: truncated"
        with warnings.catch_warnings():  # read-only buffer: it is only read
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(buffer, dtype=torch.uint8)
        self.io.scatter(job.block_ids, data.view(n, self.io.block_bytes))
        return None
