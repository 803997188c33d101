"""The least-privilege permissions derived from shared/kernel/subjects.py, and the shipped authorization config."""

from __future__ import annotations

import pytest

from shared.kernel.credentials import KINDS
from shared.kernel.subjects import LISTENS, PUBLISHES, SERVICES, Names
from shared.launcher.natsauth import auth_conf, permissions
from tests.conftest import ROOT

N = Names("r1")


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more at the end."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def may_publish(kind: str, subject: str) -> bool:
    return any(matches(p, subject) for p in permissions(kind).publish)


def may_subscribe(kind: str, subject: str) -> bool:
    return any(matches(p, subject) for p in permissions(kind).subscribe)


def test_shipped_auth_conf_is_the_generated_one():
    shipped = (ROOT / "deploy" / "nats" / "auth.conf").read_text()
    assert shipped == auth_conf(), "deploy/nats/auth.conf is stale: run `chorus nats-auth --out deploy/nats/auth.conf`"


def test_auth_conf_holds_no_literal_password():
    text = auth_conf()
    passwords = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("password:")]
    assert len(passwords) == len(KINDS)
    assert all(p.startswith("$CHORUS_NATS_PASSWORD_") for p in passwords)


def test_the_trainer_may_not_publish_on_other_kinds_subjects():
    assert may_publish("trainer", N.sync_announce("m"))
    assert may_publish("trainer", "$KV.chorus_r1.trained.m")
    for subject in (N.traj("m"), N.ready("m"), N.gen("m"), N.sync_done("m"), N.depth("m"), N.actions_submit(),
                    N.events("coordinator"), N.metrics("mq", "m-0"), N.dlq("rollouter"), "$KV.chorus_r1.version.m",
                    "$KV.chorus_r1.rollouter.m.0", "$JS.API.STREAM.DELETE.CHORUS_R1_EVENTS", "chorus.r1.anything"):
        assert not may_publish("trainer", subject), subject


def test_each_published_subject_is_allowed_to_its_kinds_only():
    for methods in PUBLISHES.values():
        for method in methods:
            fn = getattr(N, method)
            subject = fn(*["m", "0", "pause"][: fn.__code__.co_argcount - 1])
            publishers = {k for k in SERVICES if may_publish(k, subject)}
            assert publishers == {k for k, ms in PUBLISHES.items() if method in ms}, (method, publishers)


def test_each_kind_listens_on_its_subjects_and_inbox_only():
    for kind, methods in LISTENS.items():
        for method in methods:
            fn = getattr(N, method)
            args = {"status": (kind, "m", "0")}.get(method, ("m", "0", "pause")[: fn.__code__.co_argcount - 1])
            subject = fn(*args)
            listeners = {kind} if method == "status" else {k for k, ms in LISTENS.items() if method in ms}
            assert {k for k in SERVICES if may_subscribe(k, subject)} == listeners, subject
    for kind in KINDS:
        assert may_subscribe(kind, f"_INBOX.{kind}.abc.1")
        assert not any(may_subscribe(kind, f"_INBOX.{other}.abc") for other in KINDS if other != kind)
        assert not may_subscribe(kind, "_INBOX.abc")


@pytest.mark.parametrize("kind", ["observer", "supervisor"])
def test_tools_read_and_only_admin_deletes(kind):
    assert may_subscribe(kind, N.metrics("trainer", "m-0")) and may_subscribe(kind, N.events("mq"))
    assert may_publish(kind, "$JS.API.STREAM.INFO.CHORUS_R1_EVENTS")
    assert not may_publish(kind, "$JS.API.STREAM.DELETE.CHORUS_R1_EVENTS")
    assert not may_publish(kind, N.traj("m")) and not may_publish(kind, "$KV.chorus_r1.trained.m")
    assert may_publish("admin", "$JS.API.STREAM.DELETE.CHORUS_R1_EVENTS")
    assert may_publish("supervisor", "$JS.API.STREAM.CREATE.CHORUS_R1_EVENTS")
    assert not may_publish("observer", "$JS.API.STREAM.CREATE.CHORUS_R1_EVENTS")


def test_the_observer_sees_the_data_plane_chorus_monitor_raw_shows_and_publishes_none_of_it():
    for subject in (N.traj("m"), N.ready("m"), N.dlq("rollouter"), N.metrics("trainer", "m-0"), N.events("mq")):
        assert may_subscribe("observer", subject) and not may_publish("observer", subject), subject
    assert not may_publish("observer", "_INBOX.abc")  # so it cannot answer a request it sees
    assert not may_subscribe("supervisor", N.traj("m"))


def test_generated_passwords_are_what_nats_server_reads_from_its_environment_as_strings(tmp_path):
    # nats-server parses a variable's value from its environment as a config value: a password like "2026-12..."
    # was read as a date and the embedded server did not start.
    import os
    import subprocess

    from shared.kernel.credentials import password_env
    from shared.launcher.localauth import LocalAuth, new_password
    from shared.launcher.natsserver import nats_server_binary

    assert all(new_password()[0].isalpha() for _ in range(200))
    auth = LocalAuth({kind: new_password() for kind in KINDS})
    (tmp_path / "auth.conf").write_text(auth.conf())
    (tmp_path / "s.conf").write_text('listen: 127.0.0.1:4222\ninclude "auth.conf"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHORUS_NATS_PASSWORD_")}
    r = subprocess.run([nats_server_binary(), "-t", "-c", str(tmp_path / "s.conf")], capture_output=True, text=True,
                       env={**env, **auth.server_env()})
    assert r.returncode == 0, r.stderr
    bad = {**env, **auth.server_env(), password_env("observer"): "2026-12-01"}
    assert subprocess.run([nats_server_binary(), "-t", "-c", str(tmp_path / "s.conf")], capture_output=True,
                          env=bad).returncode != 0
