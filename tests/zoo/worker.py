"""Run the model zoo under torchrun: every family of ``tests/zoo/families.py`` through
``lightning_autosp.tools.verify`` (one Lightning step on one device and under AutoSPStrategy, compared).

    torchrun --nproc_per_node=2 tests/zoo/worker.py --out zoo.json [--families llama gpt2] [--lengths 27]

Each family runs at an even and an odd length under aot_eager (``--lengths``: the suite runs the odd one,
whose uneven shards are the harder case), the ``inductor`` ones also at the odd length under Inductor +
SAC; then a control: nanoGPT with the SP pass switched off, which verify must find not exact (else an
"exact" verdict would mean nothing). Rank 0 writes ``--out``: per run, the verdict, the worst loss and
gradient errors over the ranks, and each rank's error if it raised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_autosp import verify  # noqa: E402
from lightning_autosp.compiler import backend as backend_module  # noqa: E402
from lightning_autosp.compiler.sp_pass import SPReport  # noqa: E402
from tests.distributed.user_modules import with_images  # noqa: E402
from tests.launch import end_worker  # noqa: E402
from tests.zoo.families import BATCH_SIZE, EVEN_LENGTH, FAMILIES, ODD_LENGTH, Family  # noqa: E402

# A run that leaves a rank waiting fails after this, not torch's 30 minutes.
ZOO_TIMEOUT_S = 300
CONTROL = "nanogpt without the SP pass"


def make_batch(vocab: int, length: int, classes: int = 0, images: bool = False) -> dict[str, torch.Tensor]:
    """Token ids and labels; the second sample's last 5 labels are ignored (-100). A classifier's batch
    carries one ``label`` per sample (a float score for one class: a reward model's target); a
    vision-language model's an image per sample, the first sample's placeholders across the shard cut."""
    generator = torch.Generator().manual_seed(1000 + length)
    ids = torch.randint(0, vocab, (BATCH_SIZE, length), generator=generator)
    labels = ids.clone()
    labels[1, -5:] = -100
    batch = {"input_ids": ids, "labels": labels}
    if classes == 1:
        batch["label"] = torch.randn(BATCH_SIZE, generator=generator)
    elif classes:
        batch["label"] = torch.randint(0, classes, (BATCH_SIZE,), generator=generator)
    if images:
        batch = with_images(batch, [(length + 1) // 2 - 2, 2], generator)
    return batch


def run_one(family: Family, length: int, compiler: str, accelerator: str, sp_pass: bool = True) -> dict:
    torch._dynamo.reset()
    start = time.monotonic()
    record: dict = {"length": length, "compiler": compiler}
    with contextlib.ExitStack() as patches:
        if not sp_pass:  # the passes report attention but rewrite nothing
            patches.enter_context(
                mock.patch.object(
                    backend_module,
                    "sequence_parallel_pass",
                    lambda gm, *args, **kwargs: (gm, SPReport(attention=["skipped"])),
                )
            )
        try:
            torch.manual_seed(0)
            module = family.build()
            result = verify(
                module,
                make_batch(family.vocab, length, family.classes, family.images),
                sp_size=2,
                devices=dist.get_world_size(),
                accelerator=accelerator,
                show=False,
                compiler=compiler,
                sac=True,
                timeout=ZOO_TIMEOUT_S,
            )
        except Exception as error:  # verify itself failed (not the SP run): recorded, the others go on
            record.update(verdict="error", errors=[f"{type(error).__name__}: {error}"])
        else:
            worst = result.worst_parameters(1)
            record.update(
                verdict=result.verdict,
                loss_rel_err=result.loss_rel_err,
                grad_rel_err=result.grad_rel_err,
                worst_parameter=worst[0][0] if worst else None,
                errors=[r.error for r in result.ranks],
                missing_grads=sorted({n for r in result.ranks for n in r.missing_grads}),
            )
    record["seconds"] = round(time.monotonic() - start, 1)
    return record


def environment() -> dict:
    import lightning
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "ranks": dist.get_world_size(),
        "commit": commit,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        default=[EVEN_LENGTH, ODD_LENGTH],
        help="aot_eager lengths of every family (the Inductor run is at the odd one)",
    )
    parser.add_argument("--no-inductor", action="store_true", help="leave out the Inductor + SAC runs")
    parser.add_argument("--no-control", action="store_true", help="leave out the SP-pass-off control")
    args = parser.parse_args()
    backend = "nccl" if args.accelerator == "gpu" else "gloo"
    if args.accelerator == "gpu":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=ZOO_TIMEOUT_S))
    started = time.monotonic()
    families: dict[str, dict] = {}
    for name in args.families:
        family = FAMILIES[name]
        plan = [(family.length(length), "aot_eager") for length in args.lengths]
        if family.inductor and not args.no_inductor:
            plan.append((family.length(ODD_LENGTH), "inductor"))
        runs = [run_one(family, length, compiler, args.accelerator) for length, compiler in plan]
        families[name] = {"exercises": family.exercises, "expected_refusal": family.refusal, "runs": runs}
    control = None
    if not args.no_control:
        control = run_one(FAMILIES["nanogpt"], ODD_LENGTH, "aot_eager", args.accelerator, sp_pass=False)
    if dist.get_rank() == 0:
        results = {
            "environment": environment(),
            "families": families,
            "control": {"name": CONTROL, **control} if control else None,
            "wall_s": round(time.monotonic() - started, 1),
        }
        Path(args.out).write_text(json.dumps(results, indent=1))
    end_worker()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
