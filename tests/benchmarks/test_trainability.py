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


def test_a_launch_of_the_longest_policy_is_judged_on_its_own_targets() -> None:
    """A launch of ``longest``, ``alst`` and ``ulysses`` (issue 51) is judged against Ulysses' length, the
    ALST-style baseline's length and its step time (paired), not on SAC's targets, whose methods it lacks."""
    run = json.loads((RESULTS / "longest" / "sp2-bf16-mixed.gpt-tiny.json").read_text())
    rows = {row["target"]: row for row in trainability.targets({"configs": {"sp2-bf16-mixed": run}})}
    assert set(rows) == {
        "longest: max length vs hand-written Ulysses",
        "longest: max length vs ALST-style",
        "longest: step time vs ALST-style (paired)",
    }
    assert rows["longest: max length vs hand-written Ulysses"]["met"] is True  # >= 6656 against 1280
    assert rows["longest: max length vs ALST-style"]["met"] is None  # both searches ended under the budget
    step = rows["longest: step time vs ALST-style (paired)"]
    assert step["interval"] is not None and step["met"] is (step["interval"][1] <= 1.0)


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


def test_median_interval_is_the_order_statistics_that_hold_95_percent() -> None:
    from benchmarks.paired import interval_verdict, median_interval

    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) is None  # 5 rounds: no order statistic reaches 95%
    assert median_interval([3.0, 1.0, 2.0, 7.0, 5.0, 6.0, 4.0]) == (1.0, 7.0)  # 7 rounds: 98.4%
    # 151 rounds: the 63rd and 89th of the ordered ratios (75.5 +- 1.96 sqrt(151) / 2)
    assert median_interval([float(i) for i in range(151)]) == (62.0, 88.0)
    assert interval_verdict((0.90, 0.96), "<=", 0.97) is True
    assert interval_verdict((0.98, 1.02), "<=", 0.97) is False
    assert interval_verdict((0.95, 1.01), "<=", 0.97) is None  # spans the bound: undecided
    assert interval_verdict(None, "<=", 0.97) is None


def test_paired_intervals_come_from_the_slowest_ranks_rounds() -> None:
    from benchmarks.summary import _paired_intervals

    def rank(sp: list[float], ulysses: list[float]) -> dict:
        return {m: {"timing": {"step_times_s": t}} for m, t in (("sp", sp), ("ulysses", ulysses))}

    ulysses = [1.0] * 7
    fast, slow = [0.90, 0.91, 0.92, 0.93, 0.94, 0.95, 0.96], [0.95, 0.96, 0.97, 0.98, 0.99, 1.00, 1.01]
    summary = {"method": "sp"}
    _paired_intervals(summary, [rank(fast, ulysses), rank(slow, ulysses)])
    assert summary == {"method": "sp", "paired_interval_vs_ulysses": [0.95, 1.01]}


def _timed_config(step_s: float, interval: list[float], nproc: int = 4) -> dict:
    launch = _launch("aaaa", ["gpt-tiny", "llama-tiny"])
    launch["settings"]["nproc"] = nproc
    for row in launch["summary"]:
        row.update(
            label=row["method"],
            median_step_s=9.0,
            paired_ratio_vs_ulysses=1.2 if row["method"] == "sac" else 1.0,
        )
    launch["summary"].append(
        {
            "model": "gpt-tiny",
            "method": "ddp",
            "label": "DDP",
            "status": "ok",
            "median_step_s": 2.0,
            "paired_ratio_vs_ulysses": 1.6,
        }
    )
    timing = {
        "command": "timing at bbbb",
        "code": {"commit": "bbbb"},
        "settings": {**launch["settings"], "repeats": 151},
        "summary": [
            {
                "model": m,
                "method": method,
                "status": "ok",
                "median_step_s": step_s,
                "paired_ratio_vs_ulysses": 0.95 if method == "sac" else 1.0,
                **({"paired_interval_vs_ulysses": interval} if method == "sac" else {}),
            }
            for m in ("gpt-tiny", "llama-tiny")
            for method in ("sac", "ulysses")
        ],
        "per_rank": [],
    }
    return {"configs": {"sp4-fp32": launch}}, {"configs": {"sp4-fp32": timing}}


def test_a_timing_launch_gives_the_step_times_and_its_intervals_judge_the_targets(monkeypatch) -> None:
    monkeypatch.setattr(
        trainability, "TARGETS", (("time", "sac", "ulysses", "paired_ratio_vs_ulysses", "<=", 0.97),)
    )
    report, timing = _timed_config(0.5, [0.93, 0.96])
    trainability.attach_timing(report, timing)
    table = "\n".join(trainability.table(report))
    assert "| sp4-fp32 | gpt-tiny | sac |" in table and "| 500 | 0.95x (0.930-0.960) |" in table
    assert "| DDP | — | — | — | — | — | — | 1.60x* | — |" in table  # not timed there: its own launch's ratio
    assert [row["met"] for row in trainability.targets(report)] == [True, True]  # 1.2x in the own launch
    assert "- sp4-fp32 (step times): `timing at bbbb`" in trainability.commands(report)
    report, timing = _timed_config(0.5, [0.93, 1.01])
    trainability.attach_timing(report, timing)
    assert [row["met"] for row in trainability.targets(report)] == [None, None]  # the interval spans 0.97
    assert "undecided (the 95% interval 0.930-1.010 spans the bound)" in "\n".join(
        trainability.target_table(report)
    )


def test_a_timing_launch_with_other_ranks_is_not_attached() -> None:
    report, _ = _timed_config(0.5, [0.93, 0.96])
    _, timing = _timed_config(0.5, [0.93, 0.96], nproc=2)
    with pytest.raises(SystemExit, match="nproc"):
        trainability.attach_timing(report, timing)
