"""``OffloadingConnector``, worker side: writes and reads the disk tier's block files.

Two background threads, so the step never waits on the disk: the saver
copies the blocks a step asked to save out of the KV cache (one batched
gather) and writes one file each, through a temporary file and a rename; the
loader reads a request's files, checks each (``block_file.check``) and copies
the good ones into the request's blocks, stopping at the first bad one. With
the KV cache in host memory each file is read straight into its block's
slabs (one ``preadv``, no copy after it; a block whose check then fails is
reported invalid like any other); elsewhere the files are read into one
staging buffer and copied in with one batched scatter. A bad file (corrupt,
truncated, written for another model, gone) is logged, counted, deleted and
its block reported invalid, so the scheduler recomputes it; a full disk
fails the save, and the index shrinks its budget.

The forward pass must not overwrite a block the saver has not copied yet
(a block freed and handed to another request): ``start_load_kv`` waits for
those copies, which are short, never for the disk.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.kv_transfer.base import KVCacheSpec
from tokenloom.kv_transfer.block_file import (
    HEADER_BYTES,
    TMP_DIR,
    block_path,
    check,
    file_bytes,
    header,
)
from tokenloom.kv_transfer.offloading import OffloadFeedback, OffloadMeta
from tokenloom.outputs import KVConnectorOutput, KVTransferStats
from tokenloom.worker.kv_connector.base import KVConnectorWorker, blocks_written
from tokenloom.worker.kv_connector.block_io import KVBlockIO

logger = logging.getLogger(__name__)

_STOP = object()
# A load of at least this many blocks reads its second half on another thread:
# the engine has nothing else to do while the request waits for it.
_SPLIT_BLOCKS = 16


class OffloadingWorker(KVConnectorWorker):
    def __init__(
        self, spec: KVCacheSpec, root: str, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.spec = spec
        self.root = Path(root)
        self.io = KVBlockIO(kv_caches)
        if self.io.block_bytes != spec.bytes_per_block:
            raise ValueError("the KV cache spec does not match the KV cache tensors")
        self._file_bytes = file_bytes(spec)
        self._lock = threading.Condition()
        # Blocks queued for saving, not yet copied out of the KV cache.
        self._uncopied: dict[int, int] = {}
        self._recving: set[str] = set()
        self._invalid: set[int] = set()
        self._feedback = OffloadFeedback()
        self._stats = KVTransferStats()
        self._dirs: set[Path] = set()
        self._saves: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loads: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, args=(self._saves,), name="kv-save", daemon=True),
            threading.Thread(target=self._run, args=(self._loads,), name="kv-load", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-load-2")

    # ------------------------------------------------------------------ the step

    def start_load_kv(self, scheduler_output: SchedulerOutput, metadata: Any) -> None:
        if not isinstance(metadata, OffloadMeta):
            return
        with self._lock:
            if self._uncopied:
                written = blocks_written(scheduler_output, self.spec.block_size)
                while not written.isdisjoint(self._uncopied):
                    self._lock.wait()
        if metadata.deletes:
            self._saves.put((self._delete, metadata.deletes))
        for req_id, pairs in metadata.loads.items():
            self._loads.put((self._load, req_id, pairs))

    def save_kv(self, scheduler_output: SchedulerOutput, metadata: Any) -> None:
        if not isinstance(metadata, OffloadMeta) or not metadata.saves:
            return
        with self._lock:
            for block_id, _ in metadata.saves:
                self._uncopied[block_id] = self._uncopied.get(block_id, 0) + 1
        self._saves.put((self._save, metadata.saves))

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            output = KVConnectorOutput(
                finished_recving=self._recving,
                invalid_block_ids=self._invalid,
                kv_connector_stats=self._stats,
                kv_connector_worker_meta=self._feedback,
            )
            self._recving, self._invalid = set(), set()
            self._feedback, self._stats = OffloadFeedback(), KVTransferStats()
        return output

    def shutdown(self) -> None:
        for jobs in (self._saves, self._loads):
            jobs.put(_STOP)
        for thread in self._threads:
            thread.join(timeout=30)
        self._reader.shutdown(wait=True)

    # ------------------------------------------------------------------ threads

    @staticmethod
    def _run(jobs: queue.SimpleQueue[Any]) -> None:
        while True:
            job = jobs.get()
            if job is _STOP:
                return
            try:
                job[0](*job[1:])
            except Exception:  # a bug here must not kill the thread (and hang the engine)
                logger.exception("disk KV tier job failed")

    def _save(self, pairs: list[tuple[int, str]]) -> None:
        started = time.perf_counter()
        block_ids = [block_id for block_id, _ in pairs]
        saved: list[str] = []
        failed: list[str] = []
        disk_full = False
        errors: dict[str, int] = {}
        try:
            try:
                data = self.io.gather(block_ids).numpy()
            finally:
                with self._lock:
                    for block_id in block_ids:
                        count = self._uncopied[block_id] - 1
                        if count:
                            self._uncopied[block_id] = count
                        else:
                            del self._uncopied[block_id]
                    self._lock.notify_all()
            for j, (_, key) in enumerate(pairs):
                if disk_full:
                    failed.append(key)
                    continue
                try:
                    self._write(key, data[j])
                except OSError as exc:
                    disk_full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    reason = "disk_full" if disk_full else "write_error"
                    errors[reason] = errors.get(reason, 0) + 1
                    logger.warning("disk KV tier: cannot write block %s: %s", key, exc)
                    failed.append(key)
                else:
                    saved.append(key)
        finally:
            # After an unexpected error the rest failed: the index must not hold them
            # as pending for ever (requests wait for a pending block).
            unsaved = pairs[len(saved) + len(failed) :]
            if unsaved:
                errors["save_error"] = errors.get("save_error", 0) + 1
                failed.extend(key for _, key in unsaved)
            with self._lock:
                feedback = self._feedback
                feedback.saved.extend(saved)
                feedback.failed.extend(failed)
                feedback.disk_full |= disk_full
                stats = self._stats
                written = len(saved) * self._file_bytes
                stats.num_bytes["save"] = stats.num_bytes.get("save", 0) + written
                stats.seconds.setdefault("save", []).append(time.perf_counter() - started)
                for reason, count in errors.items():
                    stats.errors[reason] = stats.errors.get(reason, 0) + count

    def _write(self, key: str, payload: Any) -> None:
        final = block_path(self.root, key)
        if final.parent not in self._dirs:
            final.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(final.parent)
        tmp = self.root / TMP_DIR / f"{key}.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(header(self.spec, key, payload))
                f.write(payload)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            block_path(self.root, key).unlink(missing_ok=True)

    def _load(self, req_id: str, pairs: list[tuple[int, str]]) -> None:
        started = time.perf_counter()
        data = None
        if not self.io.in_host_memory:
            data = torch.empty((len(pairs), self.io.block_bytes), dtype=torch.uint8)
        block_ids = [block_id for block_id, _ in pairs]
        half = len(pairs) // 2 if len(pairs) >= _SPLIT_BLOCKS else len(pairs)
        num_loaded = 0
        completed = False
        bad: list[str] = []
        errors: dict[str, int] = {}
        try:
            second: Future[tuple[int, str | None, str | None]] | None = None
            if half < len(pairs):
                second = self._reader.submit(self._read_run, pairs, half, len(pairs), data)
            try:
                runs = [self._read_run(pairs, 0, half, data)]
            finally:
                if second is not None:
                    wait([second])  # no thread may write into the blocks once the load ends
            if second is not None:
                runs.append(second.result())
            for _, key, reason in runs:
                if key is not None and reason is not None:
                    bad.append(key)
                    errors[reason] = errors.get(reason, 0) + 1
            # Blocks count from the start up to the first bad one.
            num_good = runs[0][0]
            if num_good == half and second is not None:
                num_good += runs[1][0]
            if num_good and data is not None:
                self.io.scatter(block_ids[:num_good], data[:num_good])
            num_loaded = num_good
            completed = True
        finally:
            # Even after an unexpected error the request must not wait for ever: what
            # did not reach its blocks is recomputed, and its files are dropped, so
            # that they are written again rather than loaded (and failed) again.
            if not completed:
                errors["load_error"] = 1
                for _, key in pairs[num_loaded:]:
                    if key not in bad:
                        bad.append(key)
                        block_path(self.root, key).unlink(missing_ok=True)
            with self._lock:
                self._recving.add(req_id)
                self._invalid.update(block_ids[num_loaded:])
                self._feedback.bad.extend(bad)
                stats = self._stats
                loaded = num_loaded * self._file_bytes
                stats.num_bytes["load"] = stats.num_bytes.get("load", 0) + loaded
                stats.seconds.setdefault("load", []).append(time.perf_counter() - started)
                for reason, count in errors.items():
                    stats.errors[reason] = stats.errors.get(reason, 0) + count

    def _read_run(
        self, pairs: list[tuple[int, str]], begin: int, end: int, data: torch.Tensor | None
    ) -> tuple[int, str | None, str | None]:
        """Read ``pairs[begin:end]`` in order, into their blocks (or ``data``'s rows),
        stopping at the first bad file, which is deleted: (how many were good, the bad
        key, why it was bad)."""
        for j in range(begin, end):
            block_id, key = pairs[j]
            parts = self.io.block_views(block_id) if data is None else [data[j].numpy().data]
            path = block_path(self.root, key)
            reason = self._read(path, key, parts)
            if reason is not None:
                logger.warning(
                    "disk KV tier: block file %s is %s; the block is recomputed", path, reason
                )
                path.unlink(missing_ok=True)
                return j - begin, key, reason
        return end - begin, None, None

    def _read(self, path: Path, key: str, parts: list[memoryview]) -> str | None:
        """Read block ``key``'s file, its payload into ``parts`` (consecutive buffers
        of ``bytes_per_block`` in all); None if it is good, else why not."""
        head = bytearray(HEADER_BYTES)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return "missing"
        except OSError as exc:
            logger.warning("disk KV tier: cannot read %s: %s", path, exc)
            return "read_error"
        try:
            file_size = os.fstat(fd).st_size
            size = os.preadv(fd, [head, *parts], 0)
            # Loaded blocks count as used: the LRU order survives restarts.
            os.utime(fd)
        except OSError as exc:
            logger.warning("disk KV tier: cannot read %s: %s", path, exc)
            return "read_error"
        finally:
            os.close(fd)
        return check(self.spec, key, bytes(head[:size]), parts, file_size)
