"""The generated reference docs (docs/reference/) match the code."""

from __future__ import annotations

import ast
from pathlib import Path

from shared.kernel import events
from shared.kernel.config import ChorusConfig
from shared.launcher.refdocs import OUT, config_rows, render, write

ROOT = Path(__file__).resolve().parents[2]


def test_generated_reference_docs_are_up_to_date(tmp_path: Path) -> None:
    write(tmp_path)
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir()}
    committed = {p.name: p.read_text() for p in OUT.glob("*.md")}
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"docs/reference/ is out of date ({', '.join(stale)}): run `make docs` " \
                      "(python -m shared.launcher.refdocs) and commit the result"


def test_every_config_key_is_in_the_reference_including_model_and_lora_keys() -> None:
    keys = {row[0] for row in config_rows(ChorusConfig)}
    for key in ("models.<name>.source", "models.<name>.path", "models.<name>.dtype", "models.<name>.lora.r",
                "models.<name>.lora.target_modules", "train.max_versions", "nats.connect_timeout_s"):
        assert key in keys
    text = render()["config.md"]
    assert all(f"| `{k}` |" in text for k in keys)


def test_every_event_the_services_publish_is_declared() -> None:
    declared = {e.kind for e in events.EVENTS}
    used = set()
    for src in (ROOT / "services").rglob("*.py"):
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("event", "record") and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == "self" and node.args:
                arg = node.args[0]
                assert isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) \
                    and arg.value.id == "events", f"{src}:{node.lineno}: use a kind from shared/kernel/events.py"
                used.add(getattr(events, arg.attr))
    assert used and used <= declared


def test_every_counter_is_listed_with_its_placeholders_explained() -> None:
    import re

    from shared.launcher.refdocs import COUNTER_PLACEHOLDERS, events_md

    text = events_md()
    # a counter held in a local name, and counters named by f-strings, as patterns
    for name in ("gen_no_responders", "<what>_retries", "control_<verb>", "dropped_<reason>",
                 "permission_denied_<operation>", "eval_tasks_retried", "join_waits_for_sync"):
        assert f"`{name}`" in text, name
    rows = "\n".join(line for line in text.split("## Metrics")[1].splitlines() if line.startswith("| "))
    used = set(re.findall(r"`[a-z_]*<(\w+)>[a-z_]*`", rows))
    assert used and used <= set(COUNTER_PLACEHOLDERS), used - set(COUNTER_PLACEHOLDERS)
    assert "at least once" in text and "`<model>-<instance>`" in text
