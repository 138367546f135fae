"""Trainability: the longest sequence each method trains within one per-rank memory budget, at depth.

    python -m benchmarks.trainability                       # the CPU grid (CONFIGS), one launch each
    python -m benchmarks.trainability --configs sp2-fp32    # some of it; other options go to benchmarks.run
    python -m benchmarks.report trainability --readme       # the README table, from the JSON alone
    python -m benchmarks.trainability --configs sp4-fp32 --models llama-tiny   # one model's rows again

Each configuration is one side-by-side launch of ``benchmarks.run --suite trainability`` (8-layer tiny GPT
and Llama; this project with and without SAC, hand-written Ulysses, DDP and DeepSpeed's AutoSP; every
method on the same ranks, batch and per-rank budget), written to ``benchmarks/results/trainability/
<config>.json`` / ``.md``. This module runs them in turn and writes ``trainability.json`` (all of them)
and ``trainability.md`` (the tables and the issue's targets). Lengths are found by ``benchmarks.run``'s
budget search on measured allocator peaks; step times are the median of per-round ratios with the
methods alternating (``paired_ratio_vs_ulysses``, ``paired_ratio_vs_sp``), with their 95% interval.

A search launch times few rounds, and on shared CPU cores one round's ratio moves by 10-20%, so the
step-time columns and targets can come from a timing launch per configuration instead (``--search none``
and many rounds, written by this module to another ``--out``), attached with ``--timing FILE``: its rows
replace the launches' own step times in the tables, named as such, and a time target is met or not only
where the 95% interval of the paired ratio is on one side of the bound (``benchmarks/paired.py``).

A model is the unit of a row's evidence: every figure of a row compares methods of one model measured in one
launch. So a launch may rerun some models of a configuration (``--models``, or a ``--deadline-s`` that
stopped before the rest): the models it measured replace their rows, the others keep theirs, and the
configuration lists each part's models, command and commit (``merge_parts``).

On a machine with CUDA GPUs (``benchmarks/gpu_check.sh``: ``--out FILE``, more via ``TRAIN_ARGS``) the
same configurations run with ``--device cuda``, those needing more GPUs than there are being skipped.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, MiB, code_version, machine_info, write_report
from benchmarks.paired import interval_text, interval_verdict
from benchmarks.suites import SUITES
from benchmarks.suites import parse_launch_args as parse_launch
from benchmarks.summary import assemble

# name -> benchmarks.run arguments; sp is every rank (one sp group). The budget shrinks with the bytes per
# token of a rank (half in bf16, half again at sp=4) so that every configuration searches about the same
# global lengths: within the models' 8192 positions and a CPU's patience, and comparable across rows.
CONFIGS: dict[str, list[str]] = {
    "sp2-fp32": ["--nproc", "2", "--budget-mib", "64"],
    "sp2-bf16-mixed": ["--nproc", "2", "--autocast", "bfloat16", "--budget-mib", "32"],
    "sp4-fp32": ["--nproc", "4", "--budget-mib", "32"],
    "sp4-bf16-mixed": ["--nproc", "4", "--autocast", "bfloat16", "--budget-mib", "16"],
}
TARGETS = (
    # (what, numerator method, denominator method, figure, relation, bound)
    ("max length vs hand-written Ulysses", "sac", "ulysses", "max_len", ">=", 2.7),
    ("max length vs SP alone", "sac", "sp", "max_len", ">=", 1.66),
    ("step time vs SP alone (paired)", "sac", "sp", "paired_ratio_vs_sp", "<=", 1.07),
    ("SP step time vs hand-written Ulysses (paired)", "sp", "ulysses", "paired_ratio_vs_ulysses", "<=", 0.97),
    # issue 51: the longest-length policy against the record holders' recipe (ALST-style)
    ("longest: max length vs hand-written Ulysses", "longest", "ulysses", "max_len", ">=", 4.0),
    ("longest: max length vs ALST-style", "longest", "alst", "max_len", ">=", 1.0),
    ("longest: step time vs ALST-style (paired)", "longest", "alst", "paired_ratio_vs_alst", "<=", 1.0),
)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=RESULTS / "trainability.json")
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    parser.add_argument(
        "--timing", type=Path, help="take step times from this timing launch's report (and rewrite the .md)"
    )
    return parser.parse_known_args(argv)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_config(name: str, extra: list[str], out_dir: Path) -> dict:
    """One ``benchmarks.run`` launch; its report, or why there is none."""
    args = ["--suite", "trainability", *CONFIGS[name], *extra]
    gpus = _gpus()
    if gpus and "--device" not in extra:
        args += ["--device", "cuda"]
    launch = parse_launch(args)  # the launch as benchmarks.run will read it
    if launch.device == "cuda" and launch.nproc > gpus:
        return {"skipped": f"needs {launch.nproc} GPUs, {gpus} found"}
    # a launch of some models keeps the launches of the others (each part's own file)
    some = launch.models != SUITES["trainability"]["models"]
    out = out_dir / (f"{name}.{'.'.join(launch.models)}.json" if some else f"{name}.json")
    shown = out.relative_to(ROOT) if out.is_absolute() and out.is_relative_to(ROOT) else out
    command = [sys.executable, "-m", "benchmarks.run", *args, "--out", str(shown)]
    print(f"== {name}: {shlex.join(command[1:])}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode != 0 or not out.exists():
        return {"failed": f"exit code {done.returncode}", "wall_s": round(time.perf_counter() - start, 1)}
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    if args.render or args.timing:
        report = json.loads(args.out.read_text())
        if args.timing:
            attach_timing(report, json.loads(args.timing.read_text()))
        write_outputs(report, args.out)
        print(args.out.with_suffix(".md").read_text())
        return 0
    out_dir = args.out.parent / args.out.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    configs = dict(previous.get("configs", {}))  # configurations not rerun keep their results
    for name in args.configs:
        previous_run = configs.get(name) or {}
        configs[name] = merge_parts(previous_run, run_config(name, extra, out_dir))
        if "timing" in previous_run:  # its own launch, with its own command and commit
            configs[name]["timing"] = previous_run["timing"]
    report = {
        "kind": "trainability",
        "command": shlex.join(
            ["python", "-m", "benchmarks.trainability", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": machine_info(),
        "code": code_version(),
        "wall_s": round(time.perf_counter() - start, 1),
        "configs": {name: configs[name] for name in CONFIGS if name in configs},
    }
    write_outputs(report, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0 if all("failed" not in c for c in report["configs"].values()) else 1


def measured_models(run: dict) -> list[str]:
    """The models a launch measured: a row with a peak or a failure (not a model the deadline skipped)."""
    return [
        model
        for model in run.get("models", {})
        if any(
            s["model"] == model and (s.get("peak_bytes") or s.get("status") == "failed")
            for s in run.get("summary", [])
        )
    ]


def _part(run: dict, models: list[str]) -> dict:
    keys = ("command", "code", "wall_s_worker")
    return {"models": models, **{key: run.get(key) for key in keys}}


# the settings that make two launches' rows comparable
COMPARABLE = ("nproc", "dtype", "autocast", "headline_len", "compiler", "layers", "batch_size")
# a row's step-time figures, as a timing launch gives them
TIMED = (
    "median_step_s",
    *(f"paired_{kind}_vs_{ref}" for kind in ("ratio", "interval") for ref in ("ulysses", "sp", "alst")),
)


def attach_timing(report: dict, timing: dict) -> None:
    """Take every configuration's step-time figures from ``timing`` (a report of this module from launches
    with ``--search none``), where that configuration ran; the length columns keep their launches'."""
    for config, run in timing["configs"].items():
        target = report["configs"].get(config)
        if "summary" not in run or not target or "settings" not in target:
            continue
        differs = [k for k in COMPARABLE if target["settings"].get(k) != run["settings"].get(k)]
        if differs:
            raise SystemExit(f"{config}: the timing launch differs in {', '.join(differs)}")
        if run.get("per_rank"):
            assemble(run, None)  # the summaries again, with the intervals of this code
        target["timing"] = {
            "command": run["command"],
            "code": run.get("code"),
            "repeats": run["settings"]["repeats"],
            "wall_s_worker": run.get("wall_s_worker"),
            "rows": [
                {"model": s["model"], "method": s["method"], **{k: s[k] for k in TIMED if k in s}}
                for s in run["summary"]
                if s.get("status") == "ok"
            ],
        }


def _timed(run: dict) -> dict[tuple[str, str], dict]:
    """Each row's step-time figures: from the configuration's timing launch where it has one; a method that
    launch did not run keeps its own launch's, marked ``own``."""
    own = _by_key(run)
    if "timing" not in run:
        return own
    timed = {(row["model"], row["method"]): row for row in run["timing"]["rows"]}
    return {key: timed.get(key) or {**row, "own": True} for key, row in own.items()}


def merge_parts(previous: dict | None, new: dict) -> dict:
    """A configuration after ``new``'s launch: the models it measured take its rows, the rest keep theirs.

    Refused when the two launches differ in what makes rows comparable (ranks, budget, precision, lengths).
    """
    if not previous or "summary" not in previous or "summary" not in new:
        return new
    same = ("budget_mib", *COMPARABLE)
    differs = [k for k in same if previous["settings"].get(k) != new["settings"].get(k)]
    if differs:
        raise SystemExit(f"cannot merge a launch with other {', '.join(differs)} into this configuration")
    rerun = measured_models(new)
    parts = previous.get("parts") or [_part(previous, measured_models(previous))]
    kept = [{**p, "models": [m for m in p["models"] if m not in rerun]} for p in parts]
    models = {**previous.get("models", {}), **new.get("models", {})}
    rows = [s for s in previous["summary"] if s["model"] not in rerun]
    rows += [s for s in new["summary"] if s["model"] in rerun]
    rows.sort(key=lambda s: list(models).index(s["model"]))  # stable: methods keep their order
    merged = {key: value for key, value in new.items() if key != "per_rank"}  # per-rank data: see the parts
    merged.update(
        models=models,
        summary=rows,
        parts=[p for p in kept if p["models"]] + [_part(new, rerun)],
    )
    return merged


# --------------------------------------------------------------------------------------------------
# tables


def _by_key(run: dict) -> dict[tuple[str, str], dict]:
    return {(s["model"], s["method"]): s for s in run.get("summary", [])}


def _max_len(summary: dict) -> int | None:
    return (summary.get("search") or {}).get("max_len") if summary.get("status") == "ok" else None


def figure(run: dict, model: str, method: str, name: str, reference: str) -> float | None:
    """``name`` of ``method`` against ``reference``: a length ratio, or a paired step-time figure (from the
    configuration's timing launch where it has one)."""
    by_key = _by_key(run)
    mine, theirs = by_key.get((model, method), {}), by_key.get((model, reference), {})
    if name == "max_len":
        a, b = _max_len(mine), _max_len(theirs)
        return a / b if a and b else None
    if "timing" not in run and not (mine.get("status") == "ok" and theirs.get("status") == "ok"):
        return None
    timed = _timed(run)
    return timed.get((model, method), {}).get(name) if (model, reference) in timed else None


def _lower_bound(summary: dict) -> bool:
    """The search never measured a length over the budget: ``max_len`` is only a lower bound."""
    search = summary.get("search") or {}
    return _max_len(summary) is not None and (
        not search.get("first_over") or bool(search.get("capped_at_model_limit"))
    )


def verdict(value: float | None, relation: str, bound: float, low: bool, high: bool) -> bool | None:
    """Met, not met, or None when undecided: ``low`` / ``high``, the true value may be lower / higher."""
    if value is None:
        return None
    if relation == ">=":
        return (True if not low else None) if value >= bound else (False if not high else None)
    return (True if not high else None) if value <= bound else (False if not low else None)


def targets(report: dict) -> list[dict]:
    rows = []
    for config, run in report["configs"].items():
        by_key = _by_key(run)
        for model in run.get("models", {}):
            for what, method, reference, name, relation, bound in TARGETS:
                if (model, method) not in by_key or (model, reference) not in by_key:
                    continue  # a launch of some methods is judged on the targets among them
                value = figure(run, model, method, name, reference)
                # a length ratio over a lower bound may be higher; over a lower-bound reference, lower
                high = name == "max_len" and _lower_bound(by_key.get((model, method), {}))
                low = name == "max_len" and _lower_bound(by_key.get((model, reference), {}))
                interval = None
                if name != "max_len" and value is not None:
                    interval = figure(run, model, method, name.replace("_ratio_", "_interval_"), reference)
                met = (
                    interval_verdict(interval, relation, bound)
                    if interval
                    else verdict(value, relation, bound, low, high)
                )
                rows.append(
                    {
                        "config": config,
                        "model": model,
                        "target": what,
                        "value": value,
                        "bound": bound,
                        "relation": relation,
                        "met": met,
                        "interval": interval,
                        "from_lower_bound": high or low,
                    }
                )
    return rows


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _length(summary: dict) -> str:
    if summary.get("status") != "ok":
        return f"failed ({summary.get('failed_at')})"
    search = summary.get("search") or {}
    if search.get("max_len") is None:
        return "none fits" if search.get("first_over") else "—"
    text = str(search["max_len"])
    if search.get("first_over"):
        text += f" (< {search['first_over']})"
    if search.get("capped_at_model_limit") or not search.get("first_over"):
        text += " (lower bound)"
    return text


def table(report: dict) -> list[str]:
    lines = [
        "| config | model | method | max length | vs Ulysses | vs SP | vs DDP | peak MiB at headline "
        "| step ms | vs Ulysses (paired) | vs SP (paired) | vs ALST-style (paired) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config, run in report["configs"].items():
        if "summary" not in run:
            lines.append(f"| {config} | | {next(iter(run.values()))} | | | | | | | | | |")
            continue
        headline, timed = str(run["settings"]["headline_len"]), _timed(run)
        for s in run["summary"]:
            model, method = s["model"], s["method"]
            row = timed.get((model, method), {})
            # a row the timing launch did not run keeps its own launch's ratios, not its step time (another
            # launch, maybe another load on the host)
            own = "*" if row.get("own") else ""
            step = "—" if own or row.get("median_step_s") is None else f"{row['median_step_s'] * 1e3:.0f}"
            peak = s.get("peak_bytes", {}).get(headline)
            lines.append(
                f"| {config} | {model} | {s['label']} | {_length(s)} | "
                f"{_x(figure(run, model, method, 'max_len', 'ulysses'))} | "
                f"{_x(figure(run, model, method, 'max_len', 'sp'))} | "
                f"{_x(figure(run, model, method, 'max_len', 'ddp'))} | "
                f"{'—' if peak is None else f'{peak / MiB:.1f}'} | {step} | "
                f"{_paired(row, 'ulysses', own)} | {_paired(row, 'sp', own)} | {_paired(row, 'alst', own)} |"
            )
    for config in CONFIGS:
        if config not in report["configs"]:
            lines.append(f"| {config} | | not run | | | | | | | | | |")
    return lines


def _paired(row: dict, reference: str, mark: str = "") -> str:
    """A paired ratio with its 95% interval, where it has one."""
    value = row.get(f"paired_ratio_vs_{reference}")
    if value is None:
        return "—"
    interval = interval_text(row.get(f"paired_interval_vs_{reference}"))
    return _x(value) + mark + (f" ({interval})" if interval else "")


def target_table(report: dict) -> list[str]:
    lines = ["| config | model | target | measured | bound | met |", "|---|---|---|---:|---:|---|"]
    for row in targets(report):
        interval = interval_text(row.get("interval"))
        if row["met"] is None and row["value"] is None:
            met = "n/a"
        elif row["met"] is None:
            why = f"the 95% interval {interval} spans the bound" if interval else "a length is a lower bound"
            met = f"undecided ({why})"
        else:
            met = "yes" if row["met"] else "**no**"
        value = _x(row["value"])
        if row.get("from_lower_bound") and row["value"] is not None:
            value += " (from a lower bound)"
        elif interval:
            value += f" (95%: {interval})"
        lines.append(
            f"| {row['config']} | {row['model']} | {row['target']} | {value} | "
            f"{row['relation']} {row['bound']:.2f}x | {met} |"
        )
    for config in CONFIGS:
        if config not in report["configs"]:
            lines.append(f"| {config} | | every target | not run | | n/a |")
    return lines


def settings_line(report: dict) -> str:
    runs = [run for run in report["configs"].values() if "settings" in run]
    if not runs:
        return "No configuration ran."
    st, m = runs[0]["settings"], report["machine"]
    budgets = ", ".join(
        f"{run['settings']['budget_mib']:.0f} MiB ({config})"
        for config, run in report["configs"].items()
        if "settings" in run
    )
    models = "; ".join(
        f"`{name}` {spec['family']}, {spec['layers']} layers, hidden {spec['hidden']}, {spec['heads']} heads"
        + ("" if spec["kv_heads"] == spec["heads"] else f" ({spec['kv_heads']} KV)")
        + f", {spec['parameters'] / 1e6:.2f}M parameters"
        for name, spec in runs[0]["models"].items()
    )
    codes = ", ".join(
        f"{config} {_commits(run)}" for config, run in report["configs"].items() if "settings" in run
    )
    return (
        f"Per-rank budget {budgets} over each step's allocator peak (CPU: c10 allocator "
        f"high-water mark of the step; parameters held before it are not counted), batch {st['batch_size']}, "
        f"compiler `{st['compiler']}`, {st['threads']} torch thread(s) per rank, {_timing_text(report)}. "
        f"Models: {models}. "
        f"{m['cpu_count']} CPUs, torch {m['torch']}, DeepSpeed {m.get('deepspeed')}; "
        f"code per configuration (per model where it was rerun in parts): {codes} "
        "(`benchmarks/results/trainability/<config>[.<models>].json` has each launch's command)."
    )


def _timing_text(report: dict) -> str:
    """Where the step times come from: the search launches' rounds, or each configuration's timing launch."""
    runs = {config: run for config, run in report["configs"].items() if "settings" in run}
    headline = next(iter(runs.values()))["settings"]["headline_len"]
    timed = {config: run["timing"] for config, run in runs.items() if "timing" in run}
    if not timed:
        rounds = sorted({run["settings"]["repeats"] for run in runs.values()})
        return f"step times at {headline} tokens ({'/'.join(map(str, rounds))} rounds, in the same launches)"
    which = ", ".join(f"{config} {t['repeats']} rounds at {_commit(t)}" for config, t in timed.items())
    untimed = [config for config in runs if config not in timed]
    rest = f"; {', '.join(untimed)} from its own launch" if untimed else ""
    return (
        f"step times at {headline} tokens from a timing launch per configuration, methods alternating "
        f"round by round (no search; {which}{rest}), paired ratios with their 95% interval; a ratio marked "
        "* is of a method that launch did not run: from its own launch, against that launch's Ulysses and SP"
    )


def _commit(part: dict) -> str:
    return ((part.get("code") or {}).get("commit") or "?")[:10]


def _commits(run: dict) -> str:
    """The commit of a configuration's run or, where it was run in parts, each commit once with its models."""
    if "parts" not in run:
        return _commit(run)
    models: dict[str, list[str]] = {}
    for part in run["parts"]:
        models.setdefault(_commit(part), []).extend(part["models"])
    return ", ".join(f"{commit} ({' '.join(names)})" for commit, names in models.items())


def render_markdown(report: dict) -> str:
    lines = [
        "# Trainability",
        "",
        f"`{report['command']}`",
        "",
        settings_line(report),
        "",
        *table(report),
        "",
        *target_table(report),
        "",
        "Each configuration's own launch:",
        "",
        *commands(report),
    ]
    for config, run in report["configs"].items():
        for s in run.get("summary", []):
            if s.get("status") == "failed":
                lines += ["", f"{config}, {s['model']}, {s['label']}: `{(s.get('error') or '')[:300]}`"]
    return "\n".join(lines) + "\n"


def commands(report: dict) -> list[str]:
    lines = []
    for config in CONFIGS:
        run = report["configs"].get(config)
        if run is None:
            lines.append(f"- {config}: not run")
        elif "command" in run:
            for part in run.get("parts") or [run]:
                wall, models = part.get("wall_s_worker"), part.get("models")
                which = f" ({', '.join(models)})" if "parts" in run else ""
                took = "" if wall is None else f" ({wall:.0f} s)"
                lines.append(f"- {config}{which}: `{part['command']}`{took}")
        else:
            lines.append(f"- {config}: {next(iter(run.values()))}")
        if run is not None and "timing" in run:
            timing, took = run["timing"], run["timing"].get("wall_s_worker")
            took = "" if took is None else f" ({took:.0f} s)"
            lines.append(f"- {config} (step times): `{timing['command']}`{took}")
    return lines


def readme_section(report: dict) -> str:
    return "\n".join([settings_line(report), "", *table(report), "", *target_table(report)]) + "\n"


def write_outputs(report: dict, out: Path) -> None:
    write_report(report, out, render_markdown)


if __name__ == "__main__":
    sys.exit(main())
