"""MARFT in the coordinator: the chain with feedback (a wrong answer is shown to the next round, a right one ends
the episode), the samples laid out as (round, position), the team reward on the last agent of each round, and
action-level GAE over each rollout computed by hand."""

from __future__ import annotations

import pytest

from services.coordinator.marft import apply_gae, critic_rows, rollouts
from tests.unit.test_workflows_builtin import Actions, Script, config, play


def marft_config(variant: str = "action"):
    cfg = config({"name": "chain", "agents": ["a", "b"], "rounds": 2, "feedback": True}, {"a": "m1", "b": "m1"},
                 group_size=2)
    data = cfg.model_dump(mode="json", exclude={"marft"})
    data["train"].update(loss="marft", mode="sync", max_staleness=0)
    data["marft"] = {"variant": variant, "gamma": 0.9, "gae_lambda": 0.5}
    return type(cfg)(**data)


def b_right_then_wrong():
    calls = {"n": 0}

    def b(user: str) -> str:
        calls["n"] += 1
        return "7" if calls["n"] == 1 or "feedback" in user else "5"  # rollout 0 right at once; rollout 1 wrong once
    return b


async def test_a_wrong_answer_is_shown_to_the_next_round_and_a_right_one_ends_the_episode():
    cfg = marft_config()
    policy = Script({"a": lambda u: "x", "b": b_right_then_wrong()})
    ep = await play(cfg, policy, Actions())
    t0, t1 = (ep.trajectories[i]["trajectory"] for i in range(2))
    assert [(t["turn_id"], t["agent_name"], t["metadata"]["round"]) for t in t0] == [(0, "a", 0), (1, "b", 0)]
    assert [(t["turn_id"], t["agent_name"], t["metadata"]["round"]) for t in t1] == [
        (0, "a", 0), (1, "b", 0), (2, "a", 1), (3, "b", 1)]
    assert t1[2]["agent_input"] == "3+4=\nb: 5\nfeedback: 5 is wrong.\n"
    assert ep.final_correct == [True, True]
    # MARFT keeps the turns only one rollout reached, in groups of their real size
    sizes = {(s.turn, s.rollout_idx): s.group_size for s in ep.samples}
    assert sizes == {(0, 0): 2, (0, 1): 2, (1, 0): 2, (1, 1): 2, (2, 1): 1, (3, 1): 1}
    assert all(s.advantage is None for s in ep.samples)  # no GRPO advantages: the critic's GAE gives them


async def test_action_level_gae_over_each_rollout_by_hand():
    cfg = marft_config()
    ep = await play(cfg, Script({"a": lambda u: "x", "b": b_right_then_wrong()}), Actions())
    layout = rollouts(cfg, ep)
    assert [[[s.turn for s in step] for step in ro.steps] for ro in layout] == [[[0, 1]], [[0, 1], [2, 3]]]
    # team rewards: the check of each round's last answer ("5" is 2 off 7: 0.4; "7": 1)
    assert [ro.team for ro in layout] == [pytest.approx([1.0]), pytest.approx([0.4, 1.0])]
    samples = [s for ro in layout for s in ro.samples]
    rows = critic_rows(samples, "action")
    assert [r.positions for r in rows] == [[len(s.prompt_ids.numpy()) - 1] for s in samples]
    values = [[0.2], [0.4], [0.2], [0.4], [0.5], [0.6]]
    batch = apply_gae(cfg, layout, values, rows, "critic-t-1")
    # gamma 0.9, lambda 0.5. Rollout 0: r = [0, 1], V = [0.2, 0.4], the episode ends after b:
    #   A_b = 1 - 0.4 = 0.6;  A_a = (0.9 * 0.4 - 0.2) + 0.45 * 0.6 = 0.43
    # Rollout 1: r = [0, 0.4 | 0, 1], V = [0.2, 0.4 | 0.5, 0.6]; b of round 0 bootstraps from a of round 1:
    #   A_b1 = 1 - 0.6 = 0.4
    #   A_a1 = (0.9 * 0.6 - 0.5) + 0.45 * 0.4 = 0.22
    #   A_b0 = (0.4 + 0.9 * 0.5 - 0.4) + 0.45 * 0.22 = 0.549
    #   A_a0 = (0.9 * 0.4 - 0.2) + 0.45 * 0.549 = 0.40705
    expected = [0.43, 0.6, 0.40705, 0.549, 0.22, 0.4]
    assert [s.advantage for s in samples] == pytest.approx(expected)
    assert [float(s.gae_returns.numpy()[0]) for s in samples] == pytest.approx(
        [v[0] + a for v, a in zip(values, expected, strict=True)], abs=1e-6)
    assert [float(s.gae_values.numpy()[0]) for s in samples] == pytest.approx([v[0] for v in values])
    # the team reward sits on the last agent of each round, the others get 0
    assert [s.reward for s in samples] == pytest.approx([0.0, 1.0, 0.0, 0.4, 0.0, 1.0])
    assert [c.sample_id for c in batch.samples] == [s.sample_id for s in samples]
    assert [c.old_values[0] for c in batch.samples] == pytest.approx([v[0] for v in values])


async def test_token_level_gae_values_every_response_token():
    cfg = marft_config("token")
    ep = await play(cfg, Script({"a": lambda u: "x", "b": b_right_then_wrong()}), Actions())
    layout = rollouts(cfg, ep)
    samples = [s for ro in layout for s in ro.samples]
    rows = critic_rows(samples, "token")
    for s, r in zip(samples, rows, strict=True):
        p, n = len(s.prompt_ids.numpy()), len(s.response_ids.numpy())
        assert r.positions == list(range(p - 1, p - 1 + n)) and len(r.ids.numpy()) == p + n
    values = [[0.0] * len(r.positions) for r in rows]
    apply_gae(cfg, layout, values, rows, "critic-t-1")
    # rollout 0: a's 2 tokens ("x", EOS), b's 2 tokens; reward 1 on b's last token, V = 0:
    # A_k = (gamma lambda)^(K-1-k) * 1 = 0.45^3, 0.45^2, 0.45, 1
    adv = [*samples[0].token_advantages.numpy(), *samples[1].token_advantages.numpy()]
    assert adv == pytest.approx([0.45**3, 0.45**2, 0.45, 1.0])
