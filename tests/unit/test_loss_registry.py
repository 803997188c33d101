"""The loss registry (shared/rlmath/losses.py): the registered functions give the values and gradients the losses
gave before they were registered, a new loss is one function and a name and trains, and the learner's steps call
what is registered (nothing else computes a policy loss).

``data/losses_golden.pt`` holds the values and gradients (with respect to log pi_theta) of every loss on seeded
random inputs, recorded from the functions before the registry (services/trainer/grpo.py's policy_loss_terms,
aggregate_loss and kl_estimate, shared/rlmath/marft_loss.py, and the learner's inline MARFT objectives, at commit
443c84d); :func:`inputs` rebuilds the same inputs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.learner import Learner
from shared.rlmath import losses
from shared.rlmath.losses import (
    POLICY_LOSSES,
    LossSettings,
    PolicyBatch,
    kl_estimate,
    policy_loss,
    register_policy_loss,
    value_loss,
)
from tests.unit.test_learner import make_cfg, make_sample
from tests.unit.test_marft_learner import batch as marft_batch
from tests.unit.test_marft_learner import marft_cfg

GOLDEN = torch.load(Path(__file__).parent / "data" / "losses_golden.pt", weights_only=True)["cases"]
AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")


def inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    logp = (-torch.rand(b, t, generator=g) * 3).double().float()
    behav = logp + torch.randn(b, t, generator=g) * 0.3
    prox = logp + torch.randn(b, t, generator=g) * 0.2
    adv = torch.randn(b, generator=g)
    adv_t = torch.randn(b, t, generator=g)
    words = torch.randint(1, 5, (b,), generator=g)
    ref = logp + torch.randn(b, t, generator=g) * 0.4
    return dict(mask=mask, logp=logp, behav=behav, prox=prox, adv=adv, adv_t=adv_t, words=words, ref=ref)


def value_and_grad(fn: Callable[[torch.Tensor], torch.Tensor], logp: torch.Tensor) -> tuple[float, torch.Tensor]:
    x = logp.clone().requires_grad_(True)
    out = fn(x)
    out.backward()
    assert x.grad is not None
    return float(out.detach()), x.grad.clone()


def now(seed: int) -> dict[str, tuple[float, torch.Tensor]]:
    """Every golden case computed by the registered functions."""
    d = inputs(seed)
    m = d["mask"]
    out: dict[str, tuple[float, torch.Tensor]] = {}
    for name in ("ppo_clip", "decoupled"):
        for c in (None, 3.0):
            for cap in ((None, 1.5) if name == "decoupled" else (None,)):
                for adv_key in ("adv", "adv_t"):
                    for agg in AGGS:
                        s = LossSettings(clip_eps=0.2, agg=agg, denominator=16.0, clip_ratio_c=c, behav_imp_weight_cap=cap)

                        def f(x: torch.Tensor, name: str = name, adv_key: str = adv_key, s: LossSettings = s) -> torch.Tensor:
                            prox = d["prox"] if name == "decoupled" else None
                            return policy_loss(name)(PolicyBatch(x, d["behav"], d[adv_key], m, logp_prox=prox), s)[0]
                        out[f"{name}|c={c}|cap={cap}|{adv_key}|{agg}|s{seed}"] = value_and_grad(f, d["logp"])
    for est in ("k1", "k2", "k3"):
        out[f"kl|{est}|s{seed}"] = value_and_grad(lambda x, e=est: (kl_estimate(x, d["ref"], e) * m).sum() / 16.0, d["logp"])
    n, total = m.shape[0], float(m.sum())
    for norm in ("none", "token", "word"):
        s = LossSettings(clip_eps=0.2, denominator=float(n), action_norm=norm)
        words = d["words"] if norm == "word" else None
        out[f"marft_action|{norm}|s{seed}"] = value_and_grad(
            lambda x, s=s, w=words: policy_loss("marft")(PolicyBatch(x, d["behav"], d["adv"], m, words=w), s)[0], d["logp"])
    out[f"marft_token|s{seed}"] = value_and_grad(
        lambda x: policy_loss("marft_token")(PolicyBatch(x, d["behav"], d["adv_t"], m),
                                             LossSettings(clip_eps=0.2, denominator=total))[0], d["logp"])
    out[f"marft_token_k3|s{seed}"] = (float(losses.token_k3(d["logp"], d["behav"], m)), torch.zeros(1))
    v = d["adv"].clone()
    old = v + 0.3 * d["words"].float() / 4
    ret = v + d["adv_t"][:, 0]
    for clip in (None, 0.2):
        for hub in (None, 0.5):
            out[f"value|clip={clip}|huber={hub}|s{seed}"] = value_and_grad(
                lambda x, c=clip, h=hub: value_loss(x[:, 0], old, ret, c, h), d["logp"])
    return out


def test_every_registered_loss_gives_the_values_and_gradients_of_the_losses_before_it():
    got = {k: v for seed in range(4) for k, v in now(seed).items()}
    assert got.keys() == GOLDEN.keys()
    for key, (value, grad) in GOLDEN.items():
        assert got[key][0] == pytest.approx(value, rel=1e-6, abs=1e-7), key
        assert torch.allclose(got[key][1], grad, rtol=1e-5, atol=1e-7), key


def test_the_registry_names_every_policy_loss_and_refuses_an_unknown_one():
    assert {"ppo_clip", "decoupled", "marft", "marft_token"} <= set(POLICY_LOSSES)
    assert losses.loss_name("marft", "token") == "marft_token" and losses.loss_name("marft", "action") == "marft"
    with pytest.raises(ValueError, match="not registered: one of .*ppo_clip"):
        policy_loss("ppo")


@pytest.fixture
def scaled_ppo() -> Any:
    """A loss added through the registry alone: ppo_clip with every advantage doubled."""

    @register_policy_loss("ppo_double")
    def ppo_double(batch: PolicyBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
        calls.append(batch.logp.shape[0])
        doubled = PolicyBatch(batch.logp, batch.logp_behav, 2 * batch.advantages, batch.mask, batch.logp_prox)
        return losses.ppo_clip(doubled, s)

    calls: list[int] = []
    yield calls
    del POLICY_LOSSES["ppo_double"]


def test_a_loss_added_through_the_registry_alone_trains_a_tiny_model(tmp_path: Path, scaled_ppo: list[int]) -> None:
    samples = [make_sample(i) for i in range(8)]

    def trained(loss: str) -> tuple[dict[str, torch.Tensor], float]:
        torch.manual_seed(0)
        learner = Learner(make_cfg(tmp_path, global_batch=8, train_extra=f", loss: {loss}"), "m")
        before = {k: v.clone() for k, v in learner.named_tensors().items()}
        learner.micro_batch(samples, list(range(8)), "grpo")
        result = learner.step()
        assert result is not None and not result.skipped and result.version == 1
        moved = sum(float((learner.named_tensors()[k] - v).abs().sum()) for k, v in before.items())
        return {k: v.clone() for k, v in learner.named_tensors().items()}, moved

    doubled, moved = trained("ppo_double")
    assert scaled_ppo and moved > 0  # the new name reached the learner, which trained with it
    plain, _ = trained("ppo_clip")
    assert any(not torch.equal(doubled[k], plain[k]) for k in plain)  # and it is not ppo_clip under another name


@pytest.mark.parametrize("variant", ["action", "token"])
def test_the_learners_marft_step_calls_the_registered_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           variant: str) -> None:
    name = losses.loss_name("marft", variant)
    registered = POLICY_LOSSES[name]
    seen: list[int] = []

    def spy(batch: PolicyBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append(batch.logp.shape[0])
        return registered(batch, s)

    monkeypatch.setitem(POLICY_LOSSES, name, spy)
    learner = Learner(marft_cfg(tmp_path, interval=0, variant=variant), "m")
    for s in marft_batch(learner):
        learner.micro_batch([s], [0], "grpo")
    result = learner.step()
    assert result is not None and result.version == 1
    assert sum(seen) == 8  # every sample of the step went through the registered function
