"""The disk tier's directory and index: which blocks it holds, in LRU order, within a budget.

The scheduler side owns the index and decides; the worker side writes, reads
and deletes the files it is told to (``block_file``). The index is rebuilt
from the directory when an engine starts (least recently used first, by
modification time, which loads refresh), so the tier survives restarts.

One engine uses a directory at a time (an exclusive ``flock`` on
``<dir>/.lock``, released by the OS when the process dies, so a core
restarted after a crash takes it over). ``<dir>/tier.json`` records the KV
cache fingerprint the blocks were written for: a tier written by another
model, dtype or layout is detected at start, logged, counted, and its block
files are removed, so every block the index holds can be trusted to match
(and each file's header is checked again when it is read).

Entries are *stored* (on disk, evictable unless pinned by a load in flight)
or *pending* (a save in flight: they count against the budget, and are
neither served nor evicted). A save reserves its bytes first, evicting the
least recently used stored blocks; ``commit`` or ``discard`` ends it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import IO

from tokenloom.kv_transfer.base import KVCacheSpec
from tokenloom.kv_transfer.block_file import BLOCKS_DIR, TMP_DIR, VERSION, block_path

logger = logging.getLogger(__name__)

MANIFEST = "tier.json"


class DiskTierIndex:
    """What the tier at ``root`` holds, for the KV cache ``spec``, within ``capacity_bytes``."""

    def __init__(self, root: str | Path, spec: KVCacheSpec, capacity_bytes: int) -> None:
        self.root = Path(root)
        self.spec = spec
        self.capacity_bytes = capacity_bytes
        self.stored: OrderedDict[str, int] = OrderedDict()
        self.pending: dict[str, int] = {}
        self.pins: dict[str, int] = {}
        self.used_bytes = 0
        # Block files found unusable at start (another model's tier), for the metrics.
        self.num_foreign_files = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv_offload_dir {self.root}: {exc.strerror}") from None
        self._lock = _lock(self.root)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        manifest = self.root / MANIFEST
        wanted = {"format": VERSION, "fingerprint": self.spec.fingerprint}
        found: dict | None = None
        try:
            found = json.loads(manifest.read_text())
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            found = {}
        blocks = self.root / BLOCKS_DIR
        if found is not None and {k: found.get(k) for k in wanted} != wanted:
            self.num_foreign_files = sum(1 for _ in _block_files(blocks))
            logger.warning(
                "kv_offload_dir %s holds a tier written for %s, not %s: removing its %d "
                "block files",
                self.root,
                found.get("description", "an unknown KV cache"),
                self.spec.description,
                self.num_foreign_files,
            )
            shutil.rmtree(blocks, ignore_errors=True)
        shutil.rmtree(self.root / TMP_DIR, ignore_errors=True)
        (self.root / TMP_DIR).mkdir(exist_ok=True)
        blocks.mkdir(exist_ok=True)
        if found is None or found.get("fingerprint") != self.spec.fingerprint:
            tmp = self.root / TMP_DIR / MANIFEST
            tmp.write_text(json.dumps({**wanted, "description": self.spec.description}))
            os.replace(tmp, manifest)
        entries = []
        for path in _block_files(blocks):
            try:
                stat = path.stat()
            except OSError:
                continue
            entries.append((stat.st_mtime_ns, path.name, stat.st_size))
        entries.sort()
        for _, key, size in entries:
            self.stored[key] = size
            self.used_bytes += size
        for key in self._evict(0):
            _unlink(block_path(self.root, key))
        logger.info(
            "disk KV tier %s: %d blocks, %.1f MiB of %.1f MiB (%s)",
            self.root,
            len(self.stored),
            self.used_bytes / 2**20,
            self.capacity_bytes / 2**20,
            self.spec.description,
        )

    # ------------------------------------------------------------------ queries

    def __contains__(self, key: str) -> bool:
        """Stored (servable); pending saves are not."""
        return key in self.stored

    def known(self, key: str) -> bool:
        """Stored or being saved: no need to save it again."""
        return key in self.stored or key in self.pending

    # ------------------------------------------------------------------ loads

    def pin(self, keys: list[str]) -> None:
        """Keys a load is about to read: not evicted until ``unpin``; most recently used."""
        stored = self.stored
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1
            if key in stored:
                stored.move_to_end(key)

    def unpin(self, keys: list[str]) -> None:
        pins = self.pins
        for key in keys:
            count = pins.get(key, 0) - 1
            if count > 0:
                pins[key] = count
            else:
                pins.pop(key, None)

    # ------------------------------------------------------------------ saves

    def reserve(self, key: str, size: int) -> tuple[bool, list[str]]:
        """Room for a new block of ``size`` bytes: whether the save may go ahead, and the
        stored keys evicted to make room (their files are to be deleted either way)."""
        evicted = self._evict(size)
        if self.used_bytes + size > self.capacity_bytes:
            return False, evicted
        self.pending[key] = size
        self.used_bytes += size
        return True, evicted

    def _evict(self, size: int) -> list[str]:
        """Evict least recently used unpinned stored keys until ``size`` more bytes fit."""
        evicted: list[str] = []
        if self.used_bytes + size <= self.capacity_bytes:
            return evicted
        for key in list(self.stored):
            if key in self.pins:
                continue
            self.used_bytes -= self.stored.pop(key)
            evicted.append(key)
            if self.used_bytes + size <= self.capacity_bytes:
                break
        return evicted

    def commit(self, key: str) -> None:
        """A pending save reached the disk: it is stored, most recently used."""
        size = self.pending.pop(key, None)
        if size is not None:
            self.stored[key] = size

    def discard(self, key: str) -> None:
        """Forget a key: a failed save, or a file found unusable."""
        size = self.pending.pop(key, None)
        if size is None:
            size = self.stored.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    def shrink_to_fit(self) -> None:
        """The disk is full: from now on the budget is what the tier holds."""
        stored_bytes = sum(self.stored.values())
        if stored_bytes < self.capacity_bytes:
            logger.warning(
                "disk KV tier %s: the disk is full; its budget is now %.1f MiB",
                self.root,
                stored_bytes / 2**20,
            )
            self.capacity_bytes = max(stored_bytes, 1)

    def close(self) -> None:
        lock = self._lock
        if lock is not None:
            self._lock = None
            lock.close()


def _lock(root: Path) -> IO[str] | None:
    handle = (root / ".lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ValueError(
            f"kv_offload_dir {root} is in use by another tokenloom engine; "
            "give each engine its own directory"
        ) from None
    return handle


def _block_files(blocks: Path):  # type: ignore[no-untyped-def]
    if not blocks.is_dir():
        return
    for sub in blocks.iterdir():
        if sub.is_dir():
            yield from (p for p in sub.iterdir() if p.is_file())


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
