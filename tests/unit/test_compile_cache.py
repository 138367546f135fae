"""SAC and Inductor's on-disk compile caches: a cached partition is never another setting's, and a warm
cache still leaves a SAC report for ``explain()`` (Note [SAC reports and the compile caches])."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_autosp.compiler.partition.sac import SequenceAwarePartitioner

WORKER = Path(__file__).with_name("compile_cache_worker.py")
HANG_GUARD_S = 600  # many times a cold Inductor compile of the worker's step


def test_every_setting_that_changes_the_partition_changes_the_uuid() -> None:
    settings = [(mode, overhead) for mode in ("all", "auto", "off") for overhead in (0.1, 0.2)]
    uuids = {SequenceAwarePartitioner(mode, overhead).uuid() for mode, overhead in settings}
    assert len(uuids) == len(settings)
    assert SequenceAwarePartitioner("auto", 0.1).uuid() == SequenceAwarePartitioner("auto", 0.1).uuid()


def _compile(cache_dir: Path, *settings: str) -> dict[str, dict]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(WORKER), *settings],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {line["sac"]: line for line in lines}


@pytest.mark.inductor
@pytest.mark.timeout(2 * HANG_GUARD_S + 60)
def test_a_warm_cache_still_fills_explain_with_each_settings_report(tmp_path: Path) -> None:
    cache_dir = tmp_path / "inductor"
    cold = _compile(cache_dir, "True")
    assert "SAC (all)" in cold["True"]["explain"], cold
    # A second process finds the first one's compiled step on disk.
    warm = _compile(cache_dir, "True", "False", "auto")
    assert warm["True"]["fx_graph_cache_hits"] > 0, warm  # the cache was warm, and served the step
    for setting, mode in (("True", "all"), ("False", "off"), ("auto", "auto")):
        assert f"SAC ({mode}):" in warm[setting]["explain"], (setting, warm[setting]["explain"])
