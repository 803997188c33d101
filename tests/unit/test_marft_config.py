"""MARFT's settings are refused at load time where they mean nothing, with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared.kernel.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def marft(tmp_path: Path, **patch: dict) -> Path:
    base = yaml.safe_load((ROOT / "configs" / "marft-tiny.yaml").read_text())
    for section, values in patch.items():
        if values is None:
            base.pop(section, None)
        else:
            base.setdefault(section, {}).update(values)
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(base))
    return p


def test_the_shipped_configs_load_with_marft_on() -> None:
    for name in ("marft-tiny.yaml", "marft.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.marft_on and cfg.marft_agents() == ["reasoner", "actor"]
        assert cfg.workflow.feedback and cfg.workflow.rounds == 2


@pytest.mark.parametrize(("patch", "match"), [
    ({"workflow": {"name": "mixture", "agents": ["reasoner", "actor"], "feedback": False, "rounds": None}},
     r"workflow\.name: mixture runs the agents of a round concurrently"),
    ({"workflow": {"name": "debate", "feedback": False}}, r"workflow\.name: debate"),
    ({"train": {"mode": "async", "max_staleness": 1}, "marft": {"agent_interval": 1}},
     r"marft\.agent_interval: .*on-policy mode"),
    ({"train": {"grouping": "trainer"}}, r"train\.grouping"),
    ({"workflow": {"sampling": "tree"}}, r"workflow\.sampling"),
    ({"train": {"kl_coef": 0.1, "kl_in": "reward"}}, r"train\.kl_in"),
    ({"marft": {"critic": {"model": "nope"}}}, r"marft\.critic\.model: 'nope'"),
    ({"marft": {"variant": "tokens"}}, r"marft\.variant"),
    ({"marft": {"kl_target": 0}}, r"marft\.kl_target"),
    ({"workflow": {"name": "solve_verify", "agents": [], "feedback": True, "rounds": None,
                   "solver": "reasoner", "verifier": "actor"}}, r"workflow\.feedback: only the chain"),
])
def test_meaningless_marft_settings_are_refused_with_the_key(tmp_path: Path, patch: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(marft(tmp_path, **patch))


def test_async_mode_is_allowed_when_every_agent_steps_together(tmp_path: Path) -> None:
    cfg = load_config(marft(tmp_path, train={"mode": "async", "max_staleness": 1}, marft={"agent_interval": 0}))
    assert cfg.marft_on and cfg.train.mode == "async"


def test_the_marft_section_without_the_marft_loss_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"marft: read only when train.loss is marft"):
        load_config(marft(tmp_path, train={"loss": "ppo_clip"}))


def test_agents_sharing_a_full_model_cannot_update_one_by_one(tmp_path: Path) -> None:
    base = yaml.safe_load((ROOT / "configs" / "marft-tiny.yaml").read_text())
    base["models"] = {"duo_lm": {k: v for k, v in base["models"]["actor_lm"].items()}}
    base["marft"]["critic"]["model"] = "duo_lm"
    base["marft"]["agent_interval"] = 1
    for a in base["agents"].values():
        a["model"] = "duo_lm"
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(base))
    with pytest.raises(ConfigError, match=r"marft\.agent_interval: agents \[.*\] share model 'duo_lm'"):
        load_config(p)
