"""Every code block of README.md and docs/*.md marked runnable runs as written.

A runnable block is a fenced ``python`` block on the line after ``<!-- runnable -->`` (docs/contributing.md).
Each runs as a script of its own in a fresh directory, with the repository's package first on the path, as
a user who installed it would run it; a block that launches processes (``Trainer(devices=2)``) launches
them itself. Only the blocks whose output the pages describe have their output checked here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = re.compile(r"^<!-- runnable -->\n```python\n(?P<code>.*?)^```", re.M | re.S)
STEP_LOSS = re.compile(r"^step (\d+): loss ([0-9.]+)$", re.M)


def runnable_blocks() -> list[tuple[str, str]]:
    """(page and block number, code) of every runnable block."""
    blocks = []
    for page in PAGES:
        for number, match in enumerate(RUNNABLE.finditer(page.read_text()), start=1):
            blocks.append((f"{page.relative_to(REPO)}#{number}", match["code"]))
    return blocks


BLOCKS = runnable_blocks()


def test_the_readme_has_a_runnable_first_example() -> None:
    assert any(name.startswith("README.md#") and "devices=2" in code for name, code in BLOCKS)


@pytest.mark.distributed
@pytest.mark.timeout(660)
@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_runnable_block_runs_as_written(name: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard, many times what a block takes
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} failed:\n{output[-6000:]}"
    if name == "README.md#1":  # the first run: its loss falls, and rank 0 prints the memory table
        losses = [(int(step), float(loss)) for step, loss in STEP_LOSS.findall(result.stdout)]
        steps = [step for step, _ in losses]
        assert len(steps) > 1 and steps == list(range(1, len(steps) + 1)), output[-3000:]
        assert losses[-1][1] < losses[0][1] / 2, losses
        assert "Memory per rank" in result.stdout and "Saved for backward" in result.stdout
