"""Tables and plots of ``benchmarks.run`` from its JSON file alone.

    python -m benchmarks.report cpu            # rewrite benchmarks/results/cpu.md and cpu.png from cpu.json
    python -m benchmarks.report cpu --readme   # print the README's benchmark section

The summaries it renders are ``benchmarks.summary``'s (``assemble``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import RESULTS, MiB
from benchmarks.paired import interval_text
from benchmarks.summary import assemble
from lightning_autosp.extras import require

# --------------------------------------------------------------------------------------------------
# markdown


def _mib(n: float | None, digits: int = 1) -> str:
    return "—" if n is None else f"{n / MiB:.{digits}f}"


def _x(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def _err(e: float | None) -> str:
    return "—" if e is None else f"{e:.1e}"


def _max_len(s: dict) -> str:
    search = s.get("search") or {}
    if "max_len" not in search:
        return "—"
    value = search["max_len"]
    text = "none fits" if value is None else str(value)
    if search.get("capped_at_model_limit") or (value and not search.get("first_over")):
        text = f">= {text}"
    elif search.get("first_over"):
        text += f" (< {search['first_over']})"
    return text


def _compile(s: dict, settings: dict) -> str:
    first = s["compile_s"].get(str(settings["seq_lens"][0]))
    headline = s["compile_s"].get(str(settings["headline_len"]))
    if first is None:
        return "—"
    return f"{first:.0f}" + ("" if headline is None else f" / {headline:.0f}")


def _a2a(s: dict) -> str:
    if "a2a_forward_bytes_per_layer" not in s:
        return "—"
    fwd, bwd = s["a2a_forward_bytes_per_layer"], s["a2a_backward_bytes_per_layer"]
    return f"{fwd / 1024:.0f} / {bwd / 1024:.0f}"


def table_rows(report: dict) -> list[str]:
    settings = report["settings"]
    headline = str(settings["headline_len"])
    header = (
        "| model | method | step ms | vs Ulysses (paired) | saved for bw MiB | peak MiB | max length "
        "| vs DDP | compile s | loss err | grad err | a2a KiB/layer fwd / bwd |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in report["summary"]:
        if s["status"] == "failed":
            lines.append(f"| {s['model']} | {s['label']} | failed ({s['failed_at']}) | | | | | | | | | |")
            continue
        step = "—" if s.get("median_step_s") is None else f"{s['median_step_s'] * 1e3:.0f}"
        ratio = _x(s.get("time_ratio_vs_ulysses"))
        if s.get("paired_ratio_vs_ulysses") is not None:
            interval = interval_text(s.get("paired_interval_vs_ulysses"))
            ratio += f" ({s['paired_ratio_vs_ulysses']:.2f}x{'; ' + interval if interval else ''})"
        lines.append(
            f"| {s['model']} | {s['label']} | {step} | {ratio} | {_mib(s.get('saved_bytes'))} | "
            f"{_mib(s['peak_bytes'].get(headline))} | {_max_len(s)} | {_x(s.get('max_len_ratio_vs_ddp'))} | "
            f"{_compile(s, settings)} | {_err(s.get('loss_rel_err'))} | {_err(s.get('grad_rel_err'))} | "
            f"{_a2a(s)} |"
        )
    return lines


def machine_line(report: dict) -> str:
    m, st = report["machine"], report["settings"]
    where = m.get("gpu") and f"{m['gpu_count']}x {m['gpu']}" or f"{m['cpu_count']} CPUs ({m['processor']})"
    wall = f"worker wall time {report['wall_s_worker']:.0f} s"
    if "wall_s_launcher" in report:
        wall += f", launcher {report['wall_s_launcher']:.0f} s"
    return (
        f"{st['nproc']} ranks ({st['device']}, {'nccl' if st['device'] == 'cuda' else 'gloo'}), "
        f"{st['dtype']}, "
        f"batch {st['batch_size']}, compiler `{st['compiler']}`, {st['threads']} torch thread(s) per rank; "
        f"{where}, {m['platform']}, torch {m['torch']}, transformers {m['transformers']}, DeepSpeed "
        f"{m.get('deepspeed')}; {wall}; load average {m.get('loadavg_at_start')} at start, "
        f"{m.get('loadavg_at_end')} at end."
    )


def _model_text(name: str, spec: dict) -> str:
    kind = "hand-written GPT (examples.models.TinyGPT)" if spec["family"] == "gpt" else "HF LlamaForCausalLM"
    heads = f"{spec['heads']} heads" + (
        f", {spec['kv_heads']} KV heads" if spec["kv_heads"] != spec["heads"] else ""
    )
    return (
        f"`{name}` {kind}, {spec['layers']} layers, hidden {spec['hidden']}, {heads}, "
        f"vocab {spec['vocab_size']}, {spec['parameters'] / 1e6:.2f}M parameters"
    )


def _code_line(report: dict) -> str:
    code = report.get("code") or {}
    if not code.get("commit"):
        return ""
    dirty = (
        " (lightning_autosp with uncommitted changes)"
        if code.get("lightning_autosp_uncommitted_changes")
        else ""
    )
    return f" Code: commit {code['commit'][:10]}{dirty}."


def notes(report: dict) -> list[str]:
    st = report["settings"]
    memory = (
        "CUDA caching allocator `max_memory_allocated` during one step above the allocation at its start"
        if st["device"] == "cuda"
        else "high-water mark of the bytes the c10 CPU allocator handed out during one step (forward + "
        "backward + gradient sync, gradients included, parameters excluded) and still held, from the "
        f"profiler's allocation events, least of {st['profiled_steps']} steps"
    )
    budget = st.get("budget_mib")
    search = (
        f"longest length whose measured per-rank peak fits {budget:g} MiB (search on measured peaks, "
        f"lengths multiples of {st['granularity']}; `(< n)`: the shortest length measured over the budget)"
        if st["search"] == "budget"
        else "longest length that ran without a CUDA out-of-memory error (doubling, then bisection)"
        if st["search"] == "oom"
        else "not searched"
    )
    return [
        f"step ms: median over {st['repeats']} rounds of forward + backward + gradient all-reduce at "
        f"{st['headline_len']} tokens, methods alternating, max over ranks; vs Ulysses: ratio of medians "
        "(in brackets the median of per-round ratios, the slowest rank's, and where there are 6 rounds or "
        "more the 95% interval of that median: `benchmarks/paired.py`).",
        "saved for bw: distinct storages packed by `saved_tensors_hooks` during the forward, parameters "
        f"excluded, max over ranks, at {st['headline_len']} tokens.",
        f"peak: {memory}; max over ranks, at {st['headline_len']} tokens. MemTracker is not used: it is a "
        "TorchDispatchMode, under which Dynamo runs compiled code eagerly (see benchmarks/sac.py).",
        f"max length: {search}. vs DDP: ratio of the two max lengths.",
        f"compile s: first step minus a steady step, at {st['seq_lens'][0]} tokens / at {st['headline_len']} "
        "(static shapes compile again for every length; DeepSpeed's graph has a dynamic sequence length).",
        f"loss / grad err: max relative error (max|a-b| / max|b|) against one eager single-process step on "
        f"the whole sequence at {st['parity_len']} tokens; the loss each rank reports, the gradients after "
        "the method's synchronisation.",
        "a2a: bytes one rank sends to the others in all-to-alls per layer (profiler events of the process "
        "group, input bytes x (P-1)/P, even splits), forward / backward; the Ulysses formula "
        "(s/P)((P-1)/P)(2h + 2h_kv) elements per layer and direction is given below.",
        "gradient sync: one all_reduce per gradient after backward for every method but DeepSpeed "
        "(engine.backward does its own; it needs an optimizer: SGD at lr=0, no state).",
        "attention masks: this project turns HF's causal mask into `is_causal`; the hand-written baselines "
        "and DDP use a mask-free causal SDPA; DeepSpeed AutoSP, driven with the all-ones `attention_mask` "
        "its example passes (without one its pass fails), gathers HF's mask to [S, S] (quadratic memory).",
    ]


def render_markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [
        f"# Side-by-side benchmark, suite `{report['suite']}`",
        "",
        f"Generated by `python -m benchmarks.report {report['suite']}` from the JSON file of the same name. "
        f"Command: `{report['command']}`  ",
        machine_line(report) + _code_line(report),
        "",
        "Models: " + "; ".join(_model_text(name, spec) for name, spec in report["models"].items()) + ".",
        "",
        *table_rows(report),
        "",
    ]
    formula = [s for s in report["summary"] if s.get("a2a_formula_bytes_per_layer")]
    if formula:
        per_model = {s["model"]: s["a2a_formula_bytes_per_layer"] for s in formula}
        lines.append(
            "Ulysses formula at "
            f"{settings['headline_len']} tokens, P={settings['nproc']}: "
            + ", ".join(f"{m} {b / 1024:.0f} KiB/layer" for m, b in per_model.items())
            + "."
        )
        lines.append("")
    lines += ["## Targets", "", "| model | target | measured | bound | met |", "|---|---|---:|---:|---|"]
    for t in report["targets"]:
        value = "—" if t["value"] is None else f"{t['value']:.2f}x"
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        note = f" ({t['note']})" if t["note"] else ""
        bound = f"{t['relation']} {t['bound']:.2f}x"
        lines.append(f"| {t['model']} | {t['target']} | {value} | {bound} | {met}{note} |")
    failures = [s for s in report["summary"] if s["status"] == "failed"]
    if failures:
        lines += ["", "## Failures (exact errors)", ""]
        for s in failures:
            error = (s.get("error") or "").strip().replace("\n", " ")
            lines.append(f"- {s['model']} / {s['label']} at {s['failed_at']}: `{error[:600]}`")
    lines += ["", "## Notes", ""] + [f"- {note}" for note in notes(report)]
    return "\n".join(lines) + "\n"


def error_headline(error: str | None) -> str:
    """The first line of an error that says what went wrong (past wrappers such as "X raised:")."""
    lines = [line.strip() for line in (error or "").strip().splitlines() if line.strip()]
    for index, line in enumerate(lines[:-1]):
        if not line.endswith(":"):
            return " ".join(lines[: index + 1])[:300]
    return " ".join(lines[:2])[:300]


def readme_section(report: dict) -> str:
    """The README's benchmark section: command, machine, the table and the targets (notes: the .md file)."""
    suite = report["suite"]
    lines = [
        "## Benchmarks: side by side",
        "",
        f"`{report['command']}` runs the same models, batch and ranks under each method and writes "
        f"`benchmarks/results/{suite}.json`, `{suite}.md` (every note and exact error) and `{suite}.png` "
        f"(peak memory per rank against sequence length); this table is `python -m benchmarks.report {suite} "
        "--readme`, generated from the committed JSON.",
        "",
        machine_line(report) + _code_line(report),
        "",
        "Models: " + "; ".join(_model_text(name, spec) for name, spec in report["models"].items()) + ".",
        "",
        *table_rows(report),
        "",
        "| model | target | measured | bound | met |",
        "|---|---|---:|---:|---|",
    ]
    for t in report["targets"]:
        value = "—" if t["value"] is None else f"{t['value']:.2f}x"
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        note = f" ({t['note']})" if t["note"] else ""
        lines.append(
            f"| {t['model']} | {t['target']} | {value} | {t['relation']} {t['bound']:.2f}x | {met}{note} |"
        )
    for s in report["summary"]:
        if s["status"] == "failed":
            lines += ["", f"{s['label']} on {s['model']} did not run: `{error_headline(s.get('error'))}`"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# plot


def plot(report: dict, path: Path) -> None:
    require("matplotlib", extra="bench", needed_by="the benchmark report's chart (benchmarks.report)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    budget = report["settings"].get("budget_mib") if report["settings"]["search"] == "budget" else None
    colors = {method: f"C{i}" for i, method in enumerate(report["settings"]["methods"])}
    for ax, model in zip(axes[0], models):
        missing = []
        for s in report["summary"]:
            if s["model"] != model:
                continue
            if not s["peak_bytes"]:
                missing.append(f"{s['label']}: {s['status']}")
                continue
            points = sorted((int(k), v / MiB) for k, v in s["peak_bytes"].items())
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ax.plot(xs, ys, marker="o", color=colors[s["method"]], label=s["label"])
        if missing:
            ax.text(
                0.98,
                0.02,
                "not plotted: " + "; ".join(missing),
                transform=ax.transAxes,
                ha="right",
                va="bottom",
                fontsize=7,
                color="grey",
            )
        if budget:
            ax.axhline(budget, color="grey", linestyle="--", linewidth=1, label=f"budget {budget:g} MiB")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("sequence length (tokens, whole sequence)")
        ax.set_ylabel("peak memory per rank (MiB)")
        ax.set_title(f"{model}, {report['settings']['nproc']} ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(render_markdown(report))
    plot(report, out.with_suffix(".png"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", help="results/<suite>.json, or a path to a JSON file")
    parser.add_argument("--readme", action="store_true", help="print the README section instead")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    path = Path(args.suite) if args.suite.endswith(".json") else RESULTS / f"{args.suite}.json"
    report = json.loads(path.read_text())
    if report.get("kind") == "trainability":  # benchmarks.trainability: several runs, its own tables
        from benchmarks import trainability

        if args.readme:
            print(trainability.readme_section(report))
        else:
            trainability.write_outputs(report, path)
            print(trainability.render_markdown(report))
        return 0
    report = assemble(report, None)
    if args.readme:
        print(readme_section(report))
        return 0
    write_outputs(report, path)
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
