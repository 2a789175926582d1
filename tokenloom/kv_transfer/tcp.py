"""``TcpConnector``, scheduler side: prefill/decode disaggregation between two engines.

A prefill engine (``kv_role: kv_producer``) runs a request that asks
``kv_transfer_params: {"do_remote_decode": true}`` (with ``max_tokens=1``),
holds its blocks when it finishes and returns where they are:
``{"do_remote_prefill": true, "remote_host", "remote_port",
"remote_request_id", "remote_block_ids", "remote_num_tokens", ...}`` (vLLM's
keys). A decode engine (``kv_consumer``) given those params for the same
prompt pulls the blocks it lacks from the producer's KV port (ZMQ over TCP,
so the engines may be on different machines) while the request waits as
``WAITING_FOR_REMOTE_KVS``, then computes only the last prompt token. The
producer frees the blocks once they are sent, or after ``send_timeout_s``
when no pull comes.

The producer's scheduler side hands a finished request's blocks to its
worker side's serving thread through a ``HoldTable`` they share (one engine
core is one process: the connector refuses tensor parallelism), so a pull can
be served as soon as the request finished, whether or not the engine steps
again; the blocks are freed in the first step after they were sent.

KV is only taken for exactly the tokens it was computed for: the params
carry the producer's KV cache fingerprint and a digest of the prompt; a
mismatch (another model, another prompt) means a local prefill, logged and
counted. A pull that fails (dead or slow peer: ``transfer_timeout_s``) marks
its blocks invalid, and the decode engine computes them itself.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from tokenloom.config import KVTransferConfig
from tokenloom.kv_transfer.base import BlockList, KVCacheSpec, KVConnectorBase
from tokenloom.kv_transfer.keys import prefix_digest
from tokenloom.outputs import KVConnectorOutput, KVTransferStats
from tokenloom.request import RequestStatus

if TYPE_CHECKING:
    from tokenloom.request import Request

logger = logging.getLogger(__name__)

# kv_connector_extra_config keys and their defaults.
EXTRA_DEFAULTS: dict[str, Any] = {
    # Consumer: how long one pull may take before the blocks are computed locally.
    "transfer_timeout_s": 30.0,
    # Consumer: how long connecting to the producer may take.
    "connect_timeout_s": 2.0,
    # Consumer: pulls running at once.
    "max_concurrent_pulls": 4,
    # Producer: how long finished requests' blocks wait for their pull.
    "send_timeout_s": 120.0,
    # Producer: the host name consumers reach it by (default: kv_ip, or this
    # machine's name when kv_ip is a wildcard address).
    "advertise_host": None,
}


def extra_config(config: KVTransferConfig) -> dict[str, Any]:
    """The connector's settings: ``EXTRA_DEFAULTS`` overridden by the user's, checked."""
    extra = config.kv_connector_extra_config
    unknown = sorted(k for k in extra if k not in EXTRA_DEFAULTS)
    if unknown:
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config.{unknown[0]} is not a TcpConnector "
            f"setting (settings: {', '.join(EXTRA_DEFAULTS)})"
        )
    values = {**EXTRA_DEFAULTS, **extra}
    for key in ("transfer_timeout_s", "connect_timeout_s", "send_timeout_s"):
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config.{key} must be a number > 0, "
                f"got {value!r}"
            )
    pulls = values["max_concurrent_pulls"]
    if isinstance(pulls, bool) or not isinstance(pulls, int) or pulls < 1:
        raise ValueError(
            "kv_transfer_config.kv_connector_extra_config.max_concurrent_pulls must be an "
            f"integer >= 1, got {pulls!r}"
        )
    return values


class PullJob(msgspec.Struct):
    """Consumer: fetch ``remote_block_ids`` of ``remote_request_id`` from host:port
    into ``block_ids``."""

    host: str
    port: int
    remote_request_id: str
    remote_block_ids: list[int]
    block_ids: list[int]


class TcpMeta(msgspec.Struct):
    """One step's work: the pulls the consumer starts."""

    pulls: dict[str, PullJob]


class HoldTable:
    """Finished requests' blocks a producer keeps for their pull, with a deadline.

    Written by the scheduler side (``request_finished``), read by the worker
    side's serving thread; each hold is taken once (served) or expires.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: dict[str, tuple[list[int], float]] = {}

    def add(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        with self._lock:
            self._holds[request_id] = (list(block_ids), time.monotonic() + timeout_s)

    def take(self, request_id: str) -> list[int] | None:
        with self._lock:
            hold = self._holds.pop(request_id, None)
        return None if hold is None else hold[0]

    def take_expired(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            expired = [r for r, (_, deadline) in self._holds.items() if deadline < now]
            for request_id in expired:
                del self._holds[request_id]
        return expired


class PullRequest(msgspec.Struct):
    """On the wire, consumer -> producer."""

    request_id: str
    block_ids: list[int]
    fingerprint: str


class PullReply(msgspec.Struct):
    """On the wire, producer -> consumer; the blocks' bytes follow in one frame."""

    ok: bool
    error: str = ""
    num_blocks: int = 0
    block_bytes: int = 0


_PARAM_TYPES: dict[str, type | tuple[type, ...]] = {
    "remote_host": str,
    "remote_port": int,
    "remote_request_id": str,
    "remote_block_ids": list,
    "remote_num_tokens": int,
    "remote_fingerprint": str,
    "remote_prefix_digest": str,
}


class TcpConnector(KVConnectorBase):
    """``info``: what the worker side reports at start (``port``: where it listens;
    ``holds``: its ``HoldTable``, for a producer)."""

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec, info: dict[str, Any]) -> None:
        self.config = config
        self.spec = spec
        self.block_size = spec.block_size
        self.extra = extra_config(config)
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        host = self.extra["advertise_host"] or config.kv_ip
        if host in ("0.0.0.0", "::", "*"):
            host = socket.gethostname()
        self.host = host
        self.port = int(info.get("port", config.kv_port))
        self._holds: HoldTable | None = info.get("holds")
        if config.is_producer and self._holds is None:
            raise ValueError("a TcpConnector producer needs its worker side's hold table")
        self._pending: dict[str, tuple[dict[str, Any], int]] = {}
        self._pulls: dict[str, PullJob] = {}
        self._pulling: set[str] = set()
        # Requests whose params were looked at (a preempted one does not pull again).
        self._asked: set[str] = set()
        self._stats = KVTransferStats()

    # ------------------------------------------------------------------ consumer

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        req_id = request.request_id
        if req_id in self._asked:
            return 0, False  # pulled at most once: the producer frees the blocks once sent
        self._asked.add(req_id)
        reason = self._reject(request, params)
        if reason is not None:
            logger.warning(
                "request %s: not using the remote prefill's KV (%s); prefilling locally",
                req_id,
                reason,
            )
            self._stats.errors[reason] = self._stats.errors.get(reason, 0) + 1
            return 0, False
        num_remote = params["remote_num_tokens"]
        if num_remote <= num_computed_tokens:
            return 0, False
        self._pending[req_id] = (params, num_computed_tokens)
        return num_remote - num_computed_tokens, True

    def _reject(self, request: Request, params: dict[str, Any]) -> str | None:
        for key, kind in _PARAM_TYPES.items():
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                return f"bad_params ({key})"
        if params["remote_fingerprint"] != self.spec.fingerprint:
            return "foreign"
        num = params["remote_num_tokens"]
        if not 0 < num <= request.num_tokens or len(params["remote_block_ids"]) < -(
            -num // self.block_size
        ):
            return "bad_params (remote_num_tokens)"
        tokens = request.all_token_ids[:num]
        if params["remote_prefix_digest"] != prefix_digest(self.spec.fingerprint, tokens):
            return "prompt_mismatch"
        return None

    def update_state_after_alloc(
        self, request: Request, blocks: BlockList, num_external_tokens: int
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if pending is None or not num_external_tokens:
            return
        params, num_local = pending
        first = num_local // self.block_size
        last = -(-(num_local + num_external_tokens) // self.block_size)
        self._pulls[request.request_id] = PullJob(
            host=params["remote_host"],
            port=params["remote_port"],
            remote_request_id=params["remote_request_id"],
            remote_block_ids=list(params["remote_block_ids"][first:last]),
            block_ids=blocks.get_block_ids()[first:last],
        )
        self._pulling.add(request.request_id)

    # ------------------------------------------------------------------ each step

    def build_connector_meta(self, scheduler_output: Any) -> TcpMeta:
        meta = TcpMeta(self._pulls)
        self._pulls = {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._pulling.difference_update(output.finished_recving)

    # ------------------------------------------------------------------ producer

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._pending.pop(req_id, None)
        self._pulling.discard(req_id)
        self._asked.discard(req_id)
        params = request.kv_transfer_params
        if (
            self._holds is None
            or not params
            or not params.get("do_remote_decode")
            or request.status == RequestStatus.FINISHED_ABORTED
            or not block_ids
        ):
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_tokens)
        self._holds.add(req_id, block_ids, self.extra["send_timeout_s"])
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": req_id,
            "remote_block_ids": block_ids,
            "remote_num_tokens": num_tokens,
            "remote_fingerprint": self.spec.fingerprint,
            "remote_prefix_digest": prefix_digest(
                self.spec.fingerprint, request.all_token_ids[:num_tokens]
            ),
        }

    def take_stats(self) -> KVTransferStats:
        stats, self._stats = self._stats, KVTransferStats()
        return stats
