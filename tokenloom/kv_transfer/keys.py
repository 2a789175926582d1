"""Content addresses of full KV blocks, for stores outside the engine's memory.

A block's key is the prefix-caching chain (``core/kv_cache/hashing.py``: a
block's identity covers its parent's and its own token ids, and the chain
starts from the LoRA adapter) computed with a 128-bit BLAKE2b instead of a
64-bit bucket hash: in memory a digest only picks a dict bucket and equality
compares the tokens, but a file or a message named by its key must identify
its prefix alone. The chain starts from a salt: the KV cache's fingerprint
(model weights, dtypes, block layout: ``KVCacheSpec.fingerprint``) and the
adapter's name and path (not its id, which is only stable within one run).
Keys are hex strings and the same in every process and on every machine.
"""

from __future__ import annotations

import sys
from array import array
from hashlib import blake2b
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenloom.lora_request import LoRARequest

KEY_BYTES = 16
_PERSON = b"tokenloom-kv1"


def chain_root(fingerprint: str, lora_request: LoRARequest | None = None) -> bytes:
    """The salt a request's chain starts from."""
    h = blake2b(bytes.fromhex(fingerprint), digest_size=KEY_BYTES, person=_PERSON)
    if lora_request is not None:
        h.update(f"\0lora\0{lora_request.lora_name}\0{lora_request.lora_path}".encode())
    return h.digest()


def _token_bytes(token_ids: list[int]) -> bytes:
    tokens = array("I", token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens.tobytes()


class BlockKeys:
    """The keys of one request's full blocks, extended as its tokens grow."""

    __slots__ = ("keys", "_last")

    def __init__(self, root: bytes) -> None:
        self.keys: list[str] = []
        self._last = root

    def extend(self, token_ids: list[int], block_size: int) -> list[str]:
        """Keys of every full block of ``token_ids`` (a prefix of the same tokens each call)."""
        keys = self.keys
        for i in range(len(keys), len(token_ids) // block_size):
            h = blake2b(self._last, digest_size=KEY_BYTES, person=_PERSON)
            h.update(_token_bytes(token_ids[i * block_size : (i + 1) * block_size]))
            self._last = h.digest()
            keys.append(self._last.hex())
        return keys


def prefix_digest(fingerprint: str, token_ids: list[int]) -> str:
    """A digest of a whole token prefix (and the KV cache it belongs to), to check
    that KV computed elsewhere is for exactly these tokens."""
    h = blake2b(bytes.fromhex(fingerprint), digest_size=KEY_BYTES, person=_PERSON)
    h.update(_token_bytes(token_ids))
    return h.hexdigest()
