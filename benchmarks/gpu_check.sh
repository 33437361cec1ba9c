#!/usr/bin/env bash
# The GPU check behind README's GPU figures (results/h200-2026-12-04-check.txt), in the order it ran:
#   bash benchmarks/gpu_check.sh OUT_DIR [SECONDS]
# Each step's JSON document is appended to OUT_DIR/results.txt as it finishes, so a step cut by the
# time budget (default 530 s, for a lease of minutes) loses only itself; progress goes to OUT_DIR/log.txt.
# The data comes from FASHIONJAX_DATA_DIR (or the Debian package); nothing is downloaded.
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [SECONDS]}
mkdir -p "$out" && cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASHIONJAX_OFFLINE=1
results=$out/results.txt log=$out/log.txt work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # the run directories: every figure is already in results.txt
ends=$(( $(date +%s) + ${2:-530} ))

record() {  # record NAME FILE: a titled JSON document in results.txt
  { echo "### $1"; cat "$2"; echo; } >>"$results"
}

step() {  # step NAME SECONDS fashionjax-args...: at most SECONDS, and never past the budget
  local name=$1 cap=$2 room=$(( ends - $(date +%s) )); shift 2
  if [ "$room" -lt 20 ]; then echo "## $name skipped: $room s left" | tee -a "$log"; return 1; fi
  [ "$cap" -gt "$room" ] && cap=$room
  echo "## $name (at most $cap s) $(date +%T): $*" | tee -a "$log"
  timeout "$cap" python3 -m fashionjax "$@" --json >"$work/step.json" 2>>"$log"
  local rc=$?
  record "$name rc=$rc" "$work/step.json"
  return $rc
}

finished_seeds() {  # the seeds a speedrun finished before its budget ran out
  for f in "$1"/seed-*/summary.json; do [ -f "$f" ] && record "$f" "$f"; done
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, jax, optax; print(sys.version.split()[0], 'jax', jax.__version__, 'optax', optax.__version__, jax.devices())"
} 2>&1 | tee -a "$log"
step doctor 90 doctor --require-gpu || exit 1
step smoke 90 train --epochs 1 --run-dir "$work/smoke" || exit 1

# A GPU-shaped recipe, fewer and larger batches: chosen on seed 10, then confirmed on seeds 0-4. Like
# every GPU recipe measured, it reads every image in every epoch, with flip TTA alone.
every_image="--focus 1 --tta-shift 0"
for recipe in "256 4e-3 8" "512 6e-3 16" "1024 8e-3 16" "1024 8e-3 24"; do
  set -- $recipe
  step "grid-b$1-lr$2-e$3" 60 speedrun --seed 10 --seeds 1 $every_image --batch-size "$1" --lr "$2" --epochs "$3" --out "$work/g-$1-$2-$3"
done
best=$(python3 - "$results" <<'EOF'
import json, sys
sys.path.insert(0, "benchmarks")
from gpu_speedrun import fastest_to_target  # one rule for both scripts: the fastest to 94%, else the most accurate
docs = {}
for block in open(sys.argv[1]).read().split("### ")[1:]:
    name, _, body = block.partition("\n")
    try:
        doc = json.loads(body) if name.startswith("grid-") else {}
    except ValueError:
        doc = {}
    if "test_accuracy_mean" in doc:
        docs[name] = doc
best = docs.get(fastest_to_target(docs))
if best:
    print(f"--batch-size {best['config']['batch_size']} --lr {best['config']['lr']} --epochs {best['config']['epochs']}")
EOF
)
echo "## best on seed 10: $best" | tee -a "$log"
[ -n "$best" ] && { step gpu-recipe 100 speedrun --seeds 5 $every_image $best --out "$work/gpu5" || finished_seeds "$work/gpu5"; }

# The CPU record's command, unchanged (batch 16).
step speedrun 130 speedrun --seeds 5 --out "$work/sr" || finished_seeds "$work/sr"

# The codelab's 400 steps, and its loop against the fused one.
step codelab 60 train --steps 400 --schedule constant --run-dir "$work/codelab"
timeout 60 python3 benchmarks/compare_codelab.py --steps 200 --repeats 5 2>&1 | tee -a "$log" "$out/compare_codelab.txt"

# 64 mlps at once against one (bench --model speedrun did not finish within 90 s there: its eager case).
step bench-members 90 bench --batch-sizes 512 --dtypes float32 --members 1,8,64 --repeats 3 --out "$work/bm"
echo "## done $(date +%T)" | tee -a "$log"
