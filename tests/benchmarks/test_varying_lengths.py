"""benchmarks/varying_lengths.py: the committed table renders from its JSON, and its compiles are the
strategy's own count (one per (step, length class): every length of a class shares one graph)."""

from __future__ import annotations

import json

from benchmarks import varying_lengths


def test_committed_report_renders_from_its_json() -> None:
    report = json.loads(varying_lengths.OUT.read_text())
    assert varying_lengths.render(report) == varying_lengths.OUT.with_suffix(".md").read_text()
    for run in report["runs"].values():
        assert len(run["step_s"]) == len(run["lengths"])
        world = report["ranks"]
        classes = {n % world for n in run["lengths"]}
        assert run["compiles"] == {f"training_step@every length = {r} mod {world}": 1 for r in classes}
