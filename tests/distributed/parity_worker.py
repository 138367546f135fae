"""Run parity cases under torchrun: AutoSPStrategy vs the same module on one device.

Every rank computes the single-device reference for its own dp group in-process (eager, no
collectives), then trains one step with lr=0 under AutoSPStrategy and records the loss the step
returned and the gradients after DDP's all-reduce. Results go to ``<out>/rank<r>.json``.

    torchrun --nproc_per_node=2 tests/distributed/parity_worker.py --out DIR --cases gpt_shift llama_gqa
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from unittest import mock

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import grad_rel_err  # noqa: E402
from lightning_autosp import AutoSPStrategy  # noqa: E402
from lightning_autosp.compiler import backend as backend_module  # noqa: E402
from lightning_autosp.compiler.lower import attention, chunked_loss  # noqa: E402
from lightning_autosp.compiler.sp_pass import SPReport  # noqa: E402
from tests.distributed.attention_modules import (  # noqa: E402
    DocumentMaskGPTModule,
    FlashGPTModule,
    PackedLlamaModule,
    cross_document_rel_diff,
    packed_inputs,
)
from tests.distributed.modules import (  # noqa: E402
    VOCAB,
    GPTModule,
    LlamaModule,
    TokenizedLlamaModule,
    UserShardedGPTModule,
)
from tests.distributed.user_modules import (  # noqa: E402
    HFModule,
    LitGPTModule,
    LossGPT,
    MetricLlama,
    MultimodalQwen,
    SequenceIdiomGPT,
    SlicedTableGPT,
    multimodal_positions,
)
from tests.flash_stand_in import flash_attn_stand_in  # noqa: E402
from tests.launch import end_worker  # noqa: E402


@dataclass
class Case:
    module: type
    module_kwargs: dict = field(default_factory=dict)
    seq_len: int = 24
    batch_size: int = 2
    sp_size: int = 2
    ignored_tail: tuple[int, ...] = ()  # per sample: how many trailing labels are -100
    strategy_kwargs: dict = field(default_factory=dict)
    sp_pass: bool = True
    precision: str = "32-true"
    documents: tuple[int, ...] = ()  # packed rows: document lengths (position_ids restart at each)
    drop_last_loss_chunk: bool = False  # negative control: the chunked loss skips its last chunk
    ring_attention: bool = True  # False, negative control: each ring rank attends to its own tokens only
    meta_init: bool = False  # train a copy built on the meta device, materialised by the strategy
    multimodal_positions: bool = False  # position_ids [3, S] per sample (Qwen2-VL's rotary sections)


RING = {"ulysses_degree": "auto", "ring_layout": "zigzag"}
RING_CONTIGUOUS = {"ulysses_degree": "auto", "ring_layout": "contiguous"}
CASES = {
    "llama_gqa": Case(LlamaModule, {"heads": 4, "kv_heads": 2}),
    "llama_1kv": Case(LlamaModule, {"heads": 4, "kv_heads": 1}),
    "llama_gqa_no_sac": Case(LlamaModule, {"heads": 4, "kv_heads": 2}, strategy_kwargs={"sac": False}),
    "llama_gqa_auto_sac": Case(LlamaModule, {"heads": 4, "kv_heads": 2}, strategy_kwargs={"sac": "auto"}),
    "gpt_shift": Case(GPTModule),
    "gpt_shift_no_sac": Case(GPTModule, strategy_kwargs={"sac": False}),
    "gpt_triu_mask": Case(GPTModule, {"mask": "triu"}),  # plain causal: becomes is_causal=True
    "gpt_window_mask": Case(GPTModule, {"mask": "window"}),  # not causal: rebuilt at the global length
    "gpt_graph_break": Case(GPTModule, {"graph_break": "between_layers"}),
    "gpt_graph_break_in_loop": Case(GPTModule, {"graph_break": "in_loop"}),
    # The model builds one causal mask for all layers; DDP's split puts it and the attentions in
    # different graphs.
    "gpt_ddp_buckets": Case(GPTModule, {"dim": 256, "mask": "shared"}, strategy_kwargs={"bucket_cap_mb": 1}),
    # Given a tokenizer's attention_mask, HF builds one mask for all layers, from per-token data.
    "llama_ddp_buckets": Case(TokenizedLlamaModule, {"hidden": 256}, strategy_kwargs={"bucket_cap_mb": 1}),
    "gpt_len61": Case(GPTModule, seq_len=61, ignored_tail=(5, 9)),
    "llama_len61": Case(LlamaModule, seq_len=61, ignored_tail=(5, 9)),
    "gpt_sp_pass_off": Case(GPTModule, sp_pass=False),
    "ddp_sp1": Case(GPTModule, sp_size=1),
    "fsdp_sp1": Case(GPTModule, sp_size=1, strategy_kwargs={"data_parallel": "fsdp"}),
    "llama_bf16_mixed": Case(LlamaModule, {"heads": 4, "kv_heads": 2}, precision="bf16-mixed"),
    "fsdp_llama_bf16_mixed": Case(
        LlamaModule,
        {"heads": 4, "kv_heads": 2},
        precision="bf16-mixed",
        strategy_kwargs={"data_parallel": "fsdp"},
    ),
    "gpt_inductor": Case(GPTModule, {"mask": "triu"}, seq_len=25, strategy_kwargs={"compiler": "inductor"}),
    "gpt_len61_b1_inductor": Case(
        GPTModule, seq_len=61, batch_size=1, strategy_kwargs={"compiler": "inductor"}
    ),
    # Every region SAC rebuilds runs over tiles of tokens (Note [Row tiling]); HF Llama saves its final
    # norm's input, so its last block's MLP is rebuilt tile by tile in backward like the others.
    "llama_len61_b1_inductor_tiled": Case(
        LlamaModule, seq_len=61, batch_size=1, strategy_kwargs={"compiler": "inductor", "sac_tile_bytes": 0}
    ),
    # Every layer rebuilds attention and its all-to-alls in backward (Note [Layers that recompute
    # attention]): the rebuilt all-to-alls and the gradients' run in one order on ranks of 31 and 30 tokens.
    "llama_len61_b1_inductor_longest": Case(
        LlamaModule, seq_len=61, batch_size=1, strategy_kwargs={"compiler": "inductor", "sac": "longest"}
    ),
    # A budget of 100 KiB sends one of the two layers: SAC tags about 147 KiB of this step to keep, a layer
    # rebuilding its attention frees about 70 KiB of it.
    "gpt_len61_activation_budget": Case(
        GPTModule, seq_len=61, ignored_tail=(5, 9), strategy_kwargs={"activation_budget": 100 << 10}
    ),
    # ALST's recipe as two options: every layer rebuilt in backward, its input in host memory until then
    # (Note [Activation offload]; on CPU the copies stay in host memory, and the numbers must not move).
    "gpt_len61_longest_offload": Case(
        GPTModule, seq_len=61, strategy_kwargs={"sac": "longest", "offload_activations": True}
    ),
    # Chunked LM head + loss, 5 tokens a chunk: uneven shards (31 + 30), ragged last chunks, ignored labels.
    "gpt_chunked_loss": Case(
        GPTModule, seq_len=61, ignored_tail=(5, 9), strategy_kwargs={"loss_chunk_tokens": 5}
    ),
    "llama_chunked_loss": Case(
        LlamaModule, seq_len=61, ignored_tail=(5, 9), strategy_kwargs={"loss_chunk_tokens": 5}
    ),
    "gpt_chunked_loss_broken": Case(
        GPTModule, seq_len=61, strategy_kwargs={"loss_chunk_tokens": 5}, drop_last_loss_chunk=True
    ),
    "dp2_sp2": Case(GPTModule, seq_len=30, batch_size=2, ignored_tail=(0, 7, 13, 29)),
    "dp2_sp2_llama": Case(LlamaModule, {"heads": 4, "kv_heads": 2}, seq_len=30, ignored_tail=(3, 0, 29, 11)),
    # data_parallel="fsdp": parameters sharded over all dp x sp ranks, gathered where the step uses them
    # (per_step: FSDP2 gathers the module around the step); the loss is chunked, 5 tokens a chunk.
    "fsdp_gpt": Case(
        GPTModule,
        seq_len=25,
        ignored_tail=(0, 7),
        strategy_kwargs={"data_parallel": "fsdp", "loss_chunk_tokens": 5},
    ),
    "fsdp_llama": Case(LlamaModule, {"heads": 4, "kv_heads": 2}, strategy_kwargs={"data_parallel": "fsdp"}),
    "fsdp_gpt_inductor": Case(
        GPTModule, seq_len=25, strategy_kwargs={"data_parallel": "fsdp", "compiler": "inductor"}
    ),
    "fsdp_dp2_sp2": Case(
        GPTModule, seq_len=30, ignored_tail=(0, 7, 13, 29), strategy_kwargs={"data_parallel": "fsdp"}
    ),
    # The user's own units from configure_model are kept; blocks called inside the loop over layers are
    # graph breaks in a loop, which Dynamo cannot compile around (Note [FSDP units under a compiled step]).
    "fsdp_user_units": Case(UserShardedGPTModule, strategy_kwargs={"data_parallel": "fsdp"}),
    "fsdp_user_head_unit": Case(
        UserShardedGPTModule, {"units": "head_then_model"}, strategy_kwargs={"data_parallel": "fsdp"}
    ),
    "fsdp_user_blocks": Case(
        UserShardedGPTModule, {"units": "blocks"}, strategy_kwargs={"data_parallel": "fsdp"}
    ),
    # Packed rows of 3 documents (7 + 11 + 7 tokens, shards of 13 + 12): attention must not cross them.
    "llama_packed": Case(PackedLlamaModule, seq_len=25, batch_size=1, documents=(7, 11, 7)),
    "gpt_document_mask": Case(DocumentMaskGPTModule, seq_len=25, documents=(7, 11, 7)),
    # flash-attn (CPU kernels for its ops: tests/flash_stand_in.py): GQA 1 KV head over sp=2, window, softcap.
    "flash_gqa_window": Case(FlashGPTModule, {"kv_heads": 1, "window": 8, "softcap": 5.0}, seq_len=25),
    # sp=4 over 2 q heads: Ulysses 2 (auto) x ring 2, and all ring (ulysses_degree=1). Lengths do not
    # divide 2 x ring: uneven zigzag chunks; ignored labels; 1 KV head replicated to the Ulysses degree.
    "ring_gpt_contiguous": Case(
        GPTModule, {"heads": 2}, seq_len=30, sp_size=4, ignored_tail=(0, 7), strategy_kwargs=RING_CONTIGUOUS
    ),
    "ring_gpt_zigzag": Case(
        GPTModule, {"heads": 2}, seq_len=30, sp_size=4, ignored_tail=(0, 7), strategy_kwargs=RING
    ),
    "ring_gpt_window_all_ring": Case(
        GPTModule,
        {"heads": 2, "mask": "window"},
        seq_len=29,
        sp_size=4,
        strategy_kwargs={**RING, "ulysses_degree": 1},
    ),
    "ring_llama_zigzag": Case(
        LlamaModule,
        {"heads": 2, "kv_heads": 1},
        seq_len=30,
        sp_size=4,
        ignored_tail=(3, 11),
        strategy_kwargs=RING,
    ),
    "ring_llama_contiguous_all_ring": Case(
        LlamaModule,
        {"heads": 2, "kv_heads": 1},
        seq_len=30,
        sp_size=4,
        strategy_kwargs={**RING_CONTIGUOUS, "ulysses_degree": 1},
    ),
    "ring_gpt_zigzag_ring_off": Case(
        GPTModule, {"heads": 2}, seq_len=30, sp_size=4, strategy_kwargs=RING, ring_attention=False
    ),
    "flash_varlen_packed": Case(
        FlashGPTModule, {"varlen": True}, seq_len=25, batch_size=1, documents=(7, 11, 7)
    ),
}


# Training steps as users write them (tests/distributed/user_modules.py, issue 14): exact, or refused
# with the same error on every rank. Odd lengths give uneven shards; the defaults (Inductor + SAC) too.
INDUCTOR = {"compiler": "inductor"}
WHOLE = {"trace_length": "whole"}
NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0}
CASES.update(
    {
        "idiom_learned_table": Case(
            SlicedTableGPT, {"positions": "learned"}, seq_len=25, strategy_kwargs=INDUCTOR
        ),
        "idiom_rope_table": Case(SlicedTableGPT, {"positions": "rope"}, seq_len=24),
        "idiom_litgpt": Case(LitGPTModule, seq_len=25),
        "idiom_opt_cumsum_positions": Case(
            HFModule, {"family": "opt", "ffn_dim": 64, "word_embed_proj_dim": 32, **NO_DROPOUT}, seq_len=24
        ),
        "idiom_window_equals_shard": Case(HFModule, {"family": "mistral", "sliding_window": 12}, seq_len=24),
        "idiom_nll_of_log_softmax": Case(LossGPT, {"loss": "nll"}, seq_len=25, ignored_tail=(3, 7)),
        "idiom_sum_over_count": Case(
            LossGPT, {"loss": "sum_over_count"}, seq_len=25, ignored_tail=(3, 7), strategy_kwargs=INDUCTOR
        ),
        "idiom_rolled_labels": Case(LossGPT, {"loss": "roll"}, seq_len=24),
        "idiom_per_token_losses": Case(LossGPT, {"loss": "mean_none"}, seq_len=25, ignored_tail=(3, 7)),
        "idiom_sort": Case(SequenceIdiomGPT, {"idiom": "sort_over_sequence"}, seq_len=25),
        "idiom_pool_last_token": Case(SequenceIdiomGPT, {"idiom": "pool_last_token"}, seq_len=25),
        "idiom_conv_over_sequence": Case(
            SequenceIdiomGPT, {"idiom": "conv_over_sequence"}, seq_len=25, strategy_kwargs=INDUCTOR
        ),
        "idiom_refused_branch_on_length": Case(
            SequenceIdiomGPT, {"idiom": "branch_on_length"}, strategy_kwargs={"trace_length": "shard"}
        ),
        # Note [Tracing at the whole sequence's length]: Python on the length sees the whole sequence, by
        # default (trace_length="auto" traces again at the whole length after the branch is found)
        "idiom_branch_on_length_auto": Case(
            SequenceIdiomGPT, {"idiom": "branch_on_length"}, strategy_kwargs=INDUCTOR
        ),
        # the last 16 of 25 tokens: a branch on the length (traced again whole), then a fixed-length sequence
        "idiom_truncate_auto": Case(SequenceIdiomGPT, {"idiom": "truncate_to_fixed_length"}, seq_len=25),
        "idiom_refused_eager_token_mean": Case(SequenceIdiomGPT, {"idiom": "eager_token_mean"}),
        "idiom_chunked_scan_whole": Case(
            SequenceIdiomGPT, {"idiom": "chunked_scan"}, seq_len=25, strategy_kwargs={**WHOLE, **INDUCTOR}
        ),
        "idiom_multimodal_position_ids": Case(
            MultimodalQwen,
            seq_len=25,
            multimodal_positions=True,
            strategy_kwargs={"find_unused_parameters": True},
        ),
        "idiom_metric_in_training_step": Case(MetricLlama, seq_len=64, batch_size=1),
        "idiom_insert_token": Case(
            SequenceIdiomGPT, {"idiom": "insert_token"}, seq_len=25, strategy_kwargs=INDUCTOR
        ),
    }
)


def _with_strategy(name: str, **strategy_kwargs: object) -> Case:
    """Case ``name`` with these strategy options added."""
    case = CASES[name]
    return replace(case, strategy_kwargs={**case.strategy_kwargs, **strategy_kwargs})


# Cases above again under data_parallel="fsdp" (parameters gathered per use), or gathered per step.
CASES.update(
    {
        "fsdp_gpt_per_step": _with_strategy("fsdp_gpt", fsdp_gather="per_step"),
        # the shards of parameters, gradients and AdamW's state in host memory (FSDP2's CPUOffloadPolicy)
        "fsdp_gpt_per_step_offload": _with_strategy(
            "fsdp_gpt", fsdp_gather="per_step", offload_parameters=True
        ),
        "llama_packed_fsdp": _with_strategy("llama_packed", data_parallel="fsdp"),
        "flash_gqa_window_fsdp": _with_strategy("flash_gqa_window", data_parallel="fsdp"),
        "ring_llama_zigzag_fsdp": _with_strategy("ring_llama_zigzag", data_parallel="fsdp"),  # 4 ranks
        # Built on the meta device and materialised shard by shard from the reference's seed: the
        # weights, and so the step, must equal the single-device model's (4 ranks, dp=2 x sp=2).
        "fsdp_meta_dp2_sp2": replace(CASES["fsdp_dp2_sp2"], meta_init=True),
        "fsdp_meta_dp2_sp2_per_step": replace(
            _with_strategy("fsdp_dp2_sp2", fsdp_gather="per_step"), meta_init=True
        ),
    }
)


def make_samples(case: Case, count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1234)
    samples = []
    for index in range(count):
        ids = torch.randint(0, VOCAB, (case.seq_len,), generator=generator)
        sample = {"input_ids": ids}
        if case.ignored_tail:
            labels = ids.clone()
            tail = case.ignored_tail[index % len(case.ignored_tail)]
            if tail:
                labels[-tail:] = -100
            sample["labels"] = labels
        if case.documents:
            sample.update(packed_inputs(case.documents))
        if case.multimodal_positions:
            sample["position_ids"] = multimodal_positions(case.seq_len)
        samples.append(sample)
    return samples


class Capture(L.Callback):
    def __init__(self) -> None:
        self.loss: float | None = None
        self.grads: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loss = float(outputs["loss"])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {
            n: full_tensor(p.grad).detach().clone()
            for n, p in pl_module.named_parameters()
            if p.grad is not None
        }


def one_step_trainer(case: Case, strategy: AutoSPStrategy, capture: Capture, **trainer_kwargs) -> L.Trainer:
    """A Trainer for one CPU step of ``case``, nothing logged or saved; ``capture`` records loss and grads."""
    return L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        precision=case.precision,
        callbacks=[capture],
        **trainer_kwargs,
    )


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a sharded DTensor (data_parallel="fsdp"; a collective), else ``tensor``."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def single_device_reference(
    case: Case, module: L.LightningModule, samples: list[dict], dp: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Each dp group's single-device loss and the gradients averaged over dp groups (eager)."""
    # On the samples Lightning's sampler hands dp group d (training loaders are always shuffled, seed 0);
    # all ranks of one sp group must get the same ones.
    losses, grads = [], {}
    for group in range(dp):
        indices = list(
            DistributedSampler(range(len(samples)), num_replicas=dp, rank=group, shuffle=True, seed=0)
        )
        batch = {k: torch.stack([samples[i][k] for i in indices]) for k in samples[0]}
        module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16-mixed"):
            loss = module.training_step(batch, 0)
        loss.backward()
        losses.append(loss.item())
        for n, p in module.named_parameters():
            if p.grad is not None:  # a parameter the loss never reaches has no gradient on either side
                grads[n] = grads.get(n, 0) + p.grad / dp
    module.zero_grad()
    return losses, grads


def run_case(name: str, case: Case) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // case.sp_size
    samples = make_samples(case, dp * case.batch_size)
    torch.manual_seed(0)
    module = case.module(**case.module_kwargs)
    losses, grads = single_device_reference(case, module, samples, dp)
    reference_loss = losses[rank // case.sp_size]
    cross_document = cross_document_rel_diff(module, samples, reference_loss) if dp == 1 else None

    strategy = AutoSPStrategy(sp_size=case.sp_size, **{"compiler": "aot_eager", **case.strategy_kwargs})
    if not case.sp_pass:  # negative control: the passes report attention but rewrite nothing
        backend_module.sequence_parallel_pass = lambda gm, *args, **kwargs: (
            gm,
            SPReport(attention=["skipped"]),
        )
    capture = Capture()
    trainer = one_step_trainer(case, strategy, capture, devices=world)
    trained = module
    if case.meta_init:
        with torch.device("meta"):
            trained = case.module(**case.module_kwargs)
        torch.manual_seed(0)  # the generator state the reference was built from
    all_chunks = chunked_loss.token_chunks
    with contextlib.ExitStack() as patches:
        if not case.ring_attention:
            patches.enter_context(
                mock.patch.object(attention, "_lower_to_ring_attention", lambda graph, node, ctx: node)
            )
        if case.drop_last_loss_chunk:
            patches.enter_context(
                mock.patch.object(chunked_loss, "token_chunks", lambda *args: all_chunks(*args)[:-1])
            )
        trainer.fit(trained, DataLoader(samples, batch_size=case.batch_size, shuffle=False))
    checkpoint = Path(os.environ["AUTOSP_PARITY_OUT"], f"{name}.ckpt")
    trainer.save_checkpoint(checkpoint)
    saved_keys = set(torch.load(checkpoint, weights_only=False)["state_dict"])
    backends = list(strategy.backends.values())
    return {
        "loss": capture.loss,
        "reference_loss": reference_loss,
        "loss_rel_err": abs(capture.loss - reference_loss) / abs(reference_loss),
        "grad_rel_err": grad_rel_err(capture.grads, grads),
        "missing_grads": sorted(set(grads) - set(capture.grads)),
        "all_to_alls": sum(r.all_to_alls for b in backends for r in b.reports),
        "ring_attentions": sum(len(r.ring_attention) for b in backends for r in b.reports),
        "graphs": sum(len(b.reports) for b in backends),
        "saved_bytes": sum(r.saved_bytes for b in backends for r in b.sac_reports),
        "backward_parameter_gathers": sum(r.parameter_gathers for b in backends for r in b.sac_reports),
        "gathers_in_compute_dtype": sum(r.gathers_in_compute_dtype for b in backends for r in b.sac_reports),
        "tiled_regions": sum(r.tiled_regions for b in backends for r in b.sac_reports),
        "backward_collectives": sum(r.backward_collectives for b in backends for r in b.sac_reports),
        "layers_rebuilding_attention": sum(
            len(report.attention_recompute.chosen)
            for b in backends
            for report in b.sac_reports
            if report.attention_recompute
        ),
        "checkpoint_keys_match": saved_keys == set(module.state_dict()),
        "sharded": all(isinstance(p, DTensor) for p in trained.parameters()),
        "offload_policy": _offload_policy(trained),
        "explain": strategy.explain(),
        "cross_document_rel_diff": cross_document,
    }


def _offload_policy(module: torch.nn.Module) -> str | None:
    """The name of the offload policy of the FSDP2 unit that is the module, if it is one."""
    group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
    return type(group.offload_policy).__name__ if group is not None else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="+", required=True)
    args = parser.parse_args()
    os.environ["AUTOSP_PARITY_OUT"] = args.out
    Path(args.out).mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    flash_ops = contextlib.ExitStack()
    if any(issubclass(CASES[n].module, FlashGPTModule) for n in args.cases):
        flash_ops.enter_context(flash_attn_stand_in())  # CPU kernels for flash-attn's ops
    results = {}
    for name in args.cases:
        torch._dynamo.reset()
        original_pass = backend_module.sequence_parallel_pass
        start = time.monotonic()
        try:
            results[name] = run_case(name, CASES[name])
        except Exception as error:  # recorded per case so one failure does not hide the others
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        finally:
            backend_module.sequence_parallel_pass = original_pass
        results[name]["seconds"] = round(time.monotonic() - start, 1)  # where a launch's time goes
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    flash_ops.close()
    end_worker()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
