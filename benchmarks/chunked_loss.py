"""Peak memory of the LM head + cross-entropy with and without chunking, 128K vocabulary, one CPU process.

    python -m benchmarks.chunked_loss                  # --model gpt
    python -m benchmarks.chunked_loss --model llama
    python -m benchmarks.chunked_loss --before 2048 4096 8192 --after 8192 32768 65536
    python -m benchmarks.chunked_loss --model llama --render   # regenerate the .md from the .json

(from the repository root). Writes ``benchmarks/results/chunked_loss_<model>.json`` (every figure, the
command, the machine) and the ``.md`` next to it (a table generated from the JSON).

Models, both with Llama 3's vocabulary (128256 tokens), hidden size 64, 1 layer, 4 heads; batch 1, fp32:

* ``gpt``: ``examples.models.GPTModule`` (the hand-written GPT, ``is_causal`` attention) and its own
  loss, ``cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), ignore_index=-100)``.
* ``llama``: Hugging Face ``LlamaForCausalLM`` from a config (2 KV heads, intermediate size 128),
  ``labels=input_ids`` (HF's loss: ``logits.float()``, labels padded and shifted, mean over valid
  tokens). Under torch.compile HF materializes an [N, N] causal mask, which CPU SDPA copies to float:
  at 32K tokens that mask, not the loss, sets the peak.

The step is compiled with ``AutoSPBackend(None, compiler=..., sac=True, chunked_loss=...)``: the backend
the strategy uses, at sp=1 (under SP the chunked loss sees the same graph per rank: the local tokens'
sum). With hidden 64 the logits dominate the rest of the step: at N tokens they are N x 128256 x 4 bytes
(2 GiB at 4K, 16 GiB at 32K), the rest is ~100 MiB.

Each (tokens, chunked) point runs in a fresh subprocess and measures its first training step (compile,
forward, backward): steps are slow on a loaded 2-core machine (~100 s at 8K tokens), and the check at the
smallest size (``first_vs_second_step``) shows the first step's peak equals the second's.

* allocator peak: high-water mark of the bytes the c10 CPU allocator handed out and still held during
  the step (the profiler's memory events, ``benchmarks.measure.profiled_step``): what
  ``torch.cuda.max_memory_allocated`` measures on a GPU.
* saved for backward: bytes of the storages packed by ``saved_tensors_hooks`` in the forward, parameters
  excluded.
* RSS high-water mark above the process RSS at the step's start (``/proc/self/clear_refs``): coarse,
  includes the compiler's own memory.
* parity: loss, and the max relative gradient error of the chunked step against the unchunked one at the
  same size (same seed, same weights).

"before" points whose predicted peak exceeds ``--memory-fraction`` (0.6) of the memory available are
skipped (other work shares the machine); the table extrapolates them with a least-squares line through
the measured "before" points, marked as such.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, MiB, bench_command, machine_info
from benchmarks.measure import profiled_step, rss_peak

VOCAB = 128256
HIDDEN = 64
GiB = 2**30
PREDICTED_LOGITS_COPIES = 3.5  # before any point is measured: logits, log_softmax, their gradient, slack


def build_step(model: str, tokens: int) -> tuple[Any, Any]:
    """(module, loss function of token ids) for ``--model``; weights seeded."""
    import torch

    torch.manual_seed(0)
    if model == "gpt":
        from examples.models import GPTModule

        module = GPTModule(vocab_size=VOCAB, block_size=tokens, n_layer=1, n_head=4, n_embd=HIDDEN)
        # the example's own loss: logits[:, :-1].reshape(-1, V) against ids[:, 1:], ignore_index=-100
        return module, lambda ids: module._loss(module.model(ids), ids[:, 1:])
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=tokens,
        attn_implementation="sdpa",
    )
    module = LlamaForCausalLM(config)
    return module, lambda ids: module(input_ids=ids, labels=ids).loss


def measure_point(
    model_name: str, tokens: int, chunked: bool, compiler: str, steps: int, grads_out: str | None
) -> dict:
    """One (tokens, chunked) point, in this process."""
    import torch

    from lightning_autosp.compiler.backend import AutoSPBackend

    model, loss_of = build_step(model_name, tokens)
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
    backend = AutoSPBackend(None, compiler=compiler, sac=True, chunked_loss=chunked)
    step = torch.compile(lambda: loss_of(ids), backend=backend, dynamic=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    runs = []
    for _ in range(steps):
        packed: dict[int, int] = {}  # storage -> bytes; holding the tensors would change the peak

        def pack(tensor: torch.Tensor, packed: dict = packed) -> torch.Tensor:
            packed[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        def forward() -> Any:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                return step()

        run: dict = {}

        def one_step(run: dict = run, forward: Any = forward) -> None:
            start = time.perf_counter()
            run.update(profiled_step(forward))
            run["step_seconds"] = time.perf_counter() - start

        run.update(rss_peak(one_step, model))
        run["saved_bytes"] = sum(size for ptr, size in packed.items() if ptr not in params)
        run["loss"] = run["loss"].item()
        run.pop("collective_bytes"), run.pop("collective_calls")
        runs.append(run)
    if grads_out:
        torch.save({n: p.grad for n, p in model.named_parameters()}, grads_out)
    return {
        "tokens": tokens,
        "chunked": chunked,
        **runs[0],
        "steps": runs,
        "explain": [line for report in backend.loss_reports for line in report.lines()],
        "logits_bytes": tokens * VOCAB * 4,
    }


def run_point(tokens: int, chunked: bool, args: argparse.Namespace, grads_out: str | None) -> dict:
    """``measure_point`` in a fresh subprocess (clean RSS; an out-of-memory kill stays contained)."""
    steps = 2 if tokens == min(args.before + args.after) else 1
    command = [sys.executable, "-m", "benchmarks.chunked_loss", "--point", str(tokens), str(int(chunked))]
    command += ["--model", args.model, "--compiler", args.compiler, "--steps", str(steps)]
    if grads_out:
        command += ["--grads-out", grads_out]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    print(f"tokens={tokens} chunked={chunked} ...", flush=True)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {
            "tokens": tokens,
            "chunked": chunked,
            "error": done.stderr[-3000:],
            "returncode": done.returncode,
        }
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"  peak {result['alloc_peak_bytes'] / MiB:.0f} MiB, saved {result['saved_bytes'] / MiB:.1f} MiB, "
        f"{result['step_seconds']:.0f} s",
        flush=True,
    )
    return result


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of bytes against tokens."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def available_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


def rel_err(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def grad_rel_err(path_a: str, path_b: str) -> float:
    import torch

    a, b = torch.load(path_a), torch.load(path_b)
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in b)


def run_all(args: argparse.Namespace) -> dict:
    points: list[dict] = []
    skipped: list[dict] = []
    parity: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for tokens in sorted(args.before):
            measured = [
                (p["tokens"], p["alloc_peak_bytes"]) for p in points if not p["chunked"] and "error" not in p
            ]
            line = fit_line(measured)
            predicted = line[0] + line[1] * tokens if line else PREDICTED_LOGITS_COPIES * tokens * VOCAB * 4
            if predicted > args.memory_fraction * available_bytes():
                skipped.append(
                    {
                        "tokens": tokens,
                        "predicted_peak_bytes": predicted,
                        "available_bytes": available_bytes(),
                    }
                )
                print(f"tokens={tokens} unchunked: skipped, predicted {predicted / GiB:.1f} GiB", flush=True)
                continue
            grads = str(Path(scratch, f"before_{tokens}.pt")) if tokens in args.after else None
            points.append(run_point(tokens, False, args, grads))
        for tokens in sorted(args.after):
            grads = str(Path(scratch, f"after_{tokens}.pt")) if tokens in args.before else None
            points.append(run_point(tokens, True, args, grads))
            before = Path(scratch, f"before_{tokens}.pt")
            if grads and before.exists():
                pair = {(p["chunked"]): p for p in points if p["tokens"] == tokens and "error" not in p}
                parity[tokens] = {
                    "loss_rel_err": rel_err(pair[True]["loss"], pair[False]["loss"]),
                    "grad_rel_err": grad_rel_err(grads, str(before)),
                }
    return {"points": points, "skipped_before": skipped, "parity": parity}


def render(data: dict) -> str:
    points = [p for p in data["points"] if "error" not in p]
    before = {p["tokens"]: p for p in points if not p["chunked"]}
    after = {p["tokens"]: p for p in points if p["chunked"]}
    line = fit_line([(t, p["alloc_peak_bytes"]) for t, p in sorted(before.items())])
    header = data["config"]
    described = {
        "gpt": "the hand-written GPT of `examples/models.py` (`is_causal` attention, its own shifted loss)",
        "llama": "HF LlamaForCausalLM from a config (its loss: `logits.float()`, padded and shifted labels)",
    }[header["model"]]
    out = [
        "# Chunked LM head + cross-entropy: peak memory, 128K vocabulary",
        "",
        f"Generated by `benchmarks/chunked_loss.py` from the JSON file of the same name. Command: "
        f"`{data['command']}`  ",
        f"Model: {described}; vocab {header['vocab']}, hidden {header['hidden']}, 1 layer, 4 heads, "
        f"batch 1, fp32, compiled with `AutoSPBackend(None, compiler='{header['compiler']}', sac=True)` "
        "(sp=1); "
        f"one process; {data['machine']['cpu_count']} CPUs, torch {data['machine']['torch']}, load average "
        f"{data['machine']['loadavg_at_end']} at the end.",
        "",
        "Peak: c10 CPU allocator high-water mark of one training step (forward + backward). "
        "Logits: tokens x vocab x 4 bytes, for scale.",
        "",
        "| tokens | logits MiB | unchunked peak MiB | chunked peak MiB | chunked / unchunked | "
        "saved for bw MiB (unchunked / chunked) | step s (unchunked / chunked) | loss / grad rel err |",
        "|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for tokens in sorted(set(before) | set(after) | {s["tokens"] for s in data["skipped_before"]}):
        b, a = before.get(tokens), after.get(tokens)
        if b:
            b_peak = f"{b['alloc_peak_bytes'] / MiB:,.0f}"
            b_value = b["alloc_peak_bytes"]
        elif line:
            b_value = line[0] + line[1] * tokens
            b_peak = f"~{b_value / MiB:,.0f} (extrapolated)"
        else:
            b_value, b_peak = None, "-"
        a_peak = f"{a['alloc_peak_bytes'] / MiB:,.0f}" if a else "-"
        ratio = f"{a['alloc_peak_bytes'] / b_value:.3f}x" if a and b_value else "-"
        saved = f"{b['saved_bytes'] / MiB:.1f}" if b else "-"
        saved += f" / {a['saved_bytes'] / MiB:.1f}" if a else " / -"
        seconds = f"{b['step_seconds']:.0f}" if b else "-"
        seconds += f" / {a['step_seconds']:.0f}" if a else " / -"
        parity = data["parity"].get(str(tokens)) or data["parity"].get(tokens)
        errors = f"{parity['loss_rel_err']:.1e} / {parity['grad_rel_err']:.1e}" if parity else "-"
        out.append(
            f"| {tokens:,} | {tokens * VOCAB * 4 / MiB:,.0f} | {b_peak} | {a_peak} | {ratio} | {saved} | "
            f"{seconds} | {errors} |"
        )
    if line:
        out += [
            "",
            f"Unchunked peak fit over the measured points: {line[0] / MiB:,.0f} MiB + "
            f"{line[1] * 1024 / MiB:,.1f} MiB per 1K tokens = {line[1] / (VOCAB * 4):.2f} copies of the "
            "fp32 logits per token.",
        ]
    for skip in data["skipped_before"]:
        out.append(
            f"Unchunked at {skip['tokens']:,} tokens was not run: predicted "
            f"{skip['predicted_peak_bytes'] / GiB:.1f} GiB, "
            f"{skip['available_bytes'] / GiB:.1f} GiB available."
        )
    for p in points:
        if len(p.get("steps", [])) > 1:
            first, second = (s["alloc_peak_bytes"] / MiB for s in p["steps"][:2])
            out.append(
                f"First vs second step peak at {p['tokens']:,} tokens "
                f"({'chunked' if p['chunked'] else 'unchunked'}): {first:,.1f} vs {second:,.1f} MiB."
            )
    for p in data["points"]:
        if "error" in p:
            out.append(f"Failed: {p['tokens']} tokens, chunked={p['chunked']}: {p['error'][-300:]}")
    if header["model"] == "llama" and after:
        out.append(
            "Llama beyond the loss: under torch.compile HF builds an explicit [N, N] bool causal mask, and "
            "CPU SDPA makes a float copy of it (5 bytes per entry, 5 GiB at 32K tokens); that, not the loss, "
            "is the chunked peak at 32K (the `gpt` table has no mask)."
        )
    chunked_lines = sorted(
        {line for p in points if p["chunked"] for line in p["explain"]},
        key=lambda line: int(re.search(r"(\d+) tokens", line).group(1)),
    )
    out += ["", "What the pass reported:", "", *[f"- {line}" for line in chunked_lines]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=int, nargs="*", default=[2048, 4096, 8192])
    parser.add_argument("--after", type=int, nargs="*", default=[2048, 8192, 32768])
    parser.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--compiler", choices=["aot_eager", "inductor"], default="aot_eager")
    parser.add_argument(
        "--memory-fraction", type=float, default=0.6, help="skip 'before' points predicted above this share"
    )
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/chunked_loss_<model>.json")
    parser.add_argument("--render", action="store_true", help="only regenerate the .md from the .json")
    parser.add_argument("--point", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--grads-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = args.out or RESULTS / f"chunked_loss_{args.model}.json"
    if args.point:
        tokens, chunked = args.point
        result = measure_point(args.model, tokens, bool(chunked), args.compiler, args.steps, args.grads_out)
        print(json.dumps(result))
        return
    if not args.render:
        started = time.time()
        data = run_all(args)
        data.update(
            command=bench_command("benchmarks.chunked_loss", sys.argv[1:] if argv is None else argv),
            config={"model": args.model, "vocab": VOCAB, "hidden": HIDDEN, "compiler": args.compiler},
            machine=machine_info(),
            wall_seconds=time.time() - started,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1))
    data = json.loads(args.out.read_text())
    args.out.with_suffix(".md").write_text(render(data))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
