"""MARFT's math against values computed by hand (shared/rlmath/marft.py, the marft losses of losses.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shared.rlmath.losses import LossSettings, PolicyBatch, action_logprob, marft_action, token_k3, value_loss
from shared.rlmath.marft import (
    action_gae,
    agent_to_train,
    gae,
    last_agent_rewards,
    normalise_advantages,
    token_gae,
)

GAMMA, LAM = 0.9, 0.5


def test_action_level_gae_on_two_agents_and_two_steps() -> None:
    # gamma 0.9, lambda 0.5; the episode ends after step 1; the team reward 1 on the last agent of step 1.
    #   t=1 i=1: delta = 1 + 0.9 * 0 - 0.6 = 0.4                 A = 0.4
    #   t=1 i=0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04               A = 0.04 + 0.45 * 0.4 = 0.22
    #   t=0 i=1: delta = 0 + 0.9 * 0.5 - 0.4 = 0.05 (from agent 0 of step 1)   A = 0.05 + 0.45 * 0.22 = 0.149
    #   t=0 i=0: delta = 0 + 0.9 * 0.4 - 0.2 = 0.16               A = 0.16 + 0.45 * 0.149 = 0.22705
    adv, ret = action_gae([[0, 0], [0, 1]], [[0.2, 0.4], [0.5, 0.6]], [False, True], GAMMA, LAM)
    np.testing.assert_allclose(adv, [[0.22705, 0.149], [0.22, 0.4]], atol=1e-12)
    np.testing.assert_allclose(ret, [[0.42705, 0.549], [0.72, 1.0]], atol=1e-12)


def test_agent_i_bootstraps_from_agent_i_plus_1_and_the_last_from_the_next_step_unless_the_episode_ended() -> None:
    # one step of two agents, rewards [0, 1], values [0.5, 0.3]
    #   not ended, V_1^0 = 0.8:  i=1: 1 + 0.9 * 0.8 - 0.3 = 1.42;  i=0: 0.9 * 0.3 - 0.5 + 0.45 * 1.42 = 0.409
    #   ended:                   i=1: 1 - 0.3 = 0.7;               i=0: -0.23 + 0.45 * 0.7 = 0.085
    adv, _ = action_gae([[0, 1]], [[0.5, 0.3]], [False], GAMMA, LAM, next_value=0.8)
    np.testing.assert_allclose(adv, [[0.409, 1.42]], atol=1e-12)
    adv, _ = action_gae([[0, 1]], [[0.5, 0.3]], [True], GAMMA, LAM, next_value=0.8)
    np.testing.assert_allclose(adv, [[0.085, 0.7]], atol=1e-12)


def test_an_episode_end_stops_the_bootstrap_between_two_episodes_in_one_sequence() -> None:
    # two one-step episodes back to back: the first one's last agent does not see the second's values
    adv, ret = gae([0, 1, 0, 1], [0.2, 0.4, 0.5, 0.6], [False, True, False, True], GAMMA, LAM)
    # first: i=1 1 - 0.4 = 0.6; i=0 0.9 * 0.4 - 0.2 + 0.45 * 0.6 = 0.43. second: 0.4; 0.9 * 0.6 - 0.5 + 0.18 = 0.22
    np.testing.assert_allclose(adv, [0.43, 0.6, 0.22, 0.4], atol=1e-12)
    np.testing.assert_allclose(ret, [0.63, 1.0, 0.72, 1.0], atol=1e-12)
    with pytest.raises(ValueError, match="one each per action"):
        gae([0, 1], [0.1], [False, True], GAMMA, LAM)


def test_normalisation_leaves_exact_zeros_out_of_the_statistics_but_normalises_them() -> None:
    # non-zero entries 1, 3, 2: mean 2, population std sqrt(2/3)
    out = normalise_advantages([0.0, 1.0, 3.0, 0.0, 2.0])
    s = math.sqrt(2 / 3)
    np.testing.assert_allclose(out, [-2 / s, -1 / s, 1 / s, -2 / s, 0.0], rtol=1e-7)
    np.testing.assert_array_equal(normalise_advantages([0.0, 0.0]), [0.0, 0.0])  # nothing to normalise by


@pytest.mark.parametrize("adv", [[0.0, 0.3, 0.0, 0.0], [0.0, 0.3, 0.3, 0.0, 0.3], [0.7]])
def test_non_zero_advantages_without_spread_are_left_as_they_are(adv: list[float]) -> None:
    # the listing: std 0, so (0 - 0.3) / 1e-8 = -3e7 on every zero; the guard leaves the batch unchanged
    with np.errstate(all="ignore"):
        a = np.asarray(adv)
        listing = (a - a[a != 0].mean()) / (a[a != 0].std() + 1e-8)
    if 0.0 in adv:
        assert np.abs(listing).max() > 1e6
    np.testing.assert_array_equal(normalise_advantages(adv), adv)
    # one more distinct value restores the spread and the normalisation
    out = normalise_advantages([*adv, 0.5])
    assert abs(float(np.mean([x for x, y in zip(out, [*adv, 0.5], strict=True) if y != 0]))) < 1e-9


def test_token_level_gae_on_a_short_sequence() -> None:
    # one step: agent 0 says two tokens, agent 1 one; the reward 1 on the last token of the last agent
    #   k=2: 1 - 0.4 = 0.6                                  A = 0.6
    #   k=1: 0.9 * 0.4 - 0.2 = 0.16 (from agent 1's token)   A = 0.16 + 0.45 * 0.6 = 0.43
    #   k=0: 0.9 * 0.2 - 0.1 = 0.08                         A = 0.08 + 0.45 * 0.43 = 0.2735
    adv, ret = token_gae([[2, 1]], [1.0], [[0.1, 0.2], [0.4]], [True], GAMMA, LAM)
    np.testing.assert_allclose(np.concatenate(adv), [0.2735, 0.43, 0.6], atol=1e-12)
    np.testing.assert_allclose(np.concatenate(ret), [0.3735, 0.63, 1.0], atol=1e-12)
    assert [a.size for a in adv] == [2, 1]


def test_the_action_level_ratio_under_each_normalisation() -> None:
    new = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    old = torch.tensor([[-1.5, -2.0, -3.0], [-1.0, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    words = torch.tensor([2, 1])

    def ratio(norm: str) -> list[float]:
        return torch.exp(action_logprob(new, mask, norm, words) - action_logprob(old, mask, norm, words)).tolist()

    # sums: new [-6, -1], old [-6.5, -1.5]; per token: / [3, 2]; per word: / [2, 1]
    assert ratio("none") == pytest.approx([math.exp(0.5), math.exp(0.5)])
    assert ratio("token") == pytest.approx([math.exp(0.5 / 3), math.exp(0.25)])
    assert ratio("word") == pytest.approx([math.exp(0.25), math.exp(0.5)])
    with pytest.raises(ValueError, match="word count"):
        action_logprob(new, mask, "word")


def test_the_clipped_policy_loss_the_value_loss_and_the_approximate_kl() -> None:
    # one token per action, ratios 1.5 and 0.5: min(1.5 * 1, 1.2 * 1) = 1.2; min(0.5 * -1, 0.8 * -1) = -0.8;
    # eq. (6) is their mean 0.2, the loss -0.2
    old = torch.zeros(2, 1)
    batch = PolicyBatch(torch.log(torch.tensor([[1.5], [0.5]])), old, torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    loss, _ = marft_action(batch, LossSettings(clip_eps=0.2, denominator=2.0))
    assert float(loss) == pytest.approx(-0.2)
    # V 1.0, V_old 0.5, R 2.0, clip 0.2: unclipped (2 - 1)^2 / 2 = 0.5, clipped V 0.7: 1.3^2 / 2 = 0.845
    v, v_old, r = torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([2.0])
    assert float(value_loss(v, v_old, r, clip=0.2)) == pytest.approx(0.845)
    assert float(value_loss(v, v_old, r, clip=None)) == pytest.approx(0.5)
    assert float(value_loss(v, v_old, r, clip=0.2, huber_delta=1.0)) == pytest.approx(0.8)  # 1 * (1.3 - 0.5)
    # marft.kl_level token: log rho [0.5, 0]: k3 = e^0.5 - 1 - 0.5 and 0, mean over the two tokens
    kl = token_k3(torch.tensor([[-1.0, -2.0, 7.0]]), torch.tensor([[-1.5, -2.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert float(kl) == pytest.approx((math.exp(0.5) - 1.5) / 2)


@pytest.mark.parametrize("norm", ["none", "token", "word"])
def test_the_trust_region_kl_is_k3_of_each_whole_actions_log_ratio(norm: str) -> None:
    # the listing: get_joint_action_log_probs, then k3 of each action's log-ratio, averaged over the actions
    g = torch.Generator().manual_seed(3)
    lengths = [1, 4, 9, 16]
    mask = torch.tensor([[1.0] * n + [0.0] * (16 - n) for n in lengths])
    new = -torch.rand(4, 16, generator=g) * 3
    old = new - 0.05 + torch.randn(4, 16, generator=g) * 0.01  # a policy that moved: every token a bit likelier
    words = torch.tensor([1, 2, 3, 5])
    _, stats = marft_action(PolicyBatch(new, old, torch.ones(4), mask, words=words),
                            LossSettings(action_norm=norm, denominator=4.0))
    by_hand = []
    for i, n in enumerate(lengths):
        lr = float((new[i, :n] - old[i, :n]).sum()) / {"none": 1, "token": n, "word": int(words[i])}[norm]
        by_hand.append(math.exp(lr) - 1 - lr)
    assert stats["approx_kl"] == pytest.approx(sum(by_hand) / 4, rel=1e-3)  # float32 sums of the log-ratios
    if norm == "none":  # far above the token-level mean of the same log-ratios (the 16-token action alone: 0.32)
        assert stats["approx_kl"] > 20 * float(token_k3(new, old, mask))


def test_agent_by_agent_cycles_and_the_team_reward_goes_to_the_last_agent() -> None:
    assert [agent_to_train(v, 2, 3) for v in range(8)] == [0, 0, 1, 1, 2, 2, 0, 0]
    assert agent_to_train(5, 0, 3) is None
    np.testing.assert_array_equal(last_agent_rewards([0.0, 1.0], 3), [[0, 0, 0], [0, 0, 1]])
