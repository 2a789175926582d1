"""KV connectors on the default model: greedy outputs with each connector equal those
of an engine without one, through chunked prefill, preemption and prefix hits; the
disk tier survives a restart and shrugs off bad files (another model's or dtype's
tier: tests/worker/test_kv_offloading.py and tests/kv_transfer/); a
decode engine takes a prefill engine's KV, and falls back to its own prefill when
the producer is dead, silent or holds another prompt."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tokenloom import SamplingParams
from tokenloom.kv_transfer.block_file import block_path
from tokenloom.kv_transfer.keys import BlockKeys, chain_root
from tokenloom.outputs import KVTransferStats, SchedulerStats

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# A small cache and step budget: prompts are chunked, requests are preempted, and
# blocks are evicted from memory (so they come back from the disk tier).
ENGINE: dict[str, Any] = {
    "max_model_len": 1024,
    "num_blocks": 64,
    "max_num_batched_tokens": 192,
    "log_stats": False,
}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class Collector:
    """Sums the scheduler stats of every step (a StatLogger)."""

    def __init__(self) -> None:
        self.kv = KVTransferStats()
        self.queries = self.hits = self.preemptions = 0

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: Any) -> None:
        if scheduler_stats is None:
            return
        self.queries += scheduler_stats.prefix_cache_queries
        self.hits += scheduler_stats.prefix_cache_hits
        self.preemptions += scheduler_stats.num_preemptions
        if scheduler_stats.kv_transfer_stats is not None:
            self.kv.merge(scheduler_stats.kv_transfer_stats)


def start(**kwargs: Any) -> tuple[Any, Collector]:
    from tokenloom import LLM

    llm = LLM(**{**ENGINE, **kwargs})
    collector = Collector()
    llm.stat_loggers.append(collector)
    return llm, collector


def stop(llm: Any) -> None:
    llm.client.shutdown()


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    """Six prompts of 260-300 tokens: three share a 200-token document."""
    import argparse
    import csv
    import inspect
    import json

    def text(*modules: Any) -> list[int]:
        docs = "\n".join(inspect.getdoc(m) or "" for m in modules)
        return tokenizer.encode(docs, add_special_tokens=False)

    document = text(json)[:200]
    own = text(argparse, csv, socket)
    assert len(own) > 900
    shared = [document + own[i * 20 : i * 20 + 60 + 10 * i] for i in range(3)]
    distinct = [own[100 * i + 300 : 100 * i + 560 + 20 * i] for i in range(3)]
    return [shared[0], distinct[0], shared[1], distinct[1], shared[2], distinct[2]]


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[list[int]]:
    llm, collector = start()
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert collector.preemptions > 0, "the batch must preempt for these tests to mean much"
    stop(llm)
    return outputs


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ---------------------------------------------------------------- the disk tier


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv_tier")


def test_disk_tier_matches_survives_a_restart_and_recomputes_bad_files(
    tier: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm, collector = start(kv_offload_dir=str(tier))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert collector.preemptions > 0
    # Again: what memory lost (a 64-block cache) comes back from the disk.
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert collector.kv.num_hit_tokens > 0 and not collector.kv.errors
    assert collector.kv.num_bytes["save"] > 0 and collector.kv.num_bytes["load"] > 0
    stop(llm)

    restarted, collector = start(kv_offload_dir=str(tier))
    (out,) = restarted.generate([prompts[3]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == reference[3]
    # Nothing in memory after the restart: every full block before the last token
    # came from the disk (the tier holds full blocks only).
    on_disk = (len(prompts[3]) - 1) // 16 * 16
    assert on_disk >= len(prompts[3]) - 16
    assert out.num_cached_tokens == on_disk
    assert collector.kv.num_hit_tokens == on_disk
    assert collector.hits == 0

    # A corrupt and a truncated file of a prompt this engine has not seen.
    fingerprint = restarted.client.core.runner.kv_cache_spec.fingerprint
    damaged = BlockKeys(chain_root(fingerprint)).extend(prompts[1], 16)
    corrupt, truncated = block_path(tier, damaged[4]), block_path(tier, damaged[9])
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0x10
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:1000])
    collector.kv = KVTransferStats()
    (out,) = restarted.generate([prompts[1]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == reference[1]
    # The hit stops at the first bad block; the truncated one is found too when it
    # falls in the half of the load a second reader took.
    assert collector.kv.errors["corrupt"] == 1
    assert set(collector.kv.errors) <= {"corrupt", "truncated"}
    assert out.num_cached_tokens == 4 * 16
    # The rest of the tier's full blocks before the last token were recomputed.
    assert collector.kv.num_recomputed_tokens == (len(prompts[1]) - 1) // 16 * 16 - 4 * 16
    stop(restarted)


# ---------------------------------------------------------------- disaggregation


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Any, Any, Collector]]:
    # Room for every prompt at once: a producer holds a finished prefill's blocks
    # until the consumer pulls them, and here the pulls start after the last prefill.
    producer, _ = start(
        num_blocks=256,
        kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": 0},
    )
    consumer, collector = start(
        num_blocks=256,
        kv_transfer_config={
            "kv_connector": "TcpConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"transfer_timeout_s": 2, "connect_timeout_s": 1},
        },
    )
    yield producer, consumer, collector
    stop(producer)
    stop(consumer)


def prefill(producer: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    params = SamplingParams(
        max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
    )
    outputs = producer.generate(prompts, params, use_tqdm=False)
    return [o.kv_transfer_params for o in outputs]


def decode(consumer: Any, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[Any]:
    sampling = [
        SamplingParams(
            max_tokens=GREEDY.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": p},
        )
        for p in params
    ]
    return consumer.generate(prompts, sampling, use_tqdm=False)


def test_disaggregated_outputs_match_a_single_engine(
    engines: tuple[Any, Any, Collector], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    producer, consumer, collector = engines
    params = prefill(producer, prompts)
    assert all(p and p["do_remote_prefill"] for p in params)
    queries, hits, external = collector.queries, collector.hits, collector.kv.num_hit_tokens
    outputs = decode(consumer, prompts, params)
    assert token_ids(outputs) == reference
    # The decode engine computed one prompt token per request (the rest was pulled,
    # or hit its own prefix cache).
    computed = (collector.queries - queries) - (collector.hits - hits)
    computed -= collector.kv.num_hit_tokens - external
    assert computed == len(prompts)
    assert collector.kv.num_bytes["recv"] > 0 and not collector.kv.errors
    # The producer freed what it held once it was pulled.
    producer.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert producer.client.core.scheduler.kv_cache_manager.usage == 0.0


def test_a_dead_producer_means_a_local_prefill(
    engines: tuple[Any, Any, Collector], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    producer, consumer, collector = engines
    (params,) = prefill(producer, [prompts[0]])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    started = time.monotonic()
    (out,) = decode(consumer, [prompts[0]], [{**params, "remote_port": dead_port}])
    assert time.monotonic() - started < 30
    assert out.outputs[0].token_ids == reference[0]
    assert collector.kv.errors.get("peer_unreachable") == 1


def test_a_silent_producer_times_out_into_a_local_prefill(
    engines: tuple[Any, Any, Collector], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    producer, consumer, collector = engines
    (params,) = prefill(producer, [prompts[5]])
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        (out,) = decode(consumer, [prompts[5]], [{**params, "remote_port": port}])
    finally:
        silent.close(linger=0)
        context.term()
    assert out.outputs[0].token_ids == reference[5]
    assert collector.kv.errors.get("timeout") == 1


def test_kv_of_another_prompt_is_refused(
    engines: tuple[Any, Any, Collector], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    producer, consumer, collector = engines
    (params,) = prefill(producer, [prompts[1]])
    external = collector.kv.num_hit_tokens
    (out,) = decode(consumer, [prompts[3]], [params])
    assert out.outputs[0].token_ids == reference[3]
    assert collector.kv.num_hit_tokens == external  # nothing taken from the producer
    assert collector.kv.errors.get("prompt_mismatch") == 1
