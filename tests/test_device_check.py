"""The device check's CPU dry run: every stage of tests/gpu/device_check.py runs (with CPU stand-ins
for the device) and reports ok, and its JSON is complete, so the one GPU run a task may get does
not fail on the check itself."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("preflight", "kernels", "copy", "overlap", "transport", "transport_speed", "layer", "serve_parts",
          "grouped_tile", "deepep", "syncs", "launches", "host_calls", "memory", "layer_speed", "launch_budget",
          "parity", "leaks", "gpu_tests")


def test_device_check_dry_run(tmp_path):
    run = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "run_device_checks.sh"), "--cpu"], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    result = json.loads((tmp_path / "device_checks.json").read_text())
    failed = {name: stage for name, stage in result["stages"].items() if not stage["ok"]}
    assert run.returncode == 0 and not failed, (failed, run.stdout[-3000:], run.stderr[-3000:])
    assert tuple(result["stages"]) == STAGES and result["mode"] == "cpu dry run"
    assert result["stages"]["kernels"]["cases"] > 50
    assert all(result["stages"]["layer"][mode]["migrated_tokens"] > 0 for mode in ("after_own_rows", "on_arrival"))
    assert len(result["stages"]["transport_speed"]["sizes"]) == 5
    assert set(result["stages"]["serve_parts"]["variants"]) == {"1 part", "4 parts"}
    assert result["stages"]["grouped_tile"]["rows"] == list(range(0, 129, 8))
    assert result["stages"]["host_calls"]["empty_us"] > 0
    profile = result["stages"]["launch_budget"]["variants"]["grouped, balanced"]["per_rank"][0]["profile"]
    assert profile["host_self_us"] and profile["host_self_us_total"] > 0
    assert any(name == "AllToAllV" for name, _, _ in profile["waits_host_us"])


def test_a_gpu_run_without_cuda_fails_instead_of_skipping(tmp_path):
    """On a machine without a usable GPU the non-dry run stops at preflight with a failure."""
    import pytest

    from deepspeed_feplb.migrate import cuda_available
    if cuda_available():
        pytest.skip("a GPU is usable here: the real device check is run by tests/gpu/run_device_checks.sh")
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "device_check.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    result = json.loads((tmp_path / "device_checks.json").read_text())
    assert run.returncode == 1
    assert result["stages"]["preflight"]["ok"] is False and "no CUDA device" in result["stages"]["preflight"]["error"]
    assert list(result["stages"]) == ["preflight"]
