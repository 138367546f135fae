"""torchmetrics updated inside the steps, as Lightning users write them, under AutoSPStrategy on 2 ranks
(sp=2), against the same metrics on one device (Note [Metrics over sequence shards]).

    torchrun --nproc_per_node=2 tests/distributed/metrics_worker.py --out results.json [--compiler aot_eager]

The module updates, in ``training_step``, ``validation_step`` and ``test_step``: token accuracy (sum
states), the mean per-token loss (perplexity's log), AUROC of one token's probability (concatenated states)
and the mean of per-sequence losses (a sum over each sequence, then a mean over sequences); it logs them
with ``self.log`` (``on_step`` and ``on_epoch``) and a plain per-step mean loss with ``sync_dist=True``.
The training loss takes its labels as HF's causal-LM loss does (padded, then shifted), beside the metric's
``ids[:, 1:]``: two label windows, which once compiled to different collectives on the two ranks (Note
[Collectives kept apart] in steps.py). After fit, ``trainer.test`` runs the same metrics again. Rank 0
writes each value from the SP run and from a single-device run of the same module, weights and batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_autosp import AutoSPStrategy  # noqa: E402
from tests.distributed.modules import VOCAB, TinyGPT  # noqa: E402
from tests.launch import end_worker  # noqa: E402

LENGTHS = (25, 27)  # odd: uneven shards (13 + 12, 14 + 13); one length class, so one compile per step
STEPS = 2


def make_metrics(sync: bool = True) -> dict:
    from torchmetrics import MeanMetric, MetricCollection
    from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy

    def metric(cls, *args, **kwargs):
        return cls(*args, **kwargs) if sync else cls(*args, sync_on_compute=False, **kwargs)

    return {
        "train": MetricCollection(
            {
                "acc": metric(MulticlassAccuracy, num_classes=VOCAB, top_k=8, average="micro"),
                "macro_acc": metric(MulticlassAccuracy, num_classes=VOCAB, top_k=8, average="macro"),
            },
            prefix="train_",
        ),
        "train_token_nll": metric(MeanMetric),
        "val_acc": metric(MulticlassAccuracy, num_classes=VOCAB, top_k=8, average="micro"),
        "val_auroc": metric(BinaryAUROC),
        "val_sequence_nll": metric(MeanMetric),
        "test_acc": metric(MulticlassAccuracy, num_classes=VOCAB, average="micro"),
    }


def outputs(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits of every position, (B, T, V); the next tokens, (B, T - 1); their losses, (B, T - 1))."""
    ids = batch["input_ids"]
    logits = model(ids)
    targets = ids[:, 1:]
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
    return logits, targets, per_token


def padded_label_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss: the labels padded by one ignored position, then shifted by one."""
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


class MetricsGPT(L.LightningModule):
    """Metrics updated in the steps and logged with ``self.log``, Lightning's canonical form."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT()
        metrics = make_metrics()
        self.train_metrics, self.train_token_nll = metrics["train"], metrics["train_token_nll"]
        self.val_acc, self.val_auroc, self.val_sequence_nll, self.test_acc = (
            metrics[k] for k in ("val_acc", "val_auroc", "val_sequence_nll", "test_acc")
        )
        self.step_values: list[dict[str, float]] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits, targets, per_token = outputs(self.model, batch)
        self.batch_values = self.train_metrics(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1))
        self.train_token_nll.update(per_token)
        self.log_dict(self.train_metrics, on_step=True, on_epoch=True)
        self.log("train_token_nll", self.train_token_nll, on_epoch=True)
        loss = padded_label_loss(logits, batch["input_ids"])
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def on_train_batch_end(self, *args) -> None:  # outside the compiled step
        self.step_values.append({k: float(v) for k, v in self.batch_values.items()})

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        logits, targets, per_token = outputs(self.model, batch)
        logits = logits[:, :-1]
        self.val_acc(logits.reshape(-1, VOCAB), targets.reshape(-1))
        self.val_auroc(logits.softmax(-1)[..., 0], (targets == 0).long())
        self.val_sequence_nll(per_token.sum(dim=1))
        self.log("val_acc", self.val_acc, on_epoch=True)
        self.log("val_loss", per_token.mean(), on_epoch=True, sync_dist=True)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        logits, targets, _ = outputs(self.model, batch)
        self.test_acc(logits[:, :-1].argmax(-1).reshape(-1), targets.reshape(-1))
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def samples() -> list[dict]:
    generator = torch.Generator().manual_seed(7)
    out = []
    for length in LENGTHS:  # batches of one length each
        ids = torch.randint(0, VOCAB, (2, length), generator=generator)
        ids[:, ::3] = 0  # enough of token 0 for its AUROC
        out += [{"input_ids": row} for row in ids]
    return out


def epoch_values(metrics: dict) -> dict[str, float]:
    values = {k: float(v) for k, v in metrics["train"].compute().items()}
    names = ("train_token_nll", "val_acc", "val_auroc", "val_sequence_nll", "test_acc")
    return values | {k: float(metrics[k].compute()) for k in names}


@torch.no_grad()
def single_device() -> dict:
    """The same module, weights and batches, its metrics updated as the steps do, on this process alone."""
    torch.manual_seed(0)
    model = MetricsGPT().model
    metrics, steps, val_losses = make_metrics(sync=False), [], []
    batches = list(DataLoader(samples(), batch_size=2, shuffle=False))
    for batch in batches:
        logits, targets, per_token = outputs(model, batch)
        values = metrics["train"](logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1))
        metrics["train_token_nll"].update(per_token)
        steps.append({k: float(v) for k, v in values.items()})
    for batch in batches:
        logits, targets, per_token = outputs(model, batch)
        metrics["test_acc"](logits[:, :-1].argmax(-1).reshape(-1), targets.reshape(-1))
        logits = logits[:, :-1]
        metrics["val_acc"](logits.reshape(-1, VOCAB), targets.reshape(-1))
        metrics["val_auroc"](logits.softmax(-1)[..., 0], (targets == 0).long())
        metrics["val_sequence_nll"](per_token.sum(dim=1))
        val_losses.append(float(per_token.mean()))
    return {"steps": steps, "epoch": epoch_values(metrics), "val_loss": sum(val_losses) / len(val_losses)}


def sequence_parallel(compiler: str) -> dict:
    torch.manual_seed(0)
    module = MetricsGPT()
    loader = DataLoader(samples(), batch_size=2, shuffle=False)
    strategy = AutoSPStrategy(sp_size=2, compiler=compiler, timeout=timedelta(seconds=300))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, loader, loader)
    # Lightning computed and reset the logged metrics at epoch end; the others still hold the epoch's
    # states, which compute() syncs over the dp group.
    unlogged = {"val_auroc": module.val_auroc, "val_sequence_nll": module.val_sequence_nll}
    epoch = {name: float(metric.compute()) for name, metric in unlogged.items()}
    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    (tested,) = trainer.test(module, loader, verbose=False)  # a second stage: the metrics as they were
    return {"steps": module.step_values, "epoch": epoch, "logged": logged, "tested": tested}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--compiler", default="inductor")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    reference = single_device()
    try:
        sharded = sequence_parallel(args.compiler)
    except Exception as error:  # recorded: the test shows it
        sharded = {"error": f"{type(error).__name__}: {error}"}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"reference": reference, "sp": sharded}, indent=1))
    end_worker()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
