"""The figures of a ``benchmarks.run`` launch: one summary per (model, method) and the targets.

``assemble`` turns the per-rank records of a run into one summary per (model, method): figures that
differ between ranks are reported as their maximum over ranks (the slowest rank sets the step time, the
fullest rank the memory). ``benchmarks.report`` renders them; ``benchmarks.trainability`` gathers several
launches' summaries into its table.
"""

from __future__ import annotations

from typing import Any

from benchmarks.paired import slowest_rank_interval
from benchmarks.suites import PAIRED_REFERENCES, REFERENCE_METHOD

TARGETS = {
    "time_vs_deepspeed": 1.00,
    "time_vs_ulysses": 1.03,
    "max_len_vs_ddp": 3.5,
}


def _max(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _a2a_formula_bytes(model: dict, seq_len: int, ranks: int, batch: int, itemsize: int) -> float:
    """Ulysses all-to-all bytes one rank sends per layer in forward: (s/P)((P-1)/P)(2h + 2h_kv), times B."""
    head_dim = model["hidden"] // model["heads"]
    h, h_kv = model["heads"] * head_dim, model["kv_heads"] * head_dim
    return batch * (seq_len / ranks) * ((ranks - 1) / ranks) * (2 * h + 2 * h_kv) * itemsize


def _compile_s(figures: dict) -> float | None:
    """First step minus a steady step (None where only one step ran: the out-of-memory search)."""
    if figures.get("steady_step_s") is None:
        return None
    return figures["first_step_s"] - figures["steady_step_s"]


def summarize(model_name: str, method: str, per_rank: list[dict], report: dict) -> dict:
    settings, model = report["settings"], report["models"][model_name]
    ranks = len(per_rank)
    first = per_rank[0]
    summary: dict[str, Any] = {
        "model": model_name,
        "method": method,
        "label": first.get("label", method),
        "status": first["status"],
        "error": first.get("error"),
        "failed_at": first.get("failed_at"),
    }
    lengths = sorted(int(s) for s in first["lengths"] if all(s in r["lengths"] for r in per_rank))
    summary["peak_bytes"] = {
        str(s): _max([r["lengths"][str(s)]["alloc_peak_bytes"] for r in per_rank]) for s in lengths
    }
    lower = "alloc_peak_seen_frees_bytes"  # the peak without blocks freed off the profiled thread (CPU)
    bounded = [s for s in lengths if all(lower in r["lengths"][str(s)] for r in per_rank)]
    if bounded:
        summary["peak_seen_frees_bytes"] = {
            str(s): _max([r["lengths"][str(s)][lower] for r in per_rank]) for s in bounded
        }
    summary["compile_s"] = {
        str(s): _max([_compile_s(r["lengths"][str(s)]) for r in per_rank]) for s in lengths
    }
    if "timing" in first:
        summary["median_step_s"] = _max([r["timing"]["median_step_s"] for r in per_rank])
        summary["min_step_s"] = _max([r["timing"]["min_step_s"] for r in per_rank])
        for reference in PAIRED_REFERENCES:
            paired = f"paired_ratio_vs_{reference}"
            if paired in first["timing"]:
                summary[paired] = _max([r["timing"][paired] for r in per_rank])
    if "saved" in first:
        summary["saved_bytes"] = _max([r["saved"]["saved_bytes"] for r in per_rank])
        summary["saved_hook_check_ok"] = all(r["saved"]["hook_check"]["ok"] for r in per_rank)
    if "parity" in first:
        summary["loss_rel_err"] = _max([r["parity"]["loss_rel_err"] for r in per_rank])
        summary["grad_rel_err"] = _max([r["parity"]["grad_rel_err"] for r in per_rank])
        summary["losses"] = [r["parity"]["loss"] for r in per_rank]
        summary["reference_loss"] = first["parity"]["reference_loss"]
    headline = str(settings["headline_len"])
    if headline in first["lengths"] and "collective_bytes" in first["lengths"][headline]:
        layers = model["layers"]
        sent = (ranks - 1) / ranks
        for phase in ("forward", "backward"):
            key = f"{phase}:all_to_all"
            passed = _max([r["lengths"][headline]["collective_bytes"].get(key, 0) for r in per_rank])
            summary[f"a2a_{phase}_bytes_per_layer"] = passed * sent / layers
        itemsize = 2 if settings["dtype"] == "bfloat16" else 4
        summary["a2a_formula_bytes_per_layer"] = _a2a_formula_bytes(
            model, settings["headline_len"], ranks, settings["batch_size"], itemsize
        )
        summary["collectives_at_headline"] = first["lengths"][headline]["collective_bytes"]
    if "search" in first:
        summary["search"] = first["search"]
    summary["info"] = first.get("info", {})
    return summary


def assemble(report: dict, gathered: list[dict] | None) -> dict:
    """Attach per-rank records (``gathered``, in rank order; None: those already in ``report``) and their
    summaries to ``report``."""
    if gathered is not None:
        report["per_rank"] = gathered
    gathered = report["per_rank"]
    summaries = []
    for model_name in report["models"]:
        for method in report["settings"]["methods"]:
            per_rank = [g["results"][model_name][method] for g in gathered]
            summaries.append(summarize(model_name, method, per_rank, report))
    by_key = {(s["model"], s["method"]): s for s in summaries}
    for s in summaries:
        _paired_intervals(s, [g["results"][s["model"]] for g in gathered])
        ref = by_key.get((s["model"], REFERENCE_METHOD), {})
        if s.get("median_step_s") and ref.get("median_step_s"):
            s["time_ratio_vs_ulysses"] = s["median_step_s"] / ref["median_step_s"]
        for other in ("ddp", "deepspeed"):
            mine = (s.get("search") or {}).get("max_len")
            theirs = (by_key.get((s["model"], other), {}).get("search") or {}).get("max_len")
            if mine and theirs:
                s[f"max_len_ratio_vs_{other}"] = mine / theirs
    report["summary"] = summaries
    report["targets"] = targets(report)
    return report


def _paired_intervals(summary: dict, per_rank: list[dict]) -> None:
    """Each paired ratio's 95% interval, from the per-round step times (``benchmarks.paired``)."""
    mine = [r.get(summary["method"], {}).get("timing") for r in per_rank]
    for reference in PAIRED_REFERENCES:
        theirs = [r.get(reference, {}).get("timing") for r in per_rank]
        if summary["method"] == reference or not all(mine + theirs):
            continue
        interval = slowest_rank_interval(
            [(a["step_times_s"], b["step_times_s"]) for a, b in zip(mine, theirs)]
        )
        if interval is not None:
            summary[f"paired_interval_vs_{reference}"] = list(interval)


def targets(report: dict) -> list[dict]:
    """The issue's targets for this project's SP + SAC, as measured (``met`` None: not measurable)."""
    by_key = {(s["model"], s["method"]): s for s in report["summary"]}
    rows = []
    for model in report["models"]:
        ours = by_key.get((model, "sac"), {})
        ds, uly, ddp = (by_key.get((model, m), {}) for m in ("deepspeed", "ulysses", "ddp"))
        time_ds = None
        if ours.get("median_step_s") and ds.get("median_step_s"):
            time_ds = ours["median_step_s"] / ds["median_step_s"]
        checks = [
            ("step time vs DeepSpeed AutoSP", time_ds, TARGETS["time_vs_deepspeed"], "<=", _why_missing(ds)),
            (
                "step time vs hand-written Ulysses",
                ours.get("time_ratio_vs_ulysses"),
                TARGETS["time_vs_ulysses"],
                "<=",
                _why_missing(uly),
            ),
            (
                "max length vs DDP",
                ours.get("max_len_ratio_vs_ddp"),
                TARGETS["max_len_vs_ddp"],
                ">=",
                _why_missing(ddp),
            ),
            (
                "max length vs DeepSpeed AutoSP",
                ours.get("max_len_ratio_vs_deepspeed"),
                1.0,
                ">",
                _why_missing(ds),
            ),
        ]
        for what, value, bound, relation, missing in checks:
            if value is None:
                met, note = None, missing or "not measured"
            else:
                met = {"<=": value <= bound, ">=": value >= bound, ">": value > bound}[relation]
                note = _search_note(ours, ddp if "DDP" in what else ds) if "length" in what else ""
            rows.append(
                {
                    "model": model,
                    "target": what,
                    "relation": relation,
                    "value": value,
                    "bound": bound,
                    "met": met,
                    "note": note,
                }
            )
    return rows


def _why_missing(summary: dict) -> str:
    if not summary:
        return "method not run"
    if summary.get("status") == "failed":
        return f"{summary['method']} failed at {summary.get('failed_at')}"
    return ""


def _search_note(ours: dict, other: dict) -> str:
    notes = []
    for s in (ours, other):
        search = s.get("search") or {}
        if search.get("capped_at_model_limit"):
            notes.append(f"{s['method']} reached the model's position limit (a lower bound)")
        elif search.get("max_len") and not search.get("first_over"):
            notes.append(f"{s['method']}: no measured length over the budget (a lower bound)")
    return "; ".join(notes)
