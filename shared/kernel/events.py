"""Every event kind a service publishes on ``events.<service>`` (JSON, ``"kind"`` names it), in one place.

Each event also carries ``instance``, ``model`` and ``time`` (:meth:`shared.kernel.service.Service.event`). Records
(written to the events stream and acknowledged there before what they report is acked) are marked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EventKind:
    kind: str
    service: str
    fields: str  # the fields besides kind, instance, model and time
    description: str
    record: bool = False  # written with Service.record (acknowledged, deduplicated), not a best-effort event


STEP = "step"
DROP = "drop"
DONE = "done"
STEP_SKIPPED = "step_skipped"
EVAL = "eval"
ADMISSION_STOPPED = "admission_stopped"
WORKFLOW_ERROR = "workflow_error"
RUN_FAILED = "run_failed"
ROUTING = "routing"
CRITIC_STEP = "critic_step"
OUT_OF_MEMORY = "out_of_memory"
WARNING = "warning"

EVENTS: tuple[EventKind, ...] = (
    EventKind(STEP, "trainer", "the StepRecord fields (version, samples, sample_ids, reward_mean, loss, ...)",
              "an optimizer step was committed: which samples it trained", record=True),
    EventKind(DROP, "trainer, mq", "the DropEvent fields (reason, count, sample_ids, ...)",
              "samples removed without training, and why (stale, finished, invalid, ...)", record=True),
    EventKind(DONE, "trainer", "version",
              "the model reached train.max_versions; later micro-batches are dropped as finished"),
    EventKind(STEP_SKIPPED, "trainer", "version, samples, grad_norm",
              "a step's gradient norm was not finite: the weights stay, its samples are dropped"),
    EventKind(EVAL, "coordinator", "version, pass1 (per agent), final, last, ...",
              "a held-out evaluation; last: the evaluation of the final weights"),
    EventKind(ADMISSION_STOPPED, "coordinator", "trained (version per model)",
              "every model reached train.max_versions: no new tasks start"),
    EventKind(WORKFLOW_ERROR, "coordinator", "key, error",
              "the user's workflow raised or timed out (logged once per distinct error, counted after)"),
    EventKind(RUN_FAILED, "coordinator", "error, errors",
              "workflow.max_failures or reward.max_errors reached: the coordinator stops the run (exit 78)"),
    EventKind(WARNING, "coordinator", "model, cause, text, setting",
              "a model is learning nothing (its groups' rewards have not varied for reward.warn_after_steps steps): "
              "the likely cause and the setting to change; chorus up prints it"),
    EventKind(CRITIC_STEP, "critic", "version, samples, sample_ids, value_loss, explained_variance, critic_grad_norm",
              "MARFT's critic committed a step of its head: which critic samples it trained", record=True),
    EventKind(OUT_OF_MEMORY, "trainer", "who, evidence, advice, count, out_of_memory (limit, cgroup counters)",
              "the kernel's OOM killer ended the trainer or a rank of its DeepSpeed group (told by the group's own "
              "oom_kill counter): what to change (more ranks, ZeRO-3, more memory)"),
    EventKind(ROUTING, "rollouter", "routing (bool), version, reason",
              "a rollouter instance joined (routing true) or left (false) its model's request routing"),
)
