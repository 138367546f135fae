"""sp larger than the heads (Ulysses x ring) against the Ulysses-only limit, on 4 CPU ranks (gloo).

    python -m benchmarks.ring [--seq-lens 2048 4096] [--steps 4]

(from the repository root) relaunches itself as 4 ``torchrun --standalone`` workers (one thread each) that
train an HF Llama from a config (hidden 128, 2 layers, 2 q heads, 1 KV head, intermediate 256, vocabulary
256, SDPA) under ``AutoSPStrategy(compiler="aot_eager")``, fp32, batch 1, in four configurations one after
the other:

- ``ulysses_sp2``: ``sp_size=2`` (dp=2), all-to-all only: 2 q heads cap Ulysses at sp=2;
- ``ring_zigzag``: ``sp_size=4, ulysses_degree="auto"`` (Ulysses 2 x ring 2), ``ring_layout="zigzag"``;
- ``ring_contiguous``: the same with ``ring_layout="contiguous"``;
- ``all_ring_zigzag``: ``sp_size=4, ulysses_degree=1`` (ring 4), zigzag.

Every dp group trains on the same sequence, so all configurations see the same tokens and their first-step
loss should equal a single-process eager loss of the same model (computed on rank 0). SGD with lr=0 keeps
the weights fixed. Per rank: the tokens it holds, the bytes autograd saved for backward during the last
step (``saved_tensors_hooks``, parameter storages excluded), and over the steps after the first (which
compiles) the median wall time of a step and the median CPU time of the process in a step. Ranks wait for
each other in every collective, so wall times come out nearly equal across ranks; CPU time leaves out the
waits (gloo blocks, it does not spin) and shows how evenly the causal attention work is spread (zigzag vs
contiguous). Writes ``benchmarks/results/ring.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    RESULTS,
    bench_command,
    code_version,
    is_bench_worker,
    machine_info,
    relaunch_under_torchrun,
    worker_argv,
)

MiB = 2**20
RANKS = 4
LLAMA = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)
CONFIGS = {
    "ulysses_sp2": {"sp_size": 2},
    "ring_zigzag": {"sp_size": 4, "ulysses_degree": "auto", "ring_layout": "zigzag"},
    "ring_contiguous": {"sp_size": 4, "ulysses_degree": "auto", "ring_layout": "contiguous"},
    "all_ring_zigzag": {"sp_size": 4, "ulysses_degree": 1, "ring_layout": "zigzag"},
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--steps", type=int, default=4, help="steps per configuration; the first compiles")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=RESULTS / "ring.json")
    return parser.parse_args(argv)


def make_model(seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA, max_position_embeddings=seq_len, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def eager_loss(seq_len: int, ids) -> float:
    import torch

    torch.manual_seed(0)
    model = make_model(seq_len)
    with torch.no_grad():
        return model(input_ids=ids[None], labels=ids[None]).loss.item()


def run_config(name: str, seq_len: int, steps: int, ids) -> dict:
    """One ``trainer.fit`` of ``steps`` steps under ``CONFIGS[name]``; this rank's record."""
    import lightning as L
    import torch

    from lightning_autosp import AutoSPStrategy

    class LitLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(seq_len)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Probe(L.Callback):
        """Per step: wall and process CPU seconds, tokens held, bytes saved for backward."""

        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []
            self.losses: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.tokens = batch["input_ids"].shape[1]
            self.params = {p.untyped_storage().data_ptr() for p in pl_module.parameters()}
            self.saved: dict[int, int] = {}
            self.shapes: dict[int, str] = {}
            self.square: set[int] = set()  # [..., S, S] at the global length S: attention masks

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in self.params:
                    self.saved[storage.data_ptr()] = storage.nbytes()
                    self.shapes[storage.data_ptr()] = f"{tuple(tensor.shape)} {tensor.dtype}"
                    if tuple(tensor.shape[-2:]) == (seq_len, seq_len):
                        self.square.add(storage.data_ptr())
                return tensor

            self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
            self.hooks.__enter__()
            self.start = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            wall, cpu = time.perf_counter(), time.process_time()
            self.hooks.__exit__(None, None, None)
            self.wall.append(wall - self.start[0])
            self.cpu.append(cpu - self.start[1])
            self.losses.append(float(outputs["loss"]))

    torch._dynamo.reset()
    torch.manual_seed(0)
    module = LitLlama()
    strategy = AutoSPStrategy(compiler="aot_eager", **CONFIGS[name])
    probe = Probe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[probe],
    )
    dp = RANKS // CONFIGS[name]["sp_size"]
    samples = [{"input_ids": ids}] * (dp * steps)  # every dp group gets the same sequence
    trainer.fit(module, torch.utils.data.DataLoader(samples, batch_size=1))
    measured = slice(1, None) if steps > 1 else slice(None)
    return {
        "ulysses_degree": strategy.ulysses_degree,
        "ring_degree": strategy.ring_degree,
        "dp": strategy.dp_size,
        "tokens": probe.tokens,
        "saved_bytes": sum(probe.saved.values()),
        "saved_global_square_bytes": sum(probe.saved[ptr] for ptr in probe.square),
        "saved_largest": largest_saved(probe.saved, probe.shapes),
        "explain": strategy.explain(),
        "first_loss": probe.losses[0],
        "losses": probe.losses,
        "step_wall_s": probe.wall,
        "step_cpu_s": probe.cpu,
        "median_wall_s": statistics.median(probe.wall[measured]),
        "median_cpu_s": statistics.median(probe.cpu[measured]),
    }


def largest_saved(saved: dict[int, int], shapes: dict[int, str], count: int = 6) -> list[list]:
    """[shape and dtype of a tensor on the storage, storages, MiB] for the groups holding the most bytes."""
    groups: dict[str, list] = {}
    for ptr, nbytes in saved.items():
        group = groups.setdefault(shapes[ptr], [shapes[ptr], 0, 0.0])
        group[1] += 1
        group[2] += nbytes / MiB
    ranked = sorted(groups.values(), key=lambda group: -group[2])[:count]
    return [[shape, storages, round(mib, 2)] for shape, storages, mib in ranked]


def worker(args: argparse.Namespace, command: str) -> None:
    import torch
    import torch.distributed as dist

    runs = []
    for seq_len in args.seq_lens:
        ids = torch.randint(0, LLAMA["vocab_size"], (seq_len,), generator=torch.Generator().manual_seed(1234))
        reference = eager_loss(seq_len, ids) if int(os.environ["RANK"]) == 0 else None
        for name in args.configs:
            record = run_config(name, seq_len, args.steps, ids)
            gathered: list[dict | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, record)
            runs.append({"config": name, "seq_len": seq_len, "eager_loss": reference, "ranks": gathered})
            if dist.get_rank() == 0:
                print(render_run(runs[-1]), flush=True)
    if dist.get_rank() == 0:
        report = {
            "command": command,
            "compiler": "aot_eager",
            "precision": "fp32",
            "batch_size": 1,
            "steps": args.steps,
            "llama": LLAMA,
            "configs": {name: CONFIGS[name] for name in args.configs},
            "machine": machine_info(),
            **code_version(),
            "runs": runs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(render_markdown(report))
        print(render_markdown(report))


def spread(values: list[float]) -> str:
    return f"{max(values) / min(values):.2f}"


def render_run(run: dict) -> str:
    first = run["ranks"][0]
    walls = [r["median_wall_s"] for r in run["ranks"]]
    cpus = [r["median_cpu_s"] for r in run["ranks"]]
    saved = [r["saved_bytes"] / MiB for r in run["ranks"]]
    square = max(r["saved_global_square_bytes"] for r in run["ranks"]) / MiB
    losses = [r["first_loss"] for r in run["ranks"]]
    eager = run["eager_loss"]
    loss_err = max(abs(loss - eager) / abs(eager) for loss in losses) if eager else float("nan")
    tokens = sorted({r["tokens"] for r in run["ranks"]})
    return (
        f"| {run['seq_len']} | {run['config']} | {first['dp']} x ({first['ulysses_degree']} x "
        f"{first['ring_degree']}) | {'/'.join(map(str, tokens))} | {max(saved):.1f} | {min(saved):.1f} | "
        f"{square:.1f} | "
        f"{statistics.median(walls):.3f} | {spread(walls)} | "
        f"{statistics.median(cpus):.3f} | {spread(cpus)} | "
        f"{losses[0]:.6f} | {loss_err:.1e} |"
    )


def render_markdown(report: dict) -> str:
    machine = report["machine"]
    lines = [
        f"HF Llama from a config ({LLAMA['hidden_size']} hidden, {LLAMA['num_hidden_layers']} layers, "
        f"{LLAMA['num_attention_heads']} q heads, {LLAMA['num_key_value_heads']} KV head, vocabulary "
        f"{LLAMA['vocab_size']}), {RANKS} CPU ranks (gloo, 1 thread each), compiler={report['compiler']}, "
        f"{report['precision']}, batch 1, SGD lr=0, {report['steps']} steps per configuration; times are "
        "medians over the steps after the first (compile). Every dp group trains on the same sequence.",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {machine['processor']}, {machine['cpu_count']} CPUs ({machine['cpu_affinity']} usable), "
        f"{machine['memory_gib']} GiB, torch {machine['torch']}, lightning {machine['lightning']}, "
        f"transformers {machine['transformers']}; load average at end {machine['loadavg_at_end']}. "
        f"{RANKS} ranks share these cores (and other jobs), so times are only comparable within this table.",
        "",
        "| seq | config | dp x (ulysses x ring) | tokens/rank | saved for backward MiB, max rank "
        "| min rank | of which S x S MiB | step wall s | wall max/min over ranks | step CPU s "
        "| CPU max/min over ranks "
        "| first-step loss | rel err vs eager |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [render_run(run) for run in report["runs"]]
    lines += [
        "",
        "Step wall and CPU s: the median over ranks of each rank's median step. Wall max/min is close to 1 "
        "by construction (collectives make ranks wait for each other); CPU max/min leaves the waits out and "
        "shows how evenly the work is spread. Saved for backward: storages autograd kept during a step "
        "(torch.autograd.graph.saved_tensors_hooks), parameters excluded; of which S x S: saved tensors "
        "shaped [..., S, S] at the global length S (the attention mask; max over ranks). The largest "
        "saved groups per rank and ``strategy.explain()`` are in the JSON.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = worker_argv(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = bench_command("benchmarks.ring", argv)
    if not is_bench_worker():
        return relaunch_under_torchrun("benchmarks.ring", argv, nproc=RANKS, threads=1, command=command)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    worker(args, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
