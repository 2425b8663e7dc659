#!/usr/bin/env bash
# Run on the CPU machine before a GPU window: download into .whl/ (git-ignored) the cp312 wheels the GPU
# image lacks (bench/gpu/wheels.txt, versions as installed in .venv), then print one summary line.
#   bash bench/gpu/prepare.sh          # download (PyPI), verify, summarise
#   bash bench/gpu/prepare.sh --list   # print name==version of each wheel; no network
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
W=bench/gpu/wheels.py
if [ "${1:-}" = "--list" ]; then
  exec "$PY" "$W" list
fi
"$PY" "$W" check  # every need of setup.py is in the image or in wheels.txt
git check-ignore -q .whl/x.whl || { echo "prepare: .whl/ is not git-ignored; add /.whl/ to .gitignore" >&2; exit 1; }
mkdir -p .whl
mapfile -t PINS < <("$PY" "$W" list)
"$PY" "$W" prune .whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
for pin in "${PINS[@]}"; do
  "$PY" "$W" have .whl "$pin" && continue
  if ! "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${PLATFORMS[@]}" -d .whl "$pin" 2>/dev/null; then
    echo "prepare: no cp312 wheel of $pin on the index; building it here (verify checks it is pure Python)"
    "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w .whl "$pin"
  fi
done
"$PY" "$W" verify .whl
"$PY" "$W" summary .whl
