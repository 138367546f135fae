"""Where one training step's time goes, kernel by kernel, for two methods side by side.

    python -m benchmarks.kernel_diff                       # llama-tiny, 8 layers, 4096 tokens: sp vs ulysses
    python -m benchmarks.kernel_diff --models gpt-tiny --methods sp ulysses --rounds 6

From the repository root the command starts ``torchrun`` itself (2 CPU ranks, one thread each). Rank 0
writes ``benchmarks/results/kernel_diff.json`` and ``.md``. Models and methods are those of
``benchmarks.run``.

Inductor is asked to name its CPU kernels in the profiler (``cpp.enable_kernel_profile``); a kernel's
name says which ATen ops it fused (``graph_0_cpp_fused_cat_permute_3``), so kernels are grouped by
that name without the graph's and the kernel's index, and the ATen calls Inductor left as calls
(``aten::mm``, SDPA, the collectives) by their own names. Per method and per round, ``--steps`` steps
are profiled and each name's self CPU time per step is summed; rounds alternate between the methods so
that a slow spell of the machine hits both. A difference between the methods is reported as real only
where it exceeds the spread of the two methods' rounds (max - min of each) added together. Unprofiled
step times (min of the rounds) are reported beside, since the profiler's own cost is in the per-kernel
times.

Time inside a collective's wait is the rank waiting for its peer: it moves with whatever made the peer
late, so it is listed but not counted as the collective's cost.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    disable_compile_caches,
    render_or_launch,
    report_header,
    write_report,
)

_LABELS = {"sac": "ours: SP + SAC", "sp": "ours: SP", "ulysses": "hand-written Ulysses"}
_INDEX = re.compile(r"_\d+$")
_GRAPH = re.compile(r"^graph_\d+_")
_GRAPH_CALL = re.compile(r"^## Call CompiledFxGraph \w+ ##$")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama-tiny"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--methods", nargs=2, default=["sp", "ulysses"], help="exactly two: ours, baseline")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="of the parameters"
    )
    parser.add_argument(
        "--autocast", choices=("none", "bfloat16"), default="none", help="bfloat16: bf16-mixed"
    )
    parser.add_argument("--rounds", type=int, default=4, help="profiled rounds per method, alternated")
    parser.add_argument("--steps", type=int, default=2, help="steps per profiled round")
    parser.add_argument("--top", type=int, default=25, help="rows of the table")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "kernel_diff.json")
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    return parser.parse_args(argv)


def kernel_name(key: str) -> str:
    """One name for every instance of a kernel: Inductor's graph and kernel indices and hashes dropped."""
    if _GRAPH_CALL.match(key):
        return "## Call CompiledFxGraph ##"
    return _INDEX.sub("", _GRAPH.sub("", key))


def self_times(profiler: Any, steps: int) -> dict[str, float]:
    """Self CPU milliseconds per step by kernel name, from a finished profile."""
    totals: dict[str, float] = defaultdict(float)
    for event in profiler.key_averages():
        totals[kernel_name(event.key)] += event.self_cpu_time_total / 1000 / steps
    return dict(totals)


# --------------------------------------------------------------------------------------------------
# worker


def worker_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.methods import METHODS, RunContext
    from benchmarks.models import preset

    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    torch.set_num_threads(args.threads)
    disable_compile_caches()
    torch._inductor.config.compile_threads = 1
    torch._inductor.config.cpp.enable_kernel_profile = True
    rank, world = dist.get_rank(), dist.get_world_size()
    autocast = None if args.autocast == "none" else getattr(torch, args.autocast)
    ctx = RunContext(
        rank, world, dist.group.WORLD, torch.device("cpu"), "inductor", getattr(torch, args.dtype), autocast
    )
    start = time.monotonic()
    results: dict[str, dict] = {}
    for model_name in args.models:
        spec = preset(model_name, args.layers)
        generator = torch.Generator().manual_seed(args.seq_len)
        ids = torch.randint(0, spec.vocab_size, (1, args.seq_len), generator=generator)
        prepared = {}
        for name in args.methods:
            method = METHODS[name](spec, ctx)
            prepared[name] = (method, method.prepare(ids).under_autocast(ctx.device, ctx.autocast))
            for _ in range(2):  # compile, then one warm step
                method.model.zero_grad(set_to_none=True)
                prepared[name][1].step()
        per_round: dict[str, list[dict[str, float]]] = {name: [] for name in args.methods}
        step_ms: dict[str, list[float]] = {name: [] for name in args.methods}
        for _ in range(args.rounds):
            for name, (method, step) in prepared.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    method.model.zero_grad(set_to_none=True)
                    step.step()
                step_ms[name].append((time.perf_counter() - t0) * 1000 / args.steps)
                dist.barrier()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(args.steps):
                        method.model.zero_grad(set_to_none=True)
                        step.step()
                per_round[name].append(self_times(prof, args.steps))
        results[model_name] = {"kernels_ms": per_round, "step_ms": step_ms}
        if rank == 0:
            mins = ", ".join(f"{name} {min(ms):.0f} ms" for name, ms in step_ms.items())
            print(f"[{time.monotonic() - start:5.0f} s] {model_name}: {mins}", flush=True)
        del prepared
        torch._dynamo.reset()
    gathered: list | None = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if rank == 0:
        report = {**report_header("benchmarks.kernel_diff", args, start), "per_rank": gathered}
        write_outputs(report, args.out)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# report


def compare(rounds_a: list[dict[str, float]], rounds_b: list[dict[str, float]]) -> list[dict]:
    """Per kernel name: the least per-step time of each method's rounds, their spreads, the difference."""
    rows = []
    for name in set().union(*rounds_a, *rounds_b):
        a = [r.get(name, 0.0) for r in rounds_a]
        b = [r.get(name, 0.0) for r in rounds_b]
        spread = (max(a) - min(a)) + (max(b) - min(b))
        diff = min(a) - min(b)
        rows.append({"kernel": name, "a": min(a), "b": min(b), "diff": diff, "spread": spread})
    return sorted(rows, key=lambda row: -abs(row["diff"]))


def _is_wait(kernel: str) -> bool:
    return "wait" in kernel.lower() or kernel.startswith("gloo:")


def render_markdown(report: dict) -> str:
    settings = report["settings"]
    a, b = settings["methods"]
    lines = [
        f"# One step, kernel by kernel: {_LABELS.get(a, a)} against {_LABELS.get(b, b)}",
        "",
        f"`{report['command']}`; {settings['nproc']} ranks (gloo, CPU, {settings['threads']} thread each), "
        f"{settings['layers']} layers, {settings['seq_len']} tokens, batch 1, {settings['dtype']}"
        f"{' under bf16 autocast' if settings.get('autocast', 'none') != 'none' else ''}, Inductor; "
        f"{settings['rounds']} rounds x {settings['steps']} steps per method, alternated; code "
        f"{report['code']['commit'][:10]}"
        f"{' (uncommitted changes)' if report['code']['lightning_autosp_uncommitted_changes'] else ''}.",
        "Self CPU ms per step (least of the rounds); `real` where the difference exceeds both methods' "
        "round-to-round spread added. Waits on a collective are the rank idling for its peer.",
        "",
    ]
    for model in report["per_rank"][0]:
        for rank, per_rank in enumerate(report["per_rank"]):
            result = per_rank[model]
            step_a, step_b = min(result["step_ms"][a]), min(result["step_ms"][b])
            rows = compare(result["kernels_ms"][a], result["kernels_ms"][b])
            work = [row for row in rows if not _is_wait(row["kernel"])]
            lines += [
                f"## {model}, rank {rank}",
                "",
                f"Unprofiled step: {a} {step_a:.1f} ms, {b} {step_b:.1f} ms ({step_a / step_b:.3f}x). "
                f"Self time outside waits: {a} {sum(r['a'] for r in work):.1f} ms, "
                f"{b} {sum(r['b'] for r in work):.1f} ms.",
                "",
                f"| kernel | {a} | {b} | {a} - {b} | spread | |",
                "|---|---:|---:|---:|---:|---|",
            ]
            for row in rows[: settings["top"]]:
                real = abs(row["diff"]) > row["spread"]
                mark = "wait" if _is_wait(row["kernel"]) else ("real" if real else "")
                lines.append(
                    f"| `{row['kernel']}` | {row['a']:.2f} | {row['b']:.2f} | {row['diff']:+.2f} | "
                    f"{row['spread']:.2f} | {mark} |"
                )
            lines.append("")
    return "\n".join(lines)


def write_outputs(report: dict, out: Path) -> None:
    write_report(report, out, render_markdown)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return render_or_launch("benchmarks.kernel_diff", argv, parse_args, write_outputs, worker_main)


if __name__ == "__main__":
    sys.exit(main())
