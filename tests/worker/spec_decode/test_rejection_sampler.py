"""The rejection sampler's outputs follow the target distribution exactly."""

import math

import pytest
import torch

from tokenloom.worker.spec_decode.rejection_sampler import VerifyInputs, rejection_sample

V = 6


def _dist(gen: torch.Generator) -> torch.Tensor:
    w = torch.rand(V, generator=gen, dtype=torch.float64) ** 2
    return (w / w.sum()).float()


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p.double()).abs().sum())


@pytest.mark.parametrize("one_hot", [True, False])
def test_first_two_tokens_follow_the_target(one_hot: bool) -> None:
    """Each trial: 2 drafts from q, verified against p0, p1 (bonus p2). The first
    emitted token must be ~p0; the second, given the first was the accepted draft,
    must be ~p1 (positions are independent here, so that is its marginal too)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.stack([_dist(gen) for _ in range(3)])
    q = torch.stack([_dist(gen) for _ in range(2)])
    trials = 40_000
    drafts = torch.multinomial(q, trials, replacement=True, generator=gen).t()  # [trials, 2]
    rows = trials * 3
    draft_ids = torch.cat([drafts, torch.zeros(trials, 1, dtype=torch.long)], 1).reshape(-1)
    target = p.repeat(trials, 1)
    draft_probs = None
    if not one_hot:
        draft_probs = torch.cat([q, torch.zeros(1, V)]).repeat(trials, 1)
    out = rejection_sample(
        VerifyInputs(
            target_probs=target,
            draft_token_ids=draft_ids,
            draft_probs=draft_probs,
            num_drafts=torch.full((trials,), 2),
            greedy=torch.zeros(trials, dtype=torch.bool),
            accept_uniforms=torch.rand(rows, dtype=torch.float64, generator=gen),
            recovery_uniforms=torch.rand(trials, dtype=torch.float64, generator=gen),
        )
    )
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V).double()
    second_tokens = [o[1] for o in out if len(o) > 1]
    second = torch.bincount(torch.tensor(second_tokens), minlength=V).double()
    # TV of an empirical distribution over V outcomes from N samples is below
    # sqrt(V / N) with overwhelming probability (its expectation is under
    # 0.5 * sqrt(V / N)); the bound is 2x that, so a biased sampler fails.
    # One-hot: each draft is treated as a certain proposal (q(d) = 1), which must
    # give the target's distribution whatever the drafts were.
    assert _tv(first, p[0]) < math.sqrt(V / trials)
    assert _tv(second, p[1]) < math.sqrt(V / len(second_tokens))
    assert all(1 <= len(o) <= 3 for o in out)


def test_a_biased_sampler_would_fail_the_bound() -> None:
    """The bound is tight enough to see a wrong distribution (the draft's own)."""
    gen = torch.Generator().manual_seed(1)
    p, q = _dist(gen), _dist(gen)
    samples = torch.multinomial(q, 40_000, replacement=True, generator=gen)
    counts = torch.bincount(samples, minlength=V).double()
    assert _tv(counts, p) > math.sqrt(V / 40_000)


def test_greedy_accepts_argmax_matches_and_ends_with_the_argmax() -> None:
    p = torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    # Request 0: drafts [1, 0] both argmax -> bonus argmax 2. Request 1: draft 2 != argmax 1.
    target = torch.cat([p, p[:2]])
    out = rejection_sample(
        VerifyInputs(
            target_probs=target,
            draft_token_ids=torch.tensor([1, 0, 0, 2, 0]),
            draft_probs=None,
            num_drafts=torch.tensor([2, 1]),
            greedy=torch.tensor([True, True]),
            accept_uniforms=torch.zeros(5, dtype=torch.float64),
            recovery_uniforms=torch.zeros(2, dtype=torch.float64),
        )
    )
    assert out == [[1, 0, 2], [1]]


def test_requests_without_drafts_sample_their_bonus_row() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0]])
    out = rejection_sample(
        VerifyInputs(
            target_probs=p,
            draft_token_ids=torch.tensor([0]),
            draft_probs=None,
            num_drafts=torch.tensor([0]),
            greedy=torch.tensor([False]),
            accept_uniforms=torch.rand(1, dtype=torch.float64),
            recovery_uniforms=torch.rand(1, dtype=torch.float64),
        )
    )
    assert out == [[1]]
