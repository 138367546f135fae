"""What ``verify`` returns (``VerifyResult``: every rank's errors against one device) and the tables it
prints: as rich renderables (``lightning_autosp[plot]``) or as markdown."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

FULL_PRECISION = ("32-true", "64-true")
# (loss, gradients): fp32 as the parity tests; bf16/fp16 round to 8/11 bits of mantissa (2**-7 for
# bf16), which the bf16-mixed parity tests measure at under 1e-2 / 3e-2 against a bf16 reference.
TOLERANCES = {"full": (1e-5, 1e-4), "low": (1e-2, 3e-2)}


@dataclass
class RankResult:
    """What one rank measured against its single-device reference."""

    rank: int
    reference_loss: float
    loss: float | None = None
    grad_errors: dict[str, float] = field(default_factory=dict)
    missing_grads: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def loss_rel_err(self) -> float:
        if self.loss is None:
            return math.inf
        return abs(self.loss - self.reference_loss) / max(abs(self.reference_loss), 1e-12)

    @property
    def grad_rel_err(self) -> float:
        return max(self.grad_errors.values(), default=math.inf if self.error else 0.0)


@dataclass
class VerifyResult:
    """Loss and gradient errors of the SP step on every rank, and what the SP pass did."""

    ranks: list[RankResult]
    sp_size: int
    devices: int
    accelerator: str
    precision: str
    seq_len: int
    options: dict[str, Any]
    explain: str
    module: str = ""

    @property
    def tolerances(self) -> tuple[float, float]:
        return TOLERANCES["full" if self.precision in FULL_PRECISION else "low"]

    @property
    def refusal(self) -> str | None:
        """The SP run's error (the same on every rank when the pass refused), else None."""
        return next((r.error for r in self.ranks if r.error), None)

    @property
    def loss_rel_err(self) -> float:
        return max(r.loss_rel_err for r in self.ranks)

    @property
    def grad_rel_err(self) -> float:
        return max(r.grad_rel_err for r in self.ranks)

    def worst_parameters(self, count: int = 5) -> list[tuple[str, int, float]]:
        """(parameter, the rank where it is worst, relative error), worst first."""
        worst: dict[str, tuple[str, int, float]] = {}
        for r in self.ranks:
            for name, err in r.grad_errors.items():
                if name not in worst or err > worst[name][2]:
                    worst[name] = (name, r.rank, err)
        return sorted(worst.values(), key=lambda item: -item[2])[:count]

    @property
    def verdict(self) -> str:
        """ "exact", "refused" (the SP pass or the run raised) or "not exact"."""
        if self.refusal is not None:
            return "refused"
        loss_tolerance, grad_tolerance = self.tolerances
        exact = (
            self.loss_rel_err <= loss_tolerance
            and self.grad_rel_err <= grad_tolerance
            and not any(r.missing_grads for r in self.ranks)
        )
        return "exact" if exact else "not exact"

    @property
    def passed(self) -> bool:
        return self.verdict == "exact"

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "verdict": self.verdict,
            "loss_rel_err": self.loss_rel_err,
            "grad_rel_err": self.grad_rel_err,
            "tolerances": self.tolerances,
        }

    def __str__(self) -> str:
        return render_markdown(self)

    def __rich__(self) -> Any:
        return render_rich(self)


VERDICTS = {
    "exact": "EXACT: sequence parallelism reproduces the single-device step for this module and batch.",
    "not exact": (
        "NOT EXACT: the SP step differs from the single-device step past the tolerance. Please report it "
        "with this table (the SP pass should have refused what it could not make exact)."
    ),
    "refused": (
        "REFUSED: the SP run stopped with the error above, on every rank, before training anything wrong. "
        "Its lines name the op, where it is in your code and what to write instead."
    ),
}
# A run that raised something other than the SP pass's refusal (a module Lightning cannot train, a bad
# option); refusals are NotImplementedErrors, as an unsupported program is.
REFUSAL_TYPES = ("SequenceParallelRefusal", "LengthBranchRefusal", "NotImplementedError")
STOPPED = (
    "STOPPED: the SP run raised the error above before training anything; it is not the SP pass refusing "
    "an op. Fix what it names and verify again."
)


def verdict_text(result: VerifyResult) -> str:
    refusal = result.refusal
    if refusal is not None and refusal.split(":", 1)[0] not in REFUSAL_TYPES:
        return STOPPED
    return VERDICTS[result.verdict]


def title(result: VerifyResult) -> str:
    options = ", ".join(f"{k}={v!r}" for k, v in result.options.items())
    return (
        f"autosp verify: {result.module}, sp_size={result.sp_size} on {result.devices} {result.accelerator} "
        f"rank(s), {result.seq_len} tokens, {result.precision}" + (f", {options}" if options else "")
    )


def summary_rows(result: VerifyResult) -> list[list[str]]:
    """check, worst, where, tolerance, ok."""
    loss_tolerance, grad_tolerance = result.tolerances
    if result.refusal is not None:
        return [["SP run", "raised", "every rank" if _all_raised(result) else "some ranks", "-", "no"]]
    worst_loss = max(result.ranks, key=lambda r: r.loss_rel_err)
    worst_params = result.worst_parameters(1)
    where = f"rank {worst_params[0][1]}, {worst_params[0][0]}" if worst_params else "-"
    rows = [
        [
            "loss, relative error",
            f"{result.loss_rel_err:.1e}",
            f"rank {worst_loss.rank}",
            f"{loss_tolerance:.0e}",
            _ok(result.loss_rel_err <= loss_tolerance),
        ],
        [
            "gradients, relative error",
            f"{result.grad_rel_err:.1e}",
            where,
            f"{grad_tolerance:.0e}",
            _ok(result.grad_rel_err <= grad_tolerance),
        ],
    ]
    missing = sorted({name for r in result.ranks for name in r.missing_grads})
    if missing:
        rows.append(["parameters without a gradient", str(len(missing)), ", ".join(missing[:3]), "0", "no"])
    return rows


def rank_rows(result: VerifyResult) -> list[list[str]]:
    """rank, loss, single-device loss, loss error, gradient error."""
    return [
        [
            str(r.rank),
            "-" if r.loss is None else f"{r.loss:.6f}",
            f"{r.reference_loss:.6f}",
            "-" if r.error else f"{r.loss_rel_err:.1e}",
            "-" if r.error else f"{r.grad_rel_err:.1e}",
        ]
        for r in result.ranks
    ]


def parameter_rows(result: VerifyResult) -> list[list[str]]:
    return [[name, str(rank), f"{err:.1e}"] for name, rank, err in result.worst_parameters()]


def compiler_text(result: VerifyResult) -> str:
    if result.refusal is not None:
        return result.refusal
    return result.explain


def render_markdown(result: VerifyResult) -> str:
    lines = [title(result), ""]
    lines += _markdown(["check", "worst", "where", "tolerance", "ok"], summary_rows(result))
    if result.refusal is None:
        lines += [""] + _markdown(
            ["rank", "loss", "single-device loss", "loss error", "grad error"], rank_rows(result)
        )
        lines += [""] + _markdown(["worst parameters", "rank", "relative error"], parameter_rows(result))
    heading = "The SP run's error:" if result.refusal is not None else "What the SP pass did (rank 0):"
    lines += ["", heading, compiler_text(result), "", verdict_text(result)]
    return "\n".join(lines)


def render_rich(result: VerifyResult) -> Any:
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    def table(heading: str | None, columns: list[str], rows: list[list[str]]) -> Table:
        made = Table(title=heading, title_justify="left")
        for index, column in enumerate(columns):
            made.add_column(column, justify="left" if index == 0 else "right")
        for row in rows:
            made.add_row(*row)
        return made

    parts: list[Any] = [
        Text(title(result), style="bold"),
        table(None, ["check", "worst", "where", "tolerance", "ok"], summary_rows(result)),
    ]
    if result.refusal is None:
        parts.append(
            table(
                "Per rank",
                ["rank", "loss", "single-device loss", "loss error", "grad error"],
                rank_rows(result),
            )
        )
        parts.append(
            table("Worst parameters", ["parameter", "rank", "relative error"], parameter_rows(result))
        )
    heading = "The SP run's error" if result.refusal is not None else "What the SP pass did (rank 0)"
    parts.append(Panel(Text(compiler_text(result)), title=heading, title_align="left"))
    style = {"exact": "bold green", "not exact": "bold red", "refused": "bold yellow"}[result.verdict]
    parts.append(Text(verdict_text(result), style=style))
    return Group(*parts)


def _markdown(columns: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _ok(good: bool) -> str:
    return "yes" if good else "NO"


def _all_raised(result: VerifyResult) -> bool:
    return all(r.error for r in result.ranks)
