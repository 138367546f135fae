"""The memory planner against the step peaks measured by multi-rank launches of ``benchmarks.run``.

    python -m benchmarks.planner_runs benchmarks/results/trainability/sp2-fp32.json ... \
        --out benchmarks/results/planner_vs_runs.md

``benchmarks.planner --peak`` compiles one rank in one process at chosen lengths. The trainability launches
measure more: every rank of a real sp group (gloo), at every length their budget search tried, with the
policies users pick (SAC, ``sac="longest"``, SP alone). This reads those reports and puts the planner's
peak beside each measured one: ``step_memory``'s forward and backward less what is allocated before the
step (parameters, optimizer state, DDP's buckets), as ``benchmarks.planner.compare`` does, for the
report's model, ranks, precision and compiler. Nothing is run; the figures are as the JSON has them (the
max over ranks of the least peak of the profiled steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.planner import allocated_in_step, tiny_gpt, tiny_llama
from lightning_autosp.planning.memory_model import Setup, mlp_tiles, step_memory
from lightning_autosp.planning.model_shapes import ModelShape, model_shape

MiB = 2**20
# this project's methods in benchmarks/methods.py -> (sac, rebuild_attention)
POLICIES = {"sac": (True, False), "longest": (True, True), "sp": (False, False)}


def shape_of(spec: dict) -> ModelShape:
    """The planner's shape of a report's model (``benchmarks/models.py``'s spec)."""
    if spec["family"] == "gpt":
        _, config, _ = tiny_gpt(
            vocab=spec["vocab_size"],
            n_layer=spec["layers"],
            n_head=spec["heads"],
            n_embd=spec["hidden"],
            block_size=spec["max_len"],
        )
        return model_shape(config)
    model, _, _ = tiny_llama(
        vocab=spec["vocab_size"],
        hidden=spec["hidden"],
        intermediate=spec["intermediate"],
        layers=spec["layers"],
        heads=spec["heads"],
        kv=spec["kv_heads"],
    )
    return model_shape(model)


def rows_of(report: dict, name: str) -> list[dict]:
    """Planned against measured, for each of this project's methods at each length it measured."""
    settings = report["settings"]
    precision = "bf16-mixed" if settings.get("autocast") == "bfloat16" else "32-true"
    rows = []
    for summary in report["summary"]:
        if summary["method"] not in POLICIES or summary.get("status") != "ok":
            continue
        sac, rebuild = POLICIES[summary["method"]]
        shape = shape_of(report["models"][summary["model"]])
        setup = Setup(
            settings["nproc"],
            settings["nproc"],
            sac=sac,
            rebuild_attention=rebuild,
            precision=precision,
            compiler=settings["compiler"],
        )
        points = (summary.get("search") or {}).get("points") or summary.get("peak_bytes") or {}
        for length, measured in sorted((int(k), v) for k, v in points.items()):
            planned = allocated_in_step(step_memory(shape, setup, length))
            rows.append(
                {
                    "report": name,
                    "model": summary["model"],
                    "policy": setup.policy,
                    "sp": setup.sp_size,
                    "precision": precision,
                    "seq_len": length,
                    "tiles": mlp_tiles(shape, setup, length),
                    "measured": measured,
                    "planned": planned,
                    "error": (planned - measured) / measured,
                }
            )
    return rows


def at_longest(rows: list[dict]) -> list[dict]:
    """Per (report, model, policy), the row at the longest length measured: the lengths that decide a
    budget search."""
    longest: dict[tuple, dict] = {}
    for r in rows:
        key = (r["report"], r["model"], r["policy"])
        if key not in longest or r["seq_len"] > longest[key]["seq_len"]:
            longest[key] = r
    return list(longest.values())


def render(rows: list[dict], command: str) -> str:
    lines = [
        "# The planner against multi-rank launches",
        "",
        f"`{command}` (nothing run: the peaks are those of the reports named, measured by `benchmarks.run`: "
        "the CPU allocator's high-water mark of one step, gradients included, parameters excluded, max over "
        "ranks; planned: `step_memory` less the parameters, optimizer state and DDP's buckets).",
        "",
        "| report | model | policy | sp | precision | seq | MLP tiles | measured MiB | planned MiB | error |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['report']} | {r['model']} | {r['policy']} | {r['sp']} | {r['precision']} | "
            f"{r['seq_len']} | {r['tiles']} | {r['measured'] / MiB:.1f} | {r['planned'] / MiB:.1f} | "
            f"{r['error']:+.0%} |"
        )
    decisive = [r["error"] for r in at_longest(rows)]
    if decisive:
        every = [r["error"] for r in rows]
        lines += [
            "",
            f"At the longest length each search measured: {min(decisive):+.0%} to {max(decisive):+.0%} "
            f"({len(decisive)} rows); at every length: {min(every):+.0%} to {max(every):+.0%}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="benchmarks.run JSON reports")
    parser.add_argument("--out", type=Path, help="write the table here (.md)")
    args = parser.parse_args(argv)
    rows = [row for path in args.reports for row in rows_of(json.loads(path.read_text()), path.stem)]
    shown = " ".join(sys.argv[1:] if argv is None else argv)
    text = render(rows, f"python -m benchmarks.planner_runs {shown}")
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
