#!/usr/bin/env bash
# The prepared GPU check (bench/gpu/README.md). On the GPU machine, through the device tool:
#   run(command="bash bench/gpu/check.sh", carry=[".whl"], timeout_s=540)   -> $OUT/gpu_check.{json,md,log}
# On CPU (the suite runs it): bash bench/gpu/check.sh --dry-run [--out DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1
exec "$PY" bench/gpu/check.py --python "$PY" "$@"
