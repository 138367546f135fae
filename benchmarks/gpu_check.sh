#!/usr/bin/env bash
# The GPU checks, prepared as one run of at most TOTAL_S seconds (default 540) on one machine with CUDA
# GPUs (a lent H200 gives a session 15 minutes of device time, machine start included).
#
#   bash benchmarks/gpu_check.sh             # on a machine with CUDA GPUs, from anywhere in the repository
#   bash benchmarks/gpu_check.sh --dry-run   # anywhere: every step's code path on the CPU, tiny
#
# Steps, in this order, each killed at its time box (seconds; the environment variables override them):
#   0. (60 s) that the CUDA attention backwards read their output only through its row sums, as
#      compiler/partition/row_sums.py relies on: `pytest tests/unit/test_row_sums.py -k "cuda or cpu_flash"`
#   1. ring attention on the GPU kernels (RING_S=150): `python -m benchmarks.ring_kernels`: parity of
#      the ring with SDPA per kernel (flash bf16/fp16 with a padded head dim, efficient fp32 and with
#      flash off), time and peak memory against the dense fp32 fallback -> ring_kernels.json, .md
#   2. the headline at real sizes (HEADLINE_S=240): `python -m benchmarks.headline`: SAC's trainable length
#      against hand-written Ulysses' at Llama-3.2-1B shapes (HEADLINE_LAYERS=4 layers, bf16), measured on
#      this GPU as sp=1 and as rank 0 of sp=8 (the other ranks stood in by torch's fake process group)
#      -> headline.json, .md (extra arguments: HEADLINE_ARGS)
#   2b. the memory policies at the same shapes (OFFLOAD_S=120): `python -m benchmarks.headline --methods longest
#      longest_offload`: sac="longest" with and without its layer inputs in host memory (offload_activations,
#      compiler/partition/offload.py), sp=1 and rank 0 of sp=8 -> offload.json, .md
#   3. the trainability suite (TRAIN_S=150): `python -m benchmarks.trainability --out FILE`, skipped with a
#      message while that module does not exist -> trainability.json (extra arguments: TRAIN_ARGS)
#   4. the model zoo (ZOO_S=150): `python -m benchmarks.zoo --out FILE`, likewise -> zoo.json (ZOO_ARGS)
#   5. the side-by-side suite, `python -m benchmarks.run --suite gpu` (SP+SAC, SP, DeepSpeed, ...), in the
#      time left (at least MIN_RUN_S=120, else skipped) -> gpu.json, .md, .png; extra arguments go to it.
# Results go to GPU_CHECK_OUT (default benchmarks/results/gpu_check), with summary.md: the machine, and
# every step's status, time and the tail of its log. Where OUT is set (the device tool's folder of files
# to bring back), the results are packed into $OUT/gpu_check.tgz and summary.md, headline.md and
# ring_kernels.md are copied next to it.
set -uo pipefail

cd "$(dirname "$0")/.."
TOTAL_S="${TOTAL_S:-540}"
RING_S="${RING_S:-120}"
HEADLINE_S="${HEADLINE_S:-240}"
HEADLINE_LAYERS="${HEADLINE_LAYERS:-4}"
TRAIN_S="${TRAIN_S:-150}"
ZOO_S="${ZOO_S:-150}"
OFFLOAD_S="${OFFLOAD_S:-120}"
MIN_RUN_S="${MIN_RUN_S:-120}"
RESULTS="${GPU_CHECK_OUT:-benchmarks/results/gpu_check}"
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.md"
start=$(date +%s)

dry_run=0
args=()
for arg in "$@"; do
  if [[ "$arg" == "--dry-run" ]]; then dry_run=1; else args+=("$arg"); fi
done

left() { echo $(( TOTAL_S - ($(date +%s) - start) )); }
box() { local cap=$1 remaining; remaining=$(left); echo $(( cap < remaining ? cap : remaining )); }
has_module() { python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

# step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS, log it, record the outcome in summary.md
step() {
  local name=$1 seconds=$2 t0 status
  shift 2
  local log="$RESULTS/$name.log"
  if (( seconds < 10 )); then
    printf '| %s | skipped: %s s left of TOTAL_S=%s | | |\n' "$name" "$(left)" "$TOTAL_S" >> "$SUMMARY"
    return
  fi
  echo "== $name (at most $seconds s): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$seconds" "$@" > "$log" 2>&1
  status=$?
  tail -n 15 "$log"
  local outcome="exit $status"
  (( status == 124 || status == 137 )) && outcome="killed at its time box ($seconds s)"
  printf '| %s | %s | %s s | `%s` |\n' "$name" "$outcome" "$(( $(date +%s) - t0 ))" "$*" >> "$SUMMARY"
}

skip() { printf '| %s | skipped: %s | | |\n' "$1" "$2" >> "$SUMMARY"; echo "== $1 skipped: $2"; }

{
  echo "# GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null))"
  echo
  echo '```'
  python - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB, sm{props.major}{props.minor}")
EOF
  echo '```'
  echo
  echo "| step | outcome | time | command |"
  echo "|---|---|---:|---|"
} > "$SUMMARY"
cat "$SUMMARY"

gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
if [[ "$dry_run" == 0 && "$gpus" -lt 1 ]]; then
  echo "no CUDA GPU found; use --dry-run to check the script on this machine" >&2
  exit 2
fi

# 0. the CUDA kernels' side of Note [Attention output by its row sums] (compiler/partition/row_sums.py)
step row_sums_kernels "$(box 60)" python -m pytest -q -p no:cacheprovider tests/unit/test_row_sums.py \
  -k "cuda or cpu_flash"

# 1. ring attention kernels
if [[ "$dry_run" == 1 ]]; then
  step ring_kernels "$(box "$RING_S")" python -m benchmarks.ring_kernels --device cpu --quick \
    --out "$RESULTS/ring_kernels.json"
else
  step ring_kernels "$(box "$RING_S")" python -m benchmarks.ring_kernels --out "$RESULTS/ring_kernels.json"
fi

# 2. the headline: SAC against Ulysses at Llama-3.2-1B shapes, sp=1 and rank 0 of sp=8
if [[ "$dry_run" == 1 ]]; then
  step headline "$(box "$HEADLINE_S")" python -m benchmarks.headline --device cpu --model llama-smoke \
    --layers 2 --sp 1 2 --probe-lens 256 512 --budget-mib 64 --dtype float32 --compiler aot_eager \
    --out "$RESULTS/headline.json"
else
  # shellcheck disable=SC2086  # the extra arguments are meant to split
  step headline "$(box "$HEADLINE_S")" python -m benchmarks.headline --layers "$HEADLINE_LAYERS" \
    --deadline-s $(( HEADLINE_S * 2 / 3 )) --out "$RESULTS/headline.json" ${HEADLINE_ARGS:-}
fi

# 2b. the memory policies: "longest" with and without its saved values in host memory
if [[ "$dry_run" == 1 ]]; then
  step offload "$(box "$OFFLOAD_S")" python -m benchmarks.headline --device cpu --model llama-smoke \
    --layers 2 --sp 1 2 --probe-lens 256 512 --budget-mib 64 --dtype float32 --compiler aot_eager \
    --methods longest longest_offload --out "$RESULTS/offload.json"
else
  step offload "$(box "$OFFLOAD_S")" python -m benchmarks.headline --layers "$HEADLINE_LAYERS" \
    --methods longest longest_offload --deadline-s $(( OFFLOAD_S * 2 / 3 )) --out "$RESULTS/offload.json"
fi

# 3, 4. suites that may not exist yet: run when their module is there
for suite in trainability zoo; do
  if ! has_module "benchmarks.$suite"; then
    skip "$suite" "benchmarks/$suite.py does not exist in this checkout"
    continue
  fi
  cap_var="$( [[ $suite == trainability ]] && echo TRAIN_S || echo ZOO_S )"
  extra_var="$( [[ $suite == trainability ]] && echo TRAIN_ARGS || echo ZOO_ARGS )"
  if [[ "$dry_run" == 1 ]]; then
    skip "$suite" "dry run (its own options decide what a CPU run is)"
    continue
  fi
  # shellcheck disable=SC2086  # the extra arguments are meant to split
  step "$suite" "$(box "${!cap_var}")" python -m "benchmarks.$suite" --out "$RESULTS/$suite.json" ${!extra_var:-}
done

# 5. the side-by-side suite, in the time left
remaining=$(left)
if (( remaining < MIN_RUN_S )); then
  skip side_by_side "$remaining s left, under MIN_RUN_S=$MIN_RUN_S"
elif [[ "$dry_run" == 1 ]]; then
  step side_by_side "$remaining" python -m benchmarks.run --suite gpu --device cpu --nproc 1 \
    --models llama-smoke --seq-lens 128 --headline-len 128 --parity-len 128 --granularity 64 \
    --compiler aot_eager --deadline-s $(( remaining - 60 > 30 ? remaining - 60 : 30 )) \
    --out "$RESULTS/gpu.json" ${args[@]+"${args[@]}"}
else
  step side_by_side "$remaining" python -m benchmarks.run --suite gpu --nproc "$gpus" \
    --deadline-s $(( remaining - 90 > 30 ? remaining - 90 : 30 )) --out "$RESULTS/gpu.json" \
    ${args[@]+"${args[@]}"}
fi

echo >> "$SUMMARY"
for md in headline offload ring_kernels gpu trainability zoo; do
  [[ -f "$RESULTS/$md.md" ]] && { echo "## $md"; echo; cat "$RESULTS/$md.md"; echo; } >> "$SUMMARY"
done
echo "total $(( $(date +%s) - start )) s" | tee -a "$SUMMARY"
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  tar czf "$OUT/gpu_check.tgz" -C "$RESULTS" .
  cp "$SUMMARY" "$OUT/summary.md"
  for md in headline offload ring_kernels; do [[ -f "$RESULTS/$md.md" ]] && cp "$RESULTS/$md.md" "$OUT/"; done
fi
# Every step that ran must have passed (exit 0); skipped steps do not fail the check.
! grep -q '| exit [1-9]\|killed at its time box' "$SUMMARY"
