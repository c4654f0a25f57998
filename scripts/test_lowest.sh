#!/usr/bin/env bash
# The SDK suite on the lowest versions our ranges allow (uv's lowest-direct resolution, in a virtual environment
# of its own): the SDK's dependencies, the test tools, and the worker's but torch (the SDK suite compares prices
# with transformers' processors, which need no torch), so the lower bounds in pyproject.toml are tested.
# Usage: bash scripts/test_lowest.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=$(mktemp -d "${TMPDIR:-/tmp}/vlmq-lowest.XXXXXX")
trap 'rm -rf "$VENV"' EXIT
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q uv
# the SDK and test dependencies as pyproject.toml lists them, each at its lowest allowed version
DEPS=$("$VENV/bin/python" - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = ("triton", "kubernetes-validate", "flower", "kernels")  # tests/sdk needs none of these
worker_skip = ("torch", "xgrammar")  # xgrammar needs torch: the worker side, not the SDK's
extras = project["optional-dependencies"]
test = [d for d in extras["test"] if not d.startswith(skip)]
worker = [d for d in extras["worker"] if not d.startswith(worker_skip)]
print("\n".join(project["dependencies"] + test + worker))
PY
)
mapfile -t REQS <<< "$DEPS"
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --resolution lowest-direct "${REQS[@]}"
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --no-deps -e .
echo "== lowest (pip freeze) =="
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -iE '^(celery|kombu|redis|msgpack|pillow|boto3|standardwebhooks|transformers|tokenizers|numpy|moto|pytest)=='
echo "=="
"$VENV/bin/python" -m pytest tests/sdk -p no:cacheprovider --ignore tests/sdk/test_packaging.py \
  --ignore tests/sdk/test_packaging_runtime.py "$@"  # these two build and import the worker side (torch)
