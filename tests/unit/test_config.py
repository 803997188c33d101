"""Run config: YAML + CHORUS_* environment overrides, errors that name the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared.kernel.config import ConfigError, config_from_yaml_text, load_config

BASE = {
    "run": {"id": "c1"},
    "models": {"a": {}, "b": {}},
    "agents": {"solver": {"model": "a"}, "verifier": {"model": "b"}},
    "train": {"max_versions": 7},
}


def _write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_environment_override_wins_over_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHORUS_TRAIN__MAX_VERSIONS", "3")
    monkeypatch.setenv("CHORUS_RUN__ID", "from-env")
    cfg = load_config(_write(tmp_path, BASE))
    assert cfg.train.max_versions == 3
    assert cfg.run.id == "from-env"
    assert cfg.train.global_batch == 64  # untouched keys keep their defaults


def test_yaml_value_is_used_without_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHORUS_TRAIN__MAX_VERSIONS", raising=False)
    assert load_config(_write(tmp_path, BASE)).train.max_versions == 7


def test_unknown_key_error_names_the_dotted_path(tmp_path: Path) -> None:
    data = {**BASE, "models": {"a": {"optim": {"lr": 0.1, "momentum": 0.9}}, "b": {}}}
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, data))
    assert "models.a.optim.momentum" in str(exc.value)
    assert "unknown key" in str(exc.value)


def test_a_misspelt_key_gets_the_closest_known_one(tmp_path: Path) -> None:
    data = {**BASE, "train": {"max_verions": 3}, "models": {"a": {"optim": {"lrr": 0.1}, "lora": {"rank": 4}}, "b": {}},
            "agents": {"solver": {"model": "a", "adaptr": "s"}, "verifier": {"model": "b"}}, "workflw": {}}
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, data))
    text = str(exc.value)
    assert "train.max_verions: unknown key, did you mean train.max_versions?" in text
    assert "models.a.optim.lrr: unknown key, did you mean models.a.optim.lr?" in text
    assert "agents.solver.adaptr: unknown key, did you mean agents.solver.adapter?" in text
    assert "workflw: unknown key, did you mean workflow?" in text
    # nothing close: no guess, the pointer to the reference
    assert "models.a.lora.rank: unknown key (check the spelling against configs/ and docs/config.md)" in text


def test_bad_value_error_names_path_and_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"workflow\.group_size.*got 0"):
        load_config(_write(tmp_path, {**BASE, "workflow": {"group_size": 0}}))


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_non_mapping_yaml_is_rejected(tmp_path: Path) -> None:
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(p)


def test_agent_referencing_unknown_model_is_rejected(tmp_path: Path) -> None:
    data = {**BASE, "agents": {"solver": {"model": "a"}, "verifier": {"model": "zzz"}}}
    with pytest.raises(ConfigError, match=r"agents\.verifier\.model.*'zzz'"):
        load_config(_write(tmp_path, data))


def test_workflow_referencing_unknown_agent_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"workflow\.verifier.*'judge'"):
        load_config(_write(tmp_path, {**BASE, "workflow": {"verifier": "judge"}}))


def test_global_batch_must_hold_whole_groups(tmp_path: Path) -> None:
    data = {**BASE, "workflow": {"group_size": 8}, "train": {"global_batch": 60}}
    with pytest.raises(ConfigError, match="multiple of"):
        load_config(_write(tmp_path, data))


def test_run_id_must_be_a_subject_token(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run.id"):
        load_config(_write(tmp_path, {**BASE, "run": {"id": "has.dot"}}))


def test_dumped_config_loads_back_identically(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, BASE))
    assert config_from_yaml_text(cfg.dump_yaml()) == cfg
    assert cfg.run_dir == Path("runs") / "c1"
    assert cfg.mq_capacity == (cfg.train.max_staleness + 1) * cfg.train.global_batch


@pytest.mark.parametrize(("train", "key"), [
    ({"clip_eps": -0.1}, "train.clip_eps"),
    ({"clip_eps": 0.0}, "train.clip_eps"),
    ({"clip_ratio_c": 1.0}, "train.clip_ratio_c"),
    ({"behav_imp_weight_cap": 0.5, "loss": "decoupled"}, "train.behav_imp_weight_cap"),
    ({"behav_imp_weight_cap": 5.0}, "behav_imp_weight_cap"),  # ppo_clip has no pi_prox / mu to cap
    ({"loss": "grpo loss"}, "train.loss"),  # a name: whether it is registered, `chorus check` and the trainer say
    ({"loss_agg": "mean"}, "train.loss_agg"),
    ({"kl_coef": -0.1}, "train.kl_coef"),
    ({"kl_estimator": "k4"}, "train.kl_estimator"),
    ({"kl_in": "advantage"}, "train.kl_in"),
    ({"entropy_coef": -0.01}, "train.entropy_coef"),
])
def test_meaningless_loss_options_are_refused_at_load_time_naming_the_key(tmp_path: Path, train: dict,
                                                                          key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, {**BASE, "train": {**BASE["train"], **train}}))
    assert key in str(exc.value)


def test_the_loss_options_have_their_documented_defaults(tmp_path: Path) -> None:
    t = load_config(_write(tmp_path, BASE)).train
    assert (t.loss, t.loss_agg, t.clip_eps, t.clip_ratio_c, t.behav_imp_weight_cap) == (
        "ppo_clip", "seq-mean-token-mean", 0.2, 3.0, None)
    t = load_config(_write(tmp_path, {**BASE, "train": {"loss": "decoupled", "behav_imp_weight_cap": 5.0,
                                                        "clip_ratio_c": None}})).train
    assert (t.loss, t.behav_imp_weight_cap, t.clip_ratio_c) == ("decoupled", 5.0, None)


@pytest.mark.parametrize(("workflow", "key"), [
    ({"top_p": 0.0}, "workflow.top_p"),
    ({"top_p": 1.5}, "workflow.top_p"),
    ({"max_new_tokens": 5000}, "workflow.max_new_tokens"),  # a GenRequest carries at most 4096
    ({"temperature": -1.0}, "workflow.temperature"),
])
def test_meaningless_sampling_settings_are_refused_at_load_time_naming_the_key(tmp_path: Path, workflow: dict,
                                                                               key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, {**BASE, "workflow": workflow}))
    assert key in str(exc.value)


def _model_train(tmp_path: Path, train: dict, model_train: dict):
    data = {**BASE, "train": {**BASE["train"], **train}}
    model = next(iter(data["models"]))
    data["models"] = {**data["models"], model: {**data["models"][model], "train": model_train}}
    return model, load_config(_write(tmp_path, data))


def test_a_model_may_choose_its_own_loss_and_regularisers(tmp_path: Path) -> None:
    model, cfg = _model_train(tmp_path, {"entropy_coef": 0.01}, {"loss": "decoupled", "behav_imp_weight_cap": 4.0,
                                                                 "kl_coef": 0.05})
    own = cfg.objective(model)
    assert (own.loss, own.behav_imp_weight_cap, own.kl_coef, own.entropy_coef) == ("decoupled", 4.0, 0.05, 0.01)
    assert cfg.train.loss == "ppo_clip"  # the run's default is unchanged
    assert config_from_yaml_text(cfg.dump_yaml()).objective(model) == own


@pytest.mark.parametrize(("model_train", "key"), [
    ({"clip_eps": 1.5}, "train.clip_eps"),
    ({"behav_imp_weight_cap": 3.0}, "train: behav_imp_weight_cap"),  # this model's loss is ppo_clip
    ({"global_batch": 8}, "train.global_batch: not a per-model key"),
    ({"kl_in": "both"}, "train.kl_in"),
])
def test_a_models_meaningless_loss_option_is_refused_at_load_time_naming_the_key(tmp_path: Path, model_train: dict,
                                                                                 key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _model_train(tmp_path, {}, model_train)
    assert f"models.{next(iter(BASE['models']))}.{key}" in str(exc.value)


def test_a_large_fleets_keepalive_stretches_to_keep_its_heartbeats_under_the_budget(tmp_path: Path) -> None:
    small = load_config(_write(tmp_path, BASE))
    assert small.rollouter_fleet == 2 and small.keepalive_s == 5.0 and small.heartbeat_s == 5.0
    models = {m: {"rollouter": {"instances": 512}} for m in ("a", "b")}
    big = load_config(_write(tmp_path, {**BASE, "models": models, "rollouter": {"pool": 24}}))
    assert big.rollouter_fleet == 2 * 512 + 24
    assert big.keepalive_s == pytest.approx(10.48)  # 1,048 heartbeats every 10.48 s: 100 a second
    assert big.rollouter_fleet / big.keepalive_s == pytest.approx(big.balance.heartbeats_per_s)
    tight = load_config(_write(tmp_path, {**BASE, "balance": {"report_interval_s": 8.0}}))
    assert tight.heartbeat_s == 8.0  # never shorter than the look at the load
