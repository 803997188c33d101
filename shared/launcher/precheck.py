"""What `chorus check` and `chorus up` verify before any service starts: every path, dataset and function a config
names opens, so that a mistake a restart cannot fix is reported in seconds, by its config key, not by services
that load models and then fail one after another.

Each check is the code the services run themselves (the model loader's directory check, the coordinator's task
source, the workflow and reward-function loaders), so what passes here is what the services will accept.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from shared.kernel.config import ChorusConfig


def _problem(key: str, fn: Callable[[], object]) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every failure is a problem to report, by its key
        text = str(exc) or type(exc).__name__
        return text if text.startswith(key) else f"{key}: {text}"
    return None


def model_problems(cfg: ChorusConfig) -> list[str]:
    """Each model's weights: a local Hugging Face directory (``source: hf``) with its config, weights and tokenizer;
    the embedded SmolLM2 package (``source: smollm2``)."""
    from shared.models.loading import model_dir, smollm2_gguf

    out: list[str] = []
    for name, m in sorted(cfg.models.items()):
        key = f"models.{name}.path"
        if m.source == "hf":
            problem = _problem(key, partial(model_dir, cfg, name))
            if problem is None and m.path is not None:
                weights = [p for p in m.path.iterdir() if p.suffix in (".safetensors", ".bin")]
                if not weights:
                    problem = f"{key}: {m.path} has no weights file (*.safetensors or *.bin)"
                elif not any((m.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                              "tokenizer.model", "vocab.json")):
                    problem = f"{key}: {m.path} has no tokenizer files (tokenizer.json or tokenizer_config.json)"
        elif m.source == "smollm2":
            problem = _problem(f"models.{name}.source", smollm2_gguf)
        else:
            problem = None
        if problem:
            out.append(problem)
    return out


def task_problems(cfg: ChorusConfig) -> list[str]:
    """The dataset as the coordinator opens it: its training stream and, when the run evaluates, its held-out
    tasks."""
    from services.coordinator.tasks import TaskSource, heldout_tasks

    out = [p for p in [_problem("task", lambda: TaskSource(cfg.run.seed, cfg.task, "check"))] if p]
    if not out and cfg.eval.every:
        out += [p for p in [_problem("eval.tasks", lambda: heldout_tasks(cfg.task, cfg.eval.tasks, cfg.run.seed))]
                if p]
    return out


def grader_problems(cfg: ChorusConfig) -> list[str]:
    """Every verl row has a grader: a built-in one for its data_source (verl's default routing), or the user's
    ``reward.function`` (or a judge) for all of them; never a silent default."""
    if cfg.task.name != "verl" or cfg.reward.function is not None or cfg.reward.judge is not None:
        return []
    from services.coordinator.datasets import ungraded, verl_tasks

    try:
        why = ungraded(verl_tasks(cfg.task))
    except Exception:  # noqa: BLE001 - an unreadable file is task_problems' to report
        return []
    return [f"task.path: {why}"] if why else []


def reward_trial(cfg: ChorusConfig) -> str:
    """Call the reward function once, on the first held-out row (the first training row without a held-out set)
    with its own reference answer as the reply (what a right answer should earn); the line that shows what it returned. Raises what the run's workers would drop the
    sample for (it raised, or returned no finite number)."""
    from services.actions import rewardfn
    from services.coordinator.tasks import TaskSource, heldout_tasks
    from services.coordinator.workflows.scoring import check_request

    held = heldout_tasks(cfg.task, 1, cfg.run.seed) if cfg.task.heldout else []
    task = held[0] if held else TaskSource(cfg.run.seed, cfg.task, "check").next()[1]
    _, payload = check_request(cfg, task, task.answer, True)
    out = rewardfn.compute(payload)
    spec = str(payload["function"]).rpartition(":")[2]
    return (f"reward.function: {spec}(data_source={payload['data_source']!r}, solution_str=<the row's reference "
            f"{task.answer!r:.60}>, ground_truth={payload['ground_truth']!r:.60}) on {'held-out' if held else 'training'}"
            f" row {task.task_id} "
            f"returned reward {out['reward']:g}" + (f", scores {out['scores']}" if out["scores"] else ""))


def function_problems(cfg: ChorusConfig, shown: list[str] | None = None) -> list[str]:
    """The custom workflow function and the reward function, imported from their files; the reward function is
    called once (:func:`reward_trial`), and what it returned is added to ``shown``."""
    from services.actions.rewardfn import load
    from services.coordinator.workflows import workflow_of

    out: list[str] = []
    if cfg.workflow.name == "custom":
        out += [p for p in [_problem("workflow.function", lambda: workflow_of(cfg))] if p]
    spec = getattr(cfg.reward, "function", None)
    if spec:
        problem = _problem("reward.function", lambda: load(spec))
        if problem is None:
            lines: list[str] = []
            problem = _problem("reward.function", lambda: lines.append(reward_trial(cfg)))
            if problem is not None:
                problem += " (called once on a row of the task with its reference answer as the reply)"
            elif shown is not None:
                shown += lines
        out += [problem] if problem else []
    return out


def loss_problems(cfg: ChorusConfig) -> list[str]:
    """Every model's ``train.loss`` is a registered policy loss (shared/rlmath/losses.py)."""
    from shared.rlmath.losses import loss_name, policy_loss

    def registered(name: str) -> object:
        return policy_loss(loss_name(name, cfg.marft.variant))

    out: list[str] = []
    for model in sorted(cfg.models):
        loss = cfg.objective(model).loss
        key = "train.loss" if loss == cfg.train.loss else f"models.{model}.train.loss"
        problem = _problem(key, partial(registered, loss))
        if problem and problem not in out:
            out.append(problem)
    return out


FILE_KEYS = ("password_file", "nkey_seed", "creds", "tls_cert", "tls_key", "tls_ca")


def credential_problems(cfg: ChorusConfig) -> list[str]:
    """Files the nats section names (credentials, TLS certificates and keys) exist and can be read."""
    from pathlib import Path

    out: list[str] = []
    for key, value in sorted(cfg.nats.model_dump().items()):
        # `{service}` in a name is filled in per service kind: each kind's own file is checked when it connects
        if key not in FILE_KEYS or not isinstance(value, str) or not value or "{" in value:
            continue
        path = Path(value).expanduser()
        try:
            with path.open("rb"):
                pass
        except OSError as exc:
            out.append(f"nats.{key}: cannot read {path}: {exc.strerror or exc}")
    return out


def memory_problems(cfg: ChorusConfig) -> list[str]:
    """A trainer memory cap (``models.<m>.trainer.memory_mb``) needs a cgroup v1 memory controller this user may
    write (root)."""
    from shared.kernel.memcap import unavailable

    capped = sorted(m for m, c in cfg.models.items() if c.trainer.memory_mb is not None)
    why = unavailable() if capped else None
    return [f"models.{capped[0]}.trainer.memory_mb: {why}"] if why else []


def problems(cfg: ChorusConfig, shown: list[str] | None = None) -> list[str]:
    """Every problem of a loaded config, each naming its key and path; empty when the run can start. ``shown``
    collects what the checks have to show besides (what the reward function returned)."""
    task = task_problems(cfg)
    return (model_problems(cfg) + task + grader_problems(cfg) + function_problems(cfg, shown if not task else None)
            + loss_problems(cfg) + credential_problems(cfg) + memory_problems(cfg))
