"""Command line of the memory planner (``python -m lightning_autosp.planning.cli``): one plan, or
docs/scaling.md's table of the smallest sp that fits Llama 3.1 8B/70B per length, GPU count and GPU
memory (``--table``).

A module of its own because the package imports ``planner``: run as ``-m``, a module the package has already
imported draws runpy's warning that it may behave unpredictably."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_autosp.fsdp import FSDPGather
from lightning_autosp.planning.planner import (
    LLAMA_3_1_8B,
    LLAMA_3_1_70B,
    GiB,
    ModelShape,
    Setup,
    a2a_bytes_per_step,
    as_tokens,
    in_gib,
    model_shape,
    plan,
    ring_bytes_per_step,
)
from lightning_autosp.planning.sp_cost import Throughput, UlyssesDegree, comm_seconds, step_flops

GPUS = {"H100 80GB": 81559 * 2**20, "H200 141GB": 143771 * 2**20}  # total memory as CUDA reports it


def comm_share(
    shape: ModelShape, setup: Setup, seq_len: int, gpus_per_node: int, rates: Throughput = Throughput()
) -> float:
    """Time of the all-to-alls and the ring's sends over compute time per step, as if they did not
    overlap compute (``sp_cost.comm_seconds``)."""
    if setup.sp_size == 1:
        return 0.0
    sent = comm_seconds(
        a2a_bytes_per_step(shape, setup, seq_len),
        ring_bytes_per_step(shape, setup, seq_len),
        setup.layout,
        gpus_per_node,
        rates,
    )
    flops = step_flops(shape, seq_len, setup.batch_size, setup.sp_size, setup.sac, setup.rebuild_attention)
    return sent / (flops / (rates.flops * rates.mfu))


def readme_table(
    models: Sequence[ModelShape] = (LLAMA_3_1_8B, LLAMA_3_1_70B),
    seq_lens: Sequence[int] = (2**17, 2**18, 2**19, 2**20),
    device_counts: Sequence[int] = (8, 64, 1024),
    gpus: Mapping[str, int] = GPUS,
    gpus_per_node: int = 8,
    fsdp_gather: FSDPGather = "per_use",
    ulysses_degree: UlyssesDegree = None,
) -> str:
    """Per (model, tokens, GPUs) and GPU memory: the smallest sp that fits (SAC, chunked loss,
    bf16-mixed, FSDP), its peak, the bytes it sends (all-to-alls, and the ring's with ``ulysses_degree``)
    and their time against compute."""
    columns = ["model", "tokens", "GPUs"]
    ring = ulysses_degree is not None
    for name in gpus:
        columns += [f"{name}: sp", "peak GiB", "a2a GiB/step/rank"]
        columns += ["ring GiB/step/rank", "comm / compute"] if ring else ["a2a / compute"]
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for shape in models:
        for seq_len in seq_lens:
            for devices in device_counts:
                cells = [shape.name, as_tokens(seq_len), str(devices)]
                for memory in gpus.values():
                    result = plan(
                        shape,
                        seq_len,
                        devices,
                        memory,
                        sac=True,
                        data_parallel="fsdp",
                        gpus_per_node=gpus_per_node,
                        fsdp_gather=fsdp_gather,
                        ulysses_degree=ulysses_degree,
                    )
                    best = result.best()
                    if best is None:
                        top = max(result.options, key=lambda o: (o.max_seq_len, -o.setup.sp_size))
                        longest = f"max {as_tokens(top.max_seq_len)} at sp={top.setup.sp_size}"
                        cells += [f"no ({longest if top.max_seq_len else 'no sp fits'})"]
                        cells += ["-"] * (4 if ring else 3)
                        continue
                    share = comm_share(shape, best.setup, seq_len, gpus_per_node)
                    sp = best.setup.layout.describe() + ("" if best.sp_within_node else " *")
                    cells += [sp, in_gib(best.memory.total), in_gib(best.a2a_bytes_per_step)]
                    cells += [in_gib(best.ring_bytes_per_step)] if ring else []
                    cells += [f"{share:.1%}"]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Published longest full-training sequences (docs/scaling.md, "Against the records"): (model, GPUs, GPU,
# tokens, who, how). Llama-3.1-8B stands for the Llama-8B and Llama3-8B of the papers (same shape).
RECORDS = (
    ("8b", 1, "H100 80GB", 500_000, "ALST", "checkpoints, parameters and optimizer offloaded to the host"),
    ("8b", 1, "H200 141GB", 1_200_000, "ALST", "the same, with Liger kernels and FA3"),
    ("8b", 8, "H100 80GB", 3_700_000, "ALST", "the same, Ulysses over 8"),
    ("8b", 8, "H100 80GB", 5_000_000, "UPipe", "attention over chunks of heads"),
    ("8b", 16, "H100 80GB", 8_000_000, "UPipe", "attention over chunks of heads"),
    ("8b", 32, "H100 80GB", 15_000_000, "ALST", "offload, Ulysses over 32"),
    ("70b", 64, "H100 80GB", 10_000_000, "ALST", "offload, Ulysses x ZeRO-3"),
)


def longest_per_policy(
    shape: ModelShape,
    devices: int,
    memory: int,
    policies: Sequence[bool | str] = (True, "longest"),
    offload: Sequence[bool] = (False,),
    **setup: object,
) -> dict[str, tuple[int, int]]:
    """For each ``sac`` policy (with and without ``offload_activations``), the longest trainable sequence
    over every sp size the devices allow (FSDP per use unless ``setup`` says otherwise, bf16-mixed, AdamW,
    chunked loss, batch 1; ring attention where sp passes the heads), and the sp size that reaches it.
    ``setup``: more of ``plan``'s options."""
    best: dict[str, tuple[int, int]] = {}
    for offload_activations in offload:
        result = plan(
            shape,
            2**10 * devices,
            devices,
            memory,
            sac=policies,
            data_parallel="fsdp",
            ulysses_degree="auto",
            offload_activations=offload_activations,
            **setup,
        )
        for option in result.options:
            key = option.setup.policy
            best[key] = max(best.get(key, (0, 0)), (option.max_seq_len, option.setup.sp_size))
    return best


def all_offloaded(shape: ModelShape, devices: int, memory: int) -> tuple[int, int]:
    """The longest sequence and its sp size with everything on the host that can be: sac="longest" with
    offload_activations, and FSDP per step with offload_parameters (FSDP2's CPUOffloadPolicy)."""
    best = longest_per_policy(
        shape, devices, memory, ("longest",), (True,), fsdp_gather="per_step", offload_parameters=True
    )
    return best.get("longest + offload", (0, 0))


def records_table(gpus: Mapping[str, int] = GPUS) -> str:
    """Per published record (model, GPUs, GPU): the longest sequence the planner predicts for SAC, for
    sac="longest", for "longest" with its saved values offloaded, and with the parameters' shards and
    optimizer state offloaded too, beside the record."""
    policies = ("on", "longest", "longest + offload")
    labels = ("SAC", "longest", "longest + offload", "all offloaded (FSDP per step)")
    columns = [
        "model",
        "GPUs",
        "GPU",
        "record",
        "how",
        *(f"ours: {label}" for label in labels),
        "best / record",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|---|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for model, devices, gpu, tokens, who, how in RECORDS:
        best = longest_per_policy(PRESETS[model], devices, gpus[gpu], offload=(False, True))
        best["all"] = all_offloaded(PRESETS[model], devices, gpus[gpu])
        cells = [PRESETS[model].name, str(devices), gpu, f"{who}: {tokens / 1e6:.1f}M", how]
        for policy in (*policies, "all"):
            length, sp = best[policy]
            cells.append(f"{length / 1e6:.2f}M (sp={sp})" if length else "does not fit")
        cells.append(f"{max(best[p][0] for p in (*policies, 'all')) / tokens:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PRESETS = {"8b": LLAMA_3_1_8B, "70b": LLAMA_3_1_70B}


def model_to_plan(model: str, sizes: str = "") -> ModelShape:
    """``--model``: a preset, a config.json's path, or a transformers model type with ``sizes`` changed."""
    if model in PRESETS:
        return PRESETS[model]
    if Path(model).is_file():
        return model_shape(json.loads(Path(model).read_text()))
    from transformers import AutoConfig

    fields = dict(item.split("=", 1) for item in sizes.split(",") if item)
    try:
        config = AutoConfig.for_model(model, **{key: int(value) for key, value in fields.items()})
    except ValueError as error:
        raise SystemExit(
            f"--model {model!r} is not 8b, 70b, a config.json file, or a transformers model type ({error})"
        ) from None
    return model_shape(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Per-rank memory plan for AutoSPStrategy: for every sp size, SAC on and off, and "
        "data_parallel 'ddp' and 'fsdp', the peak by component and the longest sequence it trains (batch 1, "
        "AdamW, chunked loss).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="print the table of docs/scaling.md instead (Llama 3.1 8B/70B; 128K-1M tokens; 8, 64 and 1024 "
        "GPUs; H100 80GB and H200 141GB): the smallest sp that fits each; ignores --model to --precision",
    )
    parser.add_argument(
        "--records",
        action="store_true",
        help="print docs/scaling.md's table against the published longest sequences (ALST, UPipe): the "
        "longest sequence SAC and sac='longest' fit on the same GPUs",
    )
    parser.add_argument(
        "--fsdp-gather",
        choices=("per_use", "per_step"),
        default="per_use",
        help="AutoSPStrategy's fsdp_gather: gather each parameter where it is used, or all of it per step",
    )
    parser.add_argument(
        "--model",
        default="8b",
        help="the model to plan: 8b or 70b (Llama 3.1), a transformers config.json, or a transformers model "
        "type (llama, qwen3, mistral, ...) whose default config --sizes changes",
    )
    parser.add_argument(
        "--sizes",
        default="",
        help="config fields for a model type, comma-separated: hidden_size=4096,num_hidden_layers=32",
    )
    parser.add_argument("--seq-len", type=int, default=2**17, help="tokens per sequence (the whole sequence)")
    parser.add_argument("--devices", type=int, default=8, help="GPUs in the job (sp x dp); 8 per node")
    parser.add_argument(
        "--memory-gib",
        type=float,
        default=GPUS["H100 80GB"] / GiB,
        help="memory of one GPU in GiB (the default is an H100 80GB's, as CUDA reports it); 10%% is held "
        "in reserve",
    )
    parser.add_argument(
        "--precision",
        default="bf16-mixed",
        help="Lightning precision of the step: 32-true, bf16-mixed or bf16-true",
    )
    parser.add_argument(
        "--ulysses-degree",
        type=lambda value: value if value == "auto" else int(value),
        default=None,
        help="'auto' or an int: plan sp beyond the heads as Ulysses x ring attention (None: all Ulysses)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.records:
        print(records_table())
        return
    if args.table:
        print(readme_table(fsdp_gather=args.fsdp_gather, ulysses_degree=args.ulysses_degree))
        return
    shape = model_to_plan(args.model, args.sizes)
    result = plan(
        shape,
        args.seq_len,
        args.devices,
        args.memory_gib * GiB,
        precision=args.precision,
        fsdp_gather=args.fsdp_gather,
        ulysses_degree=args.ulysses_degree,
    )
    print(result.to_markdown())


if __name__ == "__main__":
    main()
