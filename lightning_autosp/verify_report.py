"""The tables ``verify`` prints: as rich renderables (``lightning_autosp[plot]``) or as markdown."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_autosp.verify import VerifyResult

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
    lines += ["", heading, compiler_text(result), "", VERDICTS[result.verdict]]
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
    parts.append(Text(VERDICTS[result.verdict], style=style))
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
