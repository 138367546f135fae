"""What sequence lengths that change from batch to batch cost: 12 steps at 12 distinct lengths against 12
steps at one length with the same total tokens, 2 CPU ranks, sp=2, the strategy's defaults.

    python -m benchmarks.varying_lengths

(from the repository root) starts ``torchrun --standalone --nproc_per_node=2 -m benchmarks.varying_lengths``
itself. Rank 0 writes ``benchmarks/results/varying_lengths.json`` (every figure, the command, the machine)
and ``.md`` (``--render`` regenerates it from the JSON). Options: ``--compiler inductor`` (the default, the
strategy's) or ``aot_eager``, ``--lengths`` (the varied ones; the fixed length is their mean, rounded).

The model is the examples' ``LlamaModule`` (a Hugging Face Llama from its default config, tiny sizes),
trained by ``Trainer.fit`` with ``AutoSPStrategy(sp_size=2)``: what a user with a collator that pads each
batch to its longest sample runs. Per run: the wall time of ``fit``, each step's time (a compile shows as a
long step), and the compiles the strategy counted per (step, length class). The compile caches are off
(``disable_compile_caches``) so no run is served another's (or a previous benchmark's) generated code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    bench_command,
    code_version,
    disable_compile_caches,
    launch_or_work,
    machine_info,
    worker_argv,
)

OUT = RESULTS / "varying_lengths.json"
# 64, 73, 80, 89, ... 153: 12 lengths, odd and even, as a collator's per-batch padding gives
LENGTHS = tuple(n + (n // 8) % 2 for n in range(64, 153, 8))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compiler", choices=["inductor", "aot_eager"], default="inductor")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the JSON and exit")
    return parser.parse_args(argv)


def _batches(lengths: list[int], batch_size: int, seed: int) -> list[dict[str, Any]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 256, (batch_size, n), generator=generator)} for n in lengths]


class _StepTimes:
    """Each training step's wall time (forward, backward and optimizer), by a Lightning callback."""

    def __init__(self) -> None:
        import lightning as L

        times = self.times = []

        class Callback(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                self.start = time.perf_counter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                times.append(time.perf_counter() - self.start)

        self.callback = Callback()


def _fit(lengths: list[int], args: argparse.Namespace) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from examples.models import LlamaModule
    from lightning_autosp import AutoSPStrategy

    torch._dynamo.reset()
    torch.manual_seed(0)
    steps = _StepTimes()
    strategy = AutoSPStrategy(sp_size=args.nproc, compiler=args.compiler)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.nproc,
        max_steps=len(lengths),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[steps.callback],
    )
    loader = DataLoader(_batches(lengths, args.batch_size, seed=len(lengths)), batch_size=None)
    start = time.perf_counter()
    trainer.fit(LlamaModule(), loader)
    wall = time.perf_counter() - start
    return {
        "lengths": lengths,
        "tokens": sum(lengths) * args.batch_size,
        "fit_s": round(wall, 2),
        "step_s": [round(t, 3) for t in steps.times],
        "compiles": {f"{name}@{region}": n for (name, region), n in strategy.compiles.items()},
    }


def work(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    disable_compile_caches()
    fixed = [round(sum(args.lengths) / len(args.lengths))] * len(args.lengths)
    runs = {"fixed": _fit(fixed, args), "varied": _fit(list(args.lengths), args)}
    if dist.get_rank() != 0:
        return
    report = {
        "command": bench_command("benchmarks.varying_lengths", worker_argv(sys.argv[1:])),
        "machine": machine_info(),
        **code_version(),
        "compiler": args.compiler,
        "ranks": args.nproc,
        "runs": runs,
        "varied_over_fixed": round(runs["varied"]["fit_s"] / runs["fixed"]["fit_s"], 2),
    }
    write_report(report, args.out)


def render(report: dict) -> str:
    lines = [
        "| run | lengths | tokens | compiles | fit s | first step s | median later step s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, run in report["runs"].items():
        later = sorted(run["step_s"][1:])
        median = later[len(later) // 2] if later else float("nan")
        shown = f"{min(run['lengths'])}-{max(run['lengths'])}" if name == "varied" else str(run["lengths"][0])
        lines.append(
            f"| {name} | {shown} ({len(set(run['lengths']))} distinct) | {run['tokens']} | "
            f"{sum(run['compiles'].values())} | {run['fit_s']:.1f} | {run['step_s'][0]:.1f} | {median:.2f} |"
        )
    lines += [
        "",
        f"varied / fixed wall time: {report['varied_over_fixed']:.2f}x; {report['ranks']} ranks, "
        f"sp={report['ranks']}, {report['compiler']}, caches off; commit {str(report.get('commit'))[:7]}.",
        f"Command: `{report['command']}`",
    ]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(render(report))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(worker_argv(argv))
    if args.render:
        write_report(json.loads(args.out.read_text()), args.out)
        return 0
    return launch_or_work("benchmarks.varying_lengths", argv, args, write_report=write_report, work=work)


if __name__ == "__main__":
    sys.exit(main())
