"""The report of ``benchmarks.sac``: every rank's figures gathered into one JSON, and its Markdown table.

The measurement is ``benchmarks/sac.py``'s; this module only assembles and renders (``python -m benchmarks.sac
--render`` rewrites the table from the JSON alone).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import MiB, bench_command, machine_info

# The target for SAC: at most this share of SP alone's saved bytes, for at most this step time.
TARGET = {"model": "gpt", "seq_len": 4096, "saved_ratio": 0.25, "time_ratio": 1.10}


def assemble(args, gathered, methods, models, deepspeed, checks, elapsed) -> dict:
    ranks = sorted(gathered, key=lambda r: r["rank"])
    results = []
    for index, config in enumerate(ranks[0]["configs"]):
        for method in methods:
            per_rank = [r["configs"][index]["methods"][method] for r in ranks]
            sp = [r["configs"][index]["methods"]["sp"] for r in ranks]
            saved = max(f["saved_bytes"] for f in per_rank)
            step = max(f["median_step_s"] for f in per_rank)
            results.append(
                {
                    "model": config["model"],
                    "seq_len": config["seq_len"],
                    "method": method,
                    "saved_bytes_per_rank": saved,
                    "saved_ratio_vs_sp": saved / max(f["saved_bytes"] for f in sp),
                    "median_step_s": step,
                    "time_ratio_vs_sp": step / max(f["median_step_s"] for f in sp),
                    "paired_time_ratio_vs_sp": max(f["paired_time_ratio_vs_sp"] for f in per_rank),
                    "min_step_s": max(f["min_step_s"] for f in per_rank),
                    "alloc_peak_bytes": max(f["alloc_peak_bytes"] for f in per_rank),
                    "alloc_peak_ratio_vs_sp": max(f["alloc_peak_bytes"] for f in per_rank)
                    / max(f["alloc_peak_bytes"] for f in sp),
                    "alloc_end_of_forward_bytes": max(f["alloc_end_of_forward_bytes"] for f in per_rank),
                    "rss_peak_delta_bytes": max((f["rss_peak_delta_bytes"] or 0) for f in per_rank),
                    "loss_rel_err_vs_sp": max(f["loss_rel_err_vs_sp"] for f in per_rank),
                    "grad_rel_err_vs_sp": max(f["grad_rel_err_vs_sp"] for f in per_rank),
                    "loss_rel_err_vs_eager": max(f["loss_rel_err_vs_eager"] for f in per_rank),
                    "grad_rel_err_vs_eager": max(f["grad_rel_err_vs_eager"] for f in per_rank),
                    "hook_check_ok": all(f["hook_check"]["ok"] for f in per_rank),
                    "recompiled_during_measurement": any(
                        f["recompiled_during_measurement"] for f in per_rank
                    ),
                    "per_rank": per_rank,
                }
            )
    return {
        "command": bench_command("benchmarks.sac", sys.argv[1:]),
        "machine": machine_info(),
        "settings": {
            "ranks": len(ranks),
            "sp_size": len(ranks),
            "backend": "gloo",
            "compiler": args.compiler,
            "batch_size": args.batch_size,
            "dtype": "float32",
            "repeats": args.repeats,
            "torch_threads_per_rank": [r["threads"] for r in ranks],
            "methods": methods,
            "models": models,
        },
        "deepspeed_sac": deepspeed,
        "memtracker_check": checks.get("memtracker"),
        "target": TARGET,
        "wall_s_worker": round(elapsed, 1),
        "results": results,
    }


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(render_markdown(report))


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MiB:.2f}"


def _recomputed(r: dict) -> str:
    parts = [part for f in r["per_rank"] for part in f["partitions"]]
    attention = max((part["recomputed_attention"] for part in parts), default="?")
    collectives = max((part["recomputed_collectives"] for part in parts), default="?")
    return f"{attention} / {collectives}"


def _method(r: dict) -> str:
    flags = ("" if r["hook_check_ok"] else " (hook check failed)") + (
        " (recompiled!)" if r["recompiled_during_measurement"] else ""
    )
    return r["method"] + flags


# (header, right-aligned, cell)
COLUMNS: list[tuple[str, bool, Callable[[dict], str]]] = [
    ("model", False, lambda r: r["model"]),
    ("seq", True, lambda r: str(r["seq_len"])),
    ("method", False, _method),
    ("saved for bw MiB/rank", True, lambda r: _mib(r["saved_bytes_per_rank"])),
    ("vs sp", True, lambda r: f"{r['saved_ratio_vs_sp']:.2f}x"),
    ("step ms (min)", True, lambda r: f"{r['median_step_s'] * 1e3:.0f} ({r['min_step_s'] * 1e3:.0f})"),
    (
        "vs sp (paired)",
        True,
        lambda r: f"{r['time_ratio_vs_sp']:.2f}x ({r['paired_time_ratio_vs_sp']:.2f}x)",
    ),
    ("peak MiB", True, lambda r: _mib(r["alloc_peak_bytes"])),
    ("vs sp", True, lambda r: f"{r['alloc_peak_ratio_vs_sp']:.2f}x"),
    ("live after fw MiB", True, lambda r: _mib(r["alloc_end_of_forward_bytes"])),
    ("peak RSS Δ MiB", True, lambda r: _mib(r["rss_peak_delta_bytes"])),
    (
        "parity vs sp (loss / grad)",
        False,
        lambda r: f"{r['loss_rel_err_vs_sp']:.1e} / {r['grad_rel_err_vs_sp']:.1e}",
    ),
    (
        "vs eager (loss / grad)",
        False,
        lambda r: f"{r['loss_rel_err_vs_eager']:.1e} / {r['grad_rel_err_vs_eager']:.1e}",
    ),
    ("recomputed attn / coll", False, _recomputed),
]

NOTES = [
    "saved for bw: distinct storages packed by `saved_tensors_hooks` during the compiled step's forward, "
    "parameters excluded; max over ranks. The hook sees AOTAutograd's `ctx.save_for_backward`; every "
    "row is checked against `grad_fn.saved_tensors` of the `CompiledFunctionBackward` node (rows that "
    "fail are marked).",
    "step ms: median (min) of forward+backward over the alternating repeats, max over ranks. vs sp: "
    "ratio of the medians, and in brackets the median of the per-repeat ratios (each step against the "
    "sp step of the same repeat: robust to the machine's load drifting during the run).",
    "peak: high-water mark of the bytes the c10 CPU allocator handed out during one step (forward + "
    "backward, gradients included) and still held, from the profiler's allocation events; least of 3 "
    "steps, as frees on gloo's threads go unrecorded. live after fw: those bytes when the forward "
    "returns. peak RSS Δ: process VmHWM above VmRSS at the step's start, after `malloc_trim` (coarse: "
    "malloc arenas, gloo buffers).",
    "parity: max relative error (max|a-b| / max|b|) of the loss and of every parameter's gradient, per "
    "rank, against `sp`; vs eager: rank-averaged gradients against one single-process eager step on "
    "the whole sequence. recomputed attn / coll: attention ops and collectives the partitioner "
    "recomputes in backward (`AOT_PARTITIONER_DEBUG`'s count of rematerialized ops).",
]


def render_markdown(report: dict) -> str:
    settings, machine = report["settings"], report["machine"]
    wall = f"worker wall time {report['wall_s_worker']:.0f} s"
    if "wall_s_launcher" in report:
        wall += f", launcher {report['wall_s_launcher']:.0f} s"
    lines = [
        "# Sequence-aware activation checkpointing (SAC) vs SP without SAC",
        "",
        "Generated by `benchmarks/sac.py` from the JSON file of the same name. "
        f"Command: `{report['command']}`  ",
        f"{settings['ranks']} ranks (sp={settings['sp_size']}, {settings['backend']}, CPU), compiler "
        f"`{settings['compiler']}`, batch {settings['batch_size']}, {settings['dtype']}, "
        f"{settings['torch_threads_per_rank'][0]} torch thread(s) per rank, {settings['repeats']} timed "
        f"repeats; {machine['platform']}, {machine['cpu_count']} CPUs, torch {machine['torch']}; {wall}; "
        f"load average {machine.get('loadavg_at_start')} at start, {machine.get('loadavg_at_end')} at end.",
        "",
        "| " + " | ".join(header for header, _, _ in COLUMNS) + " |",
        "|" + "|".join("---:" if right else "---" for _, right, _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(cell(r) for _, _, cell in COLUMNS) + " |" for r in report["results"]]

    target = report["target"]
    lines.append("")
    for r in report["results"]:
        if (r["model"], r["seq_len"], r["method"]) != (target["model"], target["seq_len"], "sac"):
            continue
        saved_ok = r["saved_ratio_vs_sp"] <= target["saved_ratio"]
        time_ok = max(r["time_ratio_vs_sp"], r["paired_time_ratio_vs_sp"]) <= target["time_ratio"]
        lines.append(
            f"Target ({target['model']}, seq {target['seq_len']}, sp={settings['sp_size']}: SAC <= "
            f"{target['saved_ratio']}x the saved bytes for <= {target['time_ratio']}x the step time): saved "
            f"{r['saved_ratio_vs_sp']:.2f}x ({'met' if saved_ok else 'not met'}), time "
            f"{r['time_ratio_vs_sp']:.2f}x median / {r['paired_time_ratio_vs_sp']:.2f}x paired "
            f"({'met' if time_ok else 'not met'}): **{'met' if saved_ok and time_ok else 'not met'}**."
        )

    rows = [
        r for r in report["results"] if (r["model"], r["seq_len"]) == (target["model"], target["seq_len"])
    ]
    if rows:
        lines += [
            "",
            f"What the partitioner saves at {target['model']} seq {target['seq_len']} (rank 0, MiB, by the "
            "op that produced each saved value, from `AOT_PARTITIONER_DEBUG`):",
            "",
        ]
        for r in rows:
            for part in r["per_rank"][0]["partitions"]:
                by_op = ", ".join(f"{op} {size / MiB:.2f}" for op, size in part["saved_bytes_by_op"].items())
                lines.append(f"- {r['method']}: {by_op}")

    notes = list(NOTES)
    mt = report.get("memtracker_check")
    if mt:
        notes.append(
            "MemTracker is not used: under it the compiled step's loss had grad_fn "
            f"`{mt['loss_grad_fn_under_memtracker']}`, and `{mt['loss_grad_fn_after_memtracker']}` after "
            "it: Dynamo skips frames while a TorchDispatchMode is active, and keeps running that code "
            "eagerly (no SP pass) until `torch._dynamo.reset()`."
        )
    ds = report["deepspeed_sac"]
    if ds.get("available"):
        notes.append(
            f"ds_sac: DeepSpeed {ds.get('deepspeed')}'s `register_long_context_checkpointing()` splice of "
            "`torch._functorch.partitioners.solve_min_cut`, in place for that method's compile only, on "
            "the same SP graph (untagged). Its ban list names CUDA attention ops, not "
            "`_scaled_dot_product_flash_attention_for_cpu`, and it lets every op outside torch's "
            "recomputable allowlist be recomputed (matmuls, but also CPU attention and the autosp "
            "collectives): on CPU it recomputes attention and all-to-alls in backward."
        )
    else:
        notes.append(f"ds_sac not measured: {ds.get('reason')}")
    lines += ["", "Notes:", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"
