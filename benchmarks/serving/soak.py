"""Soak test of `tokenloom serve`: many clients, random and hostile requests, then a leak check.

``--clients`` clients send requests for ``--minutes``: completions and chats,
streamed or not, with random ``n``, stop strings, logprobs, seeds and echo;
a third of them hang up midway (mid-stream, or before a plain answer
comes), and about one in five is a bad request from the list the server
must refuse with a 4xx (64-bit overflows, NaN, lone surrogates, deep
nesting, oversized bodies, unknown roles, ...). Afterwards it reports the
outcomes, the number of 5xx answers (which must be 0), the engine's
running/waiting/KV-usage gauges from /metrics once idle (which must all be
0), and how much the server's memory grew over the run.

Without ``--base-url`` it starts its own server on the default model
(127.0.0.1 only). Only loopback addresses are accepted.

    .venv/bin/python benchmarks/serving/soak.py --clients 32 --minutes 3
    .venv/bin/python benchmarks/serving/soak.py --base-url http://127.0.0.1:8000 --minutes 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import report, serving  # noqa: E402  (stdlib-only helpers of the benchmarks)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WORDS = (
    "the a cat dog sat on mat river stone light dark quick slow red blue tree house "
    "why how what when story number seven ocean cloud song book road"
).split()
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
BAD_SHARE = 0.2
DISCONNECT_SHARE = 1 / 3
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20


# ------------------------------------------------------------------ requests


@dataclass
class Planned:
    kind: str  # "good" or "bad:<name>"
    path: str
    body: bytes
    stream: bool = False
    disconnect_after: int | None = None  # events (streams) to read before hanging up
    disconnect_delay_s: float | None = None  # for plain requests: hang up after this long


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _seed(rng: random.Random, n: int) -> int | None:
    roll = rng.random()
    if roll < 0.4:
        return None
    if roll < 0.5 and n == 1:  # the extremes (children of n > 1 add their index)
        return rng.choice([-(2**63), 2**64 - 1])
    return rng.randint(-(2**63), 2**64 - 1 - 128)


def good_request(rng: random.Random, model: str) -> Planned:
    n = rng.choice([1, 1, 1, 2, 3])
    stream = rng.random() < 0.5
    body: dict[str, Any] = {
        "model": model,
        "n": n,
        "max_tokens": rng.randint(1, 16),
        "stream": stream,
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "top_p": rng.choice([1.0, 0.9]),
    }
    seed = _seed(rng, n)
    if seed is not None:
        body["seed"] = seed
    if rng.random() < 0.3:
        body["stop"] = rng.choice(["\n", ".", ["the", "cat"], " a"])
    if stream and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        path = COMPLETIONS
        if rng.random() < 0.2:
            body["prompt"] = [rng.randrange(49152) for _ in range(rng.randint(1, 64))]
        elif rng.random() < 0.1:
            body["prompt"] = [_text(rng, 2, 30) for _ in range(2)]
        else:
            body["prompt"] = _text(rng, 2, 200)
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
        elif rng.random() < 0.2:
            body["echo"] = True
    else:
        path = CHAT
        messages = [{"role": "user", "content": _text(rng, 2, 80)}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": _text(rng, 2, 20)})
        if rng.random() < 0.2:
            messages += [
                {"role": "assistant", "content": _text(rng, 1, 20)},
                {"role": "user", "content": _text(rng, 1, 20)},
            ]
        body["messages"] = messages
        if rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
    planned = Planned("good", path, json.dumps(body).encode(), stream=stream)
    if rng.random() < DISCONNECT_SHARE:
        if stream:
            planned.disconnect_after = rng.randint(1, 4)
        else:
            planned.disconnect_delay_s = rng.uniform(0.05, 1.5)
    return planned


def _raw(path: str, model: str, **raw_fields: str) -> bytes:
    """A valid body for ``path`` with ``raw_fields`` pasted in as JSON text, verbatim."""
    base = '"messages": [{"role": "user", "content": "hi"}]' if path == CHAT else '"prompt": "hi"'
    extra = "".join(f', "{k}": {v}' for k, v in raw_fields.items())
    return f'{{"model": "{model}", "max_tokens": 4, {base}{extra}}}'.encode()


def bad_requests(model: str, max_request_bytes: int) -> dict[str, tuple[str, Callable[[], bytes]]]:
    """Every hostile case, by name: (path, body maker). Each must be answered with a 4xx."""
    nested = "[" * 100_000 + "]" * 100_000
    oversized = b'{"prompt": "' + b"x" * max_request_bytes + b'"}'

    def raw(path: str, **fields: str) -> Callable[[], bytes]:
        body = _raw(path, model, **fields)
        return lambda: body

    return {
        "seed_2**64": (COMPLETIONS, raw(COMPLETIONS, seed=str(2**64))),
        "seed_below_-2**63": (CHAT, raw(CHAT, seed=str(-(2**63) - 1))),
        "surrogate_prompt": (COMPLETIONS, raw(COMPLETIONS, stop='"\\ud800"')),
        "surrogate_message": (
            CHAT,
            lambda: _raw(CHAT, model).replace(b'"hi"', b'"h\\udfffi"'),
        ),
        "deep_nesting": (COMPLETIONS, raw(COMPLETIONS, stop=nested)),
        "temperature_NaN": (COMPLETIONS, raw(COMPLETIONS, temperature="NaN")),
        "top_p_Infinity": (CHAT, raw(CHAT, top_p="Infinity")),
        "presence_penalty_-Infinity": (COMPLETIONS, raw(COMPLETIONS, presence_penalty="-Infinity")),
        "top_logprobs_1000": (CHAT, raw(CHAT, logprobs="true", top_logprobs="1000")),
        "logprobs_100": (COMPLETIONS, raw(COMPLETIONS, logprobs="100")),
        "n_100000": (COMPLETIONS, raw(COMPLETIONS, n="100000")),
        "role_wizard": (
            CHAT,
            lambda: _raw(CHAT, model).replace(b'"role": "user"', b'"role": "wizard"'),
        ),
        "max_tokens_10**30": (COMPLETIONS, raw(COMPLETIONS, max_tokens=str(10**30))),
        "token_id_10**30": (
            COMPLETIONS,
            lambda: json.dumps({"model": model, "prompt": [1, 10**30]}).encode(),
        ),
        "prompt_too_long": (
            COMPLETIONS,
            lambda: json.dumps({"model": model, "prompt": "word " * 20_000}).encode(),
        ),
        "chat_template_untrusted": (CHAT, raw(CHAT, chat_template='"{{ messages }}"')),
        "invalid_json": (COMPLETIONS, lambda: b'{"prompt": "x",'),
        "not_an_object": (CHAT, lambda: b"[1, 2, 3]"),
        "oversized_body": (COMPLETIONS, lambda: oversized),
    }


# ------------------------------------------------------------------ clients


class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.server_errors: list[str] = []
        self.bad_accepted: list[str] = []

    def add(self, planned: Planned, outcome: str, detail: str = "") -> None:
        self.outcomes[(planned.kind, outcome)] += 1
        if (outcome.isdigit() and int(outcome) >= 500) or outcome == "sse_5xx":
            self.server_errors.append(f"{planned.kind} {planned.path} {outcome}: {detail[:300]}")
        if planned.kind.startswith("bad:") and outcome.isdigit() and int(outcome) < 400:
            self.bad_accepted.append(f"{planned.kind}: {outcome}")


async def send(client: httpx.AsyncClient, planned: Planned, tally: Tally) -> None:
    headers = {"content-type": "application/json"}
    if planned.stream:
        async with client.stream("POST", planned.path, content=planned.body, headers=headers) as r:
            if r.status_code != 200:
                tally.add(planned, str(r.status_code), (await r.aread()).decode(errors="replace"))
                return
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                data = line[len("data: ") :]
                if data.startswith('{"error"'):
                    code = json.loads(data)["error"].get("code", 500)
                    tally.add(planned, "sse_5xx" if code >= 500 else f"sse_{code}", data)
                    return
                if planned.disconnect_after is not None and events >= planned.disconnect_after:
                    tally.add(planned, "disconnected")
                    return  # leaving the block closes the connection mid-stream
            tally.add(planned, "200")
        return
    request = client.post(planned.path, content=planned.body, headers=headers)
    if planned.disconnect_delay_s is not None:
        try:
            r = await asyncio.wait_for(request, planned.disconnect_delay_s)
        except asyncio.TimeoutError:
            tally.add(planned, "disconnected")
            return
    else:
        r = await request
    tally.add(planned, str(r.status_code), r.text)


async def client_loop(
    index: int,
    base_url: str,
    model: str,
    deadline: float,
    bad: dict[str, tuple[str, Callable[[], bytes]]],
    tally: Tally,
    seed: int,
) -> None:
    rng = random.Random(seed * 1000 + index)
    timeout = httpx.Timeout(300.0, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        while time.monotonic() < deadline:
            if rng.random() < BAD_SHARE:
                name = rng.choice(sorted(bad))
                if name == "oversized_body" and rng.random() < 0.5:
                    name = "n_100000"  # 16 MiB uploads are costly on a shared CPU; keep them rare
                path, make = bad[name]
                planned = Planned(f"bad:{name}", path, make())
            else:
                planned = good_request(rng, model)
            try:
                await send(client, planned, tally)
            except httpx.TimeoutException:
                tally.add(planned, "client_timeout")
            except httpx.TransportError as exc:
                tally.add(planned, f"transport_error:{type(exc).__name__}")


# ------------------------------------------------------------------ server side


def metric_gauges(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("tokenloom:")
            if name in GAUGES:
                values[name] = sample.value
    return values


def wait_idle(base_url: str, timeout_s: float) -> tuple[dict[str, float], float]:
    """The gauges once all are 0 (or as they are at the timeout), and the seconds waited."""
    start = time.monotonic()
    while True:
        gauges = metric_gauges(base_url)
        if all(gauges.get(g) == 0 for g in GAUGES) or time.monotonic() - start > timeout_s:
            return gauges, round(time.monotonic() - start, 1)
        time.sleep(1.0)


def rss_mb(pid: int | None) -> dict[str, float]:
    """RSS of the server process and, separately, of its children (the engine core)."""
    if pid is None:
        return {}
    proc = psutil.Process(pid)
    children = [
        c for c in proc.children(recursive=True) if "resource_tracker" not in " ".join(c.cmdline())
    ]
    return {
        "server_mb": round(proc.memory_info().rss / 2**20, 1),
        "engine_core_mb": round(sum(c.memory_info().rss for c in children) / 2**20, 1),
    }


def listening_pid(port: int) -> int | None:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return conn.pid
    return None


async def soak(args: argparse.Namespace, base_url: str, pid: int | None) -> dict[str, Any]:
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    bad = bad_requests(model, args.max_request_bytes)
    tally = Tally()
    rss_start = rss_mb(pid)
    start = time.monotonic()
    deadline = start + args.minutes * 60
    warmup_at = start + args.minutes * 60 * 0.1
    clients = [
        asyncio.create_task(client_loop(i, base_url, model, deadline, bad, tally, args.seed))
        for i in range(args.clients)
    ]
    await asyncio.sleep(max(0.0, warmup_at - time.monotonic()))
    rss_warm = rss_mb(pid)
    timeline: list[tuple[float, dict[str, float]]] = []

    async def sample_rss() -> None:
        while True:
            timeline.append((round(time.monotonic() - start), rss_mb(pid)))
            await asyncio.sleep(30)

    sampler = asyncio.create_task(sample_rss())
    done, pending = await asyncio.wait(clients, timeout=args.minutes * 60 + args.grace_s)
    sampler.cancel()
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()
    elapsed = time.monotonic() - start
    gauges, idle_wait = await asyncio.to_thread(wait_idle, base_url, args.idle_timeout_s)
    rss_end = rss_mb(pid)
    outcomes: dict[str, dict[str, int]] = {}
    for (kind, outcome), count in sorted(tally.outcomes.items()):
        outcomes.setdefault(kind, {})[outcome] = count
    total = sum(tally.outcomes.values())
    growth = {k: round(rss_end[k] - rss_warm[k], 1) for k in rss_end} if rss_end else {}
    return {
        "clients": args.clients,
        "minutes": args.minutes,
        "elapsed_s": round(elapsed, 1),
        "requests": total,
        "clients_cut_at_end": len(pending),
        "outcomes": outcomes,
        "num_5xx": len(tally.server_errors),
        "first_5xx": tally.server_errors[:5],
        "bad_requests_accepted": tally.bad_accepted[:10],
        "gauges_after": gauges,
        "seconds_until_idle": idle_wait,
        "rss_mb": {"start": rss_start, "after_warmup": rss_warm, "end": rss_end},
        "rss_growth_after_warmup_mb": growth,
        "rss_timeline_s_mb": timeline,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10.0)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, default=8132, help="port of the server started here")
    where.add_argument("--base-url", help="a running server (loopback only)")
    ap.add_argument("--serve-args", default="", help="extra `tokenloom serve` arguments")
    ap.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grace-s", type=float, default=120.0, help="for requests still running")
    ap.add_argument("--idle-timeout-s", type=float, default=120.0)
    ap.add_argument("--log", type=Path, default=ROOT / ".bench" / "soak-server.log")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()

    if args.base_url:
        base_url = args.base_url.rstrip("/")
        parsed = urlparse(base_url)
        if parsed.hostname not in LOOPBACK:
            raise SystemExit(f"--base-url must be a loopback address, got {parsed.hostname}")
        result = asyncio.run(soak(args, base_url, listening_pid(parsed.port or 80)))
    else:
        base_url = f"http://127.0.0.1:{args.port}"
        serve_cmd = [
            sys.executable, "-m", "tokenloom.entrypoints.cli", "serve",
            "--host", "127.0.0.1", "--port", str(args.port),
            "--max-request-bytes", str(args.max_request_bytes), *shlex.split(args.serve_args),
        ]  # fmt: skip
        with serving(serve_cmd, base_url, args.log, ROOT) as server:
            result = asyncio.run(soak(args, base_url, server.pid))
    report(result, "benchmarks/serving/soak.py", args.json)
    gauges = result["gauges_after"]
    ok = result["num_5xx"] == 0 and not result["bad_requests_accepted"]
    ok = ok and all(gauges.get(g) == 0 for g in GAUGES)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
