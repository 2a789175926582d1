"""Chained block hashes: exact equality even when digests collide; lazy extension."""

import pytest

from tokenloom.core.kv_cache import hashing
from tokenloom.core.kv_cache.hashing import BlockHash, extend_block_hashes
from tokenloom.request import Request
from tokenloom.sampling_params import SamplingParams


def _chain(*blocks: tuple[int, ...]) -> list[BlockHash]:
    out: list[BlockHash] = []
    parent = None
    for tokens in blocks:
        parent = BlockHash(parent, tokens)
        out.append(parent)
    return out


def test_same_prefix_is_equal_different_prefix_is_not() -> None:
    a = _chain((1, 2), (3, 4))
    b = _chain((1, 2), (3, 4))
    c = _chain((9, 9), (3, 4))
    assert a[1] == b[1] and hash(a[1]) == hash(b[1])
    assert a[1] != c[1]
    assert _chain((1, 2), (3, 4))[1] != _chain((1, 2), (3, 5))[1]
    assert a[0] != "not a hash"


def test_digest_collision_never_makes_different_prefixes_equal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hashing, "digest_block", lambda parent, tokens: 7)
    a = _chain((1, 2), (3, 4))
    b = _chain((5, 6), (3, 4))
    assert hash(a[1]) == hash(b[1]) == 7
    assert a[1] != b[1]
    assert a[1] == _chain((1, 2), (3, 4))[1]
    table = {a[1]: "a"}
    assert b[1] not in table
    assert table[_chain((1, 2), (3, 4))[1]] == "a"


def _request(tokens: list[int]) -> Request:
    return Request("r", tokens, SamplingParams())


def test_extend_hashes_only_full_blocks_and_grows_with_output() -> None:
    request = _request(list(range(7)))
    hashes = extend_block_hashes(request, 3)
    assert hashes is request.block_hashes
    assert [h.token_ids for h in hashes] == [(0, 1, 2), (3, 4, 5)]
    first = list(hashes)
    request.append_output_token_ids([7, 8], 4096)
    extend_block_hashes(request, 3)
    assert request.block_hashes[:2] == first and request.block_hashes[0] is first[0]
    assert [h.token_ids for h in request.block_hashes] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    assert request.block_hashes[2].parent is request.block_hashes[1]


def test_extension_reuses_cached_equal_objects() -> None:
    owner = extend_block_hashes(_request(list(range(6))), 3)
    cached = {h: type("Blk", (), {"block_hash": h})() for h in owner}
    other = extend_block_hashes(_request(list(range(6)) + [42, 43, 44]), 3, cached)
    assert other[0] is owner[0] and other[1] is owner[1]
    assert other[2].parent is owner[1]


def test_extra_key_separates_chains_even_when_digests_collide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The LoRA adapter id keys the chain: same tokens, other adapter, other block."""
    base = BlockHash(BlockHash(None, (1, 2)), (3, 4))
    lora = BlockHash(BlockHash(None, (1, 2), extra_key=5), (3, 4))
    assert lora.extra_key == 5 and base.extra_key == 0
    assert base != lora and hash(base) != hash(lora)
    assert lora == BlockHash(BlockHash(None, (1, 2), extra_key=5), (3, 4))
    monkeypatch.setattr(hashing, "digest_block", lambda parent, tokens: 7)
    assert BlockHash(None, (1, 2), extra_key=5) != BlockHash(None, (1, 2), extra_key=6)
