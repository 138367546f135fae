#!/usr/bin/env bash
# GPU check of the side-by-side benchmark, prepared to finish within 8 minutes on one machine.
#
#   bash benchmarks/gpu_check.sh             # on a machine with CUDA GPUs, from anywhere in the repository
#   bash benchmarks/gpu_check.sh --dry-run   # anywhere: the plan, then the same code path on the CPU, tiny
#
# One GPU: `python -m benchmarks.run --suite gpu --nproc 1`, Llama-3.2-1B shapes cut to 4 layers, bf16,
# Inductor, 32768 tokens: real peak memory (CUDA allocator stats) and step time of SAC on/off and of every
# method that runs on one device, then the longest length each trains before a real CUDA out-of-memory
# error (doubling, then bisection; SAC on/off first). Several GPUs: the same suite over all of them (sp =
# number of GPUs), the longest length within 90% of each GPU's memory instead. The run stops starting new
# work after DEADLINE_S seconds (default 330) and is killed after HARD_LIMIT_S (default 470); what it
# measured is in benchmarks/results/gpu.json, gpu.md and gpu.png. Extra arguments go to benchmarks.run
# (e.g. --models llama-8b --layers 2, --seq-lens 65536).
set -euo pipefail

cd "$(dirname "$0")/.."
DEADLINE_S="${DEADLINE_S:-330}"
HARD_LIMIT_S="${HARD_LIMIT_S:-470}"

dry_run=0
args=()
for arg in "$@"; do
  if [[ "$arg" == "--dry-run" ]]; then dry_run=1; else args+=("$arg"); fi
done

python - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB")
EOF

if [[ "$dry_run" == 1 ]]; then
  # The plan of the real run (settings, parameter counts of the GPU shapes; nothing is allocated) ...
  python -m benchmarks.run --suite gpu --dry-run ${args[@]+"${args[@]}"}
  # ... and its code path end to end on the CPU at a tiny size: one rank, bf16, the out-of-memory search
  # (three doublings; nothing runs out of memory on the CPU), the report.
  out="$(mktemp -d)/gpu_dry_run.json"
  timeout "$HARD_LIMIT_S" python -m benchmarks.run --suite gpu --device cpu --nproc 1 --models llama-smoke \
    --seq-lens 128 --headline-len 128 --parity-len 128 --granularity 64 --compiler aot_eager \
    --deadline-s "$DEADLINE_S" --out "$out" ${args[@]+"${args[@]}"}
  python -m benchmarks.report "$out" > /dev/null
  # Every method but ring (context_parallel has no CPU attention kernel) must have run and searched.
  python - "$out" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
problems = [
    f"{s['method']}: {s.get('error') or (s.get('search') or {}).get('error')}"
    for s in report["summary"]
    if s["method"] != "ring" and (s["status"] != "ok" or (s.get("search") or {}).get("error"))
]
for s in report["summary"]:
    print(f"{s['method']}: {s['status']}, max length {(s.get('search') or {}).get('max_len')}")
sys.exit("dry run found problems:\n" + "\n".join(problems) if problems else 0)
EOF
  echo "dry run done: $out"
  exit 0
fi

gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
if [[ "$gpus" -lt 1 ]]; then
  echo "no CUDA GPU found; use --dry-run to check the script on this machine" >&2
  exit 2
fi
start=$(date +%s)
status=0
timeout --kill-after=10 "$HARD_LIMIT_S" python -m benchmarks.run --suite gpu --nproc "$gpus" \
  --deadline-s "$DEADLINE_S" ${args[@]+"${args[@]}"} || status=$?
echo "benchmarks.run exit code $status after $(( $(date +%s) - start )) s"
if [[ -f benchmarks/results/gpu.json ]]; then
  cat benchmarks/results/gpu.md
fi
exit "$status"
