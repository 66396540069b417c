#!/usr/bin/env bash
# All GPU checks of the GPU path, in one go (< 8 minutes on one H100/H200): marked GPU tests, then
# the Copy-Engine / GEMM overlap measurement. Writes ${OUT:-.}/device_checks.json with the test
# outcome and the measured figures. Run from the repository root with a CUDA build of torch and CuPy.
set -u
OUT_DIR="${OUT:-.}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
export OMP_NUM_THREADS=1
start=$(date +%s)
timeout 300 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider --junitxml="$OUT_DIR/gpu_tests.xml" \
    > "$OUT_DIR/gpu_tests.log" 2>&1
tests_rc=$?
tail -5 "$OUT_DIR/gpu_tests.log"
timeout 150 "$PY" tests/gpu/bench_ce_overlap.py "$OUT_DIR/ce_overlap.json" > "$OUT_DIR/ce_overlap.log" 2>&1
bench_rc=$?
cat "$OUT_DIR/ce_overlap.log"
"$PY" - "$OUT_DIR" "$tests_rc" "$bench_rc" "$start" <<'PY'
import json, os, sys, time
out, tests_rc, bench_rc, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
result = {"gpu_tests_rc": tests_rc, "bench_rc": bench_rc, "seconds": time.time() - start}
try:
    import xml.etree.ElementTree as ET
    suite = ET.parse(os.path.join(out, "gpu_tests.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    result["gpu_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except Exception as exc:
    result["gpu_tests"] = f"unreadable: {exc}"
try:
    result["ce_overlap"] = json.load(open(os.path.join(out, "ce_overlap.json")))
except Exception as exc:
    result["ce_overlap"] = f"missing: {exc}"
json.dump(result, open(os.path.join(out, "device_checks.json"), "w"), indent=1)
print(json.dumps(result, indent=1))
PY
exit $(( tests_rc != 0 || bench_rc != 0 ))
