"""Batched verification through the real sampler code path: the kept tokens follow
the distribution the sampler itself draws from, shaped by temperature, min-p,
top-k, top-p and penalties, whichever rule (exact match or rejection) applies."""

from __future__ import annotations

import math

import pytest
import torch

from tests.worker.test_sampler import make_metadata, reference_probs
from tokenloom.worker.sampler import Sampler
from tokenloom.worker.sampling_metadata import SamplingMetadata
from tokenloom.worker.spec_decode.target_probs import processed_probs
from tokenloom.worker.spec_decode.verifier import verify

V = 12
TRIALS = 12_000
SHAPES = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 4},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.0, "top_k": 6, "top_p": 0.9, "min_p": 0.05},
]


def _tv(tokens: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    return 0.5 * float((counts / counts.sum() - p.double()).abs().sum())


def _rows(shape: dict, rows: int) -> dict:
    return {k: v if k == "temperature" else [v] * rows for k, v in shape.items()}


@pytest.mark.parametrize("shape", SHAPES)
def test_processed_probs_is_what_the_sampler_draws(shape: dict) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=gen) * 2
    probs = processed_probs(logits, make_metadata(2, **_rows(shape, 2)))
    for i in range(2):
        expected = reference_probs(
            logits[i],
            shape["temperature"],
            shape.get("top_k", 0),
            shape.get("top_p", 1.0),
            shape.get("min_p", 0.0),
        )
        torch.testing.assert_close(probs[i], expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dense", [False, True], ids=["exact-match", "rejection"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kept_tokens_follow_the_shaped_target(shape: dict, dense: bool) -> None:
    """Each trial verifies 2 drafts drawn from a q unlike p. The first kept token must
    follow the shaped p0; the second (after an accepted first draft) the shaped p1."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, V, generator=gen) * 2  # positions 0, 1 and the bonus row
    target = processed_probs(logits, make_metadata(3, **_rows(shape, 3)))
    q = torch.rand(2, V, generator=gen) ** 3
    q /= q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q, TRIALS, replacement=True, generator=gen).t().tolist()
    rows = 3 * TRIALS
    out = verify(
        logits.repeat(TRIALS, 1),
        make_metadata(rows, **_rows(shape, rows)),
        Sampler(torch.Generator().manual_seed(11)),
        drafts,
        [q] * TRIALS if dense else None,
    )
    first = [t[0] for t in out.token_ids]
    second = [t[1] for t in out.token_ids if len(t) > 1]
    assert all(1 <= len(t) <= 3 for t in out.token_ids)
    # The TV distance of N samples from their distribution over V outcomes is below
    # sqrt(V / N) with overwhelming probability (its mean is under half that).
    assert _tv(first, target[0]) < math.sqrt(V / len(first))
    assert _tv(second, target[1]) < math.sqrt(V / len(second))
    if dense:
        # min(1, p/q) acceptance beats matching a sample: sum min(p, q) >= sum p * q.
        accepted = sum(len(t) > 1 for t in out.token_ids) / TRIALS
        assert accepted > float((target[0] * q[0]).sum()) + 0.02


def test_penalties_shape_the_target_as_in_the_sampler() -> None:
    """A frequency penalty on an earlier output token applies at verification rows."""
    logits = torch.zeros(2, V)
    logits[:, 3] = 5.0
    md = make_metadata(
        2,
        temperature=0.0,
        penalties=([0.0, 0.0], [10.0, 10.0], [1.0, 1.0]),
        outputs=[[3], [3]],
    )
    out = verify(logits, md, Sampler(torch.Generator().manual_seed(0)), [[3]])
    # Token 3 is penalised below the rest, so the greedy target rejects the draft 3.
    assert out.token_ids == [[0]]


def test_greedy_groups_mixed_with_dense_random_ones_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 4.0]])
    logits = torch.cat([logits, logits])  # group 0 greedy, group 1 random with q
    md = make_metadata(6, temperature=[0.0] * 3 + [1.0] * 3, num_logprobs=[1] * 6)
    q = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = verify(logits, md, Sampler(torch.Generator().manual_seed(0)), [[1, 0], [1, 0]], [None, q])
    assert out.token_ids[0] == [1, 0, 2]  # all argmax matches, then the bonus argmax
    assert out.token_ids[1][:1] in ([1], [0], [2])
    assert out.logprobs is not None
    first = out.logprobs[0]
    assert first is not None and [e.token_ids[0] for e in first] == [1, 0, 2]
    raw = logits[:3].log_softmax(-1)
    assert first[0].logprobs[0] == pytest.approx(float(raw[0, 1]))
    random_group = out.logprobs[1]
    assert random_group is not None and len(random_group) == len(out.token_ids[1])
    for row, (entry, token) in enumerate(zip(random_group, out.token_ids[1], strict=True)):
        assert entry.token_ids[0] == token
        assert entry.logprobs[0] == pytest.approx(float(raw[row, token]))


def test_seeded_groups_are_reproducible() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    q = torch.full((2, V), 1.0 / V)

    def run() -> list[list[int]]:
        md = make_metadata(3, temperature=1.0, generators={0: torch.Generator().manual_seed(5)})
        md.generators = {r: md.generators[0] for r in range(3)}
        return verify(logits.clone(), md, Sampler(torch.Generator()), [[4, 5]], [q]).token_ids

    assert run() == run()


def test_seeded_stream_does_not_depend_on_the_drafts() -> None:
    """A seeded request verifying n-gram drafts (some right, some wrong, 0-3 a step)
    samples exactly the tokens plain decoding samples with the same seed: its
    generator advances one draw per kept token, whatever rows were verified."""
    length = 40
    logits = torch.randn(length + 4, V, generator=torch.Generator().manual_seed(2)) * 2

    def metadata(rows: int, stream: torch.Generator) -> SamplingMetadata:
        md = make_metadata(rows, temperature=0.9, top_k=[6] * rows)
        md.generators = dict.fromkeys(range(rows), stream)
        return md

    stream = torch.Generator().manual_seed(9)
    plain = [
        verify(logits[n : n + 1].clone(), metadata(1, stream), Sampler(), [[]]).token_ids[0][0]
        for n in range(length)
    ]

    stream = torch.Generator().manual_seed(9)
    choose = torch.Generator().manual_seed(4)
    speculated: list[int] = []
    while len(speculated) < length:
        n = len(speculated)
        k = int(torch.randint(0, 4, (), generator=choose))
        drafts = [
            plain[n + i]
            if float(torch.rand((), generator=choose)) < 0.7
            else (plain[n + i] + 1) % V
            for i in range(min(k, length - n - 1))
        ]
        rows = len(drafts) + 1
        out = verify(logits[n : n + rows].clone(), metadata(rows, stream), Sampler(), [drafts])
        speculated.extend(out.token_ids[0])
    assert speculated == plain
