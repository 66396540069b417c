#!/usr/bin/env bash
# The device check in one command (docs/GPU.md, "Device check"): installs the wheels carried in
# .whl/ (the lent machine's image lacks pydantic and DeepSpeed; `make device-wheels` fetches them),
# then runs tests/gpu/device_check.py, which writes ${OUT:-.}/device_checks.json after every stage.
# Fails (never skips) when CUDA or CuPy is missing. `--cpu`: the dry run that CI runs.
set -u
cd "$(dirname "$0")/../.."
OUT_DIR="${OUT:-.}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
if [[ " $* " != *" --cpu "* ]] && compgen -G ".whl/*.whl" > /dev/null; then  # the wheels are for the device's Python
    SITE="${TMPDIR:-/tmp}/feplb-device-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "installing the carried wheels failed" >&2; exit 1; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
timeout 345 "$PY" tests/gpu/device_check.py --out "$OUT_DIR" "$@"
