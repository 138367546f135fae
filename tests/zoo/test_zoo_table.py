"""The zoo table of docs/models.md is the committed results, whose verdicts are the expected ones."""

from __future__ import annotations

import json

from benchmarks import zoo
from tests.zoo.families import FAMILIES


def test_the_docs_table_is_the_committed_results():
    results = json.loads(zoo.RESULTS.read_text())
    assert zoo.page_block(results) in zoo.ZOO_PAGE.read_text(), "run: python -m benchmarks.zoo --docs"


def test_committed_results_cover_every_family_with_its_expected_verdict():
    results = json.loads(zoo.RESULTS.read_text())["families"]
    assert set(results) == set(FAMILIES)
    for name, family in FAMILIES.items():
        expected = "exact" if family.refusal is None else "refused"
        assert zoo.family_verdict(results[name]["runs"]) == expected, name


def test_refusal_reason_names_the_op_and_where_it_is():
    error = (
        "BackendCompilerFailed: backend='compile_fn' raised:\nNotImplementedError: The SP pass cannot prove "
        "this training step exact\n- addmm at /x/site-packages/transformers/pytorch_utils.py:119 in forward: "
        "x = torch.addmm(b, x, w): no rule says how this op treats the sequence dim. Write the step ..."
    )
    assert zoo.refusal_reason(error) == (
        "`addmm` at transformers/pytorch_utils.py:119 (forward): "
        "no rule says how this op treats the sequence dim"
    )
