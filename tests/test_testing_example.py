"""The user-facing example `examples/test_my_moe.py` passes with the package installed.

The test builds the package from a copy of this checkout (setup.py given the two lines
docs/TESTING.md asks for, if it lacks them), installs it without dependencies into a scratch
directory, and runs a copy of the example from outside the repository *without* ``-p``: the
``pytest11`` entry point must load the plugin and the shipped trace must be inside the package.
"""
import os
import re
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "test_my_moe.py")
ENTRY_POINT = '"pytest11": ["deepspeed_feplb.testing.plugin = deepspeed_feplb.testing.plugin"]'
PACKAGE_DATA = '"testing/data/*.npz"'


def pytest_run(args, cwd, env=None, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=timeout)
    return proc.stdout + proc.stderr


def with_requested_lines(setup_py: str) -> str:
    """setup.py with the pytest11 entry point and the trace package data (unchanged if it has them)."""
    if "pytest11" not in setup_py:
        setup_py, n = re.subn(r"entry_points=\{", "entry_points={" + ENTRY_POINT + ", ", setup_py, count=1)
        assert n == 1, "setup.py has no entry_points={...} to extend"
    if "testing/data" not in setup_py:
        setup_py, n = re.subn(r'("deepspeed_feplb":\s*\[)', r"\1" + PACKAGE_DATA + ", ", setup_py, count=1)
        assert n == 1, "setup.py has no package_data for deepspeed_feplb to extend"
    return setup_py


def test_example_passes_with_the_installed_package(tmp_path):
    source, site, user = tmp_path / "source", tmp_path / "site", tmp_path / "user_project"
    for name in ("deepspeed_feplb", "ops", "README.md"):  # what setup.py packages
        path = os.path.join(REPO, name)
        if os.path.isdir(path):
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif os.path.exists(path):
            shutil.copy(path, source / name)
    with open(os.path.join(REPO, "setup.py")) as f:
        (source / "setup.py").write_text(with_requested_lines(f.read()))
    build = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--target", str(site), str(source)], capture_output=True, text=True, timeout=180)
    assert build.returncode == 0, build.stdout + build.stderr
    assert (site / "deepspeed_feplb" / "testing" / "data" / "zipf_ep4_e8_k2.npz").exists()
    user.mkdir()
    shutil.copy(EXAMPLE, user / "test_my_moe.py")
    env = {"PYTHONPATH": str(site), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": ""}
    probe = subprocess.run([sys.executable, "-c", "import deepspeed_feplb.testing as t; print(t.__file__)"],
                           cwd=user, capture_output=True, text=True, env={**os.environ, **env})
    assert probe.stdout.startswith(str(site)), probe.stdout + probe.stderr  # the installed copy, not the repo
    out = pytest_run(["test_my_moe.py"], cwd=user, env=env)
    assert "3 passed" in out, out
