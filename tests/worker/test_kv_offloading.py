"""The disk tier end to end without a model: a real scheduler, both connector sides, and
KV cache tensors that a fake forward pass writes and checks.

The fake forward pass writes each token's id and position into its slot of every
layer's K and V, and before each step checks that every slot the step would read
(all earlier positions of the request) holds exactly its token and position. So a
block loaded from disk into the wrong place, loaded stale, or overwritten while its
save was pending fails the check: "never a wrong token", at the level of the KV.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.core.utils import FakeRunner, assert_no_leaks, make_request, make_scheduler
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.core.sched.scheduler import Scheduler
from tokenloom.kv_transfer.base import KVCacheSpec
from tokenloom.kv_transfer.block_file import block_path
from tokenloom.kv_transfer.offloading import OffloadingConnector
from tokenloom.outputs import KVTransferStats
from tokenloom.request import Request
from tokenloom.worker.kv_connector import offloading as worker_module
from tokenloom.worker.kv_connector.offloading import OffloadingWorker

BLOCK = 4
LAYERS = 2


def kv_caches(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.zeros(num_blocks, 1, 2, BLOCK), torch.zeros(num_blocks, 1, BLOCK, 2))
        for _ in range(LAYERS)
    ]


SPEC = KVCacheSpec("ab" * 16, "fake model", BLOCK, LAYERS, layer_bytes=2 * BLOCK * 4)


class KVRunner(FakeRunner):
    """FakeRunner that writes (token, position) into the KV cache and checks what it reads."""

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.caches = caches
        self.checked_tokens = 0

    def forward(self, so: SchedulerOutput) -> None:
        """After ``execute`` mirrored the step: check the context of each scheduled
        request, then write its new tokens."""
        starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, num in so.num_scheduled_tokens.items():
            state = self.mirror[req_id]
            start = starts[req_id]
            for pos in range(start):
                self._check(req_id, state, pos)
            for pos in range(start, min(start + num, len(state.token_ids))):
                self._write(state, pos)

    def _slot(self, state: Any, pos: int) -> tuple[int, int]:
        return state.block_ids[pos // BLOCK], pos % BLOCK

    def _write(self, state: Any, pos: int) -> None:
        block, off = self._slot(state, pos)
        token = float(state.token_ids[pos])
        for layer, (k, v) in enumerate(self.caches):
            k[block, 0, :, off] = torch.tensor([token + layer, float(pos)])
            v[block, 0, off, :] = torch.tensor([float(pos), token - layer])

    def _check(self, req_id: str, state: Any, pos: int) -> None:
        block, off = self._slot(state, pos)
        token = float(state.token_ids[pos])
        for layer, (k, v) in enumerate(self.caches):
            got = (k[block, 0, 0, off].item(), k[block, 0, 1, off].item())
            got_v = (v[block, 0, off, 0].item(), v[block, 0, off, 1].item())
            assert got == (token + layer, pos) and got_v == (pos, token - layer), (
                f"{req_id}: wrong KV at position {pos} (block {block})"
            )
        self.checked_tokens += 1


class Engine:
    """A scheduler with the disk tier's two sides, stepped like EngineCore does."""

    def __init__(self, root: Path, num_blocks: int, capacity: int = 1 << 30, **kw: Any) -> None:
        self.caches = kv_caches(num_blocks)
        self.connector = OffloadingConnector(SPEC, str(root), capacity)
        self.scheduler: Scheduler = make_scheduler(
            block_size=BLOCK,
            num_blocks=num_blocks,
            kv_connector=self.connector,
            log_stats=True,
            **kw,
        )
        self.worker = OffloadingWorker(SPEC, str(root), self.caches)
        self.runner = KVRunner(self.caches)
        self.stats = KVTransferStats()
        self.tokens: dict[str, list[int]] = {}

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.runner.remember(request)
            self.scheduler.add_request(request)

    def step(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        self.worker.start_load_kv(so, meta)
        # The runner sees the step's deltas first (its mirror), then "runs the model".
        mro = self.runner.execute(so)
        self.runner.forward(so)
        self.worker.save_kv(so, meta)
        mro.kv_connector_output = self.worker.get_finished()
        for outs in self.scheduler.update_from_output(so, mro).values():
            if outs.scheduler_stats is not None and outs.scheduler_stats.kv_transfer_stats:
                self.stats.merge(outs.scheduler_stats.kv_transfer_stats)
            for out in outs.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not so.num_scheduled_tokens:
            time.sleep(0.002)  # waiting on the disk
        return so

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("no progress")

    def settle(self) -> None:
        """Let pending saves land and reach the index (as the next steps would)."""
        deadline = time.monotonic() + 10
        while self.connector.index.pending and time.monotonic() < deadline:
            time.sleep(0.01)
            self.step()
        assert not self.connector.index.pending

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def shared_prompt_requests(prefix: list[int], count: int, tag: str) -> list[Request]:
    return [
        make_request(f"{tag}{i}", prefix + [900 + i, 901 + i], max_tokens=3) for i in range(count)
    ]


def save_on_disk(root: Path, prefix: list[int]) -> Engine:
    """An engine (closed when this returns) that saved one request on ``prefix`` to ``root``."""
    engine = Engine(root, num_blocks=64)
    engine.add(shared_prompt_requests(prefix, 1, "a")[0])
    engine.run()
    engine.settle()
    engine.close()
    return engine


def test_blocks_evicted_from_memory_come_back_from_disk_exactly(tmp_path: Path) -> None:
    # 12 usable blocks: one 40-token prompt fills 11; the next request evicts it.
    engine = Engine(tmp_path, num_blocks=13)
    prefix = list(range(5000, 5040))
    engine.add(shared_prompt_requests(prefix, 1, "a")[0])
    engine.run()
    engine.settle()
    assert len(engine.connector.index.stored) == 11  # the full blocks of 42 + 2 computed tokens
    engine.add(make_request("other", 44, max_tokens=2))  # evicts the prefix from memory
    engine.run()
    engine.settle()
    before = engine.runner.checked_tokens
    engine.add(shared_prompt_requests(prefix, 1, "b")[0])
    engine.run()
    assert engine.stats.num_hit_tokens == 40  # the prefix's 10 blocks loaded, not computed
    assert engine.runner.checked_tokens > before
    assert len(engine.tokens["b0"]) == 3
    engine.settle()
    assert_no_leaks(engine.scheduler)
    engine.close()


def test_a_restarted_engine_loads_what_it_saved(tmp_path: Path) -> None:
    prefix = list(range(7000, 7030))
    first = Engine(tmp_path, num_blocks=64)
    first.add(*shared_prompt_requests(prefix, 2, "a"))
    first.run()
    first.settle()
    first.close()
    second = Engine(tmp_path, num_blocks=64)  # fresh (zeroed) KV tensors
    second.add(*shared_prompt_requests(prefix, 3, "b"))
    second.run()
    # b0 (a0's prompt) loads all but its last token (31); b1 waits for that load, hits
    # the shared 28 in memory and loads its own last block (3 more); b2 is new past
    # the prefix. All three read exactly the KV the first engine computed.
    assert second.stats.num_hit_tokens == 31 + 3
    assert sorted(second.tokens) == ["b0", "b1", "b2"]
    second.settle()
    assert_no_leaks(second.scheduler)
    second.close()


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing"])
def test_a_bad_file_is_recomputed_never_served(tmp_path: Path, damage: str) -> None:
    prefix = list(range(3000, 3032))
    first = save_on_disk(tmp_path, prefix)
    keys = first.connector._track(shared_prompt_requests(prefix, 1, "x")[0]).keys.extend(
        prefix, BLOCK
    )
    second = Engine(tmp_path, num_blocks=64)  # its index lists every block
    path = block_path(tmp_path, keys[3])
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[-5] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[:-7]))
    else:
        path.unlink()
    second.add(shared_prompt_requests(prefix, 1, "b")[0])
    second.run()  # the runner's checks pass: blocks 3.. were computed, not read
    assert second.stats.num_hit_tokens == 3 * BLOCK
    assert second.stats.num_recomputed_tokens == 5 * BLOCK
    assert second.stats.errors == {damage: 1}
    second.settle()  # the bad file was deleted, and the recomputed block saved again
    assert path.exists() and keys[3] in second.connector.index
    assert_no_leaks(second.scheduler)
    second.close()


@pytest.mark.parametrize("damaged", [[15], [3, 15]])
def test_a_load_split_over_two_readers_stops_at_its_first_bad_file(
    tmp_path: Path, damaged: list[int]
) -> None:
    """24 blocks load as two halves of 12 on two threads: the hit ends at the first
    bad file whichever half holds it, and every bad file is deleted and counted."""
    prefix = list(range(4000, 4096))
    first = save_on_disk(tmp_path, prefix)
    keys = first.connector._track(shared_prompt_requests(prefix, 1, "x")[0]).keys.extend(
        prefix, BLOCK
    )
    second = Engine(tmp_path, num_blocks=64)
    for i in damaged:
        path = block_path(tmp_path, keys[i])
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x40
        path.write_bytes(bytes(data))
    second.add(shared_prompt_requests(prefix, 1, "b")[0])
    second.run()
    assert second.stats.num_hit_tokens == damaged[0] * BLOCK
    assert second.stats.num_recomputed_tokens == (24 - damaged[0]) * BLOCK
    assert second.stats.errors == {"corrupt": len(damaged)}
    second.settle()
    assert_no_leaks(second.scheduler)
    second.close()


def test_a_full_disk_fails_saves_and_shrinks_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(tmp_path, num_blocks=64)
    engine.add(make_request("a", 16, max_tokens=1))
    engine.run()
    engine.settle()
    assert len(engine.connector.index.stored) == 4
    real_open = open

    class FullFile:
        def __init__(self, path: Any, mode: str) -> None:
            self.file = real_open(path, mode)

        def __enter__(self) -> FullFile:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(worker_module, "open", FullFile, raising=False)
    engine.add(make_request("b", 16, max_tokens=1))
    engine.run()
    engine.settle()
    assert engine.stats.errors.get("disk_full") == 1
    index = engine.connector.index
    assert len(index.stored) == 4 and not index.pending
    assert index.capacity_bytes == index.used_bytes  # the budget is what it holds
    assert not list((tmp_path / "tmp").iterdir())  # no half-written file left
    monkeypatch.undo()
    # Later saves evict the least recently used blocks to fit.
    engine.add(make_request("c", 8, max_tokens=1))
    engine.run()
    engine.settle()
    assert len(index.stored) == 4 and index.used_bytes <= index.capacity_bytes
    assert_no_leaks(engine.scheduler)
    engine.close()


def test_a_block_is_copied_before_the_forward_pass_overwrites_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block freed while its save waits, and handed to another request at once: the
    step that writes it waits until the saver has copied it."""
    engine = Engine(tmp_path, num_blocks=6)  # 5 usable blocks
    real_gather = engine.worker.io.gather

    def slow_gather(block_ids: list[int]) -> torch.Tensor:
        time.sleep(0.3)
        return real_gather(block_ids)

    monkeypatch.setattr(engine.worker.io, "gather", slow_gather)
    engine.add(make_request("a", 16, max_tokens=1))
    engine.run()  # a's 4 full blocks are queued for saving; a finished, they are free
    engine.add(make_request("b", 18, max_tokens=1))  # takes those blocks at once
    engine.run()
    engine.settle()
    # a's files hold a's KV: reload them into a fresh engine and let the runner check.
    engine.close()
    again = Engine(tmp_path, num_blocks=64)
    a_again = make_request("a", 16, max_tokens=1)
    again.add(a_again)
    again.run()
    assert again.stats.num_hit_tokens == 15
    again.close()


def test_the_fingerprint_names_the_weights_dtypes_and_layout(tmp_path: Path) -> None:
    """Each of these makes another engine's KV mean something else: another fingerprint,
    so its disk tier is not used (``tier.json``) and its blocks are never loaded."""
    import os

    from tokenloom.worker.kv_connector.spec import kv_cache_spec

    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")

    def fingerprint(**changes: Any) -> str:
        args: dict[str, Any] = {
            "model_path": model,
            "quantization": None,
            "dtype": torch.bfloat16,
            "kv_cache_dtype": torch.bfloat16,
            "block_size": BLOCK,
            "kv_caches": kv_caches(8),
            **changes,
        }
        return kv_cache_spec(**args).fingerprint

    base = fingerprint()
    assert fingerprint(kv_caches=kv_caches(16)) == base  # the cache's size does not matter
    others = [
        fingerprint(kv_cache_dtype=torch.float32),
        fingerprint(dtype=torch.float32),
        fingerprint(quantization="q8_0"),
        fingerprint(block_size=2 * BLOCK),
        fingerprint(kv_caches=kv_caches(8)[:1]),
    ]
    model.write_bytes(b"other weights")
    os.utime(model, ns=(1, 1))
    others.append(fingerprint())
    assert len({base, *others}) == len(others) + 1


@pytest.mark.parametrize("failing", ["gather", "block_views"])
def test_a_failing_copy_means_a_recompute_not_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """An unexpected error while a save copies blocks out of the cache, or a load copies
    them in: the blocks are not on disk, or are recomputed, and nothing waits for ever."""
    prefix = list(range(6000, 6032))
    save_on_disk(tmp_path, prefix)
    engine = Engine(tmp_path, num_blocks=64)

    def broken(*args: Any) -> Any:
        raise RuntimeError(f"{failing} broke")

    monkeypatch.setattr(engine.worker.io, failing, broken)
    if failing == "gather":
        engine.add(make_request("new", 17, max_tokens=1))  # 4 full blocks to save
        engine.run()
        engine.settle()  # the saves ended, as failures
        assert len(engine.connector.index.stored) == 9  # what the first engine saved
    engine.add(shared_prompt_requests(prefix, 1, "b")[0])
    engine.run(max_steps=500)
    assert len(engine.tokens["b0"]) == 3
    if failing == "block_views":
        assert engine.stats.num_hit_tokens == 0
        assert engine.stats.num_recomputed_tokens == 8 * BLOCK
        assert engine.stats.errors == {"load_error": 1}
    else:
        assert engine.stats.num_hit_tokens == 8 * BLOCK
        assert engine.stats.errors == {"save_error": 1}  # "new"'s saves
    engine.settle()
    if failing == "block_views":  # the files were dropped, and written again
        assert len(engine.connector.index.stored) == 9
    assert_no_leaks(engine.scheduler)
    engine.close()
