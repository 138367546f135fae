"""Per-rank memory under ``AutoSPStrategy(data_parallel="fsdp")`` against ``"ddp"`` (CPU, gloo, sp=2).

    python -m benchmarks.fsdp_memory [--ranks 2] [--steps 4] [--seq-len 512] [--precision 32-true]

(from the repository root) runs one ``torchrun --standalone`` job per mode, each training an HF Llama from a
config (about 45M parameters: vocabulary 32000, hidden 512, 4 layers, 8 heads, 4 KV heads) with AdamW under
sp=2 (dp = ranks / 2). Per rank, after the last step: the bytes held for parameters, gradients and optimizer
state (``lightning_autosp.fsdp.local_state_bytes``: the local shards under fsdp), and the process's peak RSS
(coarse: it includes the Python and torch baseline and the activations). Writes
``benchmarks/results/fsdp_memory.json`` and ``.md``.

The state figures are what persists between steps; the in-step allocator peak is the high-water mark of
what the last step allocates (activations, gathered parameters, unsharded gradients, DDP's buckets). With
``fsdp_gather="per_use"`` (the default) each parameter is all-gathered where the step uses it and again in
backward; with ``"per_step"`` FSDP2 gathers the whole module around the step (Note [FSDP units under a
compiled step] in ``lightning_autosp/fsdp.py``), so that peak holds the whole parameters and gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, MiB
from benchmarks.measure import collective_bytes, cpu_allocation_peak

# data_parallel="fsdp" gathers each parameter where the step uses it ("per_use", the default) or the whole
# module around the step as one FSDP2 unit ("per_step").
MODES = {
    "ddp": {"data_parallel": "ddp"},
    "fsdp": {"data_parallel": "fsdp"},
    "fsdp_per_step": {"data_parallel": "fsdp", "fsdp_gather": "per_step"},
}
LLAMA = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)


COLLECTIVE_COLUMNS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="processes (sp=2, dp=ranks/2)")
    parser.add_argument("--steps", type=int, default=4, help="steps; the peak is the least of steps 2..")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--precision", default="32-true", help="Lightning's precision, e.g. bf16-mixed")
    parser.add_argument("--out", type=Path, default=RESULTS / "fsdp_memory.json")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_autosp import AutoSPStrategy
    from lightning_autosp.fsdp import local_state_bytes

    class LitLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = LlamaConfig(**LLAMA, attn_implementation="sdpa")
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class StateBytes(L.Callback):
        """State bytes after each step; the allocator's in-step peak (under the profiler) of every step
        after the first (the compile), the least of them: a tensor freed on a gloo thread has no free
        event, so one step can over-count (``benchmarks.measure.profiled_step``)."""

        step_peak = float("inf")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step >= 1:
                self.profiler = torch.profiler.profile(profile_memory=True, record_shapes=True)
                self.profiler.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.bytes = local_state_bytes(pl_module, trainer.optimizers)
            self.loss = float(outputs["loss"])
            if trainer.global_step >= 2:
                self.profiler.__exit__(None, None, None)
                self.step_peak = min(self.step_peak, cpu_allocation_peak(self.profiler))
                self.collectives = collective_bytes(self.profiler)

    torch.manual_seed(0)
    world = int(os.environ["WORLD_SIZE"])
    dp = world // 2
    samples = [
        {"input_ids": torch.randint(0, LLAMA["vocab_size"], (args.seq_len,))} for _ in range(dp * args.steps)
    ]
    state = StateBytes()
    module = LitLlama()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        precision=args.precision,
        strategy=AutoSPStrategy(sp_size=2, compiler="aot_eager", **MODES[args.worker]),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[state],
    )
    start = time.perf_counter()
    trainer.fit(module, torch.utils.data.DataLoader(samples, batch_size=1))
    record = {
        **state.bytes,
        "step_peak": state.step_peak,
        "collective_bytes": state.collectives,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "last_loss": state.loss,
        "fit_s": round(time.perf_counter() - start, 1),
    }
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, record)
    if dist.get_rank() == 0:
        parameters = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**LLAMA)).parameters())
        partial = {"mode": args.worker, "world": world, "parameters": parameters, "ranks": gathered}
        Path(f"{args.out}.{args.worker}").write_text(json.dumps(partial, indent=1))


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    command = "python -m benchmarks.fsdp_memory" + (" " + " ".join(argv) if argv else "")
    runs = {}
    for mode in MODES:
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.ranks}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        call = [*torchrun, "-m", "benchmarks.fsdp_memory", *argv, "--worker", mode]
        rc = subprocess.run(call, cwd=ROOT, env=env).returncode
        if rc:
            return rc
        partial = Path(f"{args.out}.{mode}")
        runs[mode] = json.loads(partial.read_text())
        partial.unlink()
    report = {
        "command": command,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "precision": args.precision,
        "llama": LLAMA,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


def planned_step_peak(mode: str, world: int, report: dict) -> int:
    """``lightning_autosp.plan``'s step peak for this run, less DDP's buckets (allocated before the step
    and not counted in the measured column). AdamW on CPU is PyTorch's for-loop implementation."""
    from transformers import LlamaConfig

    from lightning_autosp.planning.planner import Setup, model_shape, step_memory

    shape = model_shape(LlamaConfig(**report["llama"]))
    setup = Setup(
        2,
        world,
        precision=report.get("precision", "32-true"),
        compiler="aot_eager",
        optimizer_impl="for_loop",
        **MODES[mode],
    )
    memory = step_memory(shape, setup, report["seq_len"])
    return memory.total - (memory.params if setup.data_parallel == "ddp" else 0)


def render_markdown(report: dict) -> str:
    runs = report["runs"]
    first = next(iter(runs.values()))
    lines = [
        f"Per-rank memory, HF Llama ({first['parameters'] / 1e6:.1f}M parameters), AdamW, sp=2 on "
        f"{first['world']} CPU ranks, {report['seq_len']} tokens, {report.get('precision', '32-true')}, "
        f"after step {report['steps']}. In-step peak: the least over steps 2 to {report['steps']}; "
        "collectives: MiB each rank passes in one step (the input; gloo runs a reduce-scatter as an "
        "all-reduce). "
        f"`{report['command']}`",
        "",
        "| data_parallel | rank | params MiB | grads MiB | optimizer MiB | sum MiB | vs ddp "
        "| in-step allocator peak MiB | + params + optimizer MiB | planned | error | peak RSS MiB "
        "| all-gather | reduce-scatter | all-reduce | all-to-all |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ddp = runs.get("ddp")
    for mode, run in runs.items():
        for rank, record in enumerate(run["ranks"]):
            total = record["params"] + record["grads"] + record["optimizer"]
            sent = record.get("collective_bytes", {})
            # held through the step besides what it allocates (ddp also holds its gradient buckets)
            step_peak = record["params"] + record["optimizer"] + record["step_peak"]
            planned = planned_step_peak(mode, first["world"], report)
            base = ddp["ranks"][rank] if ddp else record
            base_total = base["params"] + base["grads"] + base["optimizer"]
            lines.append(
                f"| {mode} | {rank} | {record['params'] / MiB:.1f} | {record['grads'] / MiB:.1f} | "
                f"{record['optimizer'] / MiB:.1f} | {total / MiB:.1f} | {total / base_total:.2f}x | "
                f"{record['step_peak'] / MiB:.0f} | {step_peak / MiB:.0f} | {planned / MiB:.0f} | "
                f"{(planned - step_peak) / step_peak:+.0%} | {record['peak_rss'] / MiB:.0f} | "
                + " | ".join(f"{sent.get(name, 0) / MiB:.1f}" for name in COLLECTIVE_COLUMNS)
                + " |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
