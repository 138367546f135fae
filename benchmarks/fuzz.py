"""A differential fuzzer of the SP pass: random small modules against one device.

    python -m benchmarks.fuzz --cases N --seed S [--out FILE.md] [--case SEED]

Each case (``benchmarks/fuzz_grammar.py``: embeddings and positions, attention in several spellings and
other token mixers, norms, MLPs, pooled or per-token heads, losses; batch 1-3, odd, even and prime lengths,
sp 2-4) is written out as a module (``benchmarks/fuzz_source.py``), its training step rewritten by the SP
pass for every rank and run with the ranks as threads (``tests/unit/sp_graphs.py``), and compared with
the same step on one device. As the strategy's default (``trace_length="auto"``) does, a step refused for
branching on this rank's length is traced again at the whole sequence's. Verdicts:

- exact: every rank's loss within ``LOSS_TOLERANCE`` (relative) and every gradient within
  ``GRAD_TOLERANCE`` (``benchmarks.common.grad_rel_err``);
- refused: the SP pass refused the step (``NotImplementedError``, or the ``ValueError`` of heads sp does
  not divide), grouped by the op and reason of its first refusal;
- DEFECT: a silent mismatch, or a crash that is not a refusal. Each is shrunk (elements set to their
  simplest choice one by one while the defect persists) and its minimal module printed.

Case ``i`` of a run has seed ``S * 100_003 + i`` (``--case`` reruns one such seed alone).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import grad_rel_err, rel_err
from benchmarks.fuzz_grammar import DROPPED, ELEMENTS, Spec, sample, shrink_moves
from benchmarks.fuzz_source import build
from lightning_autosp.compiler.prove.plan import LengthBranchRefusal
from tests.unit.sp_graphs import simulate_step, single_device

LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4
SEED_STRIDE = 100_003
HEADS_REFUSAL = "must divide the number of attention heads"


@dataclass(frozen=True)
class Outcome:
    verdict: str  # "exact", "refused" or "DEFECT"
    reason: str = ""  # refused: the reason's class; DEFECT: "mismatch" or the crash's type
    detail: str = ""  # the refusal's first line, the errors, or the crash's last frames
    loss_err: float = 0.0
    grad_err: float = 0.0


@dataclass(frozen=True)
class Case:
    seed: int
    spec: Spec
    outcome: Outcome
    seconds: float


def case_seed(run_seed: int, index: int) -> int:
    return run_seed * SEED_STRIDE + index


def spec_of(seed: int) -> Spec:
    return sample(random.Random(seed))


def refusal_class(message: str, text: str = "") -> tuple[str, str]:
    """(a short class, the first refusal's line) of the SP pass's refusal message; ``text``: the case's
    source, whose lines the message quotes."""
    if HEADS_REFUSAL in message:
        return "sp does not divide the heads", message.splitlines()[0]
    lines = [line for line in message.splitlines() if line.startswith("- ")]
    first = lines[0] if lines else message.splitlines()[0]
    if "branched on the sequence length" in first:
        return "branch on the sequence length", first
    # "- <op> at <file>:<line> in <function>: <quoted source line>: <reason>. <fix>"
    match = re.match(r"- (\S+) at (?:<fuzz case \d+>:\d+ in \w+|graph node \S+): (.*)", first)
    if match is None:
        return first[:80], first
    op, rest = match.groups()
    quoted = [line.strip() for line in text.splitlines() if line.strip() and rest.startswith(line.strip())]
    reason = rest[len(max(quoted, key=len)) + 2 :] if quoted else rest
    reason = re.sub(r"\([^()]*\)|\[[^\]]*\]", "", reason)  # the values in it, which vary by case
    reason = re.sub(r"\s+", " ", re.split(r"[.;]", reason)[0]).strip()
    return f"{op}: {reason[:70]}", first


def run_case(spec: Spec, seed: int) -> Outcome:
    module, batch, text = build(spec, seed)
    loss, grads = single_device(module, batch)
    try:
        try:
            simulated = simulate_step(module, batch, spec.sp)
        except LengthBranchRefusal:  # as the default, trace_length="auto", does: traced again whole
            simulated = simulate_step(module, batch, spec.sp, whole=True)
    except NotImplementedError as refusal:
        reason, first = refusal_class(str(refusal), text)
        return Outcome("refused", reason, first)
    except ValueError as refusal:
        if HEADS_REFUSAL not in str(refusal):
            return _crash(refusal)
        reason, first = refusal_class(str(refusal), text)
        return Outcome("refused", reason, first)
    except Exception as crash:
        return _crash(crash)
    loss_err = max(rel_err(rank_loss, loss) for rank_loss in simulated.losses)
    grad_err = grad_rel_err(simulated.grads, grads)
    if loss_err <= LOSS_TOLERANCE and grad_err <= GRAD_TOLERANCE:
        return Outcome("exact", loss_err=loss_err, grad_err=grad_err)
    worst = _worst_gradients(simulated.grads, grads)
    detail = f"loss rel err {loss_err:.2e}, gradient rel err {grad_err:.2e} (worst: {worst})"
    return Outcome("DEFECT", "mismatch", detail, loss_err, grad_err)


def _crash(error: BaseException) -> Outcome:
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    last = "".join(frames[-3:]).strip()
    return Outcome(
        "DEFECT", f"crash: {type(error).__name__}", f"{type(error).__name__}: {error}"[:300] + "\n" + last
    )


def _worst_gradients(grads: dict, reference: dict, count: int = 3) -> str:
    errors = {name: grad_rel_err({name: grads[name]}, {name: ref}) for name, ref in reference.items()}
    worst = sorted(errors.items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{name} {err:.2e}" for name, err in worst)


def shrink(spec: Spec, seed: int, outcome: Outcome, budget: int = 40) -> tuple[Spec, Outcome]:
    """The simplest spec found (at most ``budget`` tries) whose case is still a defect of the same kind:
    passes over the moves (``shrink_moves``), each kept when the defect persists, until a pass keeps none."""
    tries, changed = 0, True
    while changed and tries < budget:
        changed = False
        for move in shrink_moves():
            candidate = move(spec)
            if candidate == spec or tries >= budget:
                continue
            tries += 1
            result = _guarded(candidate, seed)
            if result.verdict == "DEFECT" and result.reason == outcome.reason:
                spec, outcome, changed = candidate, result, True
    return spec, outcome


def _guarded(spec: Spec, seed: int) -> Outcome:
    """``run_case``, with an error outside the SP step (the grammar's own bug) as a defect of the harness."""
    try:
        return run_case(spec, seed)
    except Exception as error:
        return Outcome("DEFECT", f"harness: {type(error).__name__}", str(error)[:300])


def run(seeds: list[int], log: Callable[[str], None] = print, minutes: float | None = None) -> list[Case]:
    """The cases of ``seeds`` in order; with ``minutes``, no case starts after that long."""
    cases = []
    start = time.perf_counter()
    for number, seed in enumerate(seeds, 1):
        if minutes is not None and time.perf_counter() - start > 60 * minutes:
            log(f"stopped after {number - 1} of {len(seeds)} cases: --minutes {minutes} spent")
            break
        spec = spec_of(seed)
        case_start = time.perf_counter()
        outcome = _guarded(spec, seed)
        cases.append(Case(seed, spec, outcome, time.perf_counter() - case_start))
        mark = outcome.verdict + (f" ({outcome.reason})" if outcome.reason else "")
        log(f"[{number}/{len(seeds)}] seed {seed}: {mark} in {cases[-1].seconds:.1f}s | {spec.describe()}")
    return cases


def covering_seeds(run_seed: int, pool: int, count: int, max_cost: int = 4) -> list[int]:
    """``count`` case seeds among the first ``pool`` of a run, picked greedily to cover every choice of
    every element (as ``coverage`` counts them), then again, cheapest (smallest sp) first among equals,
    among the cases of at most ``max_cost`` (sp times layers): how the CI slice
    (tests/unit/test_fuzz_slice.py) was chosen."""

    def covered(spec: Spec) -> set[tuple[str, str]]:
        used = {**spec.used(), "sp": str(spec.sp), "batch": str(spec.batch), "length": spec.length_class}
        return set(used.items())

    seeds = [case_seed(run_seed, i) for i in range(pool)]
    # a case costs a Dynamo trace per rank, about as long as its layers
    cheap = [seed for seed in seeds if spec_of(seed).sp * int(spec_of(seed)["layers"]) <= max_cost]
    candidates = {seed: covered(spec_of(seed)) for seed in cheap}
    every = set().union(*candidates.values())
    picked: list[int] = []
    missing = set(every)
    while candidates and len(picked) < count:
        best = max(candidates, key=lambda seed: (len(candidates[seed] & missing), -spec_of(seed).sp))
        picked.append(best)
        missing = (missing - candidates.pop(best)) or set(every)  # all covered: another round
    return picked


LOG_LINE = re.compile(r"^\[(\d+)/(\d+)\] seed (\d+): (exact|refused|DEFECT)(?: \((.*)\))? in ([\d.]+)s \|")


def cases_from_log(path: Path) -> tuple[list[Case], int]:
    """The cases a run logged (``run``'s lines) and how many it planned, to report a run again (with
    another shrink budget) without running its cases again; the outcomes keep only verdict and reason."""
    cases, planned = [], 0
    for line in path.read_text().splitlines():
        match = LOG_LINE.match(line)
        if match:
            _, total, seed, verdict, reason, seconds = match.groups()
            planned = int(total)
            outcome = Outcome(verdict, reason or "", reason or "")
            cases.append(Case(int(seed), spec_of(int(seed)), outcome, float(seconds)))
    return cases, planned


# --------------------------------------------------------------------------------------------------
# the report


def tally(cases: list[Case]) -> list[str]:
    total = len(cases)
    verdicts = Counter(case.outcome.verdict for case in cases)
    lines = ["| verdict | cases | share |", "|---|---:|---:|"]
    for verdict in ("exact", "refused", "DEFECT"):
        lines.append(f"| {verdict} | {verdicts[verdict]} | {100 * verdicts[verdict] / max(total, 1):.1f}% |")
    reasons = Counter(case.outcome.reason for case in cases if case.outcome.verdict == "refused")
    if reasons:
        lines += ["", "Refused, by reason:", "", "| reason | cases |", "|---|---:|"]
        lines += [f"| {_cell(reason)} | {count} |" for reason, count in reasons.most_common()]
    return lines


def coverage(cases: list[Case]) -> list[str]:
    """Cases per grammar element's choice (where the choice shaped the module), with their verdicts."""
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for case in cases:
        used = {**case.spec.used(), "sp": str(case.spec.sp), "batch": str(case.spec.batch)}
        used["length"] = case.spec.length_class
        for element, choice in used.items():
            counts[element, choice][case.outcome.verdict] += 1
    lines = ["| element | choice | cases | exact | refused | DEFECT |", "|---|---|---:|---:|---:|---:|"]
    order = [*ELEMENTS, "sp", "batch", "length"]
    for element, choice in sorted(counts, key=lambda key: (order.index(key[0]), key[1])):
        found = counts[element, choice]
        row = [element, choice, sum(found.values()), found["exact"], found["refused"], found["DEFECT"]]
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return lines


def defect_reports(cases: list[Case], shrink_budget: int, log: Callable[[str], None] = print) -> list[str]:
    """Each defect shrunk and printed; a defect whose case holds every essential choice of one already
    shrunk (same kind) is listed under it instead of shrunk again (shrinking costs up to ``shrink_budget``
    cases)."""
    groups: list[tuple[str, dict[str, str], list[int], list[str]]] = []  # kind, core, seeds, report
    for case in cases:
        if case.outcome.verdict != "DEFECT":
            continue
        used = case.spec.used()
        known = [g for g in groups if g[0] == case.outcome.reason and g[1].items() <= used.items()]
        if known:
            known[0][2].append(case.seed)
            continue
        log(f"shrinking seed {case.seed} ...")
        spec, outcome = shrink(case.spec, case.seed, case.outcome, shrink_budget)
        _, _, text = build(spec, case.seed)
        lines = [
            f"As found: {case.spec.describe()}",
            f"({_cell(case.outcome.detail.splitlines()[0])})",
            "",
            f"Shrunk: {spec.describe()}",
            f"({_cell(outcome.detail.splitlines()[0])})",
            "",
            "```python",
            text.rstrip(),
            "```",
            "",
        ]
        groups.append((case.outcome.reason, essential(spec), [case.seed], lines))
    lines: list[str] = []
    for kind, core, seeds, found in groups:
        also = (
            f" (and {len(seeds) - 1} more cases with its essential choices: seeds {seeds[1:]})"
            if seeds[1:]
            else ""
        )
        lines += [f"### seed {seeds[0]}: {kind}{also}", "", f"Essential choices: {core}", "", *found]
    return lines


def essential(spec: Spec) -> dict[str, str]:
    """The choices of a shrunk spec that shrinking could not drop (neither left out nor the simplest)."""
    return {
        element: choice
        for element, choice in spec.used().items()
        if choice not in (DROPPED.get(element), ELEMENTS[element][0])
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def report(
    cases: list[Case], planned: int, command: str, seconds: float, shrink_budget: int, log: Callable = print
) -> str:
    lines = [
        "# Differential fuzz of the SP pass against one device",
        "",
        f"`{command}`: {len(cases)} cases (of {planned}) in {seconds / 60:.1f} min "
        f"({seconds / max(len(cases), 1):.1f} s a case) on {torch.get_num_threads()} CPU thread(s).",
        "",
        *tally(cases),
        "",
        "## Coverage",
        "",
        *coverage(cases),
        "",
        "## Defects",
        "",
    ]
    defects = defect_reports(cases, shrink_budget, log)
    lines += defects or ["None."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int, default=None, help="run this one case seed alone")
    parser.add_argument("--out", type=Path, default=None, help="write the report (markdown) here")
    parser.add_argument("--shrink-budget", type=int, default=40, help="tries per defect while shrinking")
    parser.add_argument("--minutes", type=float, default=None, help="start no case after this long")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the models are tiny)")
    parser.add_argument("--from-log", type=Path, default=None, help="report the cases this run's log lists")
    parser.add_argument("--command", default=None, help="with --from-log: the command that wrote the log")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python -m benchmarks.fuzz " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.from_log is not None:
        cases, planned = cases_from_log(args.from_log)
        seconds, command = sum(case.seconds for case in cases), args.command or command
    else:
        seeds = [args.case] if args.case is not None else [case_seed(args.seed, i) for i in range(args.cases)]
        start = time.perf_counter()
        cases, planned = run(seeds, minutes=args.minutes), len(seeds)
        seconds = time.perf_counter() - start
    text = report(cases, planned, command, seconds, args.shrink_budget)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 1 if any(case.outcome.verdict == "DEFECT" for case in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
