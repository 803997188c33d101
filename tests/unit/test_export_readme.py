"""The README that `chorus export` writes: its Python snippets run verbatim against the installed transformers and peft."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.kernel.config import load_config
from shared.models.export import _export

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def snippets(out: Path) -> list[str]:
    text = (out / "README.md").read_text()
    return [b.replace("'OUT", f"'{out}") for b in BLOCK.findall(text)]


def run_snippet(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, f"the README's snippet failed:\n{code}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.timeout(600)
def test_the_lora_export_readme_loads_the_adapter_and_generates(tmp_path: Path) -> None:
    # the demo's model: the embedded SmolLM2 with one adapter per agent; its cache is the checkout's runs/_cache
    cfg = load_config(ROOT / "configs" / "demo.yaml", run={"dir": str(ROOT / "runs")})
    out = tmp_path / "export"
    result = _export(cfg, tmp_path, "smol", out, 0, None)
    assert result.tokenizer and set(result.adapters) == {"sol", "ver"}
    blocks = snippets(out)
    assert len(blocks) == 2 and "generate" in blocks[1] and "Reply with only the number." in blocks[1], blocks
    run_snippet(blocks[0])
    printed = run_snippet(blocks[1])
    assert printed.strip(), "the generation snippet printed nothing"


def test_the_tiny_model_export_readme_loads_the_model(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "tiny-chain.yaml")
    model = next(iter(cfg.models))
    out = tmp_path / "export"
    result = _export(cfg, tmp_path, model, out, 0, None)
    assert not result.tokenizer
    blocks = snippets(out)
    assert len(blocks) == 1 and "from_pretrained" in blocks[0], blocks
    run_snippet(blocks[0] + "\nprint(type(model).__name__)\n")
