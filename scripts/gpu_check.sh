#!/usr/bin/env bash
# The device check for issue 22, on one CUDA GPU (an H200), in a bare copy of the repository: vlmq not installed,
# no network, none of the SDK's dependencies (Celery, Redis, boto3) needed.
#
#   bash scripts/gpu_check.sh                # the whole check; results into $OUT, else bench-results/gpu
#   bash scripts/gpu_check.sh --dry-run      # lists the setup and the steps, runs nothing
#   bash scripts/gpu_check.sh --setup-only   # setup and import preflight only (works without a GPU)
#
# Through the device tool, $OUT is the folder whose files come back (at most 8): the check writes 7 there
# (gpu_check.log with every step's output, summary.json, kernel-tests.xml, kernels.json, engine-tests.xml,
# tp-tests.xml, engine.json); copy them into bench-results/gpu/ to commit them. Python: $PY, else python3 (the device's torch).
#
# Setup: vlmq.workers and vlmq.kernels exist only through setup.py's package_dir mapping, so a bare tree must be
# installed: `pip install --no-deps --no-build-isolation --no-index -e .` (the environment's setuptools; the
# optional C resampler is built where a compiler works, else preprocessing uses PIL's resize: the same pixels);
# where pip fails, a path hook (a .pth in site-packages) maps the two folders instead. Then a preflight imports
# what every step imports (pytest collection of both test steps, both benchmark scripts) and records the versions
# and the image processor class in summary.json.
#
# Steps, cheapest and most informative first (a failed step is recorded and the next one still runs):
#   1. kernel-tests: Triton kernels vs their references on the GPU (tests/kernels -m gpu)
#   2. kernels: bench_kernels_gpu.py: cascade vs per-sequence decode (group 16 first), decode bandwidth vs HBM peak
#   3. engine-tests: engine greedy parity vs transformers on CUDA, fp32 on every prompt, bf16 on >= 95% (tests/gpu)
#   4. tp: the sharded LM over NCCL, one GPU per rank, equal to the whole model (tests/gpu/test_tensor_parallel_gpu.py;
#      skipped, saying so in the log and tp-tests.xml, where the machine has fewer than 2 GPUs)
#   5. engine: bench_engine_gpu.py: mixed captions vs transformers, then the per-resolution table, 2B then 7B shapes
# The benchmarks rewrite their JSON after every measurement, and summary.json is rewritten after every step, so a
# run stopped early keeps what it measured. Pytest runs with -W default: a warning seen only on CUDA is listed in
# the log instead of failing the test (CI keeps pyproject's warnings-are-errors).
#
# Time: the device tool runs one command for at most 600 s, inside a 15-minute lease that also pays the machine's
# start (1-2 min) and the transfers. The whole check stops itself by BUDGET_S (560 s) after its start: each step
# runs under min(its cap, the time left), and the last step takes what the others left.
# ESTIMATE for an H200, not a measurement (no GPU has run this yet), from counts made on CPU:
#   setup + preflight   ~20 s   pip -e with the C resampler (~2 s here), imports of torch/transformers, collection
#   kernel-tests        ~35 s   12 tests; ~25 Triton specialisations (0.3 s each compiled for sm_90 here, so
#                               ~0.5-1 s there), float64 references on the GPU; cap 60 s
#   kernels             ~40 s   6 cascade + 12 decode rows, each a CUDA graph capture + 20 timed replays; the
#                               largest decode cell is 4.3 GB of KV (batch 128 x 16k tokens); cap 75 s
#   engine-tests        ~90 s   transformers: 2 dtypes x 148 prompts one at a time, 6.7 new tokens each (992 over
#                               the 148, counted on CPU) = ~2,300 forward steps at ~8 ms (launch-bound 4-layer
#                               model) ~20-25 s; the engine: 7 runs, each a load, up to 11 CUDA graph buckets
#                               captured on first use (4 of the runs) and 34 steps for the 148 requests (counted
#                               on CPU), ~4-6 s each; first Triton compiles ~10 s; cap 150 s
#   engine              ~250 s  2B (~105 s): build and save 4.4 GB, load twice, warm-up (graph capture, Triton),
#                               mixed captions (engine; transformers at batch 8/16/32 over 48 requests of 9-64
#                               tokens, ~25 ms per generate step) ~30 s, then 4 resolutions x batches 1/8/64 with
#                               32 new tokens each side ~40 s; 7B (~145 s) the same with 16.6 GB and slower steps;
#                               the 2B part holds the issue's targets; cap 300 s or what is left
#   total               ~435 s of the 560 s budget; worst case (every step at its cap) 560 s, the 7B rows cut.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-$(command -v python3 || command -v python)}
OUT=${OUT:-bench-results/gpu}
BUDGET_S=${BUDGET_S:-560}
SETUP_WITH=${SETUP_WITH:-auto}  # hook: skip pip, use the path hook (tests/gpu/test_gpu_check_script.py checks both)
MODE=run
case ${1:-} in
  --dry-run) MODE=dry ;;
  --setup-only) MODE=setup ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --setup-only]"; exit 64 ;;
esac
START=$(date +%s)
# no network there: nothing may wait on a connection (every model and processor is read from a local folder)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PIP_NO_INDEX=1
PYTEST="$PY -m pytest -m gpu -v -p no:cacheprovider -W default"
STEPS=(
  "kernel-tests|60|$PYTEST --timeout 50 tests/kernels --junitxml=$OUT/kernel-tests.xml"
  "kernels|75|$PY scripts/bench_kernels_gpu.py --iters 20 --out $OUT/kernels.json"
  "engine-tests|150|$PYTEST -s tests/gpu --ignore=tests/gpu/test_tensor_parallel_gpu.py --junitxml=$OUT/engine-tests.xml"
  "tp|60|$PYTEST -rs tests/gpu/test_tensor_parallel_gpu.py --junitxml=$OUT/tp-tests.xml"
  "engine|300|$PY scripts/bench_engine_gpu.py --max-new-tokens 32 --num-mixed 48 --out $OUT/engine.json"
)

if [[ $MODE == dry ]]; then
  echo "# setup: vlmq importable (already, else pip install --no-deps --no-build-isolation --no-index -e ., else a"
  echo "# path hook), then a preflight of every step's imports; then the steps, within ${BUDGET_S}s in all:"
  for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<< "$step"
    echo "$name (timeout ${limit}s): $cmd"
  done
  exit 0
fi

importable() { (cd "$ROOT/scripts" && "$PY" -c "import vlmq.workers, vlmq.kernels" 2>/dev/null); }

path_hook() {  # vlmq.workers -> workers/, vlmq.kernels -> kernels/ (setup.py's package_dir), vlmq from the tree
  "$PY" - "$ROOT" <<'EOF'
import site, sys
from pathlib import Path
root = sys.argv[1]
hook = f'''"""Written by scripts/gpu_check.sh: the package_dir mapping of setup.py for the tree at {root}."""
import importlib.abc, importlib.util, sys
FOLDERS = {{"vlmq.workers": "{root}/workers", "vlmq.kernels": "{root}/kernels"}}
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        folder = FOLDERS.get(name)
        return folder and importlib.util.spec_from_file_location(
            name, folder + "/__init__.py", submodule_search_locations=[folder])
sys.meta_path.append(Finder())
if "{root}" not in sys.path:
    sys.path.append("{root}")
'''
for folder in [*site.getsitepackages(), site.getusersitepackages()]:
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "_vlmq_gpu_check_hook.py").write_text(hook)
        (Path(folder) / "_vlmq_gpu_check_hook.pth").write_text("import _vlmq_gpu_check_hook\n")
        print(f"path hook in {folder}")
        break
    except OSError:
        continue
EOF
}

setup_vlmq() {  # prints how vlmq became importable: already, pip-editable, path-hook (or failed)
  if importable; then echo already; return; fi
  [[ $SETUP_WITH != hook ]] && PIP_DISABLE_PIP_VERSION_CHECK=1 timeout 120 "$PY" -m pip install --no-deps \
    --no-build-isolation --no-index --root-user-action=ignore -e "$ROOT" >&2 && importable \
    && { echo pip-editable; return; }
  path_hook >&2 && importable && { echo path-hook; return; }
  echo failed
}

preflight() {  # every step's imports, then versions and choices as one JSON object on the last line
  (cd "$ROOT/scripts" && timeout 60 "$PY" -c "import bench_engine_gpu, bench_kernels_gpu") || return 1
  local collected
  collected=$(timeout 60 $PY -m pytest --collect-only -q -p no:cacheprovider -m gpu tests/kernels tests/gpu 2>&1) \
    || { echo "$collected"; return 1; }
  echo "${collected##*$'\n'}"
  timeout 60 "$PY" - <<'EOF'
import importlib.metadata as md, importlib.util, json, sys, torch
from vlmq.workers.engine import resample
from vlmq.workers.engine.device_defaults import default_block_size, flash_attn_installed
from vlmq.workers.models.processor import load_processor
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
processor = load_processor("workers/assets/tiny-shapes").image_processor
print(json.dumps({
    "python": sys.version.split()[0], **{n: version(n) for n in ("torch", "transformers", "triton", "torchvision")},
    "flash_attn": flash_attn_installed(), "cuda_block_size": default_block_size("cuda", flash_attn_installed()),
    "c_resampler": resample.AVAILABLE, "image_processor": type(processor).__name__,
    "sdk_deps_missing": [n for n in ("celery", "kombu", "redis", "boto3") if importlib.util.find_spec(n) is None],
}))
EOF
}

write_summary() {
  printf '{"device": %s, "setup": {"vlmq": "%s", "seconds": %d}, "env": %s, "budget_s": %d, "steps": {%s}}\n' \
    "${device_json:-null}" "$install" "$setup_s" "$env_json" "$BUDGET_S" "${steps_json%, }" > "$OUT/summary.json"
}

run_steps() {  # each under min(its cap, the budget left); summary.json rewritten after each
  export TRITON_INTERPRET=0  # compiled kernels, whatever tests/conftest.py guesses from /dev/nvidiactl
  local failed=0 step name limit cmd left begin rc
  for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<< "$step"
    left=$(( BUDGET_S - ($(date +%s) - START) ))
    (( limit > left )) && limit=$left
    if (( left < 10 )); then
      echo "== $name: skipped, ${left}s of the budget left"
      steps_json+="\"$name\": {\"rc\": null, \"skipped\": \"no time left\"}, "
      failed=1
      continue
    fi
    echo "== $name (timeout ${limit}s, $(date -u +%T)): $cmd"
    begin=$(date +%s)
    timeout "$limit" bash -c "$cmd"
    rc=$?
    (( rc != 0 )) && failed=1
    steps_json+="\"$name\": {\"rc\": $rc, \"timeout_s\": $limit, \"seconds\": $(( $(date +%s) - begin ))}, "
    write_summary
  done
  write_summary
  cat "$OUT/summary.json"
  return $failed
}

check() {
  echo "== setup ($(date -u +%FT%TZ)): $PY"
  install=$(setup_vlmq)
  echo "vlmq: $install"
  env_json=$(preflight | tee /dev/stderr | tail -1)
  [[ $env_json == \{* ]] || env_json=null
  echo "preflight: $([[ $env_json == null ]] && echo FAILED || echo ok)"
  setup_s=$(( $(date +%s) - START ))
  steps_json=""
  write_summary
  if [[ $MODE == setup ]]; then
    [[ $install != failed && $env_json != null ]]
    return
  fi
  run_steps
}

if [[ $MODE == run ]]; then  # before anything is written
  device=$($PY -c "import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name())" 2>/dev/null) \
    || { echo "no CUDA device: nothing to check (--dry-run lists the steps; --setup-only checks the setup)"; exit 2; }
  smi=$(nvidia-smi --query-gpu=memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
  device_json="\"$device; $smi\""
fi
mkdir -p "$OUT"
check 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
