"""Prompt lookup (the drafts) and the verification of a draft (exact for greedy and sampled rows)."""

from __future__ import annotations

import pytest
import torch

from services.rollouter.speculate import PromptLookup, verify
from shared.kernel.config import SpeculateSection


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    seq = [5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    look = PromptLookup(seq, 1, 3)
    # suffix (4, 2, 3) never occurred; (2, 3) last occurred ending at index 7, followed by 7, 8, 4, 2
    assert look.draft(4) == [7, 8, 4, 2]
    assert look.draft(2) == [7, 8]
    look.extend([7])  # suffix (2, 3, 7) occurred ending at 8: what followed it
    assert look.draft(3) == [8, 4, 2]
    assert PromptLookup([1, 2, 3, 4], 1, 3).draft(5) == []  # nothing repeats
    assert PromptLookup([1, 2, 3, 4], 1, 3).draft(0) == []


def test_extending_token_by_token_is_the_same_index_as_building_it_at_once() -> None:
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 6, (200,), generator=g).tolist()
    whole = PromptLookup(seq, 1, 4)
    grown = PromptLookup(seq[:7], 1, 4)
    for t in seq[7:]:
        grown.extend([t])
    assert grown.last == whole.last and grown.match == whole.match
    for k in (1, 3, 8):
        assert grown.draft(k) == whole.draft(k)
        d = whole.draft(k)  # a draft continues an earlier occurrence of the current suffix
        assert d and len(d) <= k


def test_greedy_verification_keeps_the_prefix_the_model_agrees_with_and_adds_its_own_token() -> None:
    logp = torch.log_softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(0)), -1)
    g = torch.Generator()
    assert verify(logp, [4, 6, 1, 2], [4, 6, 1], True, g)[0] == [4, 6, 1, 2]  # all kept, plus one
    assert verify(logp, [4, 6, 1, 2], [4, 5, 1], True, g)[0] == [4, 6]  # the model's token at the mismatch
    tokens, lps = verify(logp, [4, 6, 1, 2], [9], True, g)
    assert tokens == [4] and lps == [float(logp[0, 4])]
    assert verify(logp[:1], [3], [], True, g)[0] == [3]


def test_sampled_verification_emits_every_token_with_the_model_s_probability() -> None:
    """Speculative sampling with a one-point proposal: the first token is distributed as p0 whatever the draft,
    and after an accepted draft token d the next as p1; each log-prob is the emitting position's."""
    p0 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logp = torch.stack([p0, p1]).log()
    g = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(4)
    second = torch.zeros(4)
    for _ in range(n):
        tokens, lps = verify(logp, [0, 3], [1], False, g)  # draft: token 1 (p0 = 0.3)
        first[tokens[0]] += 1
        assert lps[0] == pytest.approx(float(logp[0, tokens[0]]))
        if len(tokens) == 2:
            assert tokens[0] == 1
            second[tokens[1]] += 1
            assert lps[1] == pytest.approx(float(logp[1, tokens[1]]))
    kept = second.sum()
    assert abs(kept / n - 0.3) < 0.015  # the draft is kept with probability p0(draft)
    assert torch.allclose(first / n, p0, atol=0.015)
    assert torch.allclose(second / kept, p1, atol=0.025)


def test_the_settings_refuse_an_empty_n_gram_range() -> None:
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculateSection(ngram_min=4, ngram_max=2)
    assert SpeculateSection().draft_tokens > 0
