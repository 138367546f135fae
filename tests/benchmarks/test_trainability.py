"""benchmarks.trainability's tables: honest about what did not run and about lengths that are lower bounds."""

from __future__ import annotations

import json

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
