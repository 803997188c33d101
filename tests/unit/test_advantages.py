"""The advantage estimators on hand-computed examples."""

from __future__ import annotations

import numpy as np
import pytest

from shared.rlmath.advantages import ESTIMATORS, batch_advantages, batch_token_advantages, estimate

REWARDS = [1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 2.0]
GROUPS = ["a", "a", "a", "a", "b", "c", "c"]  # b: a group of one; c: equal rewards


def test_grpo_normalises_by_the_group_std():
    # a: mean .5, population std .5
    assert estimate(REWARDS, GROUPS, "grpo") == pytest.approx([1, -1, -1, 1, 0, 0, 0], abs=1e-5)


def test_dr_grpo_only_centres():
    assert estimate(REWARDS, GROUPS, "dr_grpo") == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0])


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # sample 0: 1 - mean(0, 0, 1) = 2/3; sample 1: 0 - mean(1, 0, 1) = -2/3
    assert estimate(REWARDS, GROUPS, "rloo") == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0])


def test_group_estimators_never_mix_agents_of_one_environment():
    keys = ["e0:solver:0"] * 2 + ["e0:verifier:1"] * 2
    for est in ("grpo", "dr_grpo", "rloo"):
        a = estimate([1.0, 0.0, 9.0, -3.0], keys, est)
        b = estimate([1.0, 0.0, 0.0, 0.0], keys, est)
        assert a[:2] == pytest.approx(b[:2]), est


def test_reinforce_pp_whitens_returns_over_the_batch_tokens():
    # rewards 1 and 0 on 1 and 3 tokens: token mean 1/4, token std sqrt(3/16)
    std = np.sqrt(3 / 16)
    assert batch_advantages([1.0, 0.0], [1, 3]) == pytest.approx([0.75 / std, -0.25 / std], rel=1e-5)
    assert batch_advantages([2.0, 2.0], [4, 1]) == pytest.approx([0.0, 0.0])  # no signal
    with pytest.raises(ValueError, match="token counts"):
        batch_advantages([1.0], [1, 2])


def test_the_estimators_are_the_documented_ones():
    assert ESTIMATORS == ("grpo", "dr_grpo", "rloo", "reinforce_pp")
    with pytest.raises(ValueError, match="global batch"):
        estimate(REWARDS, GROUPS, "reinforce_pp")


def test_reinforce_pp_with_a_per_token_penalty_whitens_the_returns_to_go():
    # sample 0: reward 1, penalties [0.1, 0.2] -> returns [1 - 0.3, 1 - 0.2] = [0.7, 0.8]; sample 1: reward 0,
    # penalty [0.5] -> [-0.5]. Tokens 0.7, 0.8, -0.5: mean 1/3, population std sqrt(((11/30)^2 + (14/30)^2 +
    # (25/30)^2) / 3)
    got = batch_token_advantages([1.0, 0.0], [np.array([0.1, 0.2]), np.array([0.5])])
    mean = 1 / 3
    std = np.sqrt(((0.7 - mean) ** 2 + (0.8 - mean) ** 2 + (-0.5 - mean) ** 2) / 3)
    assert got[0] == pytest.approx([(0.7 - mean) / std, (0.8 - mean) / std], rel=1e-5)
    assert got[1] == pytest.approx([(-0.5 - mean) / std], rel=1e-5)


def test_reinforce_pp_without_penalty_is_the_same_per_token_or_per_sample():
    rewards, tokens = [1.0, 0.0, 0.5], [2, 3, 1]
    per_token = batch_token_advantages(rewards, [np.zeros(n) for n in tokens])
    for arr, a, n in zip(per_token, batch_advantages(rewards, tokens), tokens, strict=True):
        assert arr == pytest.approx([a] * n)
    assert [a.tolist() for a in batch_token_advantages([2.0, 2.0], [np.zeros(1), np.zeros(2)])] == [[0.0], [0.0, 0.0]]
