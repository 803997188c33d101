"""train.pool: the shipped config loads, `chorus up` plans one trainer process for every model, and what the pool
cannot do is refused at load time (or at start) with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.trainer.poolservice import TrainPoolService
from services.trainer.service import TrainerService
from shared.kernel.config import ConfigError, load_config
from shared.launcher.supervisor import plan_services

ROOT = Path(__file__).resolve().parents[2]


def pool(tmp_path: Path, **train: object) -> Path:
    base = yaml.safe_load((ROOT / "configs" / "pool-tiny.yaml").read_text())
    base["train"]["pool"].update(train)
    base["run"]["dir"] = str(tmp_path)
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(base))
    return p


def test_the_pool_config_plans_one_trainer_process_for_its_four_models() -> None:
    cfg = load_config(ROOT / "configs" / "pool-tiny.yaml")
    assert cfg.train.pool.slots == 2 and len(cfg.models) == 4
    keys = [c.key for c in plan_services(cfg)]
    assert keys.count("trainer-0") == 1 and not [k for k in keys if k.startswith("trainer-") and k != "trainer-0"]
    without = load_config(ROOT / "configs" / "tiny-chain.yaml")
    assert {c.key for c in plan_services(without) if c.service == "trainer"} == {
        "trainer-solver_lm-0", "trainer-verifier_lm-0"}


def test_a_deepspeed_model_in_a_pool_is_a_gang_refused_only_when_it_has_more_ranks_than_slots(tmp_path: Path) -> None:
    base = yaml.safe_load(pool(tmp_path).read_text())
    base["models"]["solver_lm"]["trainer"] = {"backend": "deepspeed", "deepspeed": {"ranks": 2}}
    p = tmp_path / "ds.yaml"
    p.write_text(yaml.safe_dump(base))
    assert load_config(p).models["solver_lm"].trainer.deepspeed.ranks == 2  # two ranks on two slots: a gang
    base["models"]["solver_lm"]["trainer"]["deepspeed"]["ranks"] = 3
    p.write_text(yaml.safe_dump(base))
    with pytest.raises(ConfigError, match=r"models\.solver_lm\.trainer\.deepspeed\.ranks \(3\) is more than "
                                          r"train\.pool\.slots \(2\)"):
        load_config(p)


@pytest.mark.parametrize(("key", "value"), [("slots", -1), ("cores", 0), ("mode", "hibernate"), ("attempts", 0)])
def test_bad_pool_settings_are_refused_with_their_key(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"train\.pool\.{key}"):
        load_config(pool(tmp_path, **{key: value}))


async def test_a_per_model_trainer_refuses_a_pooled_config_and_the_pool_refuses_an_unpooled_one(tmp_path: Path) -> None:
    cfg = load_config(pool(tmp_path))
    with pytest.raises(ConfigError, match="serve trainer` without --model"):
        await TrainerService(cfg, nats_url="nats://127.0.0.1:1", model="solver_lm").setup()
    plain = load_config(ROOT / "configs" / "tiny-chain.yaml")
    with pytest.raises(ConfigError, match="train.pool.slots is 0"):
        await TrainPoolService(plain, nats_url="nats://127.0.0.1:1").setup()
