"""The disk tier's block file: one full KV block, checked before it is trusted.

A file is a 64-byte header, then the block's bytes, layer by layer, K then V
(each ``KVCacheSpec.layer_bytes``). The header names the format, the KV
cache's fingerprint, the block's key, the layout (block size, layers, bytes
per layer) and the payload's checksum (XXH3-64: a restarted server checks
every byte it loads, and a CRC-32 there cost more than reading the files).
A file is loaded only when all of them match what the reader expects and
the payload is whole; otherwise ``check`` says why (``truncated``,
``corrupt``, ``foreign``: written for another model, dtype, layout or file
format version), and the block is recomputed.

Files live at ``<dir>/blocks/<first two hex digits>/<key>``; a writer puts a
file in place with one rename, so a reader never sees half a file under
its name (a crash leaves at most a temporary file in ``<dir>/tmp``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import xxhash

from tokenloom.kv_transfer.base import KVCacheSpec
from tokenloom.kv_transfer.keys import KEY_BYTES

MAGIC = b"TLKV"
VERSION = 2
# magic, version, reserved, fingerprint, key, block size, layers, layer bytes, checksum.
_HEADER = struct.Struct("<4sHH16s16sIIQQ")
HEADER_BYTES = _HEADER.size
BLOCKS_DIR = "blocks"
TMP_DIR = "tmp"


def block_path(root: Path, key: str) -> Path:
    return root / BLOCKS_DIR / key[:2] / key


def file_bytes(spec: KVCacheSpec) -> int:
    """Size of one block's file."""
    return HEADER_BYTES + spec.bytes_per_block


def checksum(parts: Sequence[memoryview | bytes]) -> int:
    """XXH3-64 of the payload given as consecutive ``parts`` (a block's layer slabs,
    read straight into the KV cache, need not be one buffer)."""
    state = xxhash.xxh3_64()
    for part in parts:
        state.update(part)
    return state.intdigest()


def header(spec: KVCacheSpec, key: str, payload: memoryview | bytes) -> bytes:
    return _HEADER.pack(
        MAGIC,
        VERSION,
        0,
        bytes.fromhex(spec.fingerprint)[:KEY_BYTES],
        bytes.fromhex(key),
        spec.block_size,
        spec.num_layers,
        spec.layer_bytes,
        checksum([payload]),
    )


def check(
    spec: KVCacheSpec,
    key: str,
    head: bytes,
    parts: Sequence[memoryview | bytes],
    file_size: int,
) -> str | None:
    """None if a file of ``file_size`` bytes starting with ``head`` (its header),
    whose payload was read into ``parts``, holds block ``key`` of this KV cache,
    else why not."""
    if len(head) < HEADER_BYTES:
        return "truncated"
    magic, version, _, fingerprint, file_key, block_size, layers, layer_bytes, digest = (
        _HEADER.unpack_from(head)
    )
    if magic != MAGIC:
        return "corrupt"
    if version != VERSION:
        return "foreign"
    if fingerprint != bytes.fromhex(spec.fingerprint)[:KEY_BYTES] or (
        block_size,
        layers,
        layer_bytes,
    ) != (spec.block_size, spec.num_layers, spec.layer_bytes):
        return "foreign"
    if file_key != bytes.fromhex(key):
        return "corrupt"
    expected = HEADER_BYTES + spec.bytes_per_block
    if file_size != expected:
        return "truncated" if file_size < expected else "corrupt"
    if checksum(parts) != digest:
        return "corrupt"
    return None
