"""NATS client credentials per kind: placeholders, passwords from the environment, secrets never dumped."""

from __future__ import annotations

import ssl

import pytest

from shared.kernel.config import ConfigError, NatsSection, config_from_yaml_text, load_config
from shared.kernel.credentials import client_options, describe, password_env, permission_denied
from tests.conftest import ROOT
from tests.natstls import make_tls

TINY = ROOT / "configs" / "tiny-chain.yaml"


def test_service_placeholder_gives_each_kind_its_own_identity(tmp_path, monkeypatch):
    (tmp_path / "trainer.pw").write_text("from-file\n")
    cfg = NatsSection(user="chorus-{service}", password_file=str(tmp_path / "{service}.pw"))
    opts = client_options(cfg, "trainer")
    assert (opts["user"], opts["password"], opts["inbox_prefix"]) == ("chorus-trainer", "from-file", "_INBOX.trainer")
    monkeypatch.setenv(password_env("trainer"), "from-env")  # the variable nats-server reads for this user too
    assert client_options(cfg, "trainer")["password"] == "from-env"
    with pytest.raises(ConfigError, match="password_file: cannot read .*mq.pw"):
        client_options(cfg, "mq")
    with pytest.raises(ConfigError, match="NATS client kind 'a.b' must match"):
        client_options(cfg, "a.b")


def test_token_nkey_creds_and_tls_options(tmp_path):
    assert client_options(NatsSection(token="s3cret"), "mq")["token"] == "s3cret"
    (tmp_path / "mq.nk").write_text("SUAEXAMPLE")
    assert client_options(NatsSection(nkey_seed=str(tmp_path / "{service}.nk")), "mq")["nkeys_seed"].endswith("mq.nk")
    with pytest.raises(ConfigError, match="creds: .* is not a file"):
        client_options(NatsSection(creds=str(tmp_path / "{service}.creds")), "mq")
    tls = make_tls(tmp_path / "tls")  # a client certificate per kind: {service} in its paths
    (tmp_path / "tls" / "mq.pem").write_bytes(tls.cert.read_bytes())
    (tmp_path / "tls" / "mq-key.pem").write_bytes(tls.key.read_bytes())
    ctx = client_options(NatsSection(tls_ca=str(tls.ca), tls_cert=str(tmp_path / "tls" / "{service}.pem"),
                                     tls_key=str(tmp_path / "tls" / "{service}-key.pem")), "mq")["tls"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ConfigError, match="tls_cert: .*trainer.pem is not a file"):
        client_options(NatsSection(tls_cert=str(tmp_path / "tls" / "{service}.pem"), tls_key="k.pem"), "trainer")
    with pytest.raises(ValueError, match="one of user, token"):
        NatsSection(user="a", token="b")
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        NatsSection(tls_cert="c.pem")


def test_secrets_come_from_the_environment_and_are_never_dumped(monkeypatch):
    monkeypatch.setenv("CHORUS_NATS__USER", "{service}")
    monkeypatch.setenv("CHORUS_NATS__PASSWORD", "hunter2")
    monkeypatch.setenv("CHORUS_NATS__URL", "tls://a:4222,tls://b:4222")
    cfg = load_config(TINY)
    assert cfg.nats.user == "{service}" and cfg.nats.password is not None
    assert cfg.nats.password.get_secret_value() == "hunter2"
    dumped = cfg.dump_yaml()
    assert "hunter2" not in dumped and "hunter2" not in repr(cfg) and "hunter2" not in str(cfg.model_dump())
    monkeypatch.delenv("CHORUS_NATS__PASSWORD")
    assert config_from_yaml_text(dumped).nats.password is None
    assert cfg.secret_env() == {"CHORUS_NATS__PASSWORD": "hunter2"}
    assert describe(cfg.nats, "coordinator") == "user coordinator, TLS"
    assert "hunter2" not in describe(cfg.nats, "coordinator")


def test_permission_violations_are_parsed_from_the_error():
    # nats-py lowercases the server's -ERR text before the error callback sees it
    assert permission_denied('nats: permissions violation for publish to "chorus.r1.traj.m"') == \
        ("publish", "chorus.r1.traj.m")
    assert permission_denied("nats: Permissions Violation for Subscription to \"chorus.>\"") == ("subscribe", "chorus.>")
    assert permission_denied("nats: stale connection") is None
