"""The memory planner against measured figures: saved-for-backward bytes, parameters, gradients, optimizer.

    python -m benchmarks.planner --out benchmarks/results/planner.md          # ~6 min on 2 cores
    python -m benchmarks.planner --peak --precisions 32-true bf16-mixed --sp 2 --seq-lens 2048 4096 \
        --chunked-loss yes --out benchmarks/results/planner_peak.md

Each row compiles one rank's training step with ``AutoSPBackend`` (the SP pass, SAC, chunked loss) and
counts the storages that autograd packs during the forward with ``saved_tensors_hooks`` (parameters
excluded), as ``MemoryMonitor`` and ``benchmarks/sac.py`` do. The step runs in one process: the
``autosp`` collectives are answered locally with tensors of the right shapes (``LocalCollectives``),
so the compiled graph, its partition and every saved tensor are those of rank ``rank`` of an sp group
(checked: for the GPT and Llama of ``benchmarks/sac.py`` at 1024 tokens, the same byte counts as its
2-process gloo runs). Parameters, gradients and AdamW state are counted after one optimizer step, as
``MemoryMonitor`` does. ``--peak`` adds the step's CPU allocator high-water mark (profiler events,
``benchmarks.measure.profiled_step``) against the planner's peak less what is allocated before the step
(parameters, optimizer state, DDP buckets). ``--list`` prints every saved tensor (what
Note [What is saved for backward] in ``lightning_autosp/planning/memory_model.py`` is written from).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_autosp.compiler.runtime.ops as ops
from benchmarks.common import completed_work, registered_process_group
from lightning_autosp.callbacks import _storage_bytes
from lightning_autosp.compiler.backend import AutoSPBackend
from lightning_autosp.compiler.sp_pass import SPContext
from lightning_autosp.data import shard_batch
from lightning_autosp.planning.memory_model import MemoryBreakdown
from lightning_autosp.planning.planner import Setup, model_shape, saved_activations, step_memory

MiB = 2**20
LOCAL_GROUP = "local"


class LocalCollectives:
    """Stands in for ``torch.distributed`` inside ``lightning_autosp.compiler.runtime.ops``: every collective
    fills its outputs with this rank's data (shapes exact, values meaningless), so one process runs
    the graph of one rank of an sp group."""

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, group=None) -> None:
        n = min(output.numel(), input.numel())  # no temporaries: they would show in the measured peak
        output.view(-1)[:n].copy_(input.reshape(-1)[:n])
        output.view(-1)[n:].zero_()

    def all_gather(self, tensor_list, tensor, group=None) -> None:
        for out in tensor_list:
            out.copy_(tensor)

    def all_reduce(self, tensor, group=None) -> None:
        pass


class LocalGroup(dist.ProcessGroup):
    """The same for functional collectives, which find their group in c10d's registry."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.local = LocalCollectives()

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self.local.all_to_all_single(output, input, output_split_sizes, input_split_sizes)
        return completed_work(output)

    def allreduce(self, tensors, opts=None):
        return completed_work(tensors)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, tensor in zip(outputs, inputs):
            output.view(-1, *tensor.shape).copy_(tensor)
        return completed_work(outputs)


@contextlib.contextmanager
def local_collectives() -> Iterator[None]:
    with (
        mock.patch.object(ops, "dist", LocalCollectives()),
        mock.patch.object(ops, "_group", lambda n: None),
        registered_process_group([LOCAL_GROUP], LocalGroup()),
    ):
        yield


# --------------------------------------------------------------------------------------------------
# models


def tiny_gpt(vocab: int = 256, n_layer: int = 2, n_head: int = 4, n_embd: int = 64, block_size: int = 64):
    """``examples.models.TinyGPT``, its config dict and its loss step (shift in the step)."""
    from examples.models import TinyGPT

    config = dict(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    torch.manual_seed(0)
    model = TinyGPT(**config)

    def loss_step(batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))

    return model, config, loss_step


def tiny_llama(
    vocab: int = 256, hidden: int = 64, intermediate: int = 128, layers: int = 2, heads: int = 4, kv: int = 2
):
    """A random-init HF ``LlamaForCausalLM`` (SDPA), its config and its loss step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2**16,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)

    def loss_step(batch: dict) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    return model, config, loss_step


# --------------------------------------------------------------------------------------------------
# measurement


@dataclass
class Measured:
    saved_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    saved: list[tuple[tuple[int, ...], torch.dtype]]
    peak_bytes: int | None
    offloaded_bytes: int = 0  # what the forward copied to host memory (offload_activations)


def measure(
    model: nn.Module,
    loss_step: Callable[[dict], torch.Tensor],
    setup: Setup,
    seq_len: int,
    *,
    vocab: int,
    rank: int = 0,
    compiler: str = "aot_eager",
    measure_peak: bool = False,
) -> Measured:
    """Saved-for-backward bytes of rank ``rank``'s compiled step, and params/grads/AdamW after a step."""
    if setup.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    ids = torch.randint(
        0, vocab, (setup.batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len)
    )
    if setup.sp_size > 1:
        batch, shard = shard_batch({"input_ids": ids}, world=setup.sp_size, rank=rank)
        context = SPContext(shard, LOCAL_GROUP)
    else:
        batch, context = {"input_ids": ids}, None
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if setup.precision == "bf16-mixed"
        else contextlib.nullcontext()
    )

    def step(batch: dict) -> torch.Tensor:
        with autocast:
            return loss_step(batch)

    torch._dynamo.reset()
    sac = "longest" if setup.rebuild_attention else setup.sac
    backend = AutoSPBackend(
        context,
        compiler=compiler,
        sac=sac,
        chunked_loss=setup.chunked_loss,
        offload_activations=setup.offload_activations,
    )
    if context is not None:
        backend.mark_sharded(batch["input_ids"])
    compiled = torch.compile(step, backend=backend, dynamic=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor)
        return tensor

    with local_collectives():
        compiled(batch).backward()  # compiles
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = compiled(batch)
        loss.backward()
    peak = None
    if measure_peak:  # the step's allocator high-water mark: activations, workspace and gradients
        from benchmarks.measure import profiled_step

        model.zero_grad(set_to_none=True)
        with local_collectives():
            peak = profiled_step(lambda: compiled(batch))["alloc_peak_bytes"]
    optimizer.step()
    activations = [t for t in packed if t.untyped_storage().data_ptr() not in params]
    state: list[torch.Tensor] = [v for s in optimizer.state.values() for v in s.values()]
    torch._dynamo.reset()
    return Measured(
        saved_bytes=_storage_bytes(activations)[0],
        params_bytes=_storage_bytes(model.parameters())[0],
        grads_bytes=_storage_bytes(p.grad for p in model.parameters() if p.grad is not None)[0],
        # AdamW's per-parameter `step` counters are scalars; the planner counts the two moment tensors.
        optimizer_bytes=_storage_bytes(t for t in state if t.dim() > 0)[0],
        saved=[(tuple(t.shape), t.dtype) for t in activations],
        peak_bytes=peak,
        offloaded_bytes=sum(r.offloaded.bytes for r in backend.sac_reports if r.offloaded is not None),
    )


def allocated_in_step(memory: MemoryBreakdown) -> int:
    """The planned peak of what a profiled step allocates: forward and backward less what is allocated
    before it (the parameters, the optimizer state and DDP's buckets, one copy of the parameters)."""
    return memory.forward_backward - memory.params - memory.optimizer - memory.params


def compare(
    kind: str,
    setup: Setup,
    seq_len: int,
    *,
    rank: int = 0,
    peak: bool = False,
    **shape: Any,
) -> dict:
    """Planned against measured figures for one (model, setup, sequence length); bytes per rank.

    The step compiles with ``setup.compiler``, which the plan also takes into account.
    """
    model, config, loss_step = tiny_gpt(**shape) if kind == "gpt" else tiny_llama(**shape)
    vocab = config["vocab_size"] if isinstance(config, dict) else config.vocab_size
    measured = measure(
        model, loss_step, setup, seq_len, vocab=vocab, rank=rank, compiler=setup.compiler, measure_peak=peak
    )
    planned_shape = model_shape(model if kind == "llama" else config)
    predicted = step_memory(planned_shape, setup, seq_len)
    in_step = allocated_in_step(predicted)
    return {
        "model": kind,
        "seq_len": seq_len,
        "sp": setup.sp_size,
        "rank": rank,
        "sac": setup.policy,
        "precision": setup.precision,
        "chunked_loss": setup.chunked_loss,
        "compiler": setup.compiler,
        "measured_saved": measured.saved_bytes,
        "planned_saved": sum(saved_activations(planned_shape, setup, seq_len).values()),
        "measured_params": measured.params_bytes,
        "planned_params": predicted.params,
        "measured_grads": measured.grads_bytes,
        "planned_grads": predicted.grads,
        "measured_optimizer": measured.optimizer_bytes,
        "planned_optimizer": predicted.optimizer,
        "measured_peak": measured.peak_bytes,
        "planned_peak": in_step,
        "measured_offloaded": measured.offloaded_bytes,
        "planned_offloaded": predicted.host_activations,
        "saved": [(shape, str(dtype)) for shape, dtype in measured.saved],
    }


def _policy(sac: bool | str) -> str:
    return sac if isinstance(sac, str) else ("on" if sac else "off")


def rel_err(planned: float, measured: float) -> float:
    return abs(planned - measured) / measured


def render(rows: list[dict]) -> str:
    lines = [
        "| model | seq | sp | SAC | precision | chunked loss | saved MiB measured | planned | error | "
        "params/grads/AdamW error | step peak MiB measured | planned | error |",
        "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        static = max(rel_err(r[f"planned_{k}"], r[f"measured_{k}"]) for k in ("params", "grads", "optimizer"))
        peak = ["-", "-", "-"]
        if r["measured_peak"]:
            error = (r["planned_peak"] - r["measured_peak"]) / r["measured_peak"]
            peak = [f"{r['measured_peak'] / MiB:.2f}", f"{r['planned_peak'] / MiB:.2f}", f"{error:+.0%}"]
        lines.append(
            f"| {r['model']} | {r['seq_len']} | {r['sp']} | {_policy(r['sac'])} | "
            f"{r['precision']} | {'yes' if r['chunked_loss'] else 'no'} | {r['measured_saved'] / MiB:.3f} | "
            f"{r['planned_saved'] / MiB:.3f} | {rel_err(r['planned_saved'], r['measured_saved']):.1%} | "
            f"{static:.1%} | " + " | ".join(peak) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=("gpt", "llama"), default=["gpt", "llama"])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--compiler", choices=("aot_eager", "inductor"), default="aot_eager")
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed", "bf16-true"])
    parser.add_argument("--sac", nargs="+", choices=("on", "off"), default=["on", "off"])
    parser.add_argument("--chunked-loss", nargs="+", choices=("yes", "no"), default=["yes", "no"])
    parser.add_argument("--peak", action="store_true", help="also the step's allocator peak (profiler)")
    parser.add_argument("--list", action="store_true", help="print every saved tensor")
    parser.add_argument("--out", type=Path, help="write the table and the command to this .md file")
    args = parser.parse_args(argv)
    rows = []
    start = time.perf_counter()
    for kind in args.models:
        shape: dict[str, Any] = (
            {"n_embd": args.hidden, "block_size": max(args.seq_lens), "n_layer": args.layers}
            if kind == "gpt"
            else {"hidden": args.hidden, "intermediate": 2 * args.hidden, "layers": args.layers}
        )
        for precision in args.precisions:
            for sp in args.sp:
                for sac in args.sac:
                    for chunked in args.chunked_loss:
                        for seq_len in args.seq_lens:
                            setup = Setup(
                                sp,
                                sp,
                                sac=sac == "on",
                                precision=precision,
                                chunked_loss=chunked == "yes",
                                compiler=args.compiler,
                            )
                            row = compare(kind, setup, seq_len, peak=args.peak, **shape)
                            rows.append(row)
                            print(render([row]).splitlines()[-1], flush=True)
                            if args.list:
                                for saved in row["saved"]:
                                    print("   ", saved)
    worst = max(rel_err(r["planned_saved"], r["measured_saved"]) for r in rows)
    summary = f"worst saved-bytes error {worst:.1%}; {len(rows)} rows in {time.perf_counter() - start:.0f} s"
    table = render(rows)
    print(f"\n{table}\n\n{summary}")
    if args.out:
        command = "python -m benchmarks.planner " + " ".join(argv if argv is not None else sys.argv[1:])
        header = (
            "# Memory planner against measured figures\n\n"
            f"Generated by `{command.strip()}` (one rank of an sp group compiled in one process, "
            f"`{args.compiler}`, hidden {args.hidden}, {args.layers} layers, vocabulary 256, batch 1; torch "
            f"{torch.__version__}). Saved: bytes packed by `saved_tensors_hooks` in the compiled forward, "
            "parameters excluded. Step peak: the CPU allocator's high-water mark during forward + backward "
            "(gradients included; parameters and optimizer state allocated before), from the profiler.\n\n"
        )
        args.out.write_text(f"{header}{table}\n\n{summary}.\n")


if __name__ == "__main__":
    main()
