"""Whether a run is learning anything, told while it runs: models whose groups have had one reward for every
sample (nothing for a group-relative advantage to learn from) for a number of steps, and reward functions that
fail on every row. The first gets a warning that names the likely cause and the setting to change; the second
stops the run, as ``workflow.max_failures`` does for workflow errors."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared.kernel.config import ChorusConfig

if TYPE_CHECKING:
    from services.coordinator.workflows.episode import Episode

TRUNCATED_HINT = 0.5  # share of replies cut at max_new_tokens above which a flat run's warning names it first


@dataclass
class RewardHealth:
    cfg: ChorusConfig
    warn_groups: int = 0  # flat groups in a row (per model) that make a warning: reward.warn_after_steps steps' worth
    flat: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    flat_sum: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # of the flat groups' reward
    warned: set[str] = field(default_factory=set)
    replies: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    truncated: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors_in_a_row: int = 0
    first_error: str = ""

    def __post_init__(self) -> None:
        per_step = max(1, self.cfg.train.global_batch // max(1, self.cfg.workflow.group_size))
        self.warn_groups = self.warn_groups or per_step * self.cfg.reward.warn_after_steps

    def record(self, ep: Episode) -> tuple[list[dict[str, Any]], str | None]:
        """Take one finished episode: (warnings to show, each ``{"model", "cause", "text", "setting"}``; the reason
        to stop the run, or None)."""
        stop = self._errors(ep)
        for turn in (t for traj in ep.trajectories for t in traj.get("trajectory", [])):
            meta, agent = turn.get("metadata") or {}, self.cfg.agents.get(str(turn.get("agent_name")))
            model = agent.model if agent is not None else None
            if model is not None and "finished" in meta:
                self.replies[model] += 1
                self.truncated[model] += not meta["finished"]
        groups: dict[tuple[str, str], list[float]] = defaultdict(list)
        for s in ep.samples:
            groups[(s.model, s.group_key)].append(s.reward)
        warnings = []
        for (model, _), rewards in sorted(groups.items()):
            if len(rewards) < 2:
                continue
            if max(rewards) - min(rewards) > 0:
                self.flat[model], self.flat_sum[model] = 0, 0.0
                self.warned.discard(model)
                continue
            self.flat[model] += 1
            self.flat_sum[model] += rewards[0]
            if self.flat[model] >= self.warn_groups and model not in self.warned:
                self.warned.add(model)
                warnings.append(self._flat_warning(model))
        return warnings, stop

    def _errors(self, ep: Episode) -> str | None:
        if ep.reward_errors and not ep.samples:
            self.errors_in_a_row += len(ep.reward_errors)
            self.first_error = self.first_error or ep.reward_errors[0]
        elif ep.samples:
            self.errors_in_a_row, self.first_error = 0, ""
        limit = self.cfg.reward.max_errors
        if self.errors_in_a_row >= limit:
            return (f"the reward function failed on {self.errors_in_a_row} samples in a row (reward.max_errors "
                    f"{limit}) and no sample was scored: {self.first_error[:500]}; fix reward.function")
        return None

    def share_truncated(self, model: str) -> float:
        return self.truncated[model] / self.replies[model] if self.replies[model] else 0.0

    def _flat_warning(self, model: str) -> dict[str, Any]:
        mean = self.flat_sum[model] / max(1, self.flat[model])
        steps = self.cfg.reward.warn_after_steps
        head = (f"model {model}: each of its last {self.flat[model]} groups ({steps} steps' worth) gave every sample "
                f"the same reward (mean {mean:.3f}): a group-relative advantage is 0, nothing is learned")
        cut = self.share_truncated(model)
        task = self.cfg.task
        if cut >= TRUNCATED_HINT:
            cause, setting = "truncated", "workflow.max_new_tokens"
            text = (f"{head}. {cut:.0%} of its replies were cut at workflow.max_new_tokens "
                    f"({self.cfg.workflow.max_new_tokens}) before their answer: raise workflow.max_new_tokens")
        elif mean <= 0.0 and task.name == "reasoning_gym" and task.answer == "tags":
            cause, setting = "zero_reward", "task.answer"
            text = (f"{head}. Every reply scored 0: reasoning-gym pays only an answer inside <answer></answer> "
                    f"tags (task.answer: tags); a model that does not write them scores 0. Set task.answer: "
                    f"flexible to score a reply's final answer, or prompt for the tags")
        elif mean <= 0.0:
            cause, setting = "zero_reward", "task"
            text = (f"{head}. Every reply scored 0: the task is too hard for the model at this length, or the "
                    f"replies do not give an answer the check reads (see `chorus samples`); make the task easier, "
                    f"raise workflow.max_new_tokens, or ask for the answer's format in the agents' prompts")
        elif mean >= 1.0:
            cause, setting = "full_reward", "task"
            text = f"{head}. Every reply scored 1: the task is too easy for the model; make it harder"
        else:
            cause, setting = "constant_reward", "reward"
            text = (f"{head}. Every reply scored the same: a reward that does not depend on the reply gives no "
                    f"signal; check reward.function or the task's check")
        return {"model": model, "cause": cause, "text": text, "setting": setting}
