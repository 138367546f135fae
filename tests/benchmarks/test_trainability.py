"""benchmarks.trainability's tables: honest about what did not run and about lengths that are lower bounds."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import trainability
from benchmarks.common import RESULTS


def test_verdict_leaves_a_lower_bound_undecided() -> None:
    verdict = trainability.verdict
    assert verdict(2.0, ">=", 1.66, low=False, high=False) is True
    assert verdict(1.0, ">=", 1.66, low=False, high=False) is False
    assert verdict(1.0, ">=", 1.66, low=False, high=True) is None  # the numerator may be longer
    assert verdict(2.0, ">=", 1.66, low=True, high=False) is None  # the reference may be longer
    assert verdict(0.9, "<=", 1.07, low=False, high=False) is True
    assert verdict(None, ">=", 1.66, low=False, high=False) is None


def test_committed_report_renders_and_names_what_did_not_run() -> None:
    report = json.loads((RESULTS / "trainability.json").read_text())
    markdown = trainability.render_markdown(report)
    for config in trainability.CONFIGS:
        if config not in report["configs"]:
            assert f"| {config} | | not run |" in markdown
            assert f"- {config}: not run" in markdown
    assert "| sp2-fp32 | gpt-tiny | ours: SP + SAC |" in markdown
    assert "\n".join(trainability.table(report)) in markdown


def test_a_method_the_deadline_never_prepared_reports_no_graph_facts() -> None:
    # A run past --deadline-s skips a model's lengths; the report of a method never prepared must not
    # crash the worker (it did, losing every finished row of the run).
    from benchmarks.methods import OursSP

    method = OursSP.__new__(OursSP)  # no model built: only what graph_facts reads
    method.backends = []
    assert method.graph_facts() == {}


def _launch(commit: str, measured: list[str], budget: float = 32.0) -> dict:
    models = ["gpt-tiny", "llama-tiny"]
    rows = [
        {
            "model": m,
            "method": method,
            "status": "ok",
            **({"peak_bytes": {"2048": 1.0}} if m in measured else {}),
        }
        for m in models
        for method in ("sac", "ulysses")
    ]
    settings = {"nproc": 4, "budget_mib": budget, "headline_len": 2048}
    return {
        "command": f"run at {commit}",
        "code": {"commit": commit},
        "settings": settings,
        "models": dict.fromkeys(models, {}),
        "summary": rows,
        "per_rank": [],
    }


def test_a_launch_of_some_models_replaces_only_their_rows() -> None:
    first = _launch("aaaa", ["gpt-tiny", "llama-tiny"])
    merged = trainability.merge_parts(first, _launch("bbbb", ["llama-tiny"]))  # gpt-tiny skipped
    commits = {(s["model"], s["method"]): s for s in merged["summary"]}
    assert [(s["model"], s["method"]) for s in merged["summary"]] == [
        ("gpt-tiny", "sac"),
        ("gpt-tiny", "ulysses"),
        ("llama-tiny", "sac"),
        ("llama-tiny", "ulysses"),
    ]
    assert commits["gpt-tiny", "sac"] is first["summary"][0]  # kept, not re-measured
    assert [(p["models"], p["code"]["commit"]) for p in merged["parts"]] == [
        (["gpt-tiny"], "aaaa"),
        (["llama-tiny"], "bbbb"),
    ]
    again = trainability.merge_parts(merged, _launch("cccc", ["gpt-tiny"]))
    assert [(p["models"], p["code"]["commit"]) for p in again["parts"]] == [
        (["llama-tiny"], "bbbb"),
        (["gpt-tiny"], "cccc"),
    ]
    lines = trainability.commands({"configs": {"sp4-fp32": again}})
    assert lines[2:4] == ["- sp4-fp32 (llama-tiny): `run at bbbb`", "- sp4-fp32 (gpt-tiny): `run at cccc`"]


def test_a_launch_with_another_budget_is_not_merged() -> None:
    with pytest.raises(SystemExit, match="budget_mib"):
        trainability.merge_parts(_launch("aaaa", ["gpt-tiny"]), _launch("bbbb", ["gpt-tiny"], budget=16.0))


@pytest.mark.parametrize(
    ("extra", "part"),
    [
        (["--repeats", "3"], "sp4-fp32.json"),
        (["--models", "llama-tiny", "--repeats", "3"], "sp4-fp32.llama-tiny.json"),
        (["--repeats", "3", "--models", "gpt-tiny", "llama-tiny"], "sp4-fp32.gpt-tiny.llama-tiny.json"),
    ],
)
def test_a_launch_of_some_models_writes_its_own_part(tmp_path, monkeypatch, extra, part) -> None:
    launched = []

    def launch(command: list[str], cwd: object) -> subprocess.CompletedProcess:
        launched.append(command)
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(trainability, "_gpus", lambda: 0)
    monkeypatch.setattr(trainability.subprocess, "run", launch)
    result = trainability.run_config("sp4-fp32", extra, tmp_path)
    assert "failed" in result  # nothing ran, so no report
    command = launched[0]
    assert command[command.index("--out") + 1] == str(tmp_path / part)
    assert command[command.index("--nproc") + 1] == "4"


def test_a_cuda_launch_needs_its_ranks_in_gpus(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(trainability, "_gpus", lambda: 2)
    assert trainability.run_config("sp4-fp32", [], tmp_path) == {"skipped": "needs 4 GPUs, 2 found"}
